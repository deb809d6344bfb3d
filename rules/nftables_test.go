package rules

import (
	"cmp"
	"errors"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/hashicorp/go-multierror"
	"sigs.k8s.io/knftables"

	"github.com/uproxy/uproxy/netfilter/conntrack/conntracktest"
	"github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/netfilter/nftables"
	"github.com/uproxy/uproxy/netfilter/nftables/nftablestest"
	"github.com/uproxy/uproxy/service"
)

func newTestNFTables(t *testing.T, cfg Config) (*NFTables, *nftablestest.Fake) {
	t.Helper()
	name, err := nftables.TableName(cmp.Or(cfg.ChainPrefix, iptables.DefaultChainPrefix))
	if err != nil {
		t.Fatal(err)
	}
	k := nftablestest.New(nftables.Table{Family: knftables.InetFamily, Name: name})
	cfg.NFTables = k
	if cfg.Conntrack == nil {
		cfg.Conntrack = &conntracktest.Recorder{}
	}
	return newTestPortals(t, cfg, NewNFTables), k
}

// writes returns the transactions run since the first n.
func writes(k *nftablestest.Fake, n int) string { return strings.Join(k.Transactions[n:], "") }

func TestNFTablesFirstSyncWritesWholeTable(t *testing.T) {
	t.Parallel()
	np := freePort(t, "tcp4")
	web := webPort(np)
	dns := dnsPort(0, "10.96.0.53")
	sctp := port("shop", "sig", "", service.SCTP, 9)
	sctp.ClusterIPs = ips("10.96.0.9")

	p, k := newTestNFTables(t, Config{
		IPv6:              true,
		DialMark:          testDialMark,
		NodePortAddresses: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")},
	})
	err := p.Sync([]Portal{{Port: web, ProxyPort: 40001}, {Port: dns, ProxyPort: 40002}, {Port: sctp, ProxyPort: 40003}})
	if err == nil || !strings.Contains(err.Error(), "portal shop/sig port 9/SCTP: protocol not supported") {
		t.Errorf("Sync: got %v, want the SCTP portal refused", err)
	}
	NP := strconv.Itoa(np)
	// IPv6 has no NodePort map: --nodeport-addresses names no IPv6 prefix.
	want := `add table inet uproxy
delete table inet uproxy
add table inet uproxy { comment "uproxy userspace-mode portals: Service IPs and NodePorts to proxy ports" ; }
add chain inet uproxy prerouting { type nat hook prerouting priority -110 ; }
add chain inet uproxy output { type nat hook output priority -110 ; }
add chain inet uproxy filter-input { type filter hook input priority -110 ; }
add chain inet uproxy filter-forward { type filter hook forward priority -110 ; }
add chain inet uproxy filter-output { type filter hook output priority -110 ; }
add chain inet uproxy no-endpoints { comment "Service ports without endpoints: refused" ; }
add chain inet uproxy refuse
add map inet uproxy service-ips4 { type ipv4_addr . inet_proto . inet_service : inet_service ; comment "ClusterIPs and LoadBalancer IPs" ; }
add map inet uproxy external-ips4 { type ipv4_addr . inet_proto . inet_service : inet_service ; comment "ExternalIPs" ; }
add map inet uproxy no-endpoint-service-ips4 { type ipv4_addr . inet_proto . inet_service : verdict ; comment "ClusterIPs and LoadBalancer IPs without endpoints" ; }
add map inet uproxy no-endpoint-external-ips4 { type ipv4_addr . inet_proto . inet_service : verdict ; comment "ExternalIPs without endpoints" ; }
add map inet uproxy nodeports4 { type inet_proto . inet_service : inet_service ; comment "NodePorts" ; }
add map inet uproxy no-endpoint-nodeports4 { type inet_proto . inet_service : verdict ; comment "NodePorts without endpoints" ; }
add set inet uproxy nodeport-addresses4 { type ipv4_addr ; flags interval ; auto-merge ; comment "--nodeport-addresses" ; }
add element inet uproxy nodeport-addresses4 { 10.0.0.0/8 }
add map inet uproxy service-ips6 { type ipv6_addr . inet_proto . inet_service : inet_service ; comment "ClusterIPs and LoadBalancer IPs" ; }
add map inet uproxy external-ips6 { type ipv6_addr . inet_proto . inet_service : inet_service ; comment "ExternalIPs" ; }
add map inet uproxy no-endpoint-service-ips6 { type ipv6_addr . inet_proto . inet_service : verdict ; comment "ClusterIPs and LoadBalancer IPs without endpoints" ; }
add map inet uproxy no-endpoint-external-ips6 { type ipv6_addr . inet_proto . inet_service : verdict ; comment "ExternalIPs without endpoints" ; }
add rule inet uproxy output meta mark & 0x2000 != 0 return comment "uproxy dials to endpoints skip the portals"
add rule inet uproxy prerouting meta l4proto { tcp, udp } redirect to : ip daddr . meta l4proto . th dport map @service-ips4 comment "Service IPs"
add rule inet uproxy prerouting fib saddr type != local meta l4proto { tcp, udp } redirect to : ip daddr . meta l4proto . th dport map @external-ips4 comment "ExternalIPs from outside the node"
add rule inet uproxy output meta l4proto { tcp, udp } dnat ip to 10.0.0.1: ip daddr . meta l4proto . th dport map @service-ips4 comment "Service IPs"
add rule inet uproxy output fib daddr type local meta l4proto { tcp, udp } dnat ip to 10.0.0.1: ip daddr . meta l4proto . th dport map @external-ips4 comment "ExternalIPs the node owns"
add rule inet uproxy prerouting fib daddr type local ip daddr @nodeport-addresses4 meta nfproto ipv4 meta l4proto { tcp, udp } redirect to : meta l4proto . th dport map @nodeports4 comment "NodePorts"
add rule inet uproxy output fib daddr type local ip daddr @nodeport-addresses4 meta nfproto ipv4 meta l4proto { tcp, udp } dnat ip to 10.0.0.1: meta l4proto . th dport map @nodeports4 comment "NodePorts"
add rule inet uproxy prerouting meta l4proto { tcp, udp } redirect to : ip6 daddr . meta l4proto . th dport map @service-ips6 comment "Service IPs"
add rule inet uproxy prerouting fib saddr type != local meta l4proto { tcp, udp } redirect to : ip6 daddr . meta l4proto . th dport map @external-ips6 comment "ExternalIPs from outside the node"
add rule inet uproxy output meta l4proto { tcp, udp } dnat ip6 to [fd00::1]: ip6 daddr . meta l4proto . th dport map @service-ips6 comment "Service IPs"
add rule inet uproxy output fib daddr type local meta l4proto { tcp, udp } dnat ip6 to [fd00::1]: ip6 daddr . meta l4proto . th dport map @external-ips6 comment "ExternalIPs the node owns"
add rule inet uproxy filter-input ct state new jump no-endpoints comment "a connection's first packet: refused when its Service port has no endpoints"
add rule inet uproxy filter-forward ct state new jump no-endpoints comment "a connection's first packet: refused when its Service port has no endpoints"
add rule inet uproxy filter-output ct state new jump no-endpoints comment "a connection's first packet: refused when its Service port has no endpoints"
add rule inet uproxy no-endpoints meta mark & 0x2000 != 0 return comment "uproxy dials to endpoints skip the portals"
add rule inet uproxy no-endpoints ip daddr . meta l4proto . th dport vmap @no-endpoint-service-ips4 comment "Service IPs without endpoints"
add rule inet uproxy no-endpoints fib daddr type local ip daddr . meta l4proto . th dport vmap @no-endpoint-external-ips4 comment "ExternalIPs the node owns, without endpoints"
add rule inet uproxy no-endpoints fib saddr type != local ip daddr . meta l4proto . th dport vmap @no-endpoint-external-ips4 comment "ExternalIPs from outside the node, without endpoints"
add rule inet uproxy no-endpoints fib daddr type local ip daddr @nodeport-addresses4 meta nfproto ipv4 meta l4proto . th dport vmap @no-endpoint-nodeports4 comment "NodePorts without endpoints"
add rule inet uproxy no-endpoints ip6 daddr . meta l4proto . th dport vmap @no-endpoint-service-ips6 comment "Service IPs without endpoints"
add rule inet uproxy no-endpoints fib daddr type local ip6 daddr . meta l4proto . th dport vmap @no-endpoint-external-ips6 comment "ExternalIPs the node owns, without endpoints"
add rule inet uproxy no-endpoints fib saddr type != local ip6 daddr . meta l4proto . th dport vmap @no-endpoint-external-ips6 comment "ExternalIPs from outside the node, without endpoints"
add rule inet uproxy refuse meta l4proto tcp reject with tcp reset comment "TCP: reset"
add rule inet uproxy refuse reject comment "UDP: port unreachable"
add element inet uproxy external-ips4 { 10.250.0.5 . tcp . 80 comment "shop/web:http" : 40001 }
add element inet uproxy external-ips6 { fd00:250::5 . tcp . 80 comment "shop/web:http" : 40001 }
add element inet uproxy nodeports4 { tcp . ` + NP + ` comment "shop/web:http" : 40001 }
add element inet uproxy service-ips4 { 10.96.0.10 . tcp . 80 comment "shop/web:http" : 40001 }
add element inet uproxy service-ips4 { 10.96.0.53 . udp . 53 comment "kube-system/dns:dns" : 40002 }
add element inet uproxy service-ips4 { 10.251.0.7 . tcp . 80 comment "shop/web:http" : 40001 }
add element inet uproxy service-ips6 { fd00:96::10 . tcp . 80 comment "shop/web:http" : 40001 }
`
	if got := writes(k, 0); got != want {
		t.Errorf("first transaction:\ngot:\n%s\nwant:\n%s", got, want)
	}
}

