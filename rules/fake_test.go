package rules

import (
	"slices"
	"strings"

	"github.com/uproxy/uproxy/netfilter/conntrack/conntracktest"
	"github.com/uproxy/uproxy/netfilter/iptables/iptablestest"
)

// fakeKernel is the kernel of the unit tests: iptables in memory, which refuses
// what iptables refuses, and a conntrack that records the stale-flow filters.
// NodePorts are held for real (Config.Listen stays nil).
type fakeKernel struct {
	*iptablestest.Fake
	ct conntracktest.Recorder
}

func newFakeKernel() *fakeKernel { return &fakeKernel{Fake: iptablestest.New()} }

// configure points cfg at the fake.
func (k *fakeKernel) configure(cfg *Config) { cfg.IPTables, cfg.Conntrack = k.Fake, &k.ct }

// restores returns the restore inputs of family f that succeeded.
func (k *fakeKernel) restores(f int) []string { return k.Restores(f == v6) }

// ops returns the rules of family f added one by one (the jumps): its Insert
// and Append calls.
func (k *fakeKernel) ops(f int) []string {
	var out []string
	for _, c := range k.Calls(f == v6) {
		if strings.HasPrefix(c, "insert ") || strings.HasPrefix(c, "append ") {
			out = append(out, c)
		}
	}
	return out
}

// lists counts the chain reads of family f (the canary checks).
func (k *fakeKernel) lists(f int) int {
	n := 0
	for _, c := range k.Calls(f == v6) {
		if strings.HasPrefix(c, "list ") {
			n++
		}
	}
	return n
}

// flush is `iptables -t nat -F` by someone else: the canary and the nat jumps
// are gone, the filter jump stays.
func (k *fakeKernel) flush(f int) { k.Flush(f == v6, "nat") }

// rules returns a chain's rules in family f as iptables-save prints them.
func (k *fakeKernel) rules(f int, table, chain string) []string {
	var out []string
	if c := k.State(f == v6).Table(table).Chain(chain); c != nil {
		for _, r := range c.Rules {
			out = append(out, r.Text)
		}
	}
	return out
}

// state returns family f's tables as "table chain rule" lines, each chain's
// rules sorted: the portals' rules match distinct addresses and ports, so
// their order within a chain means nothing, and a chain edited in place holds
// them in another order than a chain written whole.
func (k *fakeKernel) state(f int) string {
	var out []string
	for _, t := range k.State(f == v6).Tables {
		for _, c := range t.Chains {
			var rules []string
			for _, r := range c.Rules {
				rules = append(rules, t.Name+" "+c.Name+" "+r.Text)
			}
			slices.Sort(rules)
			out = append(out, t.Name+" "+c.Name)
			out = append(out, rules...)
		}
	}
	return strings.Join(out, "\n")
}
