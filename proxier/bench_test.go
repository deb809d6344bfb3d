package proxier

import (
	"fmt"
	"net/netip"
	"slices"
	"syscall"
	"testing"

	"github.com/uproxy/uproxy/service"
)

// BenchmarkSync measures the userspace mode's own share of a full sync: opening
// (and then closing) the listeners of n Service ports, without portals.
func BenchmarkSync(b *testing.B) {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err == nil && lim.Cur < lim.Max {
		lim.Cur = lim.Max
		syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim)
	}
	for _, n := range []int{1000, 10000} {
		if uint64(n)+1000 > lim.Cur {
			b.Logf("skipping %d ports: open-file limit %d", n, lim.Cur)
			continue
		}
		ports := make([]*service.Port, n)
		for i := range ports {
			ports[i] = port(fmt.Sprintf("svc-%05d", i), service.TCP,
				netip.AddrPortFrom(netip.MustParseAddr("127.0.0.2"), uint16(10000+i%1000)))
		}
		full := snapshot(ports...)
		empty := snapshot()
		b.Run(fmt.Sprintf("open/%d", n), func(b *testing.B) {
			p := newProxier(b, Config{})
			for b.Loop() {
				b.StopTimer()
				mustSync(b, p, empty)
				b.StartTimer()
				mustSync(b, p, full)
			}
		})
		b.Run(fmt.Sprintf("close/%d", n), func(b *testing.B) {
			p := newProxier(b, Config{})
			for b.Loop() {
				b.StopTimer()
				mustSync(b, p, full)
				b.StartTimer()
				mustSync(b, p, empty)
			}
		})
		b.Run(fmt.Sprintf("endpoints-only/%d", n), func(b *testing.B) {
			p := newProxier(b, Config{})
			mustSync(b, p, full)
			moved := make([]*service.Port, n)
			for i, pt := range ports {
				c := *pt
				c.Endpoints = []service.Endpoint{{Addr: netip.AddrPortFrom(netip.MustParseAddr("127.0.0.3"), 80), Ready: true}}
				moved[i] = &c
			}
			alt := snapshot(moved...)
			for i := 0; b.Loop(); i++ {
				if i%2 == 0 {
					mustSync(b, p, alt)
				} else {
					mustSync(b, p, full)
				}
			}
		})
		// One Service's endpoints change and every other Port is the same pointer,
		// as a Snapshot from service.Builder gives.
		b.Run(fmt.Sprintf("one-endpoint-change/%d", n), func(b *testing.B) {
			p := newProxier(b, Config{})
			mustSync(b, p, full)
			c := *ports[n/2]
			c.Endpoints = []service.Endpoint{{Addr: netip.AddrPortFrom(netip.MustParseAddr("127.0.0.3"), 80), Ready: true}}
			alt := snapshot(slices.Concat(ports[:n/2], []*service.Port{&c}, ports[n/2+1:])...)
			for i := 0; b.Loop(); i++ {
				if i%2 == 0 {
					mustSync(b, p, alt)
				} else {
					mustSync(b, p, full)
				}
			}
		})
		// One Service port added and removed again: the long way, with every
		// other Port the same pointer.
		b.Run(fmt.Sprintf("one-new-service/%d", n), func(b *testing.B) {
			p := newProxier(b, Config{})
			mustSync(b, p, full)
			extra := port("svc-new", service.TCP, netip.AddrPortFrom(netip.MustParseAddr("127.0.0.2"), 9999))
			i, _ := slices.BinarySearchFunc(ports, extra, func(a, b *service.Port) int { return a.Name.Compare(b.Name) })
			plus := snapshot(slices.Insert(slices.Clone(ports), i, extra)...)
			for i := 0; b.Loop(); i++ {
				if i%2 == 0 {
					mustSync(b, p, plus)
				} else {
					mustSync(b, p, full)
				}
			}
		})
	}
}
