package proxier

import (
	"net/netip"
	"testing"

	"github.com/uproxy/uproxy/rules"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/service/servicetest"
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

// NextChoice answers for the route the destination reaches, as a connection
// there is decided: an outside client of an externalTrafficPolicy Local
// NodePort keeps its address, while the same client through the ClusterIP
// (outside --cluster-cidr) is masqueraded. Both answers once came from the
// ClusterIPs' route, so explain said "from the node" of the kept NodePort.
func TestNextChoiceFollowsTheRoute(t *testing.T) {
	cfg := Config{KeepClientAddress: true, Portals: replies{ok: true}}
	cfg.ClusterCIDRs = []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}
	p := newProxier(t, cfg)
	local := port("local", service.TCP)
	local.NodePort = 30080
	local.ExternalPolicyLocal = true
	local.Endpoints = servicetest.LocalEndpoints("127.0.0.2:8080")
	if err := p.Sync(snapshot(local)); err != nil {
		t.Fatal(err)
	}
	outside := netip.MustParseAddr("192.168.50.2")
	for _, c := range []struct {
		external  bool
		source    string
		sourceWhy string
		through   string
	}{
		{false, "node", notKeptOffCluster, "through the ClusterIP"},
		{true, "client", keptLocal, "through the NodePort"},
	} {
		got, ok := p.NextChoice(local.Name.String(), outside, c.external)
		if !ok {
			t.Fatalf("NextChoice(%s): unknown Service port", local.Name)
		}
		if got.Endpoint != "127.0.0.2:8080" || got.Source != c.source || got.SourceReason != c.sourceWhy {
			t.Errorf("%s: got endpoint %s, source %s (%s); want 127.0.0.2:8080, source %s (%s)",
				c.through, got.Endpoint, got.Source, got.SourceReason, c.source, c.sourceWhy)
		}
	}
}
