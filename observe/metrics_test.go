package observe_test

import (
	"errors"
	"fmt"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/uproxy/uproxy/affinity"
	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/proxier"
	"github.com/uproxy/uproxy/socket"
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

// uproxy_accept_backoffs_total reads the source it is handed, and the userspace
// mode hands it the data path's own count.
func TestAcceptBackoffsMetric(t *testing.T) {
	const name = "uproxy_accept_backoffs_total"
	var n atomic.Uint64
	observe.SetAcceptBackoffs(n.Load)
	t.Cleanup(func() { observe.SetAcceptBackoffs(socket.AcceptBackoffs) })
	for _, want := range []uint64{3, 5} {
		n.Store(want)
		if got, ok := metric(t, name, nil); !ok || got != float64(want) {
			t.Errorf("%s with its source at %d: got %v (exported %v), want %d", name, want, got, ok, want)
		}
	}

	mkWorld(t, proxier.Config{})
	if got, want := metricOr0(t, name, nil), float64(socket.AcceptBackoffs()); got != want {
		t.Errorf("%s once a userspace proxier exists: got %v, want socket.AcceptBackoffs() = %v", name, got, want)
	}
}
