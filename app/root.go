package app

import (
	"flag"
	"fmt"

	"github.com/spf13/cobra"
	"k8s.io/klog/v2"
)

// version is set at build time with -ldflags "-X github.com/uproxy/uproxy/app.version=...".
var version = "dev"

// NewRootCommand is the command line of uproxy: the proxy (the root command
// and run) and its subcommands.
func NewRootCommand() *cobra.Command {
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
