package app

import (
	"errors"
	"fmt"

	"github.com/spf13/cobra"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/app/registry"
)

// newCleanupCommand is `uproxy cleanup`: all it needs to know is whose rules to
// remove, and whether to remove them from under a running uproxy.
func newCleanupCommand() *cobra.Command {
	opts := defaultOptions()
	force := false
	cmd := &cobra.Command{
		Use:   "cleanup",
		Short: "Remove every rule and chain uproxy installs, then exit",
		Long: `Remove every rule, chain, table, link and virtual server that uproxy installs
with --chain-prefix, in every mode, then exit. Nothing of kube-proxy's is touched:
a KUBE prefix is refused. Another program's table or chain of uproxy's names
(Docker's DOCKER-FORWARD for --chain-prefix DOCKER) is left as it is, with the
rules that jump to it, and named; cleanup then exits 1. While a uproxy with the
same prefix runs on this node, cleanup is refused (naming its pid) unless --force.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return runCleanup(opts, force)
		},
	}
	cmd.Flags().StringVar(&opts.chainPrefix, "chain-prefix", opts.chainPrefix, chainPrefixHelp)
	cmd.Flags().BoolVar(&force, "force", force, "remove the rules even while a uproxy with this --chain-prefix runs (it writes them back at its next sync)")
	return cmd
}

// runCleanup removes every mode's rules, links and virtual servers of
// --chain-prefix. Before it touches anything it checks the prefix as the run
// command does (kube-proxy's KUBE is refused) and takes the lock a running
// uproxy of that prefix holds: while one runs, cleanup is refused, naming it,
// unless force (its rules are then removed all the same, and it writes them
// back at its next sync or flush check).
func runCleanup(o *options, force bool) error {
	if err := checkChainPrefix(o.chainPrefix); err != nil {
		return err
	}
	// Without the capability every step fails alike (iptables-save, nft, netlink),
	// each with its own words: say it once.
	if !hasNetAdmin() {
		return errors.New("cleanup needs root (CAP_NET_ADMIN) to remove rules, tables and links; nothing was removed")
	}
	lock, err := lockRules(o.chainPrefix)
	var held *rulesHeldError
	switch {
	case errors.As(err, &held) && held.notUproxy:
		// No uproxy runs under the prefix: its rules are anyone's to remove.
		klog.InfoS("The lock of this --chain-prefix is held by a process that is not root, so no uproxy: cleaning up all the same", "holder", held.holder, "lock", held.name)
	case errors.As(err, &held) && force:
		klog.InfoS("Removing the rules of a running uproxy (--force): it writes them back at its next sync", "holder", held.holder, "prefix", o.chainPrefix)
	case errors.As(err, &held):
		held.remedy = "stop it first, or run `uproxy cleanup --force` to remove its rules all the same (it writes them back at its next sync)"
		return held
	case err != nil:
		return err
	}
	defer lock.Close()
	if err := registry.CleanupAll(o.chainPrefix); err != nil {
		return fmt.Errorf("cleanup: %w", err)
	}
	klog.InfoS("Removed uproxy's rules of every mode", "prefix", o.chainPrefix)
	return nil
}
