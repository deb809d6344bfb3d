package app

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/uproxy/uproxy/explain"
)

func newExplainCommand() *cobra.Command {
	o := explain.Options{MetricsAddress: explain.DefaultMetricsAddress, Output: "text", Events: 10}
	cmd := &cobra.Command{
		Use:   "explain IP:PORT[/tcp|udp|sctp]",
		Short: "Explain what happens to a connection to IP:PORT: rules, proxy port, endpoints, next choice, recent failures",
		Long: `explain asks the running uproxy (its metrics address: /proxyMode, /debug/services,
/debug/events) and the kernel's nat rules (iptables-save, and the nftables portals'
map elements) what happens to a
connection to IP:PORT:

  - which rule catches the destination: the chain and rule number, from PREROUTING
    (traffic from pods and other hosts) and from OUTPUT (traffic from this node),
    or the nftables portals' map element (--rules nftables), or the elements of
    the nftables kernel mode's table (--proxy-mode nftables);
  - which Service port it is, and what serves it: a userspace proxy port, or the
    kernel's DNAT rules;
  - the endpoints with their state (ready, ejected, active connections, failures);
  - which endpoint the client given by --client would get next, and why;
  - the recent connections of that Service port that were retried or failed.`,
		Example: `  uproxy explain 10.96.0.10:80
  uproxy explain 10.96.0.10:53/udp --client 10.244.1.7
  uproxy explain 10.96.0.10:80 -o json | jq .services[0].endpoints`,
		// The root silences usage for run-time errors; a missing destination
		// is the caller's mistake, which the usage answers.
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) != 1 {
				cmd.Usage()
				return fmt.Errorf("explain takes one destination, IP:PORT[/tcp|udp|sctp]; got %d arguments", len(args))
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			o.Stdin = cmd.InOrStdin()
			return explain.Run(cmd.OutOrStdout(), args[0], o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.Client, "client", o.Client, "client IP to explain the choice for (default: any client; the rules from both pods and the node are shown)")
	f.StringVar(&o.MetricsAddress, "metrics-address", o.MetricsAddress, "HOST:PORT of the running uproxy's metrics address (--metrics-bind-address)")
	f.StringVarP(&o.Output, "output", "o", o.Output, "output format: text or json")
	f.StringVar(&o.IPTablesSave, "iptables-save-file", o.IPTablesSave, "read the rules from this iptables-save output instead of running iptables-save (- for stdin)")
	f.IntVar(&o.Events, "events", o.Events, "how many recent retried or failed connections to show")
	f.StringVar(&o.ChainPrefix, "chain-prefix", "UPROXY", "the running uproxy's --chain-prefix, which names its iptables chains and nftables table")
	return cmd
}
