package app

import (
	"context"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// helpFlags returns the long names of the flags `uproxy ARGS --help` lists,
// in its order, without --help itself.
func helpFlags(t *testing.T, args ...string) []string {
	t.Helper()
	out, _, err := runCommand(context.Background(), append(args, "--help")...)
	if err != nil {
		t.Fatalf("uproxy %s --help: %v", strings.Join(args, " "), err)
	}
	line := regexp.MustCompile(`^\s+(?:-\w, )?--([a-z0-9-]+)\b`)
	var flags []string
	for _, l := range strings.Split(out, "\n") {
		if m := line.FindStringSubmatch(l); m != nil && m[1] != "help" {
			flags = append(flags, m[1])
		}
	}
	if len(flags) == 0 {
		t.Fatalf("uproxy %s --help lists no flag:\n%s", strings.Join(args, " "), out)
	}
	return flags
}

// readmeFlagTable returns the flags the README's flag table names in its first
// column (`-v` as "v").
func readmeFlagTable(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile(readme)
	if err != nil {
		t.Fatal(err)
	}
	const header = "| flag | default | meaning |"
	_, table, ok := strings.Cut(string(b), "\n"+header+"\n")
	if !ok {
		t.Fatalf("README.md has no flag table (a line %q)", header)
	}
	name := regexp.MustCompile("`--?([a-z0-9-]+)`")
	var flags []string
	for _, row := range strings.Split(table, "\n") {
		if !strings.HasPrefix(row, "|") {
			break
		}
		cells := strings.Split(row, "|")
		for _, m := range name.FindAllStringSubmatch(cells[1], -1) {
			flags = append(flags, m[1])
		}
	}
	return flags
}

// The README's flag table and `uproxy --help` name the same flags, so neither
// can drift from the other.
func TestREADMEFlagTableMatchesHelp(t *testing.T) {
	help, table := helpFlags(t), readmeFlagTable(t)
	for _, f := range help {
		if !slices.Contains(table, f) {
			t.Errorf("--%s is in uproxy --help but not in the README's flag table", f)
		}
	}
	for _, f := range table {
		if !slices.Contains(help, f) {
			t.Errorf("--%s is in the README's flag table but not in uproxy --help", f)
		}
	}
}

// The help says how the portals are made as the README does: nftables maps by
// default, iptables rules where nftables is missing.
func TestHelpNamesTheDefaultPortals(t *testing.T) {
	out, _, err := runCommand(context.Background(), "--help")
	if err != nil {
		t.Fatal(err)
	}
	intro, _, _ := strings.Cut(out, "\n\n")
	if !strings.Contains(intro, "nftables") || strings.Index(intro, "nftables") > strings.Index(intro, "iptables") {
		t.Errorf("uproxy --help introduces the portals as\n%s\nwant nftables named first (the default of --rules auto), iptables after", intro)
	}
}
