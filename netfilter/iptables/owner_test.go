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

// notOurs returns "table/chain <- rule" for each chain NotOurs finds to be
// another program's.
func notOurs(t *testing.T, saved string, v6 bool, ours iptables.Ours) []string {
	t.Helper()
	var out []string
	for _, err := range unjoin(iptables.Parse([]byte(saved)).NotOurs(v6, ours)) {
		e, ok := errors.AsType[*iptables.NotOursError](err)
		if !ok {
			t.Fatalf("got %v, want only *NotOursError", err)
		}
		if e.V6 != v6 {
			t.Errorf("%s: got V6 %v, want %v", e.Chain, e.V6, v6)
		}
		out = append(out, e.Table+"/"+e.Chain+" <- "+e.Rule)
	}
	return out
}

// unjoin returns the errors errors.Join joined into err; err alone when it
// joins none, nothing for nil.
func unjoin(err error) []error {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		return j.Unwrap()
	}
	if err == nil {
		return nil
	}
	return []error{err}
}

func TestNotOurs(t *testing.T) {
	t.Parallel()
	ours := iptables.Ours{
		Chains: iptables.ChainSet{
			"filter": {"P-FORWARD", "P-SERVICES", "P-GUARD"},
			"nat":    {"P-SERVICES", "P-SVC-A"},
		}.Has,
		Uncommented: []iptables.Jump{{Table: "filter", Chain: "INPUT", Spec: []string{"-j", "P-GUARD"}}},
	}
	const (
		filter = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n"
		nat    = "*nat\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n"
	)
	for _, tc := range []struct {
		name, saved string
		want        []string
	}{
		{"uproxy's jumps, with its comment", filter + ":P-FORWARD - [0:0]\n" +
			`-A FORWARD -m comment --comment "uproxy forwarding rules" -j P-FORWARD` + "\nCOMMIT\n", nil},
		{"a leftover nothing leads to", filter + ":P-FORWARD - [0:0]\n-A P-FORWARD -j ACCEPT\nCOMMIT\n", nil},
		{"led to from uproxy's own chains only", nat + ":P-SERVICES - [0:0]\n:P-SVC-A - [0:0]\n-A P-SERVICES -d 10.96.0.1/32 -j P-SVC-A\nCOMMIT\n", nil},
		{"Docker's: no comment", filter + ":P-FORWARD - [0:0]\n-A FORWARD -j P-FORWARD\nCOMMIT\n",
			[]string{"filter/P-FORWARD <- -A FORWARD -j P-FORWARD"}},
		{"Calico's: a comment of its own", filter + ":P-FORWARD - [0:0]\n" + `-A FORWARD -m comment --comment "cali:wUHhoiAYhphO9Mso" -j P-FORWARD` + "\nCOMMIT\n",
			[]string{`filter/P-FORWARD <- -A FORWARD -m comment --comment "cali:wUHhoiAYhphO9Mso" -j P-FORWARD`}},
		{"a goto counts as a jump", filter + ":P-FORWARD - [0:0]\n-A FORWARD -i docker0 -g P-FORWARD\nCOMMIT\n",
			[]string{"filter/P-FORWARD <- -A FORWARD -i docker0 -g P-FORWARD"}},
		{"one comment is not enough: every jump must have it", filter + ":P-FORWARD - [0:0]\n" +
			`-A FORWARD -m comment --comment "uproxy forwarding rules" -j P-FORWARD` + "\n-A OUTPUT -j P-FORWARD\nCOMMIT\n",
			[]string{"filter/P-FORWARD <- -A OUTPUT -j P-FORWARD"}},
		{"the comment must begin with the prefix", filter + ":P-FORWARD - [0:0]\n" + `-A FORWARD -m comment --comment "not uproxy forwarding rules" -j P-FORWARD` + "\nCOMMIT\n",
			[]string{`filter/P-FORWARD <- -A FORWARD -m comment --comment "not uproxy forwarding rules" -j P-FORWARD`}},
		{"what another program's chain leads to is its own", filter + ":P-FORWARD - [0:0]\n:P-SERVICES - [0:0]\n" +
			"-A P-FORWARD -j P-SERVICES\n-A FORWARD -j P-FORWARD\nCOMMIT\n",
			[]string{"filter/P-FORWARD <- -A FORWARD -j P-FORWARD", "filter/P-SERVICES <- -A P-FORWARD -j P-SERVICES"}},
		{"a jump uproxy wrote without its comment", filter + ":P-GUARD - [0:0]\n-A INPUT -j P-GUARD\nCOMMIT\n", nil},
		{"the same jump from another chain", filter + ":P-GUARD - [0:0]\n-A OUTPUT -j P-GUARD\nCOMMIT\n",
			[]string{"filter/P-GUARD <- -A OUTPUT -j P-GUARD"}},
		{"the same words in another table", "*mangle\n:INPUT ACCEPT [0:0]\n:P-GUARD - [0:0]\n-A INPUT -j P-GUARD\nCOMMIT\n", nil},
		{"a name of ours in a table where it is not", "*mangle\n:FORWARD ACCEPT [0:0]\n:P-FORWARD - [0:0]\n-A FORWARD -j P-FORWARD\nCOMMIT\n", nil},
		{"a chain that does not exist", filter + "-A FORWARD -j P-FORWARD\nCOMMIT\n", nil},
		{"a chain name inside a comment is no jump", filter + ":P-FORWARD - [0:0]\n" + `-A FORWARD -m comment --comment "-j P-FORWARD" -j ACCEPT` + "\nCOMMIT\n", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, v6 := range []bool{false, true} {
				if got := notOurs(t, tc.saved, v6, ours); !slices.Equal(got, tc.want) {
					t.Errorf("%s: got %q, want %q", iptables.FamilyName(v6), got, tc.want)
				}
			}
		})
	}
}

