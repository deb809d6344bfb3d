package app

import (
	"errors"
	"fmt"
	"net"

	"github.com/spf13/cobra"

	"github.com/uproxy/uproxy/measure/ab"
)

// newEchoCommand is `uproxy echo`: the server `uproxy ab` expects.
func newEchoCommand() *cobra.Command {
	var e ab.Echo
	cmd := &cobra.Command{
		Use:   "echo ADDR",
		Short: "Serve TCP on ADDR, writing back every byte read: a backend for uproxy ab",
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) != 1 {
				return fmt.Errorf("want one address to listen on (e.g. :8080), got %d arguments", len(args))
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if e.Delay < 0 {
				return fmt.Errorf("--delay %v: want zero or a positive duration", e.Delay)
			}
			ln, err := net.Listen("tcp", args[0])
			if err != nil {
				return fmt.Errorf("echo: %w", err)
			}
			fmt.Fprintf(cmd.ErrOrStderr(), "echo: listening on %s\n", ln.Addr())
			ctx, stop := interruptible(cmd)
			defer stop()
			go func() {
				<-ctx.Done()
				ln.Close()
			}()
			if err := e.Serve(ln); err != nil && !errors.Is(err, net.ErrClosed) {
				return fmt.Errorf("echo: %w", err)
			}
			return nil
		},
	}
	cmd.Flags().DurationVar(&e.Delay, "delay", 0, "wait this long before writing back each read (a slower backend on purpose)")
	return cmd
}
