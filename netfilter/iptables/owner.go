package iptables

import (
	"errors"
	"fmt"
	"slices"
	"strings"
)

// Which chains are uproxy's. A chain's name comes from --chain-prefix, which
// an operator may set to anything iptables takes: DOCKER makes uproxy's
// forward chain Docker's DOCKER-FORWARD, cali makes it Calico's cali-FORWARD.
// Every rule uproxy writes that leads (-j, -g) to one of its chains from a
// chain not its own (a built-in chain) carries a comment beginning with
// CommentPrefix. So a chain of uproxy's names is another program's when a rule
// in a chain that is not uproxy's (a built-in chain, another program's chain,
// or one of uproxy's names found to be another program's) leads to it without
// that comment; a chain that nothing outside uproxy's chains leads to is a
// leftover of uproxy's. uproxy declares (which flushes), rewrites and deletes
// only its own chains: anyone else's is left as it is, with the rules that
// lead to it, and the caller says so. The rule reads one iptables-save of the
// family and nothing else.

// Ours is what uproxy owns of a family's tables under one prefix, in one mode
// or in several.
type Ours struct {
	// Chains reports whether chain, in table, has one of uproxy's names.
	Chains func(table, chain string) bool
	// Uncommented are jumps uproxy wrote without CommentPrefix before its
	// jumps carried it: a rule equal to one of them (table, chain, words)
	// leads to a chain of uproxy's all the same.
	Uncommented []Jump
}

// NotOursError is a chain of uproxy's name that another program's rule leads
// to: another program's chain, which uproxy does not touch.
type NotOursError struct {
	V6           bool
	Table, Chain string
	// Rule is the rule that leads to it, as iptables-save prints it.
	Rule string
}

func (e *NotOursError) Error() string {
	return fmt.Sprintf("%s chain %s (table %s) is not uproxy's (the rule %s leads to it without uproxy's comment; uproxy's jumps have comments beginning %q), so it is left as it is: choose another --chain-prefix",
		command(e.V6, ""), e.Chain, e.Table, e.Rule, CommentPrefix)
}

// Claim reads both families' rules and returns, apart, a *NotOursError for
// each chain ours names that is another program's (joined), and the errors of
// the reads that failed: a refusal, and what could not be checked. A missing
// command (no ip6tables) holds no chain of anyone's.
func Claim(k Kernel, ours Ours) (notOurs, unread error) {
	var refusals, reads []error
	for _, v6 := range []bool{false, true} {
		saved, err := k.Save(v6)
		if err != nil {
			if !isMissingCommand(err) {
				reads = append(reads, fmt.Errorf("read %s rules: %w", FamilyName(v6), err))
			}
			continue
		}
		refusals = append(refusals, Parse(saved).NotOurs(v6, ours))
	}
	return errors.Join(refusals...), errors.Join(reads...)
}

// NotOurs returns a *NotOursError for each chain ours names that rs shows to
// be another program's, joined, in the order iptables-save printed them; nil
// when there is none. v6 says which family rs was read from.
func (rs *Ruleset) NotOurs(v6 bool, ours Ours) error {
	var errs []error
	for _, t := range rs.Tables {
		others := t.others(ours)
		for _, c := range t.Chains {
			if r := others[c.Name]; r != nil {
				errs = append(errs, &NotOursError{V6: v6, Table: t.Name, Chain: c.Name, Rule: r.Text})
			}
		}
	}
	return errors.Join(errs...)
}

// others returns the chains of t that ours names and another program's rule
// leads to, each with the first such rule found. A rule in another program's
// chain is another program's too, so a chain only it leads to is found in a
// later pass; the passes end when one finds nothing new, which is the first
// on a node where no name is taken.
func (t *Table) others(ours Ours) map[string]*Rule {
	var found map[string]*Rule
	for {
		more := false
		for _, c := range t.Chains {
			if ours.Chains(t.Name, c.Name) && found[c.Name] == nil {
				// uproxy's own chain: its rules are uproxy's.
				continue
			}
			for _, r := range c.Rules {
				target := r.Target()
				if target == "" || found[target] != nil || t.Chain(target) == nil || !ours.Chains(t.Name, target) || ours.wrote(t.Name, r) {
					continue
				}
				if found == nil {
					found = map[string]*Rule{}
				}
				found[target], more = r, true
			}
		}
		if !more {
			return found
		}
	}
}

// wrote reports whether r, a rule of table that leads to a chain of uproxy's
// names, is one uproxy writes: its comment begins with CommentPrefix, or it
// is one of the jumps uproxy wrote without it.
func (ours Ours) wrote(table string, r *Rule) bool {
	args := r.Args()
	for i := 0; i+1 < len(args); i++ {
		if args[i] == "--comment" && strings.HasPrefix(args[i+1], CommentPrefix) {
			return true
		}
	}
	return slices.ContainsFunc(ours.Uncommented, func(j Jump) bool {
		return j.Table == table && j.Chain == r.Chain && slices.Equal(j.Spec, args)
	})
}
