package proxier

import (
	"net/netip"
	"testing"

	"github.com/uproxy/uproxy/rules"
)

// replies is a Portals whose rules for the replies to transparent dials are,
// or are not, in place.
type replies struct {
	rules.None
	ok bool
}

func (r replies) RepliesToClientAddress() bool { return r.ok }

// decide follows kube-proxy's masquerading, and keeps nothing without the
// flag or the portals' reply rules (with --rules none, rules.None says they
// are never in place).
func TestClientAddressDecide(t *testing.T) {
	pod, outside, lo := netip.MustParseAddr("10.244.1.2"), netip.MustParseAddr("192.168.50.2"), netip.MustParseAddr("127.0.0.1")
	cidrs := []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}
	cases := []struct {
		name            string
		c               clientAddress
		external, local bool
		client          netip.Addr
		want            bool
		why             string
	}{
		{"pod to ClusterIP", clientAddress{keep: true, clusterCIDRs: cidrs, portals: replies{ok: true}}, false, false, pod, true, keptCluster},
		{"outside --cluster-cidr to ClusterIP", clientAddress{keep: true, clusterCIDRs: cidrs, portals: replies{ok: true}}, false, false, outside, false, notKeptOffCluster},
		{"no --cluster-cidr: anyone to ClusterIP", clientAddress{keep: true, portals: replies{ok: true}}, false, false, outside, true, keptCluster},
		{"external, policy Cluster", clientAddress{keep: true, portals: replies{ok: true}}, true, false, outside, false, notKeptExternal},
		{"external, policy Local", clientAddress{keep: true, portals: replies{ok: true}}, true, true, outside, true, keptLocal},
		{"loopback", clientAddress{keep: true, portals: replies{ok: true}}, false, false, lo, false, notKeptLoopback},
		{"--masquerade-all", clientAddress{keep: true, masqueradeAll: true, portals: replies{ok: true}}, false, false, pod, false, notKeptMasqAll},
		{"flag off", clientAddress{portals: replies{ok: true}}, false, false, pod, false, notKeptFlag},
		{"reply rules missing", clientAddress{keep: true, portals: replies{}}, false, false, pod, false, notKeptPortals},
		{"--rules none", clientAddress{keep: true, portals: rules.None{}}, false, false, pod, false, notKeptPortals},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, why := tc.c.decide(tc.external, tc.local, tc.client)
			if got != tc.want || why != tc.why {
				t.Errorf("decide(external %v, local %v, %v): got %v (%s), want %v (%s)", tc.external, tc.local, tc.client, got, why, tc.want, tc.why)
			}
		})
	}
}