// TestNFTablesSyncWritesOnlyChanges: after the first sync, each sync writes the
// elements that changed and nothing else, in one transaction, or nothing.
func TestNFTablesSyncWritesOnlyChanges(t *testing.T) {
	t.Parallel()
	np := freePort(t, "udp4")
	svc := func(name string, proto service.Protocol, ip string) *service.Port {
		p := port("ns", name, "", proto, 80)
		p.ClusterIPs = ips(ip)
		return p
	}
	a := svc("a", service.TCP, "10.96.0.1")
	b := svc("b", service.TCP, "10.96.0.2")
	c := svc("c", service.UDP, "10.96.0.3")
	c.ExternalIPs = ips("10.250.0.3")
	c.NodePort = np
	renamed := svc("b2", service.TCP, "10.96.0.2")
	NP := strconv.Itoa(np)

	steps := []struct {
		name    string
		portals []Portal
		want    string // the transaction, "" for none
	}{
		{"identical: no transaction", []Portal{{Port: a, ProxyPort: 40001}, {Port: b, ProxyPort: 40002}}, ""},
		{"add a Service port: its elements only", []Portal{{Port: a, ProxyPort: 40001}, {Port: b, ProxyPort: 40002}, {Port: c, ProxyPort: 40003}}, `add element inet uproxy external-ips4 { 10.250.0.3 . udp . 80 comment "ns/c" : 40003 }
add element inet uproxy nodeports4 { udp . ` + NP + ` comment "ns/c" : 40003 }
add element inet uproxy service-ips4 { 10.96.0.3 . udp . 80 comment "ns/c" : 40003 }
`},
		{"re-point: the elements replaced", []Portal{{Port: a, ProxyPort: 40001}, {Port: b, ProxyPort: 40002}, {Port: c, ProxyPort: 40009}}, `delete element inet uproxy external-ips4 { 10.250.0.3 . udp . 80 }
delete element inet uproxy nodeports4 { udp . ` + NP + ` }
delete element inet uproxy service-ips4 { 10.96.0.3 . udp . 80 }
add element inet uproxy external-ips4 { 10.250.0.3 . udp . 80 comment "ns/c" : 40009 }
add element inet uproxy nodeports4 { udp . ` + NP + ` comment "ns/c" : 40009 }
add element inet uproxy service-ips4 { 10.96.0.3 . udp . 80 comment "ns/c" : 40009 }
`},
		{"the same key under another Service: replaced for its comment", []Portal{{Port: a, ProxyPort: 40001}, {Port: renamed, ProxyPort: 40002}, {Port: c, ProxyPort: 40009}}, `delete element inet uproxy service-ips4 { 10.96.0.2 . tcp . 80 }
add element inet uproxy service-ips4 { 10.96.0.2 . tcp . 80 comment "ns/b2" : 40002 }
`},
		{"remove a Service port: its elements deleted", []Portal{{Port: a, ProxyPort: 40001}, {Port: renamed, ProxyPort: 40002}}, `delete element inet uproxy external-ips4 { 10.250.0.3 . udp . 80 }
delete element inet uproxy nodeports4 { udp . ` + NP + ` }
delete element inet uproxy service-ips4 { 10.96.0.3 . udp . 80 }
`},
		{"identical again", []Portal{{Port: a, ProxyPort: 40001}, {Port: renamed, ProxyPort: 40002}}, ""},
	}
	p, k := newTestNFTables(t, Config{})
	if err := p.Sync([]Portal{{Port: a, ProxyPort: 40001}, {Port: b, ProxyPort: 40002}}); err != nil {
		t.Fatalf("first Sync: %v", err)
	}
	for _, st := range steps {
		n := len(k.Transactions)
		if err := p.Sync(st.portals); err != nil {
			t.Fatalf("%s: Sync: %v", st.name, err)
		}
		if got := len(k.Transactions) - n; got > 1 {
			t.Errorf("%s: got %d transactions, want at most 1", st.name, got)
		}
		if got := writes(k, n); got != st.want {
			t.Errorf("%s:\ngot:\n%s\nwant:\n%s", st.name, got, st.want)
		}
	}
	// What the changes built is what one whole write of the last state builds.
	fresh, fk := newTestNFTables(t, Config{})
	if err := fresh.Sync(steps[len(steps)-1].portals); err != nil {
		t.Fatal(err)
	}
	if got, want := k.Dump(), fk.Dump(); got != want {
		t.Errorf("table after the changes:\n%s\nwant, as a whole write makes it:\n%s", got, want)
	}
}

