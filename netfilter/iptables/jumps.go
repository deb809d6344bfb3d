package iptables

import (
	"fmt"
	"slices"

	"github.com/hashicorp/go-multierror"
)

// CommentPrefix begins the comment of every rule uproxy writes in a chain not
// its own: the jumps from the built-in chains to its chains.
const CommentPrefix = "uproxy "

// JumpSpec is the Spec of a Jump: match, then a comment of CommentPrefix and
// text, then the jump to target. Every mode builds its jumps with it, so every
// one carries the comment that tells its chains from another program's.
func JumpSpec(match []string, text, target string) []string {
	return slices.Concat(match, []string{"-m", "comment", "--comment", CommentPrefix + text, "-j", target})
}

// Jump is a rule in a built-in chain that leads to a chain of ours. Its Spec
// carries a comment beginning with CommentPrefix, which is how a chain of
// uproxy's names is told from another program's (Claim). Jumps are added one
// by one after the restore that creates their targets, because a jump to a
// chain that does not exist yet is refused, and because a restore cannot add
// a rule only when it is missing.
type Jump struct {
	Table, Chain string
	// Last appends the rule; otherwise it goes first in the chain.
	Last bool
	Spec []string
}

// EnsureJumps adds the jumps that t lacks, each checked first. Those that go
// first are inserted at position 1 in reverse order, so they end up at the top
// of their chain in the order given; the others are appended in order. The
// errors of single jumps are collected.
func EnsureJumps(t Tables, v6 bool, jumps []Jump) error {
	var errs []error
	ensure := func(j Jump) {
		ok, err := t.Exists(j.Table, j.Chain, j.Spec...)
		if err == nil && !ok {
			if j.Last {
				err = t.Append(j.Table, j.Chain, j.Spec...)
			} else {
				err = t.Insert(j.Table, j.Chain, 1, j.Spec...)
			}
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s jump %s/%s -> %s: %w", FamilyName(v6), j.Table, j.Chain, j.Spec[len(j.Spec)-1], err))
		}
	}
	for i := len(jumps) - 1; i >= 0; i-- {
		if !jumps[i].Last {
			ensure(jumps[i])
		}
	}
	for _, j := range jumps {
		if j.Last {
			ensure(j)
		}
	}
	return multierror.Append(nil, errs...).ErrorOrNil()
}
