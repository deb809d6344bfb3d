package rules

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/test/testbed"
)

const testClientMark = 0x1000

// The client-address rules and policy route of each backend: written by the
// first sync (ip rule, route, the marking rules), found missing by Intact once
// someone deletes the rule, put back by the next sync, and removed by Cleanup
// with the rest; without a dial mark there are none, and the portals say the
// replies would not come back.
func TestClientAddressReplyRoute(t *testing.T) {
	for _, b := range realBackends {
		t.Run(b.name, func(t *testing.T) {
			testbed.Needs(t, b.need)
			tp := testbed.New(t, testbed.WithIPv6())
			node := tp.NS(testbed.Node)
			ipRules := func(v6 bool) string {
				args := []string{"ip", "-4", "rule"}
				if v6 {
					args[1] = "-6"
				}
				out, err := tp.Exec(testbed.Node, args...)
				if err != nil {
					t.Fatal(err)
				}
				return string(out)
			}
			const rule = "fwmark 0x1000/0x1000 lookup 21840"
			var p Portals
			run := func(what string, fn func() error) {
				t.Helper()
				if err := tp.Run(testbed.Node, fn); err != nil {
					t.Fatalf("%s: %v", what, err)
				}
			}
			run("build", func() (err error) {
				p, _ = b.build(t, Config{NodeIPs: []netip.Addr{node.IPv4, node.IPv6}, IPv6: true, DialMark: testDialMark, ClientAddressMark: testClientMark})
				return nil
			})
			run("sync", func() error { return p.Sync(nil) })
			for _, v6 := range []bool{false, true} {
				if r := ipRules(v6); !strings.Contains(r, rule) {
					t.Errorf("after the first sync, ip rule (IPv6 %v):\n%s\nwant %q", v6, r, rule)
				}
				args := []string{"ip", "-4", "route", "show", "table", "21840"}
				if v6 {
					args[1] = "-6"
				}
				if out, err := tp.Exec(testbed.Node, args...); err != nil || !strings.Contains(string(out), "local default dev lo") {
					t.Errorf("routes of table 21840 (IPv6 %v): %v\n%s\nwant local default dev lo", v6, err, out)
				}
			}
			var replies, intact bool
			run("state", func() error { replies = p.RepliesToClientAddress(); return nil })
			if !replies {
				t.Errorf("RepliesToClientAddress after a sync: false, want true")
			}
			dump := []string{"nft", "list", "ruleset"}
			if b.name == "iptables" {
				dump = []string{"iptables-save", "-t", "mangle"}
			}
			out, err := tp.Exec(testbed.Node, dump...)
			if err != nil {
				t.Fatal(err)
			}
			rules := string(out)
			marks := []string{"0x00001000", "0x00002000"} // nft prints 8 digits
			if b.name == "iptables" {
				marks = []string{"0x1000", "0x2000"}
			}
			for _, want := range marks {
				if !strings.Contains(rules, want) {
					t.Errorf("the backend's rules lack the mark %s:\n%s", want, rules)
				}
			}

			tp.MustExec(t, testbed.Node, "ip", "-4", "rule", "del", "pref", "21840")
			run("intact", func() error { intact = p.Intact(); return nil })
			if intact {
				t.Errorf("Intact with the IPv4 rule deleted: true, want false")
			}
			run("sync", func() error { return p.Sync(nil) })
			if r := ipRules(false); !strings.Contains(r, rule) {
				t.Errorf("after the sync that follows its deletion, ip rule:\n%s\nwant %q", r, rule)
			}

			run("cleanup", p.Cleanup)
			for _, v6 := range []bool{false, true} {
				if r := ipRules(v6); strings.Contains(r, "21840") {
					t.Errorf("after Cleanup, ip rule (IPv6 %v):\n%s\nwant no rule of table 21840", v6, r)
				}
			}

			run("build without a dial mark", func() (err error) {
				p, _ = b.build(t, Config{NodeIPs: []netip.Addr{node.IPv4}, ClientAddressMark: testClientMark})
				return nil
			})
			run("sync", func() error { return p.Sync(nil) })
			run("state", func() error { replies = p.RepliesToClientAddress(); return nil })
			if replies || strings.Contains(ipRules(false), "21840") {
				t.Errorf("without a dial mark: RepliesToClientAddress %v, ip rule:\n%s\nwant false and no rule", replies, ipRules(false))
			}
			run("cleanup", p.Cleanup)
		})
	}
}

