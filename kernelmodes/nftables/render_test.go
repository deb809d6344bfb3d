package nftables

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"sigs.k8s.io/knftables"

	"github.com/uproxy/uproxy/netfilter/conntrack/conntracktest"
	"github.com/uproxy/uproxy/netfilter/nftables"
	"github.com/uproxy/uproxy/netfilter/nftables/nftablestest"
	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/service/servicetest"
)

var (
	eps      = servicetest.Endpoints
	localEps = servicetest.LocalEndpoints
)

func newFake(t testing.TB, cfg Config) (*Proxier, *nftablestest.Fake, *conntracktest.Recorder) {
	t.Helper()
	k := nftablestest.New(nftables.Table{Family: knftables.InetFamily, Name: "uproxy-kernel"})
	ct := &conntracktest.Recorder{}
	cfg.NFTables, cfg.Conntrack = k, ct
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return p, k, ct
}

// lines returns the lines of transaction i that start with one of prefixes.
func lines(k *nftablestest.Fake, i int, prefixes ...string) string {
	if i < 0 {
		i += len(k.Transactions)
	}
	var out []string
	for _, l := range strings.Split(k.Transactions[i], "\n") {
		for _, p := range prefixes {
			if strings.HasPrefix(l, p) {
				out = append(out, l)
				break
			}
		}
	}
	return strings.Join(out, "\n")
}

func mustSync(t *testing.T, p *Proxier, s *service.Snapshot) {
	t.Helper()
	if err := p.Sync(s); err != nil {
		t.Fatalf("Sync: %v", err)
	}
}

func TestTableName(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ prefix, want, err string }{
		{"", "inet uproxy-kernel", ""},
		{"UPROXY", "inet uproxy-kernel", ""},
		{"EDGE", "inet edge-kernel", ""},
		{"KUBE", "", "kube-proxy"},
	} {
		got, err := TableName(tc.prefix)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("TableName(%q): got %v, %v; want an error naming %q", tc.prefix, got, err, tc.err)
			}
			continue
		}
		if err != nil || got.String() != tc.want {
			t.Errorf("TableName(%q): got %q, %v; want %q", tc.prefix, got, err, tc.want)
		}
	}
}

