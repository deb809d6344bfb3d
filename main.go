// Command uproxy is a Kubernetes service proxy whose userspace mode listens on a
// proxy port per Service port, picks a backend, retries on failure and copies the
// bytes, beside kernel modes that program the same Services into netfilter.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"
	"k8s.io/klog/v2"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	if name := filepath.Base(os.Args[0]); iptablesCommands[name] {
		err := runIPTablesWrapper(name, os.Args[1:])
		fmt.Fprintln(os.Stderr, "uproxy:", err)
		os.Exit(2)
	}
	if err := newRootCommand().Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "uproxy:", err)
		os.Exit(1)
	}
}

func newRootCommand() *cobra.Command {
	opts := defaultOptions()
	root := &cobra.Command{
		Use:   "uproxy",
		Short: "A Kubernetes service proxy with a userspace mode that retries and shows every attempt",
		Long: `uproxy proxies Kubernetes Services. In the userspace mode it opens a proxy port
per Service port, steers the Service's virtual IPs there with nftables maps (or
iptables rules where nftables is missing: --rules), chooses a backend (round robin
or another IPVS-style scheduler, ClientIP affinity), dials it and retries another
when a dial fails. The kernel modes (--proxy-mode iptables, nftables, ipvs)
program the same Services into the kernel instead.`,
		SilenceUsage:  true,
		SilenceErrors: true,
		Args:          cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if opts.cleanup {
				return runCleanup(opts, false)
			}
			return runProxy(cmd.Context(), opts, nil)
		},
	}
	opts.addFlags(root)
	// `uproxy --version` answers as `uproxy version` does.
	root.Version = version
	root.SetVersionTemplate("uproxy {{.Version}}\n")

	goflags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(goflags)
	root.PersistentFlags().AddGoFlag(goflags.Lookup("v"))
	root.PersistentFlags().AddGoFlag(goflags.Lookup("vmodule"))

	root.AddCommand(
		&cobra.Command{
			Use:   "run",
			Short: "Run the proxy (the default command)",
			Args:  cobra.NoArgs,
			RunE: func(cmd *cobra.Command, args []string) error {
				return runProxy(cmd.Context(), opts, nil)
			},
		},
		newCleanupCommand(),
		newDemoCommand(),
		newExplainCommand(),
		newBenchCommand(),
		newABCommand(), newEchoCommand(),
		&cobra.Command{
			Use:   "version",
			Short: "Print the version",
			Args:  cobra.NoArgs,
			Run: func(cmd *cobra.Command, args []string) {
				fmt.Fprintln(cmd.OutOrStdout(), "uproxy", version)
			},
		},
	)
	// The run flags belong to the root and to run; demo and cleanup have their own.
	for _, c := range root.Commands() {
		if c.Name() == "run" {
			c.Flags().AddFlagSet(root.Flags())
		}
	}
	return root
}

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
