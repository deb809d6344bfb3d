package app

import (
	"errors"
	"fmt"
	"os"

	"github.com/spf13/cobra"

	"github.com/uproxy/uproxy/measure/ab"
)

// newABCommand is `uproxy ab`: the A/B latency comparison of package ab.
func newABCommand() *cobra.Command {
	var (
		cfg       ab.Config
		output    string
		chartFile string
		maxErrors int
	)
	cmd := &cobra.Command{
		Use:   "ab ADDR_A ADDR_B",
		Short: "Compare the latency of two TCP addresses (e.g. a Service through kube-proxy and through uproxy): echo, HTTP or connect",
		Long: `ab makes connections to two addresses, one at a time, in alternating blocks
(--interleave connections to A, as many to B, then B first, and so on) so that
whatever else the machine does hits both alike. What a connection does is the
--mode:

  echo     write --payload bytes and read them back, --requests-per-connection
           times, then close: the servers must echo (uproxy echo is one);
  http     GET --path, read the whole response, which must be 2xx,
           --requests-per-connection times on a kept-alive connection, then
           close; with --http-close the request says Connection: close and the
           server closes (one request per connection): any HTTP server;
  connect  connect and close: any TCP server (a database, a cache). The connect
           completes at the first socket on the path: uproxy's proxy port in the
           userspace mode, before it dials a backend, but the backend itself
           through DNAT; compare a mode with a reply to include the backend.

It reports, for A and B, the percentiles of
  connect     dial to established,
  exchange    request written to the last byte of the reply,
  connection  dial to the end of the last exchange (what a client waits for:
              compare this one when one path accepts before it reaches a
              backend, as a userspace proxy does, and the other does not),
(connect alone with --mode connect) with B-A per percentile, its confidence
interval from a bootstrap (each side resampled with replacement) and a verdict:
"B slower, significant" or "B faster, significant" when the interval excludes 0,
else "no significant difference". Failed connections are counted by kind
(refused, connect timeout, unreachable, timeout, reset, short read, status: an
HTTP status other than 2xx, mismatch: not an echo or not HTTP, other), and the
first error of each kind is shown.

Run it with the same address twice to see how large a difference the noise
alone makes here.`,
		Example: `  uproxy ab 10.96.0.10:80 10.96.0.11:80                              # echo servers (uproxy echo)
  uproxy ab --mode http --path /healthz 10.96.0.10:80 10.96.0.11:80  # any HTTP Service
  uproxy ab --mode connect 10.96.0.20:5432 10.96.0.21:5432           # any TCP Service`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) != 2 {
				return fmt.Errorf("want two addresses, ADDR_A and ADDR_B (host:port), got %d arguments", len(args))
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if output != "table" && output != "json" {
				return fmt.Errorf("-o %q: want table or json", output)
			}
			// Zero selects a default in ab.Config; on the command line it is a
			// mistake. Other bad values are ab.Run's to name.
			// The words are ab.Run's for the negative values of the same flags.
			for _, name := range []string{"connections", "requests-per-connection", "payload", "interleave", "resamples"} {
				if v := cmd.Flags().Lookup(name).Value.String(); v == "0" {
					return fmt.Errorf("--%s 0: want at least 1", name)
				}
			}
			for _, name := range []string{"dial-timeout", "timeout"} {
				if v := cmd.Flags().Lookup(name).Value.String(); v == "0s" {
					return fmt.Errorf("--%s 0s: want a positive duration", name)
				}
			}
			if cfg.Confidence == 0 {
				return errors.New("--confidence 0: want a level between 0 and 1, e.g. 0.95")
			}
			if err := checkOutputFile("--chart", chartFile); err != nil {
				return err
			}
			if maxErrors < 0 {
				return fmt.Errorf("--max-errors %d: want 0 (never stop) or more", maxErrors)
			}
			// The defaults of another mode's flags are not settings of this
			// one; given, they are ab.Run's to refuse.
			if cfg.Mode != ab.ModeEcho && !cmd.Flags().Changed("payload") {
				cfg.Payload = 0
			}
			if cfg.Mode != ab.ModeHTTP && !cmd.Flags().Changed("path") {
				cfg.Path = ""
			}
			cfg.A, cfg.B = args[0], args[1]
			cfg.MaxErrors = maxErrors
			if maxErrors == 0 {
				cfg.MaxErrors = -1
			}
			stderr := cmd.ErrOrStderr()
			cfg.Progress = stderr
			if f, ok := stderr.(*os.File); ok {
				if st, err := f.Stat(); err == nil && st.Mode()&os.ModeCharDevice != 0 {
					cfg.Live = true
				}
			}
			// The settings' errors name their flags, as the checks above do.
			if err := cfg.Check(); err != nil {
				return err
			}
			ctx, stop := interruptible(cmd)
			defer stop()
			rep, err := ab.Run(ctx, cfg)
			if err != nil {
				return fmt.Errorf("ab: %w", err)
			}
			if err := printReport(cmd, rep, output, chartFile); err != nil {
				return err
			}
			if rep.Stopped != "" {
				return fmt.Errorf("ab: stopped early: %s", rep.Stopped)
			}
			// No comparison without a sample on each side: a script reading the
			// exit status must not take it for one.
			for _, sd := range []struct {
				name string
				s    ab.Side
			}{{"A", rep.A}, {"B", rep.B}} {
				if sd.s.Connections > 0 && sd.s.Failed == sd.s.Connections {
					return fmt.Errorf("ab: every connection to %s (%s) failed (%d), so nothing was compared", sd.name, sd.s.Address, sd.s.Failed)
				}
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.Mode, "mode", ab.ModeEcho, "what a connection does: echo (the servers must echo), http (GET --path, a 2xx expected) or connect (connect and close: any TCP server)")
	f.StringVar(&cfg.Path, "path", "/", "--mode http: the path each request gets")
	f.BoolVar(&cfg.HTTPClose, "http-close", false, "--mode http: send Connection: close, so the server closes each connection after its response (one request per connection); without it the connection is kept alive for --requests-per-connection requests, then ab closes it")
	f.IntVar(&cfg.Connections, "connections", ab.DefaultConnections, "connections to each address (p99.9 gets a verdict from 5000)")
	f.IntVar(&cfg.RequestsPerConnection, "requests-per-connection", 1, "exchanges per connection (echo, http): 1 is a short connection (connect, exchange, close), more a persistent one")
	f.IntVar(&cfg.Payload, "payload", ab.DefaultPayload, "--mode echo: bytes each exchange writes and reads back")
	f.IntVar(&cfg.Interleave, "interleave", ab.DefaultInterleave, "connections per block; blocks to A and B alternate, as does the side going first")
	f.DurationVar(&cfg.DialTimeout, "dial-timeout", ab.DefaultDialTimeout, "limit of each connect")
	f.DurationVar(&cfg.Timeout, "timeout", ab.DefaultTimeout, "limit of each exchange (request written and reply read)")
	f.IntVar(&maxErrors, "max-errors", ab.DefaultMaxErrors, "stop when either address has failed this many connections (0: never)")
	f.IntVar(&cfg.Resamples, "resamples", ab.DefaultResamples, "bootstrap resamples of each interval")
	f.Float64Var(&cfg.Confidence, "confidence", ab.DefaultConfidence, "level of the intervals")
	f.Uint64Var(&cfg.Seed, "seed", 1, "seed of the bootstrap (the same measurements give the same intervals)")
	f.StringVarP(&output, "output", "o", "table", "output format: table or json")
	f.StringVar(&chartFile, "chart", "", "write the latency distributions of A and B as an SVG chart to this file")
	return cmd
}