// TestElements states what each kind of Service port puts in the table.
func TestElements(t *testing.T) {
	t.Parallel()
	web := svcPort("shop", "web", "http", service.TCP, 80)
	web.ClusterIPs = addrs("10.96.0.10", "fd00:96::10")
	web.ExternalIPs = addrs("10.250.0.5")
	web.NodePort = 30080
	web.Endpoints = eps("10.244.1.2:8080", "10.244.2.3:8080", "[fd00:244::2]:8080")

	empty := svcPort("shop", "empty", "", service.UDP, 53)
	empty.ClusterIPs = addrs("10.96.0.12")
	empty.NodePort = 30053

	local := svcPort("shop", "local", "", service.TCP, 80)
	local.ClusterIPs = addrs("10.96.0.13")
	local.LoadBalancerIPs = addrs("10.251.0.7")
	local.LoadBalancerSourceRanges = []netip.Prefix{netip.MustParsePrefix("192.168.0.0/16"), netip.MustParsePrefix("192.168.3.0/24"), netip.MustParsePrefix("fd00::/8")}
	local.NodePort = 30081
	local.ExternalPolicyLocal = true
	local.Endpoints = []service.Endpoint{ep("10.244.1.5:80", true), ep("10.244.2.5:80", false)}

	internal := svcPort("shop", "internal", "", service.TCP, 80)
	internal.ClusterIPs = addrs("10.96.0.14")
	internal.InternalPolicyLocal = true
	internal.Endpoints = eps("10.244.2.6:80")

	p, k, _ := newFake(t, Config{Common: proxymode.Common{IPv6: true, ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}}})
	mustSync(t, p, snapshot(web, empty, local, internal))
	want := `add element inet uproxy-kernel backends4-2 { 10.250.0.5 . tcp . 80 . 0 comment "shop/web:http" : 10.244.1.2 . 8080 }
add element inet uproxy-kernel backends4-2 { 10.250.0.5 . tcp . 80 . 1 comment "shop/web:http" : 10.244.2.3 . 8080 }
add element inet uproxy-kernel backends4-2 { 10.251.0.7 . tcp . 80 . 0 comment "shop/local" : 10.244.1.5 . 80 }
add element inet uproxy-kernel backends4-2 { 10.251.0.7 . tcp . 80 . 1 comment "shop/local" : 10.244.2.5 . 80 }
add element inet uproxy-kernel backends4-2 { 10.96.0.10 . tcp . 80 . 0 comment "shop/web:http" : 10.244.1.2 . 8080 }
add element inet uproxy-kernel backends4-2 { 10.96.0.10 . tcp . 80 . 1 comment "shop/web:http" : 10.244.2.3 . 8080 }
add element inet uproxy-kernel backends4-2 { 10.96.0.13 . tcp . 80 . 0 comment "shop/local" : 10.244.1.5 . 80 }
add element inet uproxy-kernel backends4-2 { 10.96.0.13 . tcp . 80 . 1 comment "shop/local" : 10.244.2.5 . 80 }
add element inet uproxy-kernel backends6-1 { fd00:96::10 . tcp . 80 . 0 comment "shop/web:http" : fd00:244::2 . 8080 }
add element inet uproxy-kernel cluster-masq4 { 10.96.0.10 . tcp . 80 comment "shop/web:http" }
add element inet uproxy-kernel cluster-masq4 { 10.96.0.13 . tcp . 80 comment "shop/local" }
add element inet uproxy-kernel drop4 { 10.96.0.14 . tcp . 80 comment "shop/internal" }
add element inet uproxy-kernel external-local4 { 10.251.0.7 . tcp . 80 comment "shop/local" }
add element inet uproxy-kernel external-masq4 { 10.250.0.5 . tcp . 80 comment "shop/web:http" }
add element inet uproxy-kernel firewall-allow4 { 10.251.0.7 . tcp . 80 . 192.168.0.0/16 comment "shop/local" }
add element inet uproxy-kernel firewall4 { 10.251.0.7 . tcp . 80 comment "shop/local" }
add element inet uproxy-kernel hairpin4 { 10.244.1.2 . 10.244.1.2 }
add element inet uproxy-kernel hairpin4 { 10.244.1.5 . 10.244.1.5 }
add element inet uproxy-kernel hairpin4 { 10.244.2.3 . 10.244.2.3 }
add element inet uproxy-kernel hairpin4 { 10.244.2.5 . 10.244.2.5 }
add element inet uproxy-kernel hairpin6 { fd00:244::2 . fd00:244::2 }
add element inet uproxy-kernel local-backends4-1 { 10.251.0.7 . tcp . 80 . 0 comment "shop/local" : 10.244.1.5 . 80 }
add element inet uproxy-kernel np-backends4-2 { tcp . 30080 . 0 comment "shop/web:http" : 10.244.1.2 . 8080 }
add element inet uproxy-kernel np-backends4-2 { tcp . 30080 . 1 comment "shop/web:http" : 10.244.2.3 . 8080 }
add element inet uproxy-kernel np-backends4-2 { tcp . 30081 . 0 comment "shop/local" : 10.244.1.5 . 80 }
add element inet uproxy-kernel np-backends4-2 { tcp . 30081 . 1 comment "shop/local" : 10.244.2.5 . 80 }
add element inet uproxy-kernel np-backends6-1 { tcp . 30080 . 0 comment "shop/web:http" : fd00:244::2 . 8080 }
add element inet uproxy-kernel np-local-backends4-1 { tcp . 30081 . 0 comment "shop/local" : 10.244.1.5 . 80 }
add element inet uproxy-kernel np-local4 { tcp . 30081 comment "shop/local" }
add element inet uproxy-kernel np-masq4 { tcp . 30080 comment "shop/web:http" }
add element inet uproxy-kernel np-masq6 { tcp . 30080 comment "shop/web:http" }
add element inet uproxy-kernel np-reject4 { udp . 30053 comment "shop/empty" }
add element inet uproxy-kernel reject4 { 10.96.0.12 . udp . 53 comment "shop/empty" }`
	got := strings.Split(lines(k, 0, "add element"), "\n")
	slices.Sort(got)
	if g := strings.Join(got, "\n"); g != want {
		t.Errorf("elements:\ngot:\n%s\nwant:\n%s", g, want)
	}
	// Four fixed chains per family get a rule per count map in use.
	wantRules := `add rule inet uproxy-kernel local-pick4 meta l4proto { tcp, udp, sctp } dnat ip to ip daddr . meta l4proto . th dport . numgen random mod 1 map @local-backends4-1
add rule inet uproxy-kernel nodeports4 meta nfproto ipv4 meta l4proto { tcp, udp, sctp } dnat ip to meta l4proto . th dport . numgen random mod 2 map @np-backends4-2
add rule inet uproxy-kernel nodeports6 meta nfproto ipv6 meta l4proto { tcp, udp, sctp } dnat ip6 to meta l4proto . th dport . numgen random mod 1 map @np-backends6-1
add rule inet uproxy-kernel np-local-pick4 meta nfproto ipv4 meta l4proto { tcp, udp, sctp } dnat ip to meta l4proto . th dport . numgen random mod 1 map @np-local-backends4-1
add rule inet uproxy-kernel services4 meta l4proto { tcp, udp, sctp } dnat ip to ip daddr . meta l4proto . th dport . numgen random mod 2 map @backends4-2
add rule inet uproxy-kernel services6 meta l4proto { tcp, udp, sctp } dnat ip6 to ip6 daddr . meta l4proto . th dport . numgen random mod 1 map @backends6-1`
	var gotRules []string
	for _, l := range strings.Split(lines(k, 0, "add rule"), "\n") {
		if strings.Contains(l, "numgen") {
			gotRules = append(gotRules, l)
		}
	}
	slices.Sort(gotRules)
	if g := strings.Join(gotRules, "\n"); g != wantRules {
		t.Errorf("count rules:\ngot:\n%s\nwant:\n%s", g, wantRules)
	}
	if n := strings.Count(k.Transactions[0], "add chain"); n != 6+2*7 {
		t.Errorf("chains without affinity: got %d, want %d", n, 6+2*7)
	}
}

