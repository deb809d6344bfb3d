package iptablestest

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/test/testbed"
)

// step is one restore input and whether iptables-restore --noflush takes it.
type step struct {
	name, input string
	ok          bool
}

// steps run in order on one state. Each refused input is refused by real
// iptables too, and leaves its table as it was (TestFakeMatchesIPTables runs
// them on both).
var steps = []step{
	{"chains, rules, a jump from a built-in chain", "*nat\n:UPX-A - [0:0]\n:UPX-B - [0:0]\n" +
		"-A UPX-A -p tcp -m comment --comment \"a \\\"quoted\\\" comment\" -m tcp --dport 80 -j UPX-B\n" +
		"-A UPX-B -p tcp -m tcp -j DNAT --to-destination 10.0.0.1:8080\n-A PREROUTING -j UPX-A\nCOMMIT\n", true},
	{"deleting a chain with rules", "*nat\n-X UPX-B\nCOMMIT\n", false},
	{"deleting a chain still jumped to", "*nat\n-F UPX-B\n-X UPX-B\nCOMMIT\n", false},
	{"a jump to a chain that does not exist", "*nat\n-A UPX-A -j UPX-NONE\nCOMMIT\n", false},
	{"a rule in a chain that does not exist", "*nat\n-A UPX-NONE -j RETURN\nCOMMIT\n", false},
	{"deleting a rule that is not there", "*nat\n-D PREROUTING -j UPX-B\nCOMMIT\n", false},
	{"creating a chain that exists", "*nat\n-N UPX-A\nCOMMIT\n", false},
	{"inserting past the end", "*nat\n-I PREROUTING 3 -j RETURN\nCOMMIT\n", false},
	{"a table not committed", "*filter\n:UPX-F - [0:0]\n", false},
	{"the first table commits before the second fails", "*filter\n:UPX-F - [0:0]\n-A INPUT -j UPX-F\nCOMMIT\n*nat\n-A UPX-NONE -j RETURN\nCOMMIT\n", false},
	{"declaring flushes, so a chain can go once nothing jumps to it", "*nat\n:UPX-A - [0:0]\n:UPX-B - [0:0]\n-X UPX-B\n-A UPX-A -j RETURN\nCOMMIT\n", true},
	{"inserting at a position", "*nat\n-I PREROUTING 1 -m comment --comment first -j RETURN\n-I PREROUTING 2 -j RETURN\nCOMMIT\n", true},
	{"deleting a rule by its words", "*nat\n-D PREROUTING -m comment --comment \"first\" -j RETURN\nCOMMIT\n", true},
	{"a built-in chain declared keeps its rules", "*nat\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n", true},
	{"removing a jump and its chain", "*filter\n:UPX-F - [0:0]\n-D INPUT -j UPX-F\n-X UPX-F\nCOMMIT\n", true},
}

// dump is the part of a state the comparison holds to: every user chain, and
// the built-in chains that have rules, each rule by its words.
func dump(rs *iptables.Ruleset) string {
	var b strings.Builder
	for _, table := range []string{"filter", "nat"} {
		for _, c := range rs.Chains(table) {
			if c.Policy != "-" && len(c.Rules) == 0 {
				continue
			}
			b.WriteString(table + " " + c.Name + "\n")
			for _, r := range c.Rules {
				b.WriteString("  " + strings.Join(r.Args(), " | ") + "\n")
			}
		}
	}
	return b.String()
}

func TestRestore(t *testing.T) {
	f := New()
	for _, st := range steps {
		before := dump(f.State(false))
		err := f.Restore(false, []byte(st.input))
		if (err == nil) != st.ok {
			t.Fatalf("%s: got error %v, want ok %v", st.name, err, st.ok)
		}
		if err != nil && !strings.Contains(st.input, "*filter") && dump(f.State(false)) != before {
			t.Errorf("%s: refused, but the state changed:\n%s\nwas:\n%s", st.name, dump(f.State(false)), before)
		}
	}
	want := "nat PREROUTING\n  -j | RETURN\n  -j | UPX-A\nnat UPX-A\n  -j | RETURN\n"
	if got := dump(f.State(false)); got != want {
		t.Errorf("state:\n%s\nwant:\n%s", got, want)
	}
	if got := len(f.Restores(false)); got != 6 {
		t.Errorf("restores recorded: got %d, want the 6 that succeeded", got)
	}
	if dump(f.State(true)) != "" {
		t.Errorf("IPv6 changed by IPv4 restores:\n%s", dump(f.State(true)))
	}
}

