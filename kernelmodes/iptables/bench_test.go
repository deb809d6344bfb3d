package iptables

import (
	"fmt"
	"net/netip"
	"strconv"
	"testing"

	"github.com/uproxy/uproxy/netfilter/conntrack/conntracktest"
	"github.com/uproxy/uproxy/netfilter/iptables/iptablestest"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/test/testbed"
)

// benchSnapshot returns n Service ports: alternating TCP and UDP, each with a
// ClusterIP and two endpoints, every tenth with an ExternalIP and a NodePort.
func benchSnapshot(n int) *service.Snapshot {
	ports := make([]*service.Port, n)
	for i := range n {
		proto := service.TCP
		if i%2 == 1 {
			proto = service.UDP
		}
		sp := svcPort("bench", fmt.Sprintf("svc-%05d", i), "p", proto, 80)
		sp.ClusterIPs = []netip.Addr{netip.AddrFrom4([4]byte{10, 96, byte(i >> 8), byte(i)})}
		sp.Endpoints = []service.Endpoint{
			ep("10.244."+strconv.Itoa(i>>8)+"."+strconv.Itoa(i&0xff)+":8080", false),
			ep("10.245."+strconv.Itoa(i>>8)+"."+strconv.Itoa(i&0xff)+":8080", false),
		}
		if i%10 == 0 {
			sp.ExternalIPs = []netip.Addr{netip.AddrFrom4([4]byte{10, 250, byte(i >> 8), byte(i)})}
			sp.NodePort = 30000 + i/10
		}
		ports[i] = sp
	}
	return &service.Snapshot{Ports: ports}
}

// BenchmarkSync measures Sync with real iptables in a namespace.
//
//	full:      every iteration forgets what was written, as after a restart or
//	           flush: one iptables-save plus one restore of everything per family
//	one-change: one Service's endpoints change: a partial restore
//	unchanged: the same snapshot again (shared chains and the canary check)
func BenchmarkSync(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		for _, mode := range []string{"full", "one-change", "unchanged"} {
			b.Run(fmt.Sprintf("ports=%d/%s", n, mode), func(b *testing.B) {
				testbed.Needs(b, testbed.IPTables)
				tp := testbed.New(b)
				s := benchSnapshot(n)
				changed := benchSnapshot(n)
				changed.Ports[n/2].Endpoints = changed.Ports[n/2].Endpoints[:1]
				err := tp.Run(testbed.Node, func() error {
					p, err := New(Config{})
					if err != nil {
						return err
					}
					if err := p.Sync(s); err != nil {
						return err
					}
					b.ResetTimer()
					for i := 0; i < b.N; i++ {
						next := s
						switch mode {
						case "full":
							p.mu.Lock()
							p.fams[0].written = nil
							p.mu.Unlock()
						case "one-change":
							if i%2 == 0 {
								next = changed
							}
						}
						if err := p.Sync(next); err != nil {
							return err
						}
					}
					b.StopTimer()
					return p.Cleanup()
				})
				if err != nil {
					b.Fatal(err)
				}
			})
		}
	}
}

// BenchmarkRender measures rendering one family's rules alone.
func BenchmarkRender(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		b.Run(fmt.Sprintf("ports=%d", n), func(b *testing.B) {
			s := benchSnapshot(n)
			p, err := New(Config{IPTables: iptablestest.New(), Conntrack: &conntracktest.Recorder{}})
			if err != nil {
				b.Fatal(err)
			}
			r := p.fams[0].r
			for b.Loop() {
				var sh shared
				for _, sp := range s.Ports {
					r.port(sp, &sh)
				}
			}
		})
	}
}