// TestNodePortAddresses: --nodeport-addresses narrows NodePorts to its
// prefixes, loopback left out even when they hold it (no route_localnet here),
// and a family without one gets no NodePorts at all.
func TestNodePortAddresses(t *testing.T) {
	t.Parallel()
	web := svcPort("shop", "web", "", service.TCP, 80)
	web.ClusterIPs = addrs("10.96.0.10", "fd00:96::10")
	web.NodePort = 30080
	web.Endpoints = eps("10.244.1.2:8080", "[fd00:244::2]:8080")
	p, k, _ := newFake(t, Config{Common: proxymode.Common{IPv6: true, NodePortAddresses: []netip.Prefix{netip.MustParsePrefix("192.168.1.0/24"), netip.MustParsePrefix("127.0.0.0/8")}}})
	mustSync(t, p, snapshot(web))
	tx := k.Transactions[0]
	for _, want := range []string{
		"add element inet uproxy-kernel nodeport-addresses4 { 192.168.1.0/24 }",
		"add rule inet uproxy-kernel services4 fib daddr type local ip daddr != 127.0.0.0/8 ip daddr @nodeport-addresses4 jump nodeports4",
		"np-backends4-1 { tcp . 30080 . 0",
	} {
		if !strings.Contains(tx, want) {
			t.Errorf("transaction lacks %q", want)
		}
	}
	for _, unwanted := range []string{"nodeports6", "np-backends6"} {
		if strings.Contains(tx, unwanted) {
			t.Errorf("transaction has %q, want none", unwanted)
		}
	}
}

