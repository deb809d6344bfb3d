package observe_test

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/affinity"
	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/record"
	"github.com/uproxy/uproxy/test/testbed/logs"
)

// DialResult names what the data path and the balancer return, as wrapped on
// the way (observe links neither).
func TestDialResult(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want string
	}{
		{"nil", nil, "success"},
		{"no endpoints, wrapped", fmt.Errorf("pick endpoint: %w", affinity.ErrNoEndpoints), "no-endpoints"},
		{"refused", &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}, "refused"},
		{"deadline", &net.OpError{Op: "dial", Net: "tcp", Err: os.ErrDeadlineExceeded}, "timeout"},
		{"kernel timeout", syscall.ETIMEDOUT, "timeout"},
		{"host unreachable", syscall.EHOSTUNREACH, "unreachable"},
		{"network unreachable", syscall.ENETUNREACH, "unreachable"},
		{"reset", fmt.Errorf("read: %w", syscall.ECONNRESET), "reset"},
		{"no local port", &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.EADDRNOTAVAIL)}, "no_local_port"},
		{"anything else", errors.New("no usable endpoints"), "other"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := observe.DialResult(tt.err); got != tt.want {
				t.Errorf("DialResult(%v): got %q, want %q", tt.err, got, tt.want)
			}
		})
	}
}

// A dial that found no local port is counted under result no_local_port every
// time, and logged once a while per port, with what to change on the node.
func TestNoLocalPortCountedAndWarnedOnce(t *testing.T) {
	log := logs.Capture(t)
	o := observe.NewPortObserver("ns/noport:tcp", "TCP", nil)
	labels := map[string]string{"service": "ns/noport:tcp", "endpoint": "10.9.0.1:8080", "result": "no_local_port"}
	err := &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.EADDRNOTAVAIL)}
	before := metricOr0(t, "uproxy_dial_attempts_total", labels) // the registry is the process's
	for range 3 {
		o.AttemptDone("ns/noport:tcp", record.Attempt{Endpoint: netip.MustParseAddrPort("10.9.0.1:8080"), Err: err})
	}
	if got := metricOr0(t, "uproxy_dial_attempts_total", labels) - before; got != 3 {
		t.Errorf("no_local_port attempts: got %v more, want 3", got)
	}
	var warned []string
	for _, l := range log.Since() {
		if strings.Contains(l, "No local port left") {
			warned = append(warned, l)
		}
	}
	if len(warned) != 1 || !strings.Contains(warned[0], "tcp_tw_reuse") || !strings.Contains(warned[0], `endpoint="10.9.0.1:8080"`) {
		t.Errorf("warnings: got %q, want one naming the endpoint and net.ipv4.tcp_tw_reuse", warned)
	}
}

// uproxy_accept_backoffs_total counts every backoff a port's observer is told of,
// whichever port.
func TestAcceptBackoffsMetric(t *testing.T) {
	const name = "uproxy_accept_backoffs_total"
	before := metricOr0(t, name, nil)
	a := observe.NewPortObserver("ns/a:tcp", "TCP", nil)
	b := observe.NewPortObserver("ns/b:udp", "UDP", nil)
	a.BackedOff("ns/a:tcp", syscall.EMFILE, 5*time.Millisecond)
	a.BackedOff("ns/a:tcp", syscall.EMFILE, 10*time.Millisecond)
	b.BackedOff("ns/b:udp", syscall.ENOBUFS, 5*time.Millisecond)
	if got := metricOr0(t, name, nil) - before; got != 3 {
		t.Errorf("%s after 3 backoffs on two ports: grew by %v, want 3", name, got)
	}
}

// The localhost NodePort count is read from its source at each scrape, as the
// kernel keeps it; without a source, or while it counts nothing or fails to
// read, the series is absent rather than a made-up zero.
func TestLocalhostNodePortsAccepted(t *testing.T) {
	const name = "kubeproxy_iptables_localhost_nodeports_accepted_packets_total"
	defer observe.LocalhostNodePortsAccepted.Set(nil)
	if _, ok := metric(t, name, nil); ok {
		t.Fatalf("%s without a source: present, want absent", name)
	}
	var value uint64 = 7
	counting := true
	var readErr error
	observe.LocalhostNodePortsAccepted.Set(func() (uint64, bool, error) { return value, counting, readErr })
	if got, ok := metric(t, name, nil); !ok || got != 7 {
		t.Errorf("%s: got %v (present %v), want 7", name, got, ok)
	}
	value = 19
	if got, _ := metric(t, name, nil); got != 19 {
		t.Errorf("%s after the kernel counted more: got %v, want 19 read anew", name, got)
	}
	counting = false
	if _, ok := metric(t, name, nil); ok {
		t.Errorf("%s while not counting: present, want absent", name)
	}
	counting, readErr = true, errors.New("netlink: no such object")
	if _, ok := metric(t, name, nil); ok {
		t.Errorf("%s while the read fails: present, want absent", name)
	}
}
