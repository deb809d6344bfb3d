package iptables

import (
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
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
// the Chains of Ours.
func (s ChainSet) Has(table, chain string) bool { return slices.Contains(s[table], chain) }

// removalChainsPerRestore bounds the chains one cleanup restore deletes. The
// nf_tables variant of iptables-restore takes time growing with the square of
// the chains one input names: 31000 chains took 12.4 s to delete in one
// restore and 1.7 s in restores of this many.
const removalChainsPerRestore = 1500

// RemoveChains deletes, in both families, the chains of ours and every rule
// elsewhere that jumps to them. Each family's tables are read once and changed
// in one restore, or in several when there are many chains (RemovalSteps). A
// chain of uproxy's names that is another program's is left as it is, with
// the rules that lead to it, and returned as a *NotOursError. What is already
// gone, including a missing ip6tables, is not an error; the families' errors
// are collected. Every mode's cleanup uses it.
func RemoveChains(k Kernel, ours Ours) error {
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
		rs := Parse(saved)
		if err := rs.NotOurs(v6, ours); err != nil {
			errs = append(errs, err)
		}
		for _, input := range rs.RemovalSteps(ours, removalChainsPerRestore) {
			if err := k.Restore(v6, input); err != nil {
				errs = append(errs, fmt.Errorf("cleanup: %w", err))
				break
			}
		}
	}
	return errors.Join(errs...)
}

// removal is what one table holds of ours: our chains, and the rules elsewhere
// that jump or go to them. Another program's chains of our names are in
// neither.
type removal struct {
	table   string
	present []string
	jumps   []*Rule
}

func (rs *Ruleset) removals(ours Ours) []removal {
	var out []removal
	for _, t := range rs.Tables {
		others := t.others(ours)
		mine := func(chain string) bool { return ours.Chains(t.Name, chain) && others[chain] == nil }
		r := removal{table: t.Name}
		for _, c := range t.Chains {
			if mine(c.Name) {
				r.present = append(r.present, c.Name)
				continue
			}
			for _, rule := range c.Rules {
				if target := rule.Target(); target != "" && mine(target) {
					r.jumps = append(r.jumps, rule)
				}
			}
		}
		if len(r.present) > 0 || len(r.jumps) > 0 {
			out = append(out, r)
		}
	}
	return out
}

// Removal returns the restore input that deletes the chains of ours and the
// rules elsewhere that jump or go to them; nothing when none is there. Another
// program's chains of our names (NotOurs) and the rules that lead to them are
// left out. Only what exists is named: a -D or -X of something absent would
// fail the whole restore, and declaring a chain in a table that does not exist
// would create the table.
func (rs *Ruleset) Removal(ours Ours) []byte { return removalInput(rs.removals(ours)) }

func removalInput(removals []removal) []byte {
	var b strings.Builder
	for _, r := range removals {
		b.WriteString("*" + r.table + "\n")
		// Declaring a chain flushes it, so -X finds it empty.
		writeLines(&b, ":%s - [0:0]\n", r.present)
		for _, j := range r.jumps {
			b.WriteString("-D " + j.Chain + " " + j.Spec + "\n")
		}
		writeLines(&b, "-X %s\n", r.present)
		b.WriteString("COMMIT\n")
	}
	return []byte(b.String())
}

// RemovalSteps returns Removal's input as one restore when at most per of our
// chains are present. With more, it returns restores of at most per chains
// each: first the flushes (the first of each table also deletes the jumps to
// ours from elsewhere), then the deletions, which find every chain empty.
func (rs *Ruleset) RemovalSteps(ours Ours, per int) [][]byte {
	removals := rs.removals(ours)
	n := 0
	for _, r := range removals {
		n += len(r.present)
	}
	if n <= per {
		if in := removalInput(removals); len(in) > 0 {
			return [][]byte{in}
		}
		return nil
	}
	var flushes, deletes [][]byte
	for _, r := range removals {
		var jumps []string
		for _, j := range r.jumps {
			jumps = append(jumps, "-D "+j.Chain+" "+j.Spec)
		}
		f, d := ChainDeletion(r.table, r.present, per, jumps)
		flushes, deletes = append(flushes, f...), append(deletes, d...)
	}
	return append(flushes, deletes...)
}

// ChainDeletion returns the restore inputs that delete chains from table, per
// chains a restore: the flushes (declaring a chain flushes it), to run first,
// then the deletions, which so find none of them still jumped to by another.
// The first flush also carries the lines of first (the deletions of jumps to
// them from elsewhere), alone when there is no chain.
func ChainDeletion(table string, chains []string, per int, first []string) (flushes, deletes [][]byte) {
	step := func(lines []string, format string, chunk []string) []byte {
		var b strings.Builder
		b.WriteString("*" + table + "\n")
		for _, l := range lines {
			b.WriteString(l + "\n")
		}
		writeLines(&b, format, chunk)
		b.WriteString("COMMIT\n")
		return []byte(b.String())
	}
	if len(chains) == 0 && len(first) > 0 {
		flushes = append(flushes, step(first, "", nil))
	}
	for chunk := range slices.Chunk(chains, per) {
		flushes = append(flushes, step(first, ":%s - [0:0]\n", chunk))
		first = nil
		deletes = append(deletes, step(nil, "-X %s\n", chunk))
	}
	return flushes, deletes
}

func writeLines(b *strings.Builder, format string, chains []string) {
	for _, c := range chains {
		fmt.Fprintf(b, format, c)
	}
}
