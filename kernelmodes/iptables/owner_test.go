package iptables

import (
	"testing"

	ipt "github.com/uproxy/uproxy/netfilter/iptables"
)

// TestJumpsCarryTheComment: every rule the mode writes in a built-in chain
// that leads to its chains carries uproxy's comment, localhost NodePorts'
// guard among them, so the ownership check takes every chain the mode wrote
// as uproxy's, without the jumps it once wrote uncommented.
func TestJumpsCarryTheComment(t *testing.T) {
	t.Parallel()
	w := newLocalhostWorld(t, Config{LocalhostNodePorts: true})
	if err := w.sync(t); err != nil {
		t.Fatal(err)
	}
	commented := ipt.Ours{Chains: w.p.n.ours().Chains}
	for _, v6 := range []bool{false, true} {
		if len(w.k.jumps(idx(v6))) == 0 {
			t.Fatalf("%s: no jumps written", ipt.FamilyName(v6))
		}
		if err := w.k.State(v6).NotOurs(v6, commented); err != nil {
			t.Errorf("%s: got %v, want every chain uproxy's", ipt.FamilyName(v6), err)
		}
	}
}
