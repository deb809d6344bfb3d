package rules

import (
	"errors"
	"fmt"

	"sigs.k8s.io/knftables"

	"github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/netfilter/nftables"
)

// Cleanup removes the portals of every backend with this chain prefix (the
// iptables chains and jumps of both families, and the nftables table) through
// the real commands. What is already gone, including a missing ip6tables or nft,
// is not an error. It is `uproxy cleanup`.
func Cleanup(prefix string) error { return CleanupExcept("", prefix) }

// CleanupExcept removes the portals of every backend but active: call it when
// the portals start with backend active, so a switch of --rules leaves no
// stale portals behind; BackendNone (or "") removes every backend's. The
// backends' errors are collected.
func CleanupExcept(active Backend, prefix string) error {
	prefix, err := iptables.ChainPrefix(prefix)
	if err != nil {
		return err
	}
	var errs []error
	if active != BackendIPTables {
		if err := cleanup(iptables.Commands{}, chainNames(prefix)); err != nil {
			errs = append(errs, err)
		}
	}
	if active != BackendNFTables {
		if err := cleanupNFTables(prefix); err != nil {
			errs = append(errs, err)
		}
	}
	if active == "" || active == BackendNone {
		// Either backend's policy route of the replies to transparent dials,
		// unless the portals of another prefix use it.
		if err := removeReplyRoutes(prefix); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// IPTablesChains returns what the iptables portals own of a family's tables
// with this chain prefix ("" for the default), the client-address chain
// among them, for a check that none of it is another program's before
// anything is written (iptables.Claim).
func IPTablesChains(prefix string) (iptables.Ours, error) {
	prefix, err := iptables.ChainPrefix(prefix)
	if err != nil {
		return iptables.Ours{}, err
	}
	return chainNames(prefix).ours(), nil
}

// cleanup removes the portals' chains and the jumps to them; another
// program's chain of the portals' names is left, and named in the error.
func cleanup(k iptables.Kernel, c chains) error {
	return iptables.RemoveChains(k, c.ours())
}

func cleanupNFTables(prefix string) error {
	name, err := nftables.TableName(prefix)
	if err != nil {
		// No NFTables could have made a table of this prefix.
		return nil
	}
	if err := nftables.Delete(nftables.Table{Family: knftables.InetFamily, Name: name}); err != nil {
		return fmt.Errorf("remove the nftables portals: %w", err)
	}
	return nil
}
