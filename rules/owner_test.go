package rules

import (
	"slices"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/netfilter/iptables/iptablestest"
	"github.com/uproxy/uproxy/service"
)

// TestPortalJumpsCarryTheComment: every rule the portals write in a built-in
// chain that leads to their chains carries uproxy's comment, the
// client-address jumps among them, so the ownership check takes every chain
// the portals wrote as uproxy's.
func TestPortalJumpsCarryTheComment(t *testing.T) {
	t.Parallel()
	k := newFakeKernel()
	p := newTestIPTables(t, k, Config{IPv6: true})
	svc := port("a", "b", "", service.TCP, 80)
	svc.ClusterIPs = ips("10.96.0.80", "fd00:96::80")
	if err := p.Sync([]Portal{{Port: svc, ProxyPort: 40000}}); err != nil {
		t.Fatal(err)
	}
	for f := v4; f <= v6; f++ {
		if len(k.ops(f)) == 0 {
			t.Fatalf("%s: no jumps written", familyName(f))
		}
		if err := k.State(f == v6).NotOurs(f == v6, p.chains.ours()); err != nil {
			t.Errorf("%s: got %v, want every chain uproxy's", familyName(f), err)
		}
	}
	for _, j := range chainNames("UPROXY").withClientAddressChain().jumps() {
		if i := slices.Index(j.Spec, "--comment"); i < 0 || !strings.HasPrefix(j.Spec[i+1], iptables.CommentPrefix) {
			t.Errorf("jump %s/%s %q: want a comment beginning %q", j.Table, j.Chain, j.Spec, iptables.CommentPrefix)
		}
	}
}

// TestCleanupLeavesAnotherProgramsChains: a firewall's chain that has a
// portal chain's name (FW-NO-ENDPOINTS for --chain-prefix FW) stays, with the
// rule that leads to it, and is named; the portals' own chains of that prefix
// go.
func TestCleanupLeavesAnotherProgramsChains(t *testing.T) {
	t.Parallel()
	const firewall = "*filter\n:FW-NO-ENDPOINTS - [0:0]\n-A FW-NO-ENDPOINTS -p tcp -j REJECT\n-A INPUT -j FW-NO-ENDPOINTS\nCOMMIT\n"
	k := newFakeKernel()
	var before [2]string
	for f := v4; f <= v6; f++ {
		if err := k.Apply(f == v6, firewall); err != nil {
			t.Fatal(err)
		}
		before[f] = k.state(f)
		// Leftovers of the portals of that prefix.
		if err := k.Apply(f == v6, "*nat\n:FW-PORTALS-HOST - [0:0]\n-A OUTPUT -m comment --comment \"uproxy service portals\" -j FW-PORTALS-HOST\nCOMMIT\n"); err != nil {
			t.Fatal(err)
		}
	}
	p := newTestIPTables(t, k, Config{ChainPrefix: "FW"})
	named, others := iptablestest.NotOurs(p.Cleanup())
	if want := []string{"IPv4 filter/FW-NO-ENDPOINTS", "IPv6 filter/FW-NO-ENDPOINTS"}; !slices.Equal(named, want) || others != nil {
		t.Errorf("Cleanup: got errors naming %q and %v besides, want errors naming %q alone", named, others, want)
	}
	for f := v4; f <= v6; f++ {
		if got := k.state(f); got != before[f] {
			t.Errorf("%s after Cleanup:\n%s\nwant the firewall's alone, as it was:\n%s", familyName(f), got, before[f])
		}
	}
}
