// Package iptables is uproxy's one access to iptables, shared by every mode and
// tool: the kernel boundary (Kernel, and Commands, the real one), the parser of
// iptables-save output (Parse), which chains are uproxy's (Claim, owner.go),
// the removal of a mode's chains (RemoveChains), the jumps from built-in chains
// (EnsureJumps) and the canary that notices an external flush (Canary).
//
// A mode renders its own rules as iptables-restore input and writes them all in
// one Restore per family; this package never decides what the rules say:
//
//	k := iptables.Commands{}
//	err := k.Restore(false, input) // iptables-restore --noflush
//	...
//	ours := iptables.Ours{Chains: iptables.ChainSet{"nat": {"UPROXY-SERVICES"}}.Has}
//	notOurs, unread := iptables.Claim(k, ours) // before the first write: none of them another program's
//	...
//	err = iptables.RemoveChains(k, ours)
//
// It is one backend of the kernel's packet filter; the UDP conntrack cleanup
// every backend needs lives beside it in netfilter/conntrack, so an nftables
// backend can take its place in a mode without this package.
package iptables

import (
	"bytes"
	"errors"
	"fmt"
	"os/exec"
	"strings"

	goiptables "github.com/coreos/go-iptables/iptables"
)

// Kernel is the iptables of one network namespace, both families: v6 selects
// ip6tables. Commands is the real one; iptablestest.Fake stands in for it in
// unit tests.
type Kernel interface {
	// Restore feeds input to iptables-restore --noflush: the chains it declares
	// are flushed and rewritten, everything else is left as it is.
	Restore(v6 bool, input []byte) error
	// Save returns iptables-save output for every table that exists.
	Save(v6 bool) ([]byte, error)
	// SaveCounters returns iptables-save -c output for one table: each rule with
	// its [packets:bytes].
	SaveCounters(v6 bool, table string) ([]byte, error)
	// Tables returns the per-rule calls of one family.
	Tables(v6 bool) (Tables, error)
}

// Tables is the part of go-iptables (*iptables.IPTables) the modes use, one
// rule at a time: checking and adding the jumps in built-in chains, and
// reading the canary chain.
type Tables interface {
	Exists(table, chain string, rulespec ...string) (bool, error)
	Insert(table, chain string, pos int, rulespec ...string) error
	Append(table, chain string, rulespec ...string) error
	// List returns the chain as iptables -S prints it: "-N chain" (or "-P
	// chain POLICY"), then one "-A chain ..." per rule.
	List(table, chain string) ([]string, error)
}

// Commands is the Kernel of the iptables commands, run in the network namespace
// of the calling thread: a caller that locked its thread into a namespace
// programs that namespace.
type Commands struct{}

// Restore implements Kernel.
func (Commands) Restore(v6 bool, input []byte) error {
	// -w waits for the xtables lock when the legacy backend holds it; nf_tables
	// ignores it. The argument list goes to exec directly: no shell sees it.
	cmd := exec.Command(command(v6, "-restore"), "-w", "5", "--noflush")
	cmd.Stdin = bytes.NewReader(input)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s --noflush: %w: %s", command(v6, "-restore"), err, strings.TrimSpace(stderr.String()))
	}
	return nil
}

// Save implements Kernel.
func (Commands) Save(v6 bool) ([]byte, error) { return save(v6) }

// SaveCounters implements Kernel.
func (Commands) SaveCounters(v6 bool, table string) ([]byte, error) {
	return save(v6, "-c", "-t", table)
}

func save(v6 bool, args ...string) ([]byte, error) {
	cmd := exec.Command(command(v6, "-save"), args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("%s: %w: %s", strings.Join(cmd.Args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}

// Tables implements Kernel with go-iptables.
func (Commands) Tables(v6 bool) (Tables, error) {
	proto := goiptables.ProtocolIPv4
	if v6 {
		proto = goiptables.ProtocolIPv6
	}
	t, err := goiptables.New(goiptables.IPFamily(proto), goiptables.Timeout(5))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", command(v6, ""), err)
	}
	return t, nil
}

func command(v6 bool, suffix string) string {
	if v6 {
		return "ip6tables" + suffix
	}
	return "iptables" + suffix
}

// isMissingCommand reports whether err says an iptables command itself is
// absent, which a cleanup takes as nothing to clean.
func isMissingCommand(err error) bool { return errors.Is(err, exec.ErrNotFound) }

// FamilyName names the family of v6 in messages.
func FamilyName(v6 bool) string {
	if v6 {
		return "IPv6"
	}
	return "IPv4"
}
