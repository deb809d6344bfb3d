package proxier

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/test/testbed"
)

// listeningSocket returns the descriptor of the process's listening TCP socket
// on port pp (the socket layer keeps it outside Go's poller).
func listeningSocket(t *testing.T, pp int) int {
	t.Helper()
	// Serve takes the socket over from Go's poller (a duplicate, then a close
	// of the original) after Sync returns: a look at /proc/self/fd during the
	// hand-over can miss both, so look again for a while.
	fd := -1
	testbed.Await(t, 2*time.Second, fmt.Sprintf("a listening socket on port %d", pp), func() bool {
		fd = findListeningSocket(pp)
		return fd >= 0
	})
	return fd
}

// findListeningSocket returns the descriptor of the listening socket on port
// pp, or -1.
func findListeningSocket(pp int) int {
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return -1
	}
	for _, e := range entries {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if on, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ACCEPTCONN); err != nil || on != 1 {
			continue
		}
		if sa, err := unix.Getsockname(fd); err == nil {
			if in4, ok := sa.(*unix.SockaddrInet4); ok && in4.Port == pp {
				return fd
			}
		}
	}
	return -1
}

// counterValue reads one series of a counter vector.
func counterValue(t *testing.T, c interface{ Write(*dto.Metric) error }) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

// seriesValue reads the counter name of the series with labels from uproxy's
// metrics, as a scrape would; it fails the test when there is none.
func seriesValue(t *testing.T, name string, labels map[string]string) float64 {
	t.Helper()
	// Proxiers of tests running at once may serve Service ports of the same
	// name, whose scrape-time series (affinity, UDP clients) then collide:
	// Gather reports those and still returns every family.
	families, _ := observe.Registry.Gather()
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	metrics:
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if v, ok := labels[l.GetName()]; !ok || v != l.GetValue() {
					continue metrics
				}
			}
			return m.GetCounter().GetValue()
		}
	}
	t.Fatalf("no %s%v among the metrics", name, labels)
	return 0
}

// debugState returns the /debug/services view of the one Service port of p.
func debugState(t *testing.T, p *Proxier) observe.ServiceState {
	t.Helper()
	st := p.DebugServices()
	if len(st) != 1 {
		t.Fatalf("DebugServices: got %d ports, want 1", len(st))
	}
	return st[0]
}

// A proxy socket that fails for good - shut down under the proxy, so accept says
// EINVAL - is reopened by the next Sync of the same Snapshot: on the same proxy
// port while it is free, on another when someone took it meanwhile. The port's
// connections flow again, and /debug/services and the metric tell the story.
func TestSyncReopensAFailedProxySocket(t *testing.T) {
	tests := []struct {
		name     string
		takePort bool // someone binds the proxy port between the failure and the sync
	}{
		{name: "same port"},
		{name: "port taken meanwhile", takePort: true},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := newWorld(t)
			a := w.tcpBackend("a", "127.0.0.2")
			p := newProxier(t, Config{})
			svc := port(fmt.Sprintf("web%d", i), service.TCP, a)
			reopens := map[string]string{"service": svc.Name.String()}
			snap := snapshot(svc)
			mustSync(t, p, snap)
			pp := p.ProxyPort(svc.Name)
			if got, err := getTCP(t, pp); err != nil || got != "a" {
				t.Fatalf("before the failure: got %q, %v; want a", got, err)
			}

			if err := unix.Shutdown(listeningSocket(t, pp), unix.SHUT_RD); err != nil {
				t.Fatalf("shutdown the listening socket: %v", err)
			}
			testbed.Await(t, 10*time.Second, "/debug/services to show the listener down", func() bool { return debugState(t, p).ListenerDown })
			if st := debugState(t, p); !strings.Contains(st.ListenerError, "invalid argument") || st.Reopens != 0 {
				t.Errorf("/debug/services with the socket failed: got error %q, %d reopens; want EINVAL's, 0", st.ListenerError, st.Reopens)
			}
			if _, err := getTCP(t, pp); !errors.Is(err, syscall.ECONNREFUSED) {
				t.Errorf("connect to the failed proxy port: got %v, want refused", err)
			}
			if tt.takePort {
				ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", pp))
				if err != nil {
					t.Fatalf("take the proxy port: %v", err)
				}
				defer ln.Close()
			}
			before := seriesValue(t, "uproxy_proxy_port_reopens_total", reopens)

			mustSync(t, p, snap)
			got := p.ProxyPort(svc.Name)
			if tt.takePort && (got == pp || got == 0) {
				t.Errorf("proxy port after the reopen: got %d, want another than the taken %d", got, pp)
			} else if !tt.takePort && got != pp {
				t.Errorf("proxy port after the reopen: got %d, want the same %d", got, pp)
			}
			if name, err := getTCP(t, got); err != nil || name != "a" {
				t.Errorf("after the reopen: got %q, %v; want a", name, err)
			}
			st := debugState(t, p)
			if st.ListenerDown || st.Reopens != 1 || !strings.Contains(st.ListenerError, "invalid argument") || st.ProxyPort != got {
				t.Errorf("/debug/services after the reopen: got down %v, %d reopens, error %q, proxy port %d; want up, 1, EINVAL's, %d",
					st.ListenerDown, st.Reopens, st.ListenerError, st.ProxyPort, got)
			}
			if n := seriesValue(t, "uproxy_proxy_port_reopens_total", reopens) - before; n != 1 {
				t.Errorf("uproxy_proxy_port_reopens_total: went up by %v, want 1", n)
			}
		})
	}
}

// Config.TCPKeepAlive reaches the proxy sockets: a listening socket carries it
// for every connection it accepts to inherit.
func TestTCPKeepAliveReachesTheListener(t *testing.T) {
	tests := []struct {
		name      string
		keepAlive time.Duration
		wantIdle  int // seconds; 0: keepalive off
	}{
		{name: "default", wantIdle: 15},
		{name: "20s", keepAlive: 20 * time.Second, wantIdle: 20},
		{name: "off", keepAlive: -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := newWorld(t)
			p := newProxier(t, Config{TCPKeepAlive: tt.keepAlive})
			svc := port("web", service.TCP, w.tcpBackend("a", "127.0.0.2"))
			mustSync(t, p, snapshot(svc))
			fd := listeningSocket(t, p.ProxyPort(svc.Name))
			on, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_KEEPALIVE)
			if err != nil {
				t.Fatal(err)
			}
			idle, err := unix.GetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_KEEPIDLE)
			if err != nil {
				t.Fatal(err)
			}
			if on == 0 {
				idle = 0
			}
			if idle != tt.wantIdle {
				t.Errorf("keepalive idle time of the listening socket: got %ds, want %ds (0: off)", idle, tt.wantIdle)
			}
		})
	}
}