// TestPartialSync: after the first sync, each sync sends only the elements and
// chains of the Service ports that changed, or nothing at all.
func TestPartialSync(t *testing.T) {
	t.Parallel()
	a := svcPort("ns", "a", "", service.TCP, 80)
	a.ClusterIPs = addrs("10.96.0.1")
	a.Endpoints = localEps("10.244.1.1:80", "10.244.1.2:80")
	b := svcPort("ns", "b", "", service.TCP, 80)
	b.ClusterIPs = addrs("10.96.0.2")
	b.Endpoints = localEps("10.244.2.1:80", "10.244.2.2:80")
	moved := *b
	moved.Endpoints = localEps("10.244.2.1:80", "10.244.2.3:80")
	grown := *b
	grown.Endpoints = localEps("10.244.2.1:80", "10.244.2.2:80", "10.244.2.3:80")
	sticky := svcPort("ns", "s", "", service.TCP, 80)
	sticky.ClusterIPs = addrs("10.96.0.3")
	sticky.AffinityClientIP, sticky.AffinityTimeout = true, time.Minute
	sticky.Endpoints = localEps("10.244.3.1:80", "10.244.3.2:80")
	stickyMoved := *sticky
	stickyMoved.Endpoints = localEps("10.244.3.1:80", "10.244.3.3:80")
	// c shares an endpoint address with b.
	c := svcPort("ns", "c", "", service.TCP, 81)
	c.ClusterIPs = addrs("10.96.0.4")
	c.Endpoints = localEps("10.244.2.1:81")
	aff := func(ep string) string { return "aff4-" + hash("ns/s/TCP", 16) + "-" + hash(ep, 8) + "-60" }
	chain := "aff4-" + hash("ns/s/TCP", 16) + "-all"

	steps := []struct {
		name  string
		ports []*service.Port
		want  string // the transaction's lines, "" for none
		// netlink: the elements alone changed, so they went through
		// WriteElements rather than nft.
		netlink bool
	}{
		{"identical: no transaction", []*service.Port{a, b}, "", false},
		{"an endpoint replaced: its element and hairpin pair", []*service.Port{a, &moved}, `delete element inet uproxy-kernel backends4-2 { 10.96.0.2 . tcp . 80 . 1 }
delete element inet uproxy-kernel hairpin4 { 10.244.2.2 . 10.244.2.2 }
add element inet uproxy-kernel backends4-2 { 10.96.0.2 . tcp . 80 . 1 comment "ns/b" : 10.244.2.3 . 80 }
add element inet uproxy-kernel hairpin4 { 10.244.2.3 . 10.244.2.3 }`, true},
		{"a new count: its map and rule, the port moves over", []*service.Port{a, &grown}, `add map inet uproxy-kernel backends4-3 { typeof ip daddr . meta l4proto . th dport . numgen random mod 3 : ip daddr . th dport ; }
add rule inet uproxy-kernel services4 meta l4proto { tcp, udp, sctp } dnat ip to ip daddr . meta l4proto . th dport . numgen random mod 3 map @backends4-3
delete element inet uproxy-kernel backends4-2 { 10.96.0.2 . tcp . 80 . 0 }
delete element inet uproxy-kernel backends4-2 { 10.96.0.2 . tcp . 80 . 1 }
add element inet uproxy-kernel backends4-3 { 10.96.0.2 . tcp . 80 . 0 comment "ns/b" : 10.244.2.1 . 80 }
add element inet uproxy-kernel backends4-3 { 10.96.0.2 . tcp . 80 . 1 comment "ns/b" : 10.244.2.2 . 80 }
add element inet uproxy-kernel backends4-3 { 10.96.0.2 . tcp . 80 . 2 comment "ns/b" : 10.244.2.3 . 80 }
add element inet uproxy-kernel hairpin4 { 10.244.2.2 . 10.244.2.2 }`, false},
		{"a ClientIP-affinity port added: its sets, chain and verdict", []*service.Port{a, &grown, sticky}, `add set inet uproxy-kernel ` + aff("10.244.3.1:80") + ` { type ipv4_addr ; flags dynamic,timeout ; timeout 60s ; }
add set inet uproxy-kernel ` + aff("10.244.3.2:80") + ` { type ipv4_addr ; flags dynamic,timeout ; timeout 60s ; }
add chain inet uproxy-kernel ` + chain + `
add rule inet uproxy-kernel ` + chain + ` ip saddr @` + aff("10.244.3.1:80") + ` update @` + aff("10.244.3.1:80") + ` { ip saddr } meta l4proto tcp dnat ip to 10.244.3.1:80
add rule inet uproxy-kernel ` + chain + ` ip saddr @` + aff("10.244.3.2:80") + ` update @` + aff("10.244.3.2:80") + ` { ip saddr } meta l4proto tcp dnat ip to 10.244.3.2:80
add rule inet uproxy-kernel ` + chain + ` numgen random mod 2 0 update @` + aff("10.244.3.1:80") + ` { ip saddr } meta l4proto tcp dnat ip to 10.244.3.1:80
add rule inet uproxy-kernel ` + chain + ` update @` + aff("10.244.3.2:80") + ` { ip saddr } meta l4proto tcp dnat ip to 10.244.3.2:80
add element inet uproxy-kernel affinity4 { 10.96.0.3 . tcp . 80 comment "ns/s" : goto ` + chain + ` }
add element inet uproxy-kernel hairpin4 { 10.244.3.1 . 10.244.3.1 }
add element inet uproxy-kernel hairpin4 { 10.244.3.2 . 10.244.3.2 }`, false},
		{"its endpoint replaced: the chain rewritten, the stale set deleted", []*service.Port{a, &grown, &stickyMoved}, `add set inet uproxy-kernel ` + aff("10.244.3.3:80") + ` { type ipv4_addr ; flags dynamic,timeout ; timeout 60s ; }
delete element inet uproxy-kernel hairpin4 { 10.244.3.2 . 10.244.3.2 }
flush chain inet uproxy-kernel ` + chain + `
add rule inet uproxy-kernel ` + chain + ` ip saddr @` + aff("10.244.3.1:80") + ` update @` + aff("10.244.3.1:80") + ` { ip saddr } meta l4proto tcp dnat ip to 10.244.3.1:80
add rule inet uproxy-kernel ` + chain + ` ip saddr @` + aff("10.244.3.3:80") + ` update @` + aff("10.244.3.3:80") + ` { ip saddr } meta l4proto tcp dnat ip to 10.244.3.3:80
add rule inet uproxy-kernel ` + chain + ` numgen random mod 2 0 update @` + aff("10.244.3.1:80") + ` { ip saddr } meta l4proto tcp dnat ip to 10.244.3.1:80
add rule inet uproxy-kernel ` + chain + ` update @` + aff("10.244.3.3:80") + ` { ip saddr } meta l4proto tcp dnat ip to 10.244.3.3:80
delete set inet uproxy-kernel ` + aff("10.244.3.2:80") + `
add element inet uproxy-kernel hairpin4 { 10.244.3.3 . 10.244.3.3 }`, false},
		{"the affinity port removed: verdict, chain and sets deleted", []*service.Port{a, &grown}, `delete element inet uproxy-kernel affinity4 { 10.96.0.3 . tcp . 80 }
delete element inet uproxy-kernel hairpin4 { 10.244.3.1 . 10.244.3.1 }
delete element inet uproxy-kernel hairpin4 { 10.244.3.3 . 10.244.3.3 }
flush chain inet uproxy-kernel ` + chain + `
delete chain inet uproxy-kernel ` + chain + `
delete set inet uproxy-kernel ` + aff("10.244.3.1:80") + `
delete set inet uproxy-kernel ` + aff("10.244.3.3:80"), false},
		{"a port removed: its elements deleted, a hairpin pair another port shares kept", []*service.Port{a, c}, `add map inet uproxy-kernel backends4-1 { typeof ip daddr . meta l4proto . th dport . numgen random mod 1 : ip daddr . th dport ; }
add rule inet uproxy-kernel services4 meta l4proto { tcp, udp, sctp } dnat ip to ip daddr . meta l4proto . th dport . numgen random mod 1 map @backends4-1
delete element inet uproxy-kernel backends4-3 { 10.96.0.2 . tcp . 80 . 0 }
delete element inet uproxy-kernel backends4-3 { 10.96.0.2 . tcp . 80 . 1 }
delete element inet uproxy-kernel backends4-3 { 10.96.0.2 . tcp . 80 . 2 }
delete element inet uproxy-kernel hairpin4 { 10.244.2.2 . 10.244.2.2 }
delete element inet uproxy-kernel hairpin4 { 10.244.2.3 . 10.244.2.3 }
add element inet uproxy-kernel backends4-1 { 10.96.0.4 . tcp . 81 . 0 comment "ns/c" : 10.244.2.1 . 81 }`, false},
		{"identical again", []*service.Port{a, c}, "", false},
		{"a port added: its elements alone", []*service.Port{a, b, c}, `add element inet uproxy-kernel backends4-2 { 10.96.0.2 . tcp . 80 . 0 comment "ns/b" : 10.244.2.1 . 80 }
add element inet uproxy-kernel backends4-2 { 10.96.0.2 . tcp . 80 . 1 comment "ns/b" : 10.244.2.2 . 80 }
add element inet uproxy-kernel hairpin4 { 10.244.2.2 . 10.244.2.2 }`, true},
		{"a port removed", []*service.Port{a, c}, `delete element inet uproxy-kernel backends4-2 { 10.96.0.2 . tcp . 80 . 0 }
delete element inet uproxy-kernel backends4-2 { 10.96.0.2 . tcp . 80 . 1 }
delete element inet uproxy-kernel hairpin4 { 10.244.2.2 . 10.244.2.2 }`, true},
	}
	// In name order, as Build makes Snapshots, a walk beside the last sync's
	// ports finds the changes; in any other order, a map of them all does.
	// Both make the same transactions.
	for _, order := range []string{"name order", "reversed"} {
		t.Run(order, func(t *testing.T) {
			snap := func(ports ...*service.Port) *service.Snapshot {
				s := snapshot(ports...)
				if order == "reversed" {
					slices.Reverse(s.Ports)
				}
				return s
			}
			p, k, _ := newFake(t, Config{})
			mustSync(t, p, snap(a, b))
			for _, st := range steps {
				n, writes := len(k.Transactions), k.ElementWrites
				mustSync(t, p, snap(slices.Clone(st.ports)...))
				if p.lastWasFull {
					t.Fatalf("%s: got a whole write, want a partial one", st.name)
				}
				got := ""
				if len(k.Transactions) > n {
					got = strings.TrimSpace(k.Transactions[n])
				}
				if len(k.Transactions) > n+1 {
					t.Errorf("%s: %d transactions, want at most one", st.name, len(k.Transactions)-n)
				}
				if got != st.want {
					t.Errorf("%s:\ngot:\n%s\nwant:\n%s", st.name, got, st.want)
				}
				if netlink := k.ElementWrites > writes; netlink != st.netlink {
					t.Errorf("%s: through WriteElements %v, want %v", st.name, netlink, st.netlink)
				}
			}
			// The fake's table now equals a whole write of the last snapshot.
			fresh, fk, _ := newFake(t, Config{})
			mustSync(t, fresh, snapshot(a, c))
			if got, want := elementsOf(t, k), elementsOf(t, fk); got != want {
				t.Errorf("elements after the partial syncs:\n%s\nwant those of a whole write:\n%s", got, want)
			}
		})
	}
}

