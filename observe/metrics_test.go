package observe_test

import (
	"errors"
	"fmt"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/affinity"
	"github.com/uproxy/uproxy/observe"
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
