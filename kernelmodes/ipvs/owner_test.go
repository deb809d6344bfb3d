package ipvs

import (
	"slices"
	"testing"

	"github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/netfilter/iptables/iptablestest"
	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/service"
)

// TestJumpsCarryTheComment: every rule the mode writes in a built-in chain
// that leads to its chains carries uproxy's comment, so the ownership check
// takes every chain the mode wrote as uproxy's.
func TestJumpsCarryTheComment(t *testing.T) {
	t.Parallel()
	p, _, r := newProxier(t, Config{Common: proxymode.Common{IPv6: true}})
	syncOK(t, p, snap(port("web", service.TCP, 80, "10.96.0.10", "10.244.1.2:8080")))
	for _, v6 := range []bool{false, true} {
		if err := r.State(v6).NotOurs(v6, p.n.ours()); err != nil {
			t.Errorf("%s: got %v, want every chain uproxy's", iptables.FamilyName(v6), err)
		}
	}
}

// TestCleanupLeavesAnotherProgramsChains: a chain of another program's that
// has one of the mode's names stays, with the rule that leads to it, and is
// named; the mode's own chains of that prefix go.
func TestCleanupLeavesAnotherProgramsChains(t *testing.T) {
	t.Parallel()
	const other = "*filter\n:FW-IPVS-FILTER - [0:0]\n-A FW-IPVS-FILTER -j ACCEPT\n-A INPUT -m comment --comment \"fw: ipvs\" -j FW-IPVS-FILTER\nCOMMIT\n"
	r := iptablestest.New()
	saved := func(v6 bool) string {
		t.Helper()
		b, err := r.Save(v6)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	var before [2]string
	for i, v6 := range []bool{false, true} {
		if err := r.Apply(v6, other); err != nil {
			t.Fatal(err)
		}
		before[i] = saved(v6)
		if err := r.Apply(v6, "*nat\n:FW-IPVS-SERVICES - [0:0]\n-A PREROUTING -m comment --comment \"uproxy ipvs service portals\" -j FW-IPVS-SERVICES\nCOMMIT\n"); err != nil {
			t.Fatal(err)
		}
	}
	named, others := iptablestest.NotOurs(cleanupRules(r, namesOf("FW")))
	if want := []string{"IPv4 filter/FW-IPVS-FILTER", "IPv6 filter/FW-IPVS-FILTER"}; !slices.Equal(named, want) || others != nil {
		t.Errorf("cleanup: got errors naming %q and %v besides, want errors naming %q alone", named, others, want)
	}
	for i, v6 := range []bool{false, true} {
		if got := saved(v6); got != before[i] {
			t.Errorf("%s after cleanup:\n%s\nwant the other program's alone, as it was:\n%s", iptables.FamilyName(v6), got, before[i])
		}
	}
}