func TestChangedPorts(t *testing.T) {
	t.Parallel()
	a := svcPort("ns", "a", "", service.TCP, 80)
	b := svcPort("ns", "b", "", service.TCP, 80)
	bUDP := svcPort("ns", "b", "", service.UDP, 80)
	b2 := *b
	c := svcPort("ns", "c", "", service.TCP, 80)
	name := func(keys []portKey, ports []*service.Port) string {
		var out []string
		for i, k := range keys {
			out = append(out, fmt.Sprintf("%s/%s:%v", k.name, k.proto, ports[i] != nil))
		}
		return strings.Join(out, " ")
	}
	for _, tt := range []struct {
		name     string
		old, now []*service.Port
		want     string // key/protocol:still there, ...
		ok       bool
	}{
		{"same pointers: nothing", []*service.Port{a, b, c}, []*service.Port{a, b, c}, "", true},
		{"another Port of the same name, however equal", []*service.Port{a, b, c}, []*service.Port{a, &b2, c}, "ns/b/TCP:true", true},
		{"added and removed at either end", []*service.Port{b, c}, []*service.Port{a, b}, "ns/a/TCP:true ns/c/TCP:false", true},
		{"the same name in another protocol", []*service.Port{b}, []*service.Port{b, bUDP}, "ns/b/UDP:true", true},
		{"from nothing", nil, []*service.Port{a}, "ns/a/TCP:true", true},
		{"new ones out of order", []*service.Port{a, b}, []*service.Port{b, a}, "", false},
		{"old ones out of order", []*service.Port{c, a}, []*service.Port{a, c}, "", false},
		{"a name twice", []*service.Port{a}, []*service.Port{a, a}, "", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			keys, ports, ok := changedPorts(tt.old, tt.now)
			if got := name(keys, ports); ok != tt.ok || ok && got != tt.want {
				t.Errorf("got %q, %v; want %q, %v", got, ok, tt.want, tt.ok)
			}
		})
	}
}

