package iptables

import (
	"fmt"
	"regexp"
	"slices"
	"strings"

	"github.com/hashicorp/go-multierror"
)

// DefaultChainPrefix prefixes every chain of every mode when none is given. It
// differs from kube-proxy's KUBE so the two never touch each other's chains.
const DefaultChainPrefix = "UPROXY"

// chainPrefixRE keeps prefixes to what iptables accepts in a chain name; the
// length bound keeps the longest chain name of any mode (prefix +
// "-NODEPORT-NON-LOCAL") within iptables' 28 characters.
var chainPrefixRE = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_-]{0,8}$`)

// ChainPrefix returns prefix, or DefaultChainPrefix when it is empty, once it
// has checked that every chain name built on it fits iptables' limit (1 to 9
// letters, digits, '_' or '-'). Every mode resolves its prefix through it.
func ChainPrefix(prefix string) (string, error) {
	if prefix == "" {
		prefix = DefaultChainPrefix
	}
	if !chainPrefixRE.MatchString(prefix) {
		return "", fmt.Errorf("chain prefix %q: want 1 to 9 letters, digits, '_' or '-'", prefix)
	}
	return prefix, nil
}

// ChainSet names chains by table.
type ChainSet map[string][]string

// Has reports whether the set holds chain in table; as a method value it is
// the ours of RemoveChains.
func (s ChainSet) Has(table, chain string) bool { return slices.Contains(s[table], chain) }

// RemoveChains deletes, in both families, the chains ours accepts and every rule
// elsewhere that jumps to them. Each family's tables are read once and changed
// in one restore. What is already gone, including a missing ip6tables, is not an
// error; the families' errors are collected. Every mode's cleanup uses it.
func RemoveChains(k Kernel, ours func(table, chain string) bool) error {
	var errs []error
	for _, v6 := range []bool{false, true} {
		saved, err := k.Save(v6)
		if err != nil {
			if isMissingCommand(err) {
				continue
			}
			errs = append(errs, fmt.Errorf("read rules for cleanup: %w", err))
			continue
		}
		input := Parse(saved).Removal(ours)
		if len(input) == 0 {
			continue
		}
		if err := k.Restore(v6, input); err != nil {
			errs = append(errs, fmt.Errorf("cleanup: %w", err))
		}
	}
	return multierror.Append(nil, errs...).ErrorOrNil()
}

// Removal returns the restore input that deletes the chains ours accepts and
// the rules elsewhere that jump or go to them; nothing when none is there. Only
// what exists is named: a -D or -X of something absent would fail the whole
// restore, and declaring a chain in a table that does not exist would create
// the table.
func (rs *Ruleset) Removal(ours func(table, chain string) bool) []byte {
	var b strings.Builder
	for _, t := range rs.Tables {
		var present []string // our chains in the table
		var jumps []*Rule    // rules elsewhere that jump to them
		for _, c := range t.Chains {
			if ours(t.Name, c.Name) {
				present = append(present, c.Name)
				continue
			}
			for _, r := range c.Rules {
				if target := r.Target(); target != "" && ours(t.Name, target) {
					jumps = append(jumps, r)
				}
			}
		}
		if len(present) == 0 && len(jumps) == 0 {
			continue
		}
		b.WriteString("*" + t.Name + "\n")
		// Declaring a chain flushes it, so -X finds it empty.
		for _, c := range present {
			b.WriteString(":" + c + " - [0:0]\n")
		}
		for _, r := range jumps {
			b.WriteString("-D " + r.Chain + " " + r.Spec + "\n")
		}
		for _, c := range present {
			b.WriteString("-X " + c + "\n")
		}
		b.WriteString("COMMIT\n")
	}
	return []byte(b.String())
}