// TestNFTablesExternalFlushRewritesWhole: whatever another program did to the
// table, the next sync writes it whole, as the first sync did, and the sync
// after that writes nothing.
func TestNFTablesExternalFlushRewritesWhole(t *testing.T) {
	t.Parallel()
	svc := port("ns", "dns", "", service.UDP, 53)
	svc.ClusterIPs = ips("10.96.0.53", "fd00:96::53")
	portals := []Portal{{Port: svc, ProxyPort: 40001}}
	tests := []struct {
		name  string
		flush func(*nftablestest.Fake) error
	}{
		{"nft flush table: chains emptied, maps kept", (*nftablestest.Fake).FlushChains},
		{"nft delete table or nft flush ruleset", (*nftablestest.Fake).DeleteTable},
		{"a rule added to a chain", func(k *nftablestest.Fake) error {
			tx := k.NewTransaction()
			tx.Add(&knftables.Rule{Chain: nftOutput, Rule: "accept"})
			return k.Fake.Run(t.Context(), tx)
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, k := newTestNFTables(t, Config{IPv6: true})
			if err := p.Sync(portals); err != nil {
				t.Fatal(err)
			}
			first := k.Dump()
			if err := tt.flush(k); err != nil {
				t.Fatal(err)
			}
			if err := p.Sync(portals); err != nil {
				t.Fatalf("Sync after the flush: %v", err)
			}
			if len(k.Transactions) != 2 || k.Transactions[1] != k.Transactions[0] {
				t.Fatalf("transactions: got %d, want 2, the second a whole write as the first:\n%s", len(k.Transactions), writes(k, 1))
			}
			if got := k.Dump(); got != first {
				t.Errorf("table after the rewrite:\n%s\nwant:\n%s", got, first)
			}
			if err := p.Sync(portals); err != nil {
				t.Fatal(err)
			}
			if len(k.Transactions) != 2 {
				t.Errorf("a quiet sync after the rewrite wrote:\n%s", writes(k, 2))
			}
		})
	}
}

