package iptables

import (
	"fmt"

	ipt "github.com/uproxy/uproxy/netfilter/iptables"
)

// Cleanup removes every chain and jump rule the iptables mode installs with
// this chain prefix ("" for the default), in both families, through the real
// iptables commands of the calling thread's namespace. What is already gone,
// including a missing ip6tables, is not an error. The userspace mode's portal
// chains share the prefix but not the names, and are left alone.
func Cleanup(prefix string) error {
	prefix, err := ipt.ChainPrefix(prefix)
	if err != nil {
		return err
	}
	return cleanup(ipt.Commands{}, namesOf(prefix))
}

func cleanup(k ipt.Kernel, n names) error {
	fixed := ipt.ChainSet{"nat": n.natChains(), "filter": n.filterChains()}
	err := ipt.RemoveChains(k, func(table, chain string) bool {
		return fixed.Has(table, chain) || table == "nat" && n.isPortChain(chain)
	})
	if err != nil {
		return fmt.Errorf("clean up iptables-mode rules: %w", err)
	}
	return nil
}
