package app

import (
	"bytes"
	"io"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/explain"
)

// The command's flags reach explain.Run, with the defaults users know.
func TestExplainCommandFlags(t *testing.T) {
	cmd := newExplainCommand()
	for flag, want := range map[string]string{
		"metrics-address":    explain.DefaultMetricsAddress,
		"output":             "text",
		"events":             "10",
		"client":             "",
		"iptables-save-file": "",
	} {
		if f := cmd.Flags().Lookup(flag); f == nil || f.DefValue != want {
			t.Errorf("--%s: got %+v, want default %q", flag, f, want)
		}
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"10.96.0.10:80", "--client", "nope"}, `--client "nope"`},
		{[]string{"10.96.0.10:80", "-o", "yaml"}, `-o "yaml"`},
		{[]string{"10.96.0.10:80", "--metrics-address", "127.0.0.1:1"}, "ask the running uproxy at 127.0.0.1:1"},
		{[]string{"10.96.0.10:80", "10.96.0.11:80"}, "explain takes one destination, IP:PORT[/tcp|udp|sctp]; got 2 arguments"},
		{[]string{"10.96.0.10:0"}, `"10.96.0.10:0": port 0: no Service port is 0`},
		{[]string{"10.96.0.10:80/xyz"}, `protocol "xyz": want tcp, udp or sctp`},
		{[]string{"10.96.0.10:80", "--events", "-5"}, "--events -5: want 0 or more"},
		{[]string{"10.96.0.10:80", "--iptables-save-file", "/nonexistent"}, "--iptables-save-file: stat /nonexistent: no such file or directory"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			cmd := newExplainCommand()
			cmd.SetOut(io.Discard)
			cmd.SetErr(io.Discard)
			cmd.SetArgs(tc.args)
			if err := cmd.Execute(); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// explain without a destination says what it takes and prints its usage.
func TestExplainWithoutDestinationPrintsUsage(t *testing.T) {
	root := NewRootCommand()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetArgs([]string{"explain"})
	err := root.Execute()
	if err == nil || err.Error() != "explain takes one destination, IP:PORT[/tcp|udp|sctp]; got 0 arguments" {
		t.Errorf("uproxy explain: got error %v, want one saying it takes a destination", err)
	}
	for _, want := range []string{"Usage:\n  uproxy explain IP:PORT[/tcp|udp|sctp] [flags]", "uproxy explain 10.96.0.10:80", "--client"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("uproxy explain: output lacks %q:\n%s", want, out.String())
		}
	}
}
