package iptables_test

import (
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/netfilter/iptables/iptablestest"
)

// rules returns a chain's rules as iptables-save prints them.
func rules(k *iptablestest.Fake, v6 bool, table, chain string) []string {
	var out []string
	if c := k.State(v6).Table(table).Chain(chain); c != nil {
		for _, r := range c.Rules {
			out = append(out, r.Text)
		}
	}
	return out
}

// dump prints a family's state, one line per chain and rule.
func dump(k *iptablestest.Fake, v6 bool) string {
	var b strings.Builder
	for _, t := range k.State(v6).Tables {
		for _, c := range t.Chains {
			fmt.Fprintf(&b, "%s %s %s\n", t.Name, c.Name, c.Policy)
			for _, r := range c.Rules {
				b.WriteString("  " + r.Text + "\n")
			}
		}
	}
	return b.String()
}

// jump is restore input's line of a jump from chain to target as uproxy
// writes it, with its comment.
func jump(chain, target string) string {
	return "-A " + chain + ` -m comment --comment "` + iptables.CommentPrefix + `test" -j ` + target + "\n"
}

func mustApply(t *testing.T, k *iptablestest.Fake, v6 bool, input string) {
	t.Helper()
	if err := k.Apply(v6, input); err != nil {
		t.Fatal(err)
	}
}

func TestCanary(t *testing.T) {
	t.Parallel()
	k := iptablestest.New()
	c := iptables.Canary{Chain: "UPX-CANARY", Tables: []string{"nat", "filter"}}
	tables, err := k.Tables(false)
	if err != nil {
		t.Fatal(err)
	}
	check := func(what string, want, wantErr bool) {
		t.Helper()
		got, err := c.Intact(tables)
		if got != want || (err != nil) != wantErr {
			t.Errorf("%s: got %v, %v; want %v, error %v", what, got, err, want, wantErr)
		}
	}
	check("never written", false, true)
	write := func(table string) string {
		return "*" + table + "\n:" + c.Chain + " - [0:0]\n" + c.Rule() + "\nCOMMIT\n"
	}
	mustApply(t, k, false, write("nat"))
	check("written in nat only", false, true)
	mustApply(t, k, false, write("filter"))
	check("written in both tables", true, false)
	k.Flush(false, "filter")
	check("after iptables -t filter -F", false, false)
	mustApply(t, k, false, write("filter"))
	mustApply(t, k, false, "*nat\n:"+c.Chain+" - [0:0]\n-A "+c.Chain+" -j RETURN\nCOMMIT\n")
	check("another rule in its place", false, false)
}

func TestEnsureJumps(t *testing.T) {
	t.Parallel()
	k := iptablestest.New()
	mustApply(t, k, false, "*nat\n:KUBE-SERVICES - [0:0]\n:UPX-A - [0:0]\n:UPX-B - [0:0]\n:UPX-LAST - [0:0]\n-A PREROUTING -j KUBE-SERVICES\nCOMMIT\n")
	tables, _ := k.Tables(false)
	jumps := []iptables.Jump{
		{Table: "nat", Chain: "PREROUTING", Spec: []string{"-m", "comment", "--comment", "first of all", "-j", "UPX-A"}},
		{Table: "nat", Chain: "PREROUTING", Last: true, Spec: []string{"-j", "UPX-LAST"}},
		{Table: "nat", Chain: "PREROUTING", Spec: []string{"-j", "UPX-B"}},
	}
	for i := range 2 {
		if err := iptables.EnsureJumps(tables, false, jumps); err != nil {
			t.Fatalf("EnsureJumps %d: %v", i, err)
		}
	}
	want := []string{
		`-A PREROUTING -m comment --comment "first of all" -j UPX-A`,
		`-A PREROUTING -j UPX-B`,
		`-A PREROUTING -j KUBE-SERVICES`,
		`-A PREROUTING -j UPX-LAST`,
	}
	if got := rules(k, false, "nat", "PREROUTING"); !slices.Equal(got, want) {
		t.Errorf("PREROUTING after two EnsureJumps:\ngot  %q\nwant %q", got, want)
	}

	// A jump that cannot go in is reported; the others still go in.
	k = iptablestest.New()
	mustApply(t, k, true, "*nat\n:UPX-A - [0:0]\nCOMMIT\n")
	tables, _ = k.Tables(true)
	err := iptables.EnsureJumps(tables, true, []iptables.Jump{
		{Table: "nat", Chain: "OUTPUT", Spec: []string{"-j", "UPX-MISSING"}},
		{Table: "nat", Chain: "OUTPUT", Spec: []string{"-j", "UPX-A"}},
	})
	if err == nil || !strings.Contains(err.Error(), "IPv6 jump nat/OUTPUT -> UPX-MISSING") {
		t.Errorf("got error %v, want one naming the IPv6 jump to UPX-MISSING", err)
	}
	if got, want := rules(k, true, "nat", "OUTPUT"), []string{"-A OUTPUT -j UPX-A"}; !slices.Equal(got, want) {
		t.Errorf("OUTPUT: got %q, want %q", got, want)
	}
}