func TestNFTablesWriteFailureRewritesWhole(t *testing.T) {
	t.Parallel()
	a := port("ns", "a", "", service.TCP, 80)
	a.ClusterIPs = ips("10.96.0.1")
	p, k := newTestNFTables(t, Config{})
	if err := p.Sync([]Portal{{Port: a, ProxyPort: 40001}}); err != nil {
		t.Fatal(err)
	}
	k.FailNextRun(errors.New("nft: Could not process rule: No such file or directory"))
	err := p.Sync([]Portal{{Port: a, ProxyPort: 40002}})
	if err == nil || !strings.Contains(err.Error(), "write nftables table inet uproxy: nft: Could not process rule") {
		t.Fatalf("Sync: got %v, want the failed write", err)
	}
	if err := p.Sync([]Portal{{Port: a, ProxyPort: 40002}}); err != nil {
		t.Fatalf("Sync after the failure: %v", err)
	}
	if got := writes(k, 1); !strings.HasPrefix(got, "add table inet uproxy\ndelete table inet uproxy\n") ||
		!strings.Contains(got, `service-ips4 { 10.96.0.1 . tcp . 80 comment "ns/a" : 40002 }`) {
		t.Errorf("write after the failure: got\n%s\nwant the whole table with the new proxy port", got)
	}
}

