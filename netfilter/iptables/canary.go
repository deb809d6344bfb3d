package iptables

import (
	"fmt"
	"slices"

	"k8s.io/klog/v2"
)

// Canary is a chain of ours holding one rule that nothing jumps to. Another
// program that flushes a table (iptables -t nat -F), deletes chains or restores
// without --noflush takes the rule with it, which is how a mode that writes
// only what changed learns that it must write everything again.
type Canary struct {
	Chain string
	// Tables are the tables the canary lives in: each gets the chain and Rule
	// in the restore input, and Intact checks each.
	Tables []string
}

// Rule is the canary's one rule, as restore input takes it and iptables -S
// prints it.
func (c Canary) Rule() string {
	return "-A " + c.Chain + ` -m comment --comment "uproxy canary: gone means the table was flushed" -j RETURN`
}

// Intact reports whether the canary's rule is still there in every table. A
// chain that cannot be read counts as not intact, which costs one rewrite at
// worst; the error says why, for the log.
func (c Canary) Intact(t Tables) (bool, error) {
	return c.intact(t)
}

// Holds is Intact for a caller that only acts on the answer: a read error
// counts as not intact and is logged at -v=2 with family ("IPv4", "IPv6").
func (c Canary) Holds(t Tables, family string) bool {
	ok, err := c.intact(t)
	if err != nil {
		klog.V(2).InfoS("Checking the canary chain", "family", family, "err", err)
	}
	return ok
}

func (c Canary) intact(t Tables) (bool, error) {
	for _, table := range c.Tables {
		rules, err := t.List(table, c.Chain)
		if err != nil {
			return false, fmt.Errorf("read the canary chain %s/%s: %w", table, c.Chain, err)
		}
		if !slices.Contains(rules, c.Rule()) {
			return false, nil
		}
	}
	return true, nil
}
