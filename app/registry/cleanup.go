package registry

import (
	"errors"
	"fmt"
	"slices"

	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/kernelmodes/iptables"
	"github.com/uproxy/uproxy/kernelmodes/ipvs"
	"github.com/uproxy/uproxy/kernelmodes/nftables"
	ipt "github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/rules"
)

// chains name what each mode owns of iptables under a chain prefix; the
// nftables mode owns a table instead, which it claims itself.
var chains = map[string]func(prefix string) (ipt.Ours, error){
	proxymode.Userspace: rules.IPTablesChains,
	proxymode.IPTables:  iptables.Chains,
	proxymode.IPVS:      ipvs.Chains,
}

// ClaimChains refuses a chain prefix under which any mode's iptables chain,
// in either family, is another program's (a *ipt.NotOursError for each, from
// ipt.Claim), reading the real iptables once per family; rules that cannot
// be read are logged. Call it when
// starting in any mode that touches rules, before anything is written: the
// mode declares its chains, which flushes them, and its leftover removal
// (CleanupOthers) takes every mode's, so a prefix is usable only when none of
// its chains is taken. Its names are Docker's for DOCKER (DOCKER-FORWARD),
// Calico's for cali (cali-FORWARD).
func ClaimChains(prefix string) error { return claimChains(ipt.Commands{}, prefix) }

func claimChains(k ipt.Kernel, prefix string) error {
	var all []ipt.Ours
	for _, m := range proxymode.Names {
		if chainsOf := chains[m]; chainsOf != nil {
			o, err := chainsOf(prefix)
			if err != nil {
				return err
			}
			all = append(all, o)
		}
	}
	union := ipt.Ours{Chains: func(table, chain string) bool {
		return slices.ContainsFunc(all, func(o ipt.Ours) bool { return o.Chains(table, chain) })
	}}
	for _, o := range all {
		union.Uncommented = append(union.Uncommented, o.Uncommented...)
	}
	notOurs, unread := ipt.Claim(k, union)
	if unread != nil {
		// Nothing is refused for rules that cannot be read: a mode that
		// writes iptables says so at its first sync, and one that does not
		// (nftables, on a node whose kernel has no iptables) must still start.
		klog.ErrorS(unread, "Cannot check that no iptables chain of this --chain-prefix is another program's", "prefix", prefix)
	}
	return notOurs
}

// cleaners remove one mode's kernel state for a chain prefix; a var so tests
// can watch which run.
var cleaners = map[string]func(prefix string) error{
	proxymode.Userspace: rules.Cleanup,
	proxymode.IPTables:  iptables.Cleanup,
	proxymode.NFTables:  nftables.Cleanup,
	proxymode.IPVS:      ipvs.Cleanup,
}

// CleanupOthers removes what every mode but active left in the kernel with
// this chain prefix: call it when starting in mode active, so a switch of
// modes leaves no stale rules, links or virtual servers behind. In the
// userspace mode with portals it also removes the other portal backend's
// (portals: the backend it runs, rules.BackendNone or "" for none). Every
// mode is tried; the errors are collected.
func CleanupOthers(active string, portals rules.Backend, prefix string) error {
	if _, ok := cleaners[active]; !ok {
		return fmt.Errorf("cleanup for mode %q: want userspace, iptables, nftables or ipvs", active)
	}
	err := cleanupExcept(active, prefix)
	if active == proxymode.Userspace && portals != "" && portals != rules.BackendNone {
		if perr := rules.CleanupExcept(portals, prefix); perr != nil {
			err = errors.Join(err, fmt.Errorf("remove the other portal backend's leftovers: %w", perr))
		}
	}
	return err
}

// CleanupAll removes every mode's state (`uproxy --cleanup`): the userspace
// portals of both backends (iptables chains, nftables table), the iptables
// mode's chains, the nftables mode's table, the IPVS mode's chains, virtual servers
// (when the kernel has IPVS) and dummy link.
func CleanupAll(prefix string) error { return cleanupExcept("", prefix) }

func cleanupExcept(active, prefix string) error {
	var errs []error
	for _, m := range proxymode.Names {
		if m == active {
			continue
		}
		if err := cleaners[m](prefix); err != nil {
			errs = append(errs, fmt.Errorf("clean up %s mode: %w", m, err))
		}
	}
	return errors.Join(errs...)
}