// TestNFTablesDuplicateKey: a key two Service ports claim goes to the first (by
// name), and the other gets a PortalError; the rest is written regardless.
func TestNFTablesDuplicateKey(t *testing.T) {
	t.Parallel()
	first := port("ns", "a", "", service.TCP, 80)
	first.ClusterIPs = ips("10.96.0.1")
	second := port("ns", "b", "", service.TCP, 80)
	second.ClusterIPs = ips("10.96.0.1")
	second.LoadBalancerIPs = ips("10.251.0.2")
	p, k := newTestNFTables(t, Config{})
	err := p.Sync([]Portal{{Port: second, ProxyPort: 40002}, {Port: first, ProxyPort: 40001}})
	me, ok := err.(*multierror.Error)
	if !ok || len(me.Errors) != 1 {
		t.Fatalf("Sync: got %v, want one error", err)
	}
	var pe *PortalError
	if !errors.As(me.Errors[0], &pe) || pe.Service != second.Name || pe.Port != 80 ||
		!strings.Contains(pe.Error(), "10.96.0.1 . tcp . 80 in map service-ips4 already used by ns/a") {
		t.Errorf("error: got %v, want a PortalError of ns/b naming ns/a", me.Errors[0])
	}
	if again := p.Sync([]Portal{{Port: second, ProxyPort: 40002}, {Port: first, ProxyPort: 40001}}); again == nil || again.Error() != err.Error() || len(k.Transactions) != 1 {
		t.Errorf("an unchanged sync: got %v and %d transactions, want the same error and no write", again, len(k.Transactions)-1)
	}
	m := k.Table.Maps["service-ips4"]
	if e := m.FindElement("10.96.0.1 . tcp . 80"); e == nil || e.Value[0] != "40001" {
		t.Errorf("10.96.0.1 . tcp . 80: got %v, want ns/a's proxy port 40001", e)
	}
	if e := m.FindElement("10.251.0.2 . tcp . 80"); e == nil || e.Value[0] != "40002" {
		t.Errorf("ns/b's LoadBalancer IP: got %v, want proxy port 40002", e)
	}
}