func TestRemoveChains(t *testing.T) {
	t.Parallel()
	ours := iptables.Ours{Chains: iptables.ChainSet{"nat": {"UPX-SERVICES"}, "filter": {"UPX-FILTER"}}.Has}
	others := "*nat\n:KUBE-SERVICES - [0:0]\n-A PREROUTING -j KUBE-SERVICES\n-A KUBE-SERVICES -j RETURN\nCOMMIT\n"
	mine := "*nat\n:UPX-SERVICES - [0:0]\n-A UPX-SERVICES -j RETURN\n" + jump("PREROUTING", "UPX-SERVICES") + jump("OUTPUT", "UPX-SERVICES") + "COMMIT\n" +
		"*filter\n:UPX-FILTER - [0:0]\n" + jump("INPUT", "UPX-FILTER") + "COMMIT\n"
	for _, tc := range []struct {
		name    string
		saveErr [2]error
		wantErr string
		cleaned [2]bool
	}{
		{name: "both families", cleaned: [2]bool{true, true}},
		{name: "no ip6tables", saveErr: [2]error{nil, fmt.Errorf("ip6tables-save: %w", exec.ErrNotFound)}, cleaned: [2]bool{true, false}},
		{name: "IPv4 unreadable", saveErr: [2]error{errors.New("iptables-save: permission denied")}, wantErr: "read rules for cleanup: iptables-save: permission denied", cleaned: [2]bool{false, true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k := iptablestest.New()
			var before [2]string
			for i, v6 := range []bool{false, true} {
				mustApply(t, k, v6, others)
				before[i] = dump(k, v6)
				mustApply(t, k, v6, mine)
				k.FailSave(v6, tc.saveErr[i])
			}
			err := iptables.RemoveChains(k, ours)
			if (err == nil) != (tc.wantErr == "") || err != nil && !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("got error %v, want %q", err, tc.wantErr)
			}
			for i, v6 := range []bool{false, true} {
				restores := len(k.Restores(v6))
				if cleaned := dump(k, v6) == before[i]; cleaned != tc.cleaned[i] || restores != map[bool]int{true: 1}[cleaned] {
					t.Errorf("%s: got cleaned %v in %d restores, want %v:\n%s", iptables.FamilyName(v6), cleaned, restores, tc.cleaned[i], dump(k, v6))
				}
				k.FailSave(v6, nil)
			}
			// Readable again, what was left goes; then there is nothing to write.
			for range 2 {
				if err := iptables.RemoveChains(k, ours); err != nil {
					t.Fatal(err)
				}
			}
			for i, v6 := range []bool{false, true} {
				if got := dump(k, v6); got != before[i] {
					t.Errorf("%s after the retry:\n%s\nwant:\n%s", iptables.FamilyName(v6), got, before[i])
				}
				if got := len(k.Restores(v6)); got != 1 {
					t.Errorf("%s: got %d restores in all, want 1", iptables.FamilyName(v6), got)
				}
			}
		})
	}
}

func TestRemovalSteps(t *testing.T) {
	t.Parallel()
	ours := iptables.Ours{Chains: iptables.ChainSet{"nat": {"UPX-SERVICES", "UPX-SVC-A", "UPX-SVC-B", "UPX-SEP-A", "UPX-SEP-B"}, "filter": {"UPX-FILTER", "UPX-FW"}}.Has}
	others := "*nat\n:KUBE-SERVICES - [0:0]\n-A PREROUTING -j KUBE-SERVICES\n-A KUBE-SERVICES -j RETURN\nCOMMIT\n"
	// Our chains jump to one another, and built-in chains jump to them.
	mine := "*nat\n:UPX-SERVICES - [0:0]\n:UPX-SVC-A - [0:0]\n:UPX-SVC-B - [0:0]\n:UPX-SEP-A - [0:0]\n:UPX-SEP-B - [0:0]\n" +
		"-A UPX-SERVICES -d 10.96.0.1/32 -j UPX-SVC-A\n-A UPX-SERVICES -d 10.96.0.2/32 -j UPX-SVC-B\n" +
		"-A UPX-SVC-A -j UPX-SEP-A\n-A UPX-SVC-B -j UPX-SEP-B\n-A UPX-SEP-A -j RETURN\n-A UPX-SEP-B -j UPX-SVC-A\n" +
		jump("PREROUTING", "UPX-SERVICES") + jump("OUTPUT", "UPX-SERVICES") + "COMMIT\n" +
		"*filter\n:UPX-FILTER - [0:0]\n:UPX-FW - [0:0]\n-A UPX-FILTER -j UPX-FW\n" + jump("INPUT", "UPX-FILTER") + "COMMIT\n"
	for _, tc := range []struct {
		per, steps int
	}{
		// Seven chains, two a restore: nat's five flushed in three, filter's
		// two in one, then deleted in as many.
		{per: 2, steps: 8},
		{per: 5, steps: 4},
		{per: 7, steps: 1},
	} {
		t.Run(fmt.Sprintf("%d chains a restore", tc.per), func(t *testing.T) {
			k := iptablestest.New()
			mustApply(t, k, false, others)
			before := dump(k, false)
			mustApply(t, k, false, mine)
			saved, err := k.Save(false)
			if err != nil {
				t.Fatal(err)
			}
			rs := iptables.Parse(saved)
			steps := rs.RemovalSteps(ours, tc.per)
			if len(steps) != tc.steps {
				t.Errorf("got %d restores, want %d", len(steps), tc.steps)
			}
			if tc.steps == 1 && len(steps) == 1 && string(steps[0]) != string(rs.Removal(ours)) {
				t.Errorf("one restore: got\n%s\nwant Removal's\n%s", steps[0], rs.Removal(ours))
			}
			for i, in := range steps {
				if n := strings.Count(string(in), "\n:") + strings.Count(string(in), "\n-X "); tc.steps > 1 && n > tc.per {
					t.Errorf("restore %d names %d chains, want at most %d:\n%s", i, n, tc.per, in)
				}
				mustApply(t, k, false, string(in))
			}
			if got := dump(k, false); got != before {
				t.Errorf("after the restores:\n%s\nwant:\n%s", got, before)
			}
			if again := iptables.Parse([]byte(dump(k, false))).RemovalSteps(ours, tc.per); len(again) != 0 {
				t.Errorf("nothing left: got restores %q, want none", again)
			}
		})
	}
}
