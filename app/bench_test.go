package app

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The bench's flags are checked before it builds anything, and each refusal
// names the flag and the value.
func TestBenchCommandRejectsBadFlags(t *testing.T) {
	notExecutable := filepath.Join(t.TempDir(), "uproxy")
	if err := os.WriteFile(notExecutable, []byte("not a program"), 0o644); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"bench", "-o", "yaml"}, `-o "yaml": want table or json`},
		{[]string{"bench", "--udp-clients", "-1"}, "--udp-clients -1: want a positive number of clients"},
		{[]string{"bench", "--connection-clients", "-3"}, "--connection-clients -3: want a positive number of clients"},
		{[]string{"bench", "--connection-clients", "65"}, "--connection-clients 65: at most 64"},
		{[]string{"bench", "--proxy-cpus", "x"}, `--proxy-cpus: CPU list "x"`},
		{[]string{"bench", "--duration", "-5s"}, "--duration -5s: want a positive duration"},
		{[]string{"bench", "--duration", "0s"}, "--duration 0s: want a positive duration"},
		{[]string{"bench", "--rounds", "-3"}, "--rounds -3: want at least 1"},
		{[]string{"bench", "--idle-connections", "-100"}, "--idle-connections -100: want at least 1"},
		{[]string{"bench", "--sync-sizes", "1000,-5"}, "--sync-sizes -5: want Service-port counts of at least 1"},
		{[]string{"bench", "--uproxy", "/nonexistent"}, "--uproxy: stat /nonexistent: no such file or directory"},
		{[]string{"bench", "--uproxy", notExecutable}, "--uproxy " + notExecutable + ": not an executable file"},
		{[]string{"bench", "--chart", "/nonexistent/dir/x.svg"}, "--chart /nonexistent/dir/x.svg: stat /nonexistent/dir"},
	}
	for _, tc := range cases {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			_, _, err := runCommand(context.Background(), tc.args...)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// The command line a report records parses back to the same settings: a list
// flag is written as the flag takes it, not as Go prints a slice.
func TestBenchCommandLineParsesBack(t *testing.T) {
	args := []string{"--sync-sizes", "1000,10000", "--quick", "-o", "json", "--paths", "direct,userspace"}
	cmd := newBenchCommand()
	if err := cmd.ParseFlags(args); err != nil {
		t.Fatal(err)
	}
	line := commandLine(cmd)
	name, flags, _ := strings.Cut(line, " ")
	if name != "bench" {
		t.Errorf("command line %q: want it to begin with the command, bench", line)
	}
	again := newBenchCommand()
	if err := again.ParseFlags(strings.Fields(flags)); err != nil {
		t.Fatalf("command line %q does not parse back: %v", line, err)
	}
	for _, f := range []string{"sync-sizes", "quick", "output", "paths"} {
		if got, want := again.Flags().Lookup(f).Value.String(), cmd.Flags().Lookup(f).Value.String(); got != want {
			t.Errorf("--%s from %q: got %s, want %s", f, line, got, want)
		}
	}
}
