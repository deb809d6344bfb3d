package observe

import (
	"errors"
	"fmt"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/record"
)

// BenchmarkPortObserver is the observer's cost per proxied connection: what
// ConnOpened, AttemptDone and ConnClosed add to the connection path, with the
// events ring on. It must stay at 0 allocs/op.
func BenchmarkPortObserver(b *testing.B) {
	ep1 := netip.MustParseAddrPort("10.0.0.1:8080")
	ep2 := netip.MustParseAddrPort("10.0.0.2:8080")
	refused := fmt.Errorf("dial tcp %s: %w", ep2, syscall.ECONNREFUSED)
	for _, bc := range []struct {
		name     string
		attempts []record.Attempt
	}{
		{"first-attempt", []record.Attempt{{Endpoint: ep1, Duration: 200 * time.Microsecond}}},
		{"retried", []record.Attempt{{Endpoint: ep2, Duration: 100 * time.Microsecond, Err: refused}, {Endpoint: ep1, Duration: 200 * time.Microsecond}}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			o := NewPortObserver("bench/"+bc.name+":p", "TCP", NewEvents(256))
			b.Cleanup(o.Forget)
			c := record.Conn{Service: "bench/" + bc.name + ":p", Protocol: "TCP",
				Client: netip.MustParseAddrPort("192.0.2.1:40000"), Start: time.Now(),
				Attempts: bc.attempts, Endpoint: ep1, BytesIn: 512, BytesOut: 4096, Duration: time.Millisecond}
			b.ReportAllocs()
			for b.Loop() {
				o.ConnOpened(c.Service, c.Protocol)
				for _, a := range c.Attempts {
					o.AttemptDone(c.Service, a)
				}
				o.ConnClosed(&c)
			}
		})
	}
}

func BenchmarkDialResult(b *testing.B) {
	errs := map[string]error{
		"nil":     nil,
		"refused": fmt.Errorf("dial: %w", syscall.ECONNREFUSED),
		"other":   errors.New("something else"),
	}
	for name, err := range errs {
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				dialResult(err)
			}
		})
	}
}
