// Command uproxy is a Kubernetes service proxy whose userspace mode listens on a
// proxy port per Service port, picks a backend, retries on failure and copies the
// bytes, beside kernel modes that program the same Services into netfilter.
//
// This file only dispatches: called by an iptables command's name, to the
// wrapper that picks the node's iptables backend; otherwise to the command
// line of package app, which holds the program.
package main

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/uproxy/uproxy/app"
)

func main() {
	if name := filepath.Base(os.Args[0]); app.IsIPTablesCommand(name) {
		err := app.RunIPTablesWrapper(name, os.Args[1:])
		fmt.Fprintln(os.Stderr, "uproxy:", err)
		os.Exit(2)
	}
	if err := app.NewRootCommand().Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "uproxy:", err)
		os.Exit(1)
	}
}