func TestNFTablesCleanupDeletesTable(t *testing.T) {
	t.Parallel()
	a := port("ns", "a", "", service.TCP, 80)
	a.ClusterIPs = ips("10.96.0.1")
	a.NodePort = freePort(t, "tcp4")
	p, k := newTestNFTables(t, Config{})
	if err := p.Sync([]Portal{{Port: a, ProxyPort: 40001}}); err != nil {
		t.Fatal(err)
	}
	for i := range 2 { // the second finds nothing to delete
		if err := p.Cleanup(); err != nil {
			t.Fatalf("Cleanup %d: %v", i, err)
		}
		if k.Table != nil || len(k.Tables[knftables.InetFamily]) != 0 {
			t.Errorf("Cleanup %d left:\n%s", i, k.Dump())
		}
	}
	if len(p.holder.held) != 0 {
		t.Errorf("NodePorts still held after Cleanup: %v", p.holder.held)
	}
	// The next sync writes the whole table again.
	if err := p.Sync([]Portal{{Port: a, ProxyPort: 40001}}); err != nil {
		t.Fatal(err)
	}
	if k.Table == nil || k.Table.Maps["service-ips4"].FindElement("10.96.0.1 . tcp . 80") == nil {
		t.Errorf("Sync after Cleanup:\n%s", k.Dump())
	}
}

// With the proxy ports on the node IP only (a specific --bind-address), traffic
// from outside the node is DNATed there like the node's own: REDIRECT would send
// it to the address of the interface it arrived on, where nothing listens. Both
// backends.
func TestProxyPortsOnNodeIPDNATFromOutside(t *testing.T) {
	t.Parallel()
	web := webPort(freePort(t, "tcp4"))
	portals := []Portal{{Port: web, ProxyPort: 40001}}
	t.Run("iptables", func(t *testing.T) {
		k := newFakeKernel()
		p := newTestIPTables(t, k, Config{ProxyPortsOnNodeIP: true})
		if err := p.Sync(portals); err != nil {
			t.Fatal(err)
		}
		got := k.restores(v4)[0]
		for _, chain := range []string{"UPROXY-PORTALS-CONTAINER", "UPROXY-NODEPORT-CONTAINER"} {
			if !strings.Contains(got, "-A "+chain) {
				t.Errorf("restore input has no %s rule:\n%s", chain, got)
			}
		}
		if strings.Contains(got, "REDIRECT") || strings.Count(got, "-j DNAT --to-destination 10.0.0.1:40001") != 8 {
			t.Errorf("restore input: want every portal (4 from outside, 4 from the node) to DNAT to 10.0.0.1:40001, none to REDIRECT:\n%s", got)
		}
	})
	t.Run("nftables", func(t *testing.T) {
		p, k := newTestNFTables(t, Config{ProxyPortsOnNodeIP: true})
		if err := p.Sync(portals); err != nil {
			t.Fatal(err)
		}
		got := writes(k, 0)
		if strings.Contains(got, "redirect") {
			t.Errorf("transaction redirects:\n%s", got)
		}
		for _, want := range []string{
			"add rule inet uproxy prerouting meta l4proto { tcp, udp } dnat ip to 10.0.0.1: ip daddr . meta l4proto . th dport map @service-ips4",
			"prerouting fib daddr type local meta nfproto ipv4 meta l4proto { tcp, udp } dnat ip to 10.0.0.1: meta l4proto . th dport map @nodeports4",
		} {
			if !strings.Contains(got, want) {
				t.Errorf("transaction lacks %q:\n%s", want, got)
			}
		}
	})
}

