package rules

import (
	"fmt"
	"net/netip"
	"slices"
	"testing"

	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/test/testbed"
)

// BenchmarkNFTablesPortalSync measures NFTables.Sync with real nft in a
// namespace holding n Service ports (benchPortals: every tenth with an
// ExternalIP and a held NodePort):
//
//	whole       the whole table written again (first sync, or after a flush)
//	add-one     one Service port added: its ClusterIP, ExternalIP and NodePort elements
//	remove-one  the same Service port removed
//	add-one-clusterip  one ClusterIP Service port added (a change without a
//	            NodePort writes the changed Service ports' elements alone)
//	unchanged   the same state again: the flush check and the element diff
//
// Run as root, e.g. go test -run '^$' -bench NFTablesPortalSync -benchtime 5x ./rules
func BenchmarkNFTablesPortalSync(b *testing.B) {
	extra := port("bench", "new", "p", service.TCP, 80)
	extra.ClusterIPs = ips("10.200.0.1")
	extra.ExternalIPs = ips("10.201.0.1")
	extra.NodePort = 39999 // above benchPortals' NodePorts, below its proxy ports
	plain := port("bench", "new-clusterip", "p", service.TCP, 80)
	plain.ClusterIPs = ips("10.200.0.2")
	// insert adds pt to portals in name order.
	insert := func(portals []Portal, pt Portal) []Portal {
		i, _ := slices.BinarySearchFunc(portals, pt, func(a, b Portal) int { return a.Port.Name.Compare(b.Port.Name) })
		return slices.Insert(slices.Clone(portals), i, pt)
	}
	for _, n := range []int{1000, 10000, 50000} {
		base := benchPortals(n, 20000)
		plus := insert(base, Portal{Port: extra, ProxyPort: 61000})
		plusPlain := insert(base, Portal{Port: plain, ProxyPort: 61001})
		ops := []struct {
			name string
			// untimed runs before each timed sync, which syncs to
			untimed func(p *NFTables) error
			to      []Portal
		}{
			{"whole", func(p *NFTables) error { p.written = nil; return nil }, base},
			{"add-one", func(p *NFTables) error { return p.Sync(base) }, plus},
			{"remove-one", func(p *NFTables) error { return p.Sync(plus) }, base},
			{"add-one-clusterip", func(p *NFTables) error { return p.Sync(base) }, plusPlain},
			{"unchanged", func(p *NFTables) error { return nil }, base},
		}
		for _, op := range ops {
			b.Run(fmt.Sprintf("portals=%d/%s", n, op.name), func(b *testing.B) {
				testbed.Needs(b, testbed.NFTables)
				tp := testbed.New(b)
				p, err := NewNFTables(Config{NodeIPs: []netip.Addr{tp.NS(testbed.Node).IPv4}, DialMark: testDialMark})
				if err != nil {
					b.Fatal(err)
				}
				err = tp.Run(testbed.Node, func() error {
					if err := p.Sync(base); err != nil {
						return err
					}
					b.ResetTimer()
					for range b.N {
						b.StopTimer()
						if err := op.untimed(p); err != nil {
							return err
						}
						b.StartTimer()
						if err := p.Sync(op.to); err != nil {
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
