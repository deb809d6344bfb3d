package testbed

import "testing"

// NFTRuleset returns the node's whole nftables ruleset without counters or
// handles (nft -s), for exact before/after comparisons. With iptables on its
// nf_tables backend it holds iptables' tables too.
func (tp *Topology) NFTRuleset(t testing.TB) string {
	t.Helper()
	out, err := tp.Exec(Node, "nft", "-s", "list", "ruleset")
	if err != nil {
		t.Fatalf("nft list ruleset: %v: %s", err, out)
	}
	return string(out)
}
