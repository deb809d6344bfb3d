package iptables

import (
	"fmt"
	"slices"

	"github.com/uproxy/uproxy/rules"
)

// Cleanup removes every chain and jump rule the iptables mode installs with
// this chain prefix ("" for the default), in both families, through the real
// iptables commands of the calling thread's namespace. What is already gone,
// including a missing ip6tables, is not an error. The userspace mode's portal
// chains share the prefix but not the names, and are left alone.
func Cleanup(prefix string) error {
	prefix, err := rules.ChainPrefix(prefix)
	if err != nil {
		return err
	}
	return cleanup(nil, namesOf(prefix))
}

func cleanup(k *rules.Kernel, n names) error {
	nat, filter := n.natChains(), n.filterChains()
	err := rules.RemoveChains(k, func(table, chain string) bool {
		switch table {
		case "nat":
			return slices.Contains(nat, chain) || n.isPortChain(chain)
		case "filter":
			return slices.Contains(filter, chain)
		}
		return false
	})
	if err != nil {
		return fmt.Errorf("clean up iptables-mode rules: %w", err)
	}
	return nil
}
