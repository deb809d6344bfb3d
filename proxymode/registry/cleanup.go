package registry

import (
	"errors"
	"fmt"

	"github.com/uproxy/uproxy/kernelmodes/iptables"
	"github.com/uproxy/uproxy/kernelmodes/ipvs"
	"github.com/uproxy/uproxy/kernelmodes/nftables"
	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/rules"
)

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
