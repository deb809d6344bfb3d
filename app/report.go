package app

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/spf13/cobra"
)

// writeFile creates name and fills it with write, reporting the first error
// of writing or closing.
func writeFile(name string, write func(io.Writer) error) error {
	f, err := os.Create(name)
	if err != nil {
		return err
	}
	if err := write(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// interruptible is the command's context, ended by SIGINT or SIGTERM as well.
func interruptible(cmd *cobra.Command) (context.Context, context.CancelFunc) {
	ctx := cmd.Context()
	if ctx == nil {
		ctx = context.Background()
	}
	return signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
}

// report is what bench and ab print.
type report interface {
	WriteJSON(io.Writer) error
	WriteTable(io.Writer) error
	WriteChart(io.Writer) error
}

// checkOutputFile says, before a run, why file could not be written after it
// (nil when it can be tried, or is not asked for): its directory must exist.
func checkOutputFile(flag, file string) error {
	if file == "" {
		return nil
	}
	dir := filepath.Dir(file)
	if st, err := os.Stat(dir); err != nil {
		return fmt.Errorf("%s %s: %w", flag, file, err)
	} else if !st.IsDir() {
		return fmt.Errorf("%s %s: %s is not a directory", flag, file, dir)
	}
	return nil
}

// printReport writes rep to stdout in the -o format (table or json), and its
// chart to chartFile if one is named.
func printReport(cmd *cobra.Command, rep report, output, chartFile string) error {
	out := cmd.OutOrStdout()
	var err error
	if output == "json" {
		err = rep.WriteJSON(out)
	} else {
		err = rep.WriteTable(out)
	}
	if err != nil {
		return err
	}
	if chartFile != "" {
		if err := writeFile(chartFile, rep.WriteChart); err != nil {
			return fmt.Errorf("--chart: %w", err)
		}
	}
	return nil
}
