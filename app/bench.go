package app

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/uproxy/uproxy/measure/bench"
)

// newBenchCommand is `uproxy bench`: the A/B benchmark of the bench package.
func newBenchCommand() *cobra.Command {
	var (
		cfg       bench.Config
		output    string
		chart     string
		paths     string
		workloads string
		proxyCPUs string
	)
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure the same traffic direct, through uproxy's modes and through HAProxy/nginx (root)",
		Long: `bench builds its own network namespaces (client, node, backends) and runs the
same workloads over every available path, interleaved round by round: TCP bulk
throughput, short connections (the client closing first, the server closing
first, the client resetting), request/response latency on a persistent
connection, UDP request/response, memory per idle connection, and the control
plane (sync time at many Service ports, heap per Service port, endpoint change
to traffic).

Every figure comes with the proxy's own CPU per unit of work, read from /proc,
and ratios against the direct path and the best of HAProxy and nginx. Paths
whose prerequisites are missing are listed as unavailable with the reason
(install the peers with make bench-deps).

Paths:     ` + strings.Join(bench.Paths, ",") + `
Workloads: ` + strings.Join(bench.Workloads, ","),
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if output != "table" && output != "json" {
				return fmt.Errorf("-o %q: want table or json", output)
			}
			for _, c := range []struct {
				flag string
				n    int
			}{{"--udp-clients", cfg.UDPClients}, {"--connection-clients", cfg.ConnClients}} {
				if c.n < 0 {
					return fmt.Errorf("%s %d: want a positive number of clients", c.flag, c.n)
				}
			}
			// Zero, the flags' default, selects the run's default; given on the
			// command line, zero or less is a mistake.
			for _, c := range []struct {
				flag string
				bad  bool
				want string
			}{
				{"duration", cfg.Duration < 0 || cmd.Flags().Changed("duration") && cfg.Duration == 0, "a positive duration"},
				{"rounds", cfg.Rounds < 0 || cmd.Flags().Changed("rounds") && cfg.Rounds == 0, "at least 1"},
				{"idle-connections", cfg.IdleConns < 0 || cmd.Flags().Changed("idle-connections") && cfg.IdleConns == 0, "at least 1"},
			} {
				if c.bad {
					return fmt.Errorf("--%s %s: want %s", c.flag, cmd.Flags().Lookup(c.flag).Value, c.want)
				}
			}
			for _, n := range cfg.SyncSizes {
				if n < 1 {
					return fmt.Errorf("--sync-sizes %d: want Service-port counts of at least 1", n)
				}
			}
			if cfg.Uproxy != "" {
				if st, err := os.Stat(cfg.Uproxy); err != nil {
					return fmt.Errorf("--uproxy: %w", err)
				} else if !st.Mode().IsRegular() || st.Mode().Perm()&0o111 == 0 {
					return fmt.Errorf("--uproxy %s: not an executable file", cfg.Uproxy)
				}
			}
			if err := checkOutputFile("--chart", chart); err != nil {
				return err
			}
			if cfg.ConnClients > bench.MaxConnClients {
				return fmt.Errorf("--connection-clients %d: at most %d", cfg.ConnClients, bench.MaxConnClients)
			}
			if proxyCPUs != "" {
				cpus, err := bench.ParseCPUList(proxyCPUs)
				if err != nil {
					return fmt.Errorf("--proxy-cpus: %w", err)
				}
				cfg.ProxyCPUs = cpus
			}
			cfg.Paths = splitList(paths)
			cfg.Workloads = splitList(workloads)
			cfg.Progress = cmd.ErrOrStderr()
			cfg.Log = cmd.ErrOrStderr()
			ctx, stop := interruptible(cmd)
			defer stop()
			rep, err := bench.Run(ctx, cfg)
			if errors.Is(err, context.Canceled) {
				return errors.New("bench: interrupted (everything it built has been removed)")
			}
			if err != nil {
				return fmt.Errorf("bench: %w", err)
			}
			rep.Command = commandLine(cmd)
			if err := printReport(cmd, rep, output, chart); err != nil {
				return err
			}
			if failed := rep.Failed(); len(failed) > 0 {
				return fmt.Errorf("bench: %d failures:\n  %s", len(failed), strings.Join(failed, "\n  "))
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.BoolVar(&cfg.Quick, "quick", false, "short run (under two minutes): 500ms rounds, 2 rounds, 1000 idle connections, syncs of 1000 Service ports")
	f.DurationVar(&cfg.Duration, "duration", 0, "measurement window of each round of each workload over each path (default 5s, --quick 500ms)")
	f.IntVar(&cfg.Rounds, "rounds", 0, "rounds per workload and path, interleaved across paths (default 3, --quick 2)")
	f.IntVar(&cfg.IdleConns, "idle-connections", 0, "idle connections of the memory workload (default 10000, --quick 1000)")
	f.IntSliceVar(&cfg.SyncSizes, "sync-sizes", nil, "Service-port counts of the control-plane syncs (default 1000,10000,50000; --quick 1000)")
	f.StringVarP(&output, "output", "o", "table", "output format: table or json")
	f.StringVar(&chart, "chart", "", "write the latency distributions as an SVG chart to this file")
	f.StringVar(&paths, "paths", "", "comma-separated paths to run (default all)")
	f.StringVar(&workloads, "workloads", "", "comma-separated workloads to run (default all)")
	f.IntVar(&cfg.UDPClients, "udp-clients", 0, "clients of the UDP workload, each with one request outstanding (default 4)")
	f.IntVar(&cfg.ConnClients, "connection-clients", 0, "clients of each short-connection workload (connections, connections-server-close, connections-reset), each with one connection open (default 4, at most 64)")
	f.StringVar(&proxyCPUs, "proxy-cpus", "", "run every proxy on these CPUs (a list such as 1 or 2-3) and the load generators and backends on the others; the peers run one worker per CPU in it (default: every process on every CPU)")
	f.StringVar(&cfg.Uproxy, "uproxy", "", "uproxy binary for the uproxy paths (default this executable)")
	cmd.AddCommand(newBenchReportCommand())
	return cmd
}

// newBenchReportCommand is `uproxy bench report FILE`: the Markdown page of
// docs/performance.md from a saved `uproxy bench -o json`.
func newBenchReportCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "report FILE.json",
		Short: "Write the Markdown performance page (docs/performance.md) from the output of uproxy bench -o json",
		Long: `report reads what uproxy bench -o json wrote and prints a Markdown page: when
and on what machine it ran (CPU model, CPUs, kernel, load average), the command,
and one table per workload and for the control plane. Every workload the file
holds is rendered; the columns are those its paths have figures for.
make perf-doc runs the bench and this command into docs/performance.md.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			f, err := os.Open(args[0])
			if err != nil {
				return err
			}
			defer f.Close()
			rep, err := bench.ReadReport(f)
			if err != nil {
				return fmt.Errorf("%s: %w", args[0], err)
			}
			return rep.WriteMarkdown(cmd.OutOrStdout())
		},
	}
}

// commandLine spells the command as it ran: its path and the flags set.
func commandLine(cmd *cobra.Command) string {
	parts := []string{cmd.CommandPath()}
	cmd.Flags().Visit(func(f *pflag.Flag) {
		v := f.Value.String()
		if s, ok := f.Value.(pflag.SliceValue); ok {
			v = strings.Join(s.GetSlice(), ",")
		}
		parts = append(parts, "--"+f.Name+"="+v)
	})
	return strings.Join(parts, " ")
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}
