package iptables

import (
	"errors"
	"fmt"

	ipt "github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/netfilter/nfacct"
)

// Cleanup removes every chain and jump rule the iptables mode installs with
// this chain prefix ("" for the default), in both families, through the real
// iptables commands of the calling thread's namespace, and its localhost
// NodePort counter (route_localnet stays as it is, as kube-proxy leaves it). What is already gone,
// including a missing ip6tables, is not an error. The userspace mode's portal
// chains share the prefix but not the names, and are left alone.
func Cleanup(prefix string) error {
	prefix, err := ipt.ChainPrefix(prefix)
	if err != nil {
		return err
	}
	err = cleanup(ipt.Commands{}, namesOf(prefix))
	if !removedOurs(err) {
		return err
	}
	return errors.Join(err, deleteCounter(nil, LocalhostNodePortsCounter(prefix)))
}

// deleteCounter removes the localhost NodePort counter, which no rule names
// once the mode's chains are gone; acct nil opens nfnetlink_acct. A counter
// already gone is no error, and neither is a kernel without nfacct, where no
// counter can have been made.
func deleteCounter(acct Accounting, name string) error {
	if acct == nil {
		c, err := nfacct.Open()
		if err != nil {
			return nil
		}
		defer c.Close()
		acct = c
	}
	if err := acct.Delete(name); err != nil && !errors.Is(err, nfacct.ErrNotFound) {
		return fmt.Errorf("clean up the iptables mode's localhost NodePort counter: %w", err)
	}
	return nil
}

// Chains returns what the iptables mode owns of a family's tables with this
// chain prefix ("" for the default), for a check that none of it is another
// program's before anything is written (iptables.Claim).
func Chains(prefix string) (ipt.Ours, error) {
	prefix, err := ipt.ChainPrefix(prefix)
	if err != nil {
		return ipt.Ours{}, err
	}
	return namesOf(prefix).ours(), nil
}

// cleanup removes the mode's chains and the jumps to them; another program's
// chain of the mode's names is left, and named in the error.
func cleanup(k ipt.Kernel, n names) error {
	if err := ipt.RemoveChains(k, n.ours()); err != nil {
		return fmt.Errorf("clean up iptables-mode rules: %w", err)
	}
	return nil
}

// removedOurs reports whether cleanup, returning err, removed the mode's own
// rules, and with them every rule that counts into the localhost NodePort
// counter: it succeeded, or left another program's chains alone. When a
// restore failed as well, the counter's deletion fails too, the counter busy.
func removedOurs(err error) bool {
	if err == nil {
		return true
	}
	_, others := errors.AsType[*ipt.NotOursError](err)
	return others
}