// The fake holds to what real iptables-restore --noflush does: the same inputs
// are taken or refused alike and leave the same rules, in a namespace of the
// test's own.
func TestFakeMatchesIPTables(t *testing.T) {
	testbed.Needs(t, testbed.IPTables)
	tp := testbed.New(t)
	f, real := New(), iptables.Commands{}
	for _, st := range steps {
		err := tp.Run(testbed.Node, func() error { return real.Restore(false, []byte(st.input)) })
		ferr := f.Restore(false, []byte(st.input))
		if (err == nil) != (ferr == nil) {
			t.Fatalf("%s: iptables-restore says %v, the fake %v", st.name, err, ferr)
		}
		var saved []byte
		if err := tp.Run(testbed.Node, func() (err error) { saved, err = real.Save(false); return err }); err != nil {
			t.Fatal(err)
		}
		if got, want := dump(f.State(false)), dump(iptables.Parse(saved)); got != want {
			t.Fatalf("%s: the fake holds\n%s\niptables holds\n%s", st.name, got, want)
		}
	}
}

func TestTables(t *testing.T) {
	f := New()
	tb, err := f.Tables(false)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Apply(false, "*nat\n:UPX-A - [0:0]\nCOMMIT\n"); err != nil {
		t.Fatal(err)
	}
	spec := []string{"-m", "comment", "--comment", "uproxy portals", "-j", "UPX-A"}
	if ok, err := tb.Exists("nat", "PREROUTING", spec...); ok || err != nil {
		t.Errorf("Exists before Insert: got %v, %v; want false, nil", ok, err)
	}
	if ok, err := tb.Exists("nat", "UPX-NONE", spec...); ok || err != nil {
		t.Errorf("Exists in a missing chain: got %v, %v; want false, nil (as go-iptables)", ok, err)
	}
	if err := tb.Insert("nat", "PREROUTING", 1, "-j", "UPX-NONE"); err == nil {
		t.Errorf("Insert of a jump to a missing chain: got nil error")
	}
	if err := tb.Append("nat", "PREROUTING", "-j", "RETURN"); err != nil {
		t.Fatal(err)
	}
	if err := tb.Insert("nat", "PREROUTING", 1, spec...); err != nil {
		t.Fatal(err)
	}
	if ok, err := tb.Exists("nat", "PREROUTING", spec...); !ok || err != nil {
		t.Errorf("Exists after Insert: got %v, %v; want true, nil", ok, err)
	}
	got, err := tb.List("nat", "PREROUTING")
	want := []string{"-P PREROUTING ACCEPT", `-A PREROUTING -m comment --comment "uproxy portals" -j UPX-A`, "-A PREROUTING -j RETURN"}
	if err != nil || !slices.Equal(got, want) {
		t.Errorf("List: got %q, %v; want %q", got, err, want)
	}
	if got, err := tb.List("nat", "UPX-A"); err != nil || !slices.Equal(got, []string{"-N UPX-A"}) {
		t.Errorf("List of an empty user chain: got %q, %v", got, err)
	}
	if _, err := tb.List("nat", "UPX-NONE"); err == nil {
		t.Errorf("List of a missing chain: got nil error")
	}
	calls := f.Calls(false)
	if len(calls) != 9 || calls[4] != `insert nat PREROUTING 1 -m comment --comment "uproxy portals" -j UPX-A` {
		t.Errorf("calls: got %q, want 9 with the insert fifth", calls)
	}
}

func TestFailures(t *testing.T) {
	f := New()
	boom := errors.New("boom")
	f.FailNextRestore(true, boom)
	if err := f.Restore(true, []byte("*nat\n:UPX-A - [0:0]\nCOMMIT\n")); err != boom {
		t.Errorf("first Restore: got %v, want boom", err)
	}
	if f.State(true).Table("nat").Chain("UPX-A") != nil || len(f.Restores(true)) != 0 {
		t.Errorf("a failed Restore changed the state or was recorded")
	}
	if err := f.Restore(true, []byte("*nat\n:UPX-A - [0:0]\nCOMMIT\n")); err != nil {
		t.Errorf("second Restore: got %v, want nil", err)
	}
	f.FailSave(false, boom)
	if _, err := f.Save(false); err != boom {
		t.Errorf("Save: got %v, want boom", err)
	}
	if _, err := f.SaveCounters(false, "nat"); err != boom {
		t.Errorf("SaveCounters: got %v, want boom", err)
	}
	f.FailSave(false, nil)
	if out, err := f.SaveCounters(true, "nat"); err != nil || !strings.HasPrefix(string(out), "*nat\n") || strings.Contains(string(out), "*filter") {
		t.Errorf("SaveCounters of nat: got %q, %v; want the nat table alone", out, err)
	}
}
