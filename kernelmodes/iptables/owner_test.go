package iptables

import (
	"errors"
	"slices"
	"strings"
	"testing"

	ipt "github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/netfilter/iptables/iptablestest"
	"github.com/uproxy/uproxy/proxymode"
)

// dockerAndCalico is what Docker and Calico hold of a node's tables: their
// chains are the iptables mode's of --chain-prefix DOCKER (DOCKER-FORWARD)
// and cali (cali-FORWARD, cali-POSTROUTING), led to from the built-in chains
// without uproxy's comment.
const dockerAndCalico = "*filter\n:DOCKER-FORWARD - [0:0]\n:cali-FORWARD - [0:0]\n" +
	"-A DOCKER-FORWARD -i docker0 -j ACCEPT\n-A cali-FORWARD -m mark --mark 0x10000/0x10000 -j ACCEPT\n" +
	"-A FORWARD -j DOCKER-FORWARD\n" +
	`-A FORWARD -m comment --comment "cali:wUHhoiAYhphO9Mso" -j cali-FORWARD` + "\nCOMMIT\n" +
	"*nat\n:cali-POSTROUTING - [0:0]\n-A cali-POSTROUTING -j MASQUERADE\n" +
	`-A POSTROUTING -m comment --comment "cali:O3lYWMrLQYEMJtB5" -j cali-POSTROUTING` + "\nCOMMIT\n"

// TestJumpsCarryTheComment: every rule the mode writes in a built-in chain
// that leads to its chains carries uproxy's comment, localhost NodePorts'
// guard among them, so the ownership check takes every chain the mode wrote
// as uproxy's, without the jumps it once wrote uncommented.
func TestJumpsCarryTheComment(t *testing.T) {
	t.Parallel()
	w := newLocalhostWorld(t, Config{LocalhostNodePorts: true})
	if err := w.sync(t); err != nil {
		t.Fatal(err)
	}
	commented := ipt.Ours{Chains: w.p.n.ours().Chains}
	for _, v6 := range []bool{false, true} {
		if len(w.k.jumps(idx(v6))) == 0 {
			t.Fatalf("%s: no jumps written", ipt.FamilyName(v6))
		}
		if err := w.k.State(v6).NotOurs(v6, commented); err != nil {
			t.Errorf("%s: got %v, want every chain uproxy's", ipt.FamilyName(v6), err)
		}
	}
}

// TestAnotherProgramsChainsLeftAlone: with a --chain-prefix whose chains
// another program has, a sync writes nothing in either family and says why,
// and a cleanup leaves the other program's chains and the rules that lead to
// them as they were.
func TestAnotherProgramsChainsLeftAlone(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		prefix string
		chains []string // "table/chain" of the other program's, in order
	}{
		{"DOCKER", []string{"filter/DOCKER-FORWARD"}},
		{"cali", []string{"filter/cali-FORWARD", "nat/cali-POSTROUTING"}},
	} {
		t.Run(tc.prefix, func(t *testing.T) {
			t.Parallel()
			w := newLocalhostWorld(t, Config{Common: proxymode.Common{ChainPrefix: tc.prefix}, LocalhostNodePorts: true})
			var before [2]string
			for i, v6 := range []bool{false, true} {
				if err := w.k.Apply(v6, dockerAndCalico); err != nil {
					t.Fatal(err)
				}
				before[i] = saved(w.k, v6)
			}
			var want []string
			for _, family := range []string{"IPv4", "IPv6"} {
				for _, c := range tc.chains {
					want = append(want, family+" "+c)
				}
			}
			check := func(what string, err error) {
				t.Helper()
				if named, others := iptablestest.NotOurs(err); !slices.Equal(named, want) || others != nil {
					t.Errorf("%s: got errors naming %q and %v besides, want errors naming %q alone", what, named, others, want)
				}
				for i, v6 := range []bool{false, true} {
					if got := saved(w.k, v6); got != before[i] {
						t.Errorf("%s: %s is\n%s\nwant as before:\n%s", what, ipt.FamilyName(v6), got, before[i])
					}
				}
			}
			check("Sync", w.sync(t))
			for f := range 2 {
				if got := w.k.restores(f); len(got) != 0 {
					t.Errorf("Sync: family %d got restores %q, want none", f, got)
				}
			}
			check("Sync again", w.sync(t))
			check("Proxier.Cleanup", w.p.Cleanup())
			check("cleanup", cleanup(w.k.Fake, w.p.n))
		})
	}
}

// TestUncommentedGuardJumpsAreOurs: the localnet guard's jumps as uproxy wrote
// them before they carried its comment are no sign of another program: a
// sync over them goes ahead, and a cleanup removes them. The same rule from
// another chain is another program's.
func TestUncommentedGuardJumpsAreOurs(t *testing.T) {
	t.Parallel()
	const older = "*filter\n:UPROXY-BLOCK-LOCALNET - [0:0]\n" + guardRule + "\n" +
		"-A INPUT -j UPROXY-BLOCK-LOCALNET\n-A OUTPUT -j UPROXY-BLOCK-LOCALNET\nCOMMIT\n"
	w := newLocalhostWorld(t, Config{LocalhostNodePorts: true})
	if err := w.k.Apply(false, older); err != nil {
		t.Fatal(err)
	}
	if err := w.sync(t); err != nil {
		t.Fatalf("Sync over the older jumps: %v", err)
	}
	if err := w.p.Cleanup(); err != nil {
		t.Fatalf("Cleanup: %v", err)
	}
	for _, v6 := range []bool{false, true} {
		if got := w.k.jumps(idx(v6)); len(got) != 0 {
			t.Errorf("%s after Cleanup: got jumps %q, want none", ipt.FamilyName(v6), got)
		}
		if got := saved(w.k, v6); strings.Contains(got, "UPROXY-") {
			t.Errorf("%s after Cleanup:\n%s\nwant no chain of uproxy's", ipt.FamilyName(v6), got)
		}
	}

	w = newLocalhostWorld(t, Config{LocalhostNodePorts: true})
	if err := w.k.Apply(false, strings.Replace(older, "-A OUTPUT -j", "-A FORWARD -j", 1)); err != nil {
		t.Fatal(err)
	}
	if _, ok := errors.AsType[*ipt.NotOursError](w.sync(t)); !ok {
		t.Errorf("Sync with -A FORWARD -j UPROXY-BLOCK-LOCALNET: got no *NotOursError, want one")
	}
}

// saved is family v6's tables as iptables-save prints them.
func saved(k *fakeKernel, v6 bool) string {
	var b strings.Builder
	for _, t := range k.State(v6).Tables {
		b.WriteString("*" + t.Name + "\n")
		for _, c := range t.Chains {
			b.WriteString(":" + c.Name + " " + c.Policy + "\n")
		}
		for _, c := range t.Chains {
			for _, r := range c.Rules {
				b.WriteString(r.Text + "\n")
			}
		}
	}
	return b.String()
}