// TestNFTablesCommentOfAnyName: a Service port's name is the comment of its
// elements, written in nft's quotes; a name that nft could not take there
// (from a manifest: the API server allows none) is written without the
// characters it cannot take, and the transaction still parses.
func TestNFTablesCommentOfAnyName(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, svc, portName, want string
	}{
		{"a quote", `a"b`, "", `comment "ns/a_b"`},
		{"a backslash and a newline", `a\b`, "p\n", `comment "ns/a_b:p_"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			svc := port("ns", tt.svc, tt.portName, service.TCP, 80)
			svc.ClusterIPs = ips("10.96.0.71")
			p, k := newTestNFTables(t, Config{})
			if err := p.Sync([]Portal{{Port: svc, ProxyPort: 40001}}); err != nil {
				t.Fatalf("Sync: %v", err)
			}
			if got := writes(k, 0); !strings.Contains(got, tt.want) {
				t.Errorf("transaction:\n%s\nwant an element with %s", got, tt.want)
			}
		})
	}
}

// TestNFTablesWritesSteeringChangesOverNetlink: a change of the maps' elements
// (a Service port added, removed, moved to another proxy port, refused or
// steered again: the no-endpoint maps' values are verdicts) goes over
// netlink. The table is the same as a whole write's.
func TestNFTablesWritesSteeringChangesOverNetlink(t *testing.T) {
	t.Parallel()
	a := port("ns", "a", "", service.TCP, 80)
	a.ClusterIPs = ips("10.96.0.1")
	b := port("ns", "b", "", service.UDP, 53)
	b.ClusterIPs = ips("10.96.0.2")
	b.ExternalIPs = ips("10.250.0.2")
	c := port("ns", "c", "", service.TCP, 8080)
	c.ClusterIPs = ips("10.96.0.3")
	refused := Refusal{Cluster: [2]bool{true, true}, External: [2]bool{true, true}}
	steps := []struct {
		name    string
		portals []Portal
		netlink bool
	}{
		{"first: the whole table", []Portal{{Port: a, ProxyPort: 40001}}, false},
		{"a Service port added", []Portal{{Port: a, ProxyPort: 40001}, {Port: b, ProxyPort: 40002}}, true},
		{"a proxy port moved", []Portal{{Port: a, ProxyPort: 40003}, {Port: b, ProxyPort: 40002}}, true},
		{"refused: into a no-endpoint map (a verdict value)", []Portal{{Port: a, ProxyPort: 40003}, {Port: b, ProxyPort: 40002, Refuse: refused}}, true},
		{"steered again", []Portal{{Port: a, ProxyPort: 40003}, {Port: b, ProxyPort: 40002}}, true},
		{"a new Service port, refused: no endpoints yet", []Portal{{Port: a, ProxyPort: 40003}, {Port: b, ProxyPort: 40002}, {Port: c, ProxyPort: 40004, Refuse: refused}}, true},
		{"a Service port removed", []Portal{{Port: b, ProxyPort: 40002}}, true},
	}
	p, k := newTestNFTables(t, Config{})
	for _, st := range steps {
		runs, writes := len(k.Transactions), k.ElementWrites
		if err := p.Sync(st.portals); err != nil {
			t.Fatalf("%s: Sync: %v", st.name, err)
		}
		if len(k.Transactions) != runs+1 {
			t.Errorf("%s: got %d writes, want 1", st.name, len(k.Transactions)-runs)
		}
		if netlink := k.ElementWrites > writes; netlink != st.netlink {
			t.Errorf("%s: written over netlink: got %v, want %v", st.name, netlink, st.netlink)
		}
		// The fake's table, written partly over netlink, is what one whole
		// write of the same portals gives (in another order: the fake lists
		// a map's elements as they came).
		whole, wk := newTestNFTables(t, Config{})
		if err := whole.Sync(st.portals); err != nil {
			t.Fatal(err)
		}
		sorted := func(dump string) string {
			lines := strings.Split(dump, "\n")
			slices.Sort(lines)
			return strings.Join(lines, "\n")
		}
		if got, want := sorted(k.Dump()), sorted(wk.Dump()); got != want {
			t.Errorf("%s: table\n%s\nwant, as written whole,\n%s", st.name, got, want)
		}
	}
}