// elementsOf lists the table's set and map elements, sorted.
func elementsOf(t *testing.T, k *nftablestest.Fake) string {
	var out []string
	for _, l := range strings.Split(k.Dump(), "\n") {
		if strings.HasPrefix(l, "add element") && !strings.Contains(l, "nodeport-addresses") {
			out = append(out, l)
		}
	}
	slices.Sort(out)
	return strings.Join(out, "\n")
}

// TestWholeWriteAfterFailureOrFlush: a failed transaction, or a table someone
// flushed, makes the next sync write everything.
func TestWholeWriteAfterFailureOrFlush(t *testing.T) {
	t.Parallel()
	a := svcPort("ns", "a", "", service.TCP, 80)
	a.ClusterIPs = addrs("10.96.0.1")
	a.Endpoints = eps("10.244.1.1:80")
	b := *a
	b.Endpoints = eps("10.244.1.2:80")
	p, k, _ := newFake(t, Config{})
	mustSync(t, p, snapshot(a))
	if !p.Intact() {
		t.Fatalf("Intact after the first sync: got false, want true")
	}

	k.FailNextRun(errors.New("nft: out of memory"))
	if err := p.Sync(snapshot(&b)); err == nil || !strings.Contains(err.Error(), "out of memory") {
		t.Fatalf("Sync with a failing nft: got %v, want the error", err)
	}
	if p.Intact() {
		t.Errorf("Intact after a failed write: got true, want false")
	}
	mustSync(t, p, snapshot(&b))
	if !p.lastWasFull {
		t.Errorf("sync after a failure: got partial, want whole")
	}

	if err := k.FlushChains(); err != nil {
		t.Fatal(err)
	}
	if p.Intact() {
		t.Errorf("Intact after a flush: got true, want false")
	}
	mustSync(t, p, snapshot(&b))
	if !p.lastWasFull || !p.Intact() {
		t.Errorf("sync after a flush: whole %v, intact %v; want both", p.lastWasFull, p.Intact())
	}
	if !strings.Contains(k.Transactions[len(k.Transactions)-1], "backends4-1 { 10.96.0.1 . tcp . 80 . 0 comment \"ns/a\" : 10.244.1.2 . 80 }") {
		t.Errorf("whole write lacks the element:\n%s", k.Transactions[len(k.Transactions)-1])
	}
}