func TestNotOursMessage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		err  iptables.NotOursError
		want string
	}{
		{iptables.NotOursError{Table: "filter", Chain: "DOCKER-FORWARD", Rule: "-A FORWARD -j DOCKER-FORWARD"},
			`iptables chain DOCKER-FORWARD (table filter) is not uproxy's (the rule -A FORWARD -j DOCKER-FORWARD leads to it without uproxy's comment; uproxy's jumps have comments beginning "uproxy "), so it is left as it is: choose another --chain-prefix`},
		{iptables.NotOursError{V6: true, Table: "filter", Chain: "cali-FORWARD", Rule: `-A FORWARD -m comment --comment "cali:xyz" -j cali-FORWARD`},
			`ip6tables chain cali-FORWARD (table filter) is not uproxy's (the rule -A FORWARD -m comment --comment "cali:xyz" -j cali-FORWARD leads to it without uproxy's comment; uproxy's jumps have comments beginning "uproxy "), so it is left as it is: choose another --chain-prefix`},
	} {
		if got := tc.err.Error(); got != tc.want {
			t.Errorf("got  %s\nwant %s", got, tc.want)
		}
	}
}

// anotherProgram is the filter table of a node with Docker and Calico: their
// forward chains are uproxy's forward chain for --chain-prefix DOCKER and cali.
const anotherProgram = "*filter\n:DOCKER-FORWARD - [0:0]\n:cali-FORWARD - [0:0]\n" +
	"-A DOCKER-FORWARD -i docker0 -j ACCEPT\n-A cali-FORWARD -m mark --mark 0x10000/0x10000 -j ACCEPT\n" +
	"-A FORWARD -j DOCKER-FORWARD\n" + `-A FORWARD -m comment --comment "cali:wUHhoiAYhphO9Mso" -j cali-FORWARD` + "\nCOMMIT\n"

// forwardChains are uproxy's chains of prefix, in the filter table only.
func forwardChains(prefix string) iptables.Ours {
	return iptables.Ours{Chains: iptables.ChainSet{"filter": {prefix + "-FORWARD", prefix + "-SERVICES"}}.Has}
}

// TestRemoveChainsLeavesAnotherProgramsChains: a cleanup under a prefix whose
// chains another program has removes uproxy's own chains of that prefix and
// leaves the other program's, and the rules that lead to them, as they were,
// in both families, naming each.
func TestRemoveChainsLeavesAnotherProgramsChains(t *testing.T) {
	t.Parallel()
	for _, prefix := range []string{"DOCKER", "cali"} {
		t.Run(prefix, func(t *testing.T) {
			k := iptablestest.New()
			var before [2]string
			for i, v6 := range []bool{false, true} {
				mustApply(t, k, v6, anotherProgram)
				before[i] = dump(k, v6)
				// A leftover of uproxy's of the same prefix, which goes.
				mustApply(t, k, v6, "*filter\n:"+prefix+"-SERVICES - [0:0]\n-A "+prefix+"-SERVICES -j REJECT\n"+jump("OUTPUT", prefix+"-SERVICES")+"COMMIT\n")
			}
			named, others := iptablestest.NotOurs(iptables.RemoveChains(k, forwardChains(prefix)))
			if want := []string{"IPv4 filter/" + prefix + "-FORWARD", "IPv6 filter/" + prefix + "-FORWARD"}; !slices.Equal(named, want) || others != nil {
				t.Errorf("got errors naming %q and %v besides, want errors naming %q alone", named, others, want)
			}
			for i, v6 := range []bool{false, true} {
				if got := dump(k, v6); got != before[i] {
					t.Errorf("%s after the cleanup:\n%s\nwant the other program's rules alone, as they were:\n%s", iptables.FamilyName(v6), got, before[i])
				}
			}
		})
	}
}

func TestClaim(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		prefix  string
		saveErr [2]error
		want    []string // the messages' beginnings, in order
	}{
		{name: "nobody's", prefix: "UPROXY"},
		{name: "Docker's", prefix: "DOCKER", want: []string{"iptables chain DOCKER-FORWARD (table filter) is not uproxy's", "ip6tables chain DOCKER-FORWARD (table filter) is not uproxy's"}},
		{name: "no ip6tables", prefix: "cali", saveErr: [2]error{nil, fmt.Errorf("ip6tables-save: %w", exec.ErrNotFound)},
			want: []string{"iptables chain cali-FORWARD (table filter) is not uproxy's"}},
		{name: "IPv4 unreadable", prefix: "UPROXY", saveErr: [2]error{errors.New("iptables-save: permission denied")},
			want: []string{"read IPv4 rules: iptables-save: permission denied"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k := iptablestest.New()
			for i, v6 := range []bool{false, true} {
				mustApply(t, k, v6, anotherProgram)
				k.FailSave(v6, tc.saveErr[i])
			}
			notOurs, unread := iptables.Claim(k, forwardChains(tc.prefix))
			errs := append(unjoin(notOurs), unjoin(unread)...)
			if len(errs) != len(tc.want) {
				t.Fatalf("got %d errors %v, want %d beginning %q", len(errs), errs, len(tc.want), tc.want)
			}
			for i, err := range errs {
				if !strings.HasPrefix(err.Error(), tc.want[i]) {
					t.Errorf("error %d: got %q, want it to begin %q", i, err, tc.want[i])
				}
			}
			for _, v6 := range []bool{false, true} {
				if calls := k.Calls(v6); slices.ContainsFunc(calls, func(c string) bool { return c != "save" }) {
					t.Errorf("%s: got calls %q, want reads alone", iptables.FamilyName(v6), calls)
				}
			}
		})
	}
}
