package testbed

import (
	"regexp"
	"strings"
	"testing"
)

var ruleCounters = regexp.MustCompile(`\[\d+:\d+\]`)

// SavedRules returns the node's iptables-save output (ip6tables-save when v6)
// without its timestamp comments, with every counter zeroed and without the
// tables that hold nothing (built-in chains only, each accepting, no rule:
// iptables-nft keeps a table a program once used), for exact before/after
// comparisons.
func (tp *Topology) SavedRules(t testing.TB, v6 bool) string {
	t.Helper()
	cmd := "iptables-save"
	if v6 {
		cmd = "ip6tables-save"
	}
	out, err := tp.Exec(Node, cmd)
	if err != nil {
		t.Fatalf("%s: %v: %s", cmd, err, out)
	}
	var b, table strings.Builder
	empty := true
	for _, line := range strings.Split(string(out), "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		line = ruleCounters.ReplaceAllString(line, "[0:0]")
		table.WriteString(line + "\n")
		switch {
		case strings.HasPrefix(line, "*"):
			empty = true
		case line == "COMMIT":
			if !empty {
				b.WriteString(table.String())
			}
			table.Reset()
		case !builtinAccept.MatchString(line):
			empty = false
		}
	}
	return b.String()
}

// builtinAccept matches the declaration of a built-in chain with policy ACCEPT.
var builtinAccept = regexp.MustCompile(`^:[A-Z]+ ACCEPT \[0:0\]$`)