// TestStaleUDPFlows: the UDP flows of a Service port whose endpoints changed
// are deleted unless they go to an endpoint still in use; ports that did not
// change are not looked at.
func TestStaleUDPFlows(t *testing.T) {
	t.Parallel()
	dns := svcPort("kube-system", "dns", "", service.UDP, 53)
	dns.ClusterIPs = addrs("10.96.0.53")
	dns.NodePort = 30053
	dns.Endpoints = eps("10.244.1.1:53", "10.244.1.2:53")
	other := svcPort("ns", "other", "", service.UDP, 53)
	other.ClusterIPs = addrs("10.96.0.54")
	other.Endpoints = eps("10.244.2.1:53")
	p, _, ct := newFake(t, Config{})
	mustSync(t, p, snapshot(dns, other))
	ct.Filters = [2][]netlink.CustomConntrackFilter{}
	moved := *dns
	moved.Endpoints = eps("10.244.1.2:53")
	mustSync(t, p, snapshot(&moved, other))
	if len(ct.Filters[0]) != 1 {
		t.Fatalf("IPv4 conntrack deletions: got %d, want 1", len(ct.Filters[0]))
	}
	f := ct.Filters[0][0]
	for _, c := range []struct {
		dst, reply string
		stale      bool
	}{
		{"10.96.0.53:53", "10.244.1.1:53", true},
		{"10.96.0.53:53", "10.244.1.2:53", false},
		{"192.168.1.1:30053", "10.244.1.1:53", true},
		{"10.96.0.54:53", "10.244.9.9:53", false}, // not changed: not looked at
	} {
		if got := f.MatchConntrackFlow(udpFlow(c.dst, c.reply)); got != c.stale {
			t.Errorf("flow to %s answered by %s: stale %v, want %v", c.dst, c.reply, got, c.stale)
		}
	}
}

// TestDebugServices: every Service port of the last sync, with the endpoints
// traffic is sent to marked usable.
func TestDebugServices(t *testing.T) {
	t.Parallel()
	web := svcPort("shop", "web", "", service.TCP, 80)
	web.ClusterIPs = addrs("10.96.0.10")
	web.Endpoints = append(eps("10.244.1.2:8080"), service.Endpoint{Addr: netip.MustParseAddrPort("10.244.1.3:8080")})
	p, _, _ := newFake(t, Config{})
	if got := p.DebugServices(); got != nil {
		t.Errorf("before any sync: got %v, want nil", got)
	}
	mustSync(t, p, snapshot(web))
	got := p.DebugServices()
	if len(got) != 1 || got[0].Name != "shop/web" || len(got[0].Endpoints) != 2 {
		t.Fatalf("got %+v, want shop/web with two endpoints", got)
	}
	if !got[0].Endpoints[0].Usable || got[0].Endpoints[1].Usable {
		t.Errorf("usable: got %v, %v; want true (ready), false (not ready)", got[0].Endpoints[0].Usable, got[0].Endpoints[1].Usable)
	}
}

// TestSyncReportsBadPortsAndProgramsTheRest: an unsupported protocol or an
// invalid port is an error naming the Service port; the others are written.
func TestSyncReportsBadPortsAndProgramsTheRest(t *testing.T) {
	t.Parallel()
	good := svcPort("ns", "good", "", service.TCP, 80)
	good.ClusterIPs = addrs("10.96.0.1")
	good.Endpoints = eps("10.244.1.1:80")
	bad := svcPort("ns", "bad", "", "ICMP", 80)
	bad.ClusterIPs = addrs("10.96.0.2")
	p, k, _ := newFake(t, Config{})
	err := p.Sync(snapshot(good, bad))
	if err == nil || !strings.Contains(err.Error(), "ns/bad") {
		t.Errorf("Sync: got %v, want an error naming ns/bad", err)
	}
	if !strings.Contains(k.Transactions[0], "10.96.0.1 . tcp . 80") {
		t.Errorf("the good port was not written")
	}
}

func TestOutermost(t *testing.T) {
	t.Parallel()
	got := outermost([]netip.Prefix{
		netip.MustParsePrefix("10.1.0.0/16"), netip.MustParsePrefix("10.0.0.0/8"),
		netip.MustParsePrefix("192.168.1.0/24"), netip.MustParsePrefix("10.0.0.0/8"),
	})
	want := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("192.168.1.0/24")}
	if !slices.Equal(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
}

// udpFlow is a UDP conntrack flow from a pod to dst, answered by reply (the
// endpoint after DNAT).
func udpFlow(dst, reply string) *netlink.ConntrackFlow {
	d, r := netip.MustParseAddrPort(dst), netip.MustParseAddrPort(reply)
	c := &netlink.ConntrackFlow{}
	c.Forward.Protocol = 17
	c.Forward.SrcIP = net.ParseIP("10.244.9.9")
	c.Forward.DstIP = net.IP(d.Addr().AsSlice())
	c.Forward.DstPort = d.Port()
	c.Reverse.SrcIP = net.IP(r.Addr().AsSlice())
	c.Reverse.SrcPort = r.Port()
	return c
}