// The policy route carries no chain prefix, so the portals of one prefix
// share it with those of another: a cleanup of another prefix (`uproxy
// cleanup`, and the leftover removal at a start in another mode) and the
// Cleanup of another prefix's portals (--cleanup-on-exit) leave it while these
// portals use it. Once they are cleaned up, nothing keeps it: their own
// Cleanup removes it, and so does a cleanup of another prefix.
func TestClientAddressReplyRouteSharedByPrefixes(t *testing.T) {
	for _, b := range realBackends {
		t.Run(b.name, func(t *testing.T) {
			testbed.Needs(t, b.need)
			tp := testbed.New(t)
			node := tp.NS(testbed.Node)
			run := func(what string, fn func() error) {
				t.Helper()
				if err := tp.Run(testbed.Node, fn); err != nil {
					t.Fatalf("%s: %v", what, err)
				}
			}
			hasRule := func() bool {
				out, err := tp.Exec(testbed.Node, "ip", "-4", "rule")
				if err != nil {
					t.Fatal(err)
				}
				return strings.Contains(string(out), "lookup 21840")
			}
			hasRoute := func() bool {
				out, err := tp.Exec(testbed.Node, "ip", "-4", "route", "show", "table", "21840")
				if err != nil {
					t.Fatal(err)
				}
				return strings.Contains(string(out), "local default dev lo")
			}
			build := func(prefix string) (p Portals) {
				run("build "+prefix, func() error {
					p, _ = b.build(t, Config{ChainPrefix: prefix, NodeIPs: []netip.Addr{node.IPv4}, DialMark: testDialMark, ClientAddressMark: testClientMark})
					return nil
				})
				return p
			}

			running := build("UPROXY")
			run("sync UPROXY", func() error { return running.Sync(nil) })
			if !hasRule() || !hasRoute() {
				t.Fatalf("after the sync of UPROXY's portals: rule %v, route %v, want both", hasRule(), hasRoute())
			}

			run("Cleanup(OTHER)", func() error { return Cleanup("OTHER") })
			if !hasRule() || !hasRoute() {
				t.Errorf("after a cleanup of OTHER beside UPROXY's portals: rule %v, route %v, want both left", hasRule(), hasRoute())
			}

			other := build("OTHER")
			run("sync OTHER", func() error { return other.Sync(nil) })
			run("cleanup OTHER's portals", other.Cleanup)
			if !hasRule() || !hasRoute() {
				t.Errorf("after the Cleanup of OTHER's portals beside UPROXY's: rule %v, route %v, want both left", hasRule(), hasRoute())
			}

			run("cleanup UPROXY's portals", running.Cleanup)
			if hasRule() || hasRoute() {
				t.Errorf("after the Cleanup of the last portals: rule %v, route %v, want neither", hasRule(), hasRoute())
			}

			// A route that a uproxy killed left behind, with no portals running.
			tp.MustExec(t, testbed.Node, "ip", "-4", "rule", "add", "fwmark", "0x1000/0x1000", "lookup", "21840", "pref", "21840")
			tp.MustExec(t, testbed.Node, "ip", "-4", "route", "add", "local", "default", "dev", "lo", "table", "21840")
			run("Cleanup(OTHER) of a leftover", func() error { return Cleanup("OTHER") })
			if hasRule() || hasRoute() {
				t.Errorf("after a cleanup of OTHER with no portals running: rule %v, route %v, want neither", hasRule(), hasRoute())
			}
		})
	}
}
