package proxier

import (
	"errors"
	"net/netip"
	"testing"

	"github.com/uproxy/uproxy/affinity"
	"github.com/uproxy/uproxy/service"
)

// A route's picker has the balancer of its Service port's primary family from
// the start and the other family's only once that family has endpoints; a
// client of a family without endpoints is refused as by an empty balancer,
// before and after; the balancer made later takes the scheduler the route has
// then, and stays when its endpoints go.
func TestFamilyPickerMakesTheOtherFamilyWhenItHasEndpoints(t *testing.T) {
	ep4 := netip.MustParseAddrPort("10.0.0.1:80")
	ep6 := netip.MustParseAddrPort("[fd00::1]:80")
	client4, client6 := netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("2001:db8::1")
	for _, tc := range []struct {
		name       string
		clusterIPs []netip.Addr
		primary    int
	}{
		{"IPv4 primary", []netip.Addr{netip.MustParseAddr("10.96.0.1")}, 0},
		{"IPv6 primary", []netip.Addr{netip.MustParseAddr("fd00:96::1"), netip.MustParseAddr("10.96.0.1")}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			port := &service.Port{ClusterIPs: tc.clusterIPs}
			fp, err := newFamilyPicker("rr", affinity.Ejection{}, nil, port)
			if err != nil {
				t.Fatal(err)
			}
			families := func() []int {
				var out []int
				for _, fb := range fp.each() {
					out = append(out, fb.family)
				}
				return out
			}
			pick := func(client netip.Addr) (netip.AddrPort, error) {
				ep, err := fp.Pick(client, nil)
				if err == nil {
					fp.Release(ep)
				}
				return ep, err
			}
			if got := families(); len(got) != 1 || got[0] != tc.primary {
				t.Fatalf("balancers of a new picker: families %v, want [%d] alone", got, tc.primary)
			}

			primaryEP, otherEP, otherClient := ep4, ep6, client6
			if tc.primary == 1 {
				primaryEP, otherEP, otherClient = ep6, ep4, client4
			}
			fp.update([]netip.AddrPort{primaryEP}, port)
			if got := families(); len(got) != 1 {
				t.Errorf("after endpoints of the primary family alone: families %v, want one", got)
			}
			if _, err := pick(otherClient); !errors.Is(err, affinity.ErrNoEndpoints) {
				t.Errorf("a client of the family without endpoints: %v, want ErrNoEndpoints", err)
			}
			if _, err := (&route{picker: fp}).explain(otherClient); !errors.Is(err, affinity.ErrNoEndpoints) {
				t.Errorf("explain for a client of the family without endpoints: %v, want ErrNoEndpoints", err)
			}

			if err := fp.setScheduler("lc"); err != nil {
				t.Fatal(err)
			}
			fp.update([]netip.AddrPort{primaryEP, otherEP}, port)
			if got := families(); len(got) != 2 {
				t.Fatalf("after endpoints of both families: families %v, want both", got)
			}
			if got, err := pick(otherClient); err != nil || got != otherEP {
				t.Errorf("a client of the other family: %v, %v; want %v", got, err, otherEP)
			}
			other := fp.family(1 - tc.primary)
			if got := other.Scheduler(); got != "lc" {
				t.Errorf("the balancer made later: scheduler %q, want the route's lc", got)
			}

			fp.update([]netip.AddrPort{primaryEP}, port)
			if fp.family(1-tc.primary) != other {
				t.Errorf("the other family's endpoints gone: its balancer was dropped or replaced, want it kept")
			}
			if _, err := pick(otherClient); !errors.Is(err, affinity.ErrNoEndpoints) {
				t.Errorf("the other family's endpoints gone: %v, want ErrNoEndpoints", err)
			}
		})
	}
}