// TestFind: the elements that concern a destination, with what they do.
func TestFind(t *testing.T) {
	t.Parallel()
	web := svcPort("shop", "web", "", service.TCP, 80)
	web.ClusterIPs = addrs("10.96.0.10")
	web.NodePort = 30080
	web.Endpoints = eps("10.244.1.2:8080", "10.244.1.3:8080")
	empty := svcPort("shop", "empty", "", service.TCP, 80)
	empty.ClusterIPs = addrs("10.96.0.12")
	p, k, _ := newFake(t, Config{Common: proxymode.Common{ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}}})
	if _, err := Find(t.Context(), k, netip.MustParseAddrPort("10.96.0.10:80"), "tcp", false); !errors.Is(err, ErrNoTable) {
		t.Errorf("Find before any sync: got %v, want ErrNoTable", err)
	}
	mustSync(t, p, snapshot(web, empty))
	for _, tc := range []struct {
		dst   string
		local bool
		want  []string
	}{
		{"10.96.0.10:80", false, []string{
			"cluster-masq4 10.96.0.10 . tcp . 80 :  (shop/web)",
			"backends4-2 10.96.0.10 . tcp . 80 . 0 : 10.244.1.2 . 8080 (shop/web)",
			"backends4-2 10.96.0.10 . tcp . 80 . 1 : 10.244.1.3 . 8080 (shop/web)",
		}},
		{"10.96.0.12:80", false, []string{"reject4 10.96.0.12 . tcp . 80 :  (shop/empty)"}},
		{"192.168.1.1:30080", true, []string{
			"np-masq4 tcp . 30080 :  (shop/web)",
			"np-backends4-2 tcp . 30080 . 0 : 10.244.1.2 . 8080 (shop/web)",
			"np-backends4-2 tcp . 30080 . 1 : 10.244.1.3 . 8080 (shop/web)",
		}},
		{"192.168.1.1:30080", false, nil},
	} {
		found, err := Find(t.Context(), k, netip.MustParseAddrPort(tc.dst), "TCP", tc.local)
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, e := range found {
			got = append(got, e.Set+" "+e.Key+" : "+e.Value+" ("+e.Service+")")
			if e.Meaning == "" {
				t.Errorf("%s: no meaning", e.Set)
			}
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("Find(%s, local %v):\ngot  %q\nwant %q", tc.dst, tc.local, got, tc.want)
		}
	}
}

// TestZoneFromSnapshot: topology hints follow the zone each snapshot carries,
// also when only the zone changed and the ports are the same objects (the
// Node's zone label edited while the proxy runs).
func TestZoneFromSnapshot(t *testing.T) {
	t.Parallel()
	p, k, _ := newFake(t, Config{})
	sp := svcPort("ns", "z", "", service.TCP, 80)
	sp.ClusterIPs = addrs("10.96.0.9")
	sp.Endpoints = eps("10.244.1.1:80", "10.244.2.1:80")
	sp.Endpoints[0].ZoneHints = []string{"zone-a"}
	sp.Endpoints[1].ZoneHints = []string{"zone-b"}
	for _, step := range []struct{ zone, want, not string }{
		{"zone-a", "10.244.1.1 . 80", "10.244.2.1 . 80"},
		{"zone-b", "10.244.2.1 . 80", "10.244.1.1 . 80"},
		{"", "10.244.1.1 . 80", ""}, // no zone: every endpoint
	} {
		mustSync(t, p, &service.Snapshot{Ports: []*service.Port{sp}, Zone: step.zone})
		got := elementsOf(t, k)
		if !strings.Contains(got, step.want) || (step.not != "" && strings.Contains(got, step.not)) {
			t.Errorf("zone %q: elements\n%s\nwant %s and not %q", step.zone, got, step.want, step.not)
		}
		if step.zone == "" && !strings.Contains(got, "10.244.2.1 . 80") {
			t.Errorf("no zone: elements\n%s\nwant both endpoints", got)
		}
	}
}

// TestElementCommentOfAnyName: a Service port's name, the comment of its
// elements, is written without what nft cannot take in a quoted comment
// (a name from a manifest may hold anything; the API server allows none of
// it), so that one Service cannot make every transaction fail.
func TestElementCommentOfAnyName(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, svc, portName, want string
	}{
		{"a quote", `a"b`, "", `comment "shop/a_b"`},
		{"a backslash and a newline", `a\b`, "p\n", `comment "shop/a_b:p_"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			svc := svcPort("shop", tt.svc, tt.portName, service.TCP, 80)
			svc.ClusterIPs = addrs("10.96.0.71")
			svc.Endpoints = eps("10.244.1.2:8080")
			p, k, _ := newFake(t, Config{})
			mustSync(t, p, snapshot(svc))
			got := lines(k, -1, "add element")
			if !strings.Contains(got, tt.want) || strings.Contains(got, `\`) {
				t.Errorf("elements:\n%s\nwant each with %s and no escape", got, tt.want)
			}
		})
	}
}
