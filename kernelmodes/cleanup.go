package kernelmodes

import (
	"fmt"

	"github.com/hashicorp/go-multierror"

	"github.com/uproxy/uproxy/kernelmodes/iptables"
	"github.com/uproxy/uproxy/kernelmodes/ipvs"
	"github.com/uproxy/uproxy/kernelmodes/nftables"
	"github.com/uproxy/uproxy/rules"
)

// cleaners remove one mode's kernel state for a chain prefix; a var so tests
// can watch which run.
var cleaners = map[string]func(prefix string) error{
	Userspace: rules.Cleanup,
	IPTables:  iptables.Cleanup,
	NFTables:  nftables.Cleanup,
	IPVS:      ipvs.Cleanup,
}

// modes in cleanup order. The userspace mode's cleaner removes the portals of
// both backends; which backend a userspace run keeps is the portals' own
// concern (rules.CleanupExcept).
var modes = []string{Userspace, IPTables, NFTables, IPVS}

// CleanupOthers removes what every mode but active left in the kernel with
// this chain prefix: call it when starting in mode active, so a switch of
// modes leaves no stale rules, links or virtual servers behind. Every mode is
// tried; the errors are collected.
func CleanupOthers(active, prefix string) error {
	if _, ok := cleaners[active]; !ok {
		return fmt.Errorf("cleanup for mode %q: want userspace, iptables, nftables or ipvs", active)
	}
	return cleanupExcept(active, prefix)
}

// CleanupAll removes every mode's state (`uproxy --cleanup`): the userspace
// portals of both backends (iptables chains, nftables table), the iptables
// mode's chains, the nftables mode's table, the IPVS mode's chains, virtual servers
// (when the kernel has IPVS) and dummy link.
func CleanupAll(prefix string) error { return cleanupExcept("", prefix) }

func cleanupExcept(active, prefix string) error {
	var errs []error
	for _, m := range modes {
		if m == active {
			continue
		}
		if err := cleaners[m](prefix); err != nil {
			errs = append(errs, fmt.Errorf("clean up %s mode: %w", m, err))
		}
	}
	return multierror.Append(nil, errs...).ErrorOrNil()
}
