package affinity

import (
	"fmt"
	"net/netip"
	"testing"
	"time"
)

// BenchmarkPick measures one Pick plus its Release, the cost every proxied connection
// pays, per scheduler, endpoint count and affinity setting. Clients cycle over 256
// addresses, so with affinity on the table is in steady state (hits, plus the misses
// of clients whose endpoint rr and friends moved). Steady state must not allocate.
func BenchmarkPick(b *testing.B) {
	clients := make([]netip.Addr, 256)
	for i := range clients {
		clients[i] = clientAddr(i * 7919)
	}
	for _, sched := range Schedulers {
		for _, n := range []int{10, 1000} {
			for _, aff := range []bool{false, true} {
				name := fmt.Sprintf("%s/endpoints=%d/affinity=%v", sched, n, aff)
				b.Run(name, func(b *testing.B) {
					bal, err := NewBalancer(sched)
					if err != nil {
						b.Fatal(err)
					}
					bal.Update(endpoints(n), netip.MustParseAddr("10.96.0.1"), aff, time.Hour)
					// Keep some connections open so lc, sed and nq see real loads.
					for i := range n / 2 {
						if _, err := bal.Pick(clientAddr(100000+i), nil); err != nil {
							b.Fatal(err)
						}
					}
					b.ReportAllocs()
					i := 0
					for b.Loop() {
						ep, err := bal.Pick(clients[i&255], nil)
						if err != nil {
							b.Fatal(err)
						}
						bal.Release(ep)
						i++
					}
				})
			}
		}
	}
}

// BenchmarkPickTried is a retry: Pick with three endpoints already tried.
func BenchmarkPickTried(b *testing.B) {
	for _, sched := range Schedulers {
		b.Run(sched, func(b *testing.B) {
			bal, err := NewBalancer(sched)
			if err != nil {
				b.Fatal(err)
			}
			eps := endpoints(10)
			bal.Update(eps, netip.MustParseAddr("10.96.0.1"), true, time.Hour)
			tried := eps[:3]
			client := clientAddr(1)
			b.ReportAllocs()
			for b.Loop() {
				ep, err := bal.Pick(client, tried)
				if err != nil {
					b.Fatal(err)
				}
				bal.Release(ep)
			}
		})
	}
}
