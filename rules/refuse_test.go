package rules

import (
	"io"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/service"
)

// refuseAll refuses every address of a Service port: it has no endpoint at all.
var refuseAll = Refusal{Cluster: [2]bool{true, true}, External: [2]bool{true, true}}

func TestRefusalOf(t *testing.T) {
	t.Parallel()
	ep := netip.MustParseAddrPort
	tests := []struct {
		name              string
		cluster, external []netip.AddrPort
		want              Refusal
	}{
		{"no endpoints: everything refused", nil, nil, refuseAll},
		{"IPv4 endpoints only: IPv6 refused", []netip.AddrPort{ep("10.244.0.5:8080")}, []netip.AddrPort{ep("10.244.0.5:8080")},
			Refusal{Cluster: [2]bool{false, true}, External: [2]bool{false, true}}},
		{"both families", []netip.AddrPort{ep("10.244.0.5:8080"), ep("[fd00:244::5]:8080")}, []netip.AddrPort{ep("[fd00:244::5]:8080"), ep("10.244.0.5:8080")},
			Refusal{}},
		{"a Local policy leaves the external balancer empty", []netip.AddrPort{ep("10.244.0.5:8080")}, nil,
			Refusal{Cluster: [2]bool{false, true}, External: [2]bool{true, true}}},
		{"an IPv4-mapped endpoint counts as IPv4", []netip.AddrPort{ep("[::ffff:10.244.0.5]:8080")}, []netip.AddrPort{ep("[::ffff:10.244.0.5]:8080")},
			Refusal{Cluster: [2]bool{false, true}, External: [2]bool{false, true}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := RefusalOf(tt.cluster, tt.external); got != tt.want {
				t.Errorf("got %+v, want %+v", got, tt.want)
			}
			for _, ext := range []bool{false, true} {
				for f := v4; f <= v6; f++ {
					want := tt.want.Cluster[f]
					if ext {
						want = tt.want.External[f]
					}
					if got := tt.want.Refused(ext, f == v6); got != want {
						t.Errorf("Refused(external %v, %s): got %v, want %v", ext, familyName(f), got, want)
					}
				}
			}
		})
	}
}

// refusedPortals are the Service ports of the refusal tests: web (TCP, every
// kind of address, both families) and dns (UDP, ClusterIPs of both families,
// a NodePort) with no endpoints at all, and local (TCP) whose ClusterIP has
// endpoints but whose external addresses, under externalTrafficPolicy Local,
// have none on this node.
func refusedPortals(t *testing.T) ([]Portal, map[string]string) {
	np, npUDP, npLocal := freePort(t, "tcp4"), freePort(t, "udp4"), freePort(t, "tcp4")
	web := webPort(np)
	dns := dnsPort(npUDP, "10.96.0.53", "fd00:96::53")
	local := port("shop", "local", "", service.TCP, 443)
	local.ClusterIPs = ips("10.96.0.44")
	local.ExternalIPs = ips("10.250.0.44")
	local.NodePort = npLocal
	return []Portal{
			{Port: web, ProxyPort: 40001, Refuse: refuseAll},
			{Port: dns, ProxyPort: 40002, Refuse: refuseAll},
			{Port: local, ProxyPort: 40003, ExternalProxyPort: 40004, Refuse: Refusal{External: [2]bool{true, true}}},
		}, map[string]string{
			"NP": strconv.Itoa(np), "NPU": strconv.Itoa(npUDP), "NPL": strconv.Itoa(npLocal),
			// The NodePorts' spans in the NON-LOCAL guards: local is IPv4 only.
			"SPAN": portSpan(np, npUDP, npLocal), "SPAN6": portSpan(np, npUDP),
		}
}

// portSpan is the span of ports as iptables matches it: "lo:hi", or "lo".
func portSpan(ports ...int) string {
	lo, hi := slices.Min(ports), slices.Max(ports)
	if lo == hi {
		return strconv.Itoa(lo)
	}
	return strconv.Itoa(lo) + ":" + strconv.Itoa(hi)
}

// expand replaces $NAME in s by vars[NAME].
func expand(s string, vars map[string]string) string {
	return os.Expand(s, func(k string) string { return vars[k] })
}

// TestIPTablesRefusesPortsWithoutEndpoints: a refused address has no nat rule,
// so its packets keep their destination, and one REJECT in NO-ENDPOINTS per
// address (two per ExternalIP), whose matches are those of the nat rule it
// replaces; TCP gets a reset, UDP ICMP port unreachable of its family.
func TestIPTablesRefusesPortsWithoutEndpoints(t *testing.T) {
	t.Parallel()
	portals, vars := refusedPortals(t)
	k := newFakeKernel()
	p := newTestIPTables(t, k, Config{IPv6: true, DialMark: testDialMark})
	if err := p.Sync(portals); err != nil {
		t.Fatalf("Sync: %v", err)
	}
	want := [2]string{expand(`*filter
:UPROXY-NODEPORT-NON-LOCAL - [0:0]
:UPROXY-NO-ENDPOINTS - [0:0]
:UPROXY-CANARY - [0:0]
-A UPROXY-CANARY -m comment --comment "uproxy canary: gone means the table was flushed" -j RETURN
-A UPROXY-NODEPORT-NON-LOCAL -m conntrack ! --ctstate DNAT -m comment --comment "uproxy NodePorts: not redirected" -j RETURN
-A UPROXY-NODEPORT-NON-LOCAL -m conntrack ! --ctorigdstport $SPAN -m comment --comment "uproxy NodePorts: not to a NodePort" -j RETURN
-A UPROXY-NODEPORT-NON-LOCAL -p udp -m comment --comment "kube-system/dns:dns" -m udp --dport 40002 -m conntrack --ctstate DNAT --ctorigdstport $NPU -j ACCEPT
-A UPROXY-NODEPORT-NON-LOCAL -p tcp -m comment --comment "shop/local" -m tcp --dport 40004 -m conntrack --ctstate DNAT --ctorigdstport $NPL -j ACCEPT
-A UPROXY-NODEPORT-NON-LOCAL -p tcp -m comment --comment "shop/web:http" -m tcp --dport 40001 -m conntrack --ctstate DNAT --ctorigdstport $NP -j ACCEPT
-A UPROXY-NO-ENDPOINTS -m mark --mark 0x2000/0x2000 -m comment --comment "uproxy dials to endpoints skip the portals" -j RETURN
-A UPROXY-NO-ENDPOINTS -d 10.96.0.53/32 -p udp -m comment --comment "kube-system/dns:dns has no endpoints" -m udp --dport 53 -j REJECT --reject-with icmp-port-unreachable
-A UPROXY-NO-ENDPOINTS -p udp -m comment --comment "kube-system/dns:dns has no endpoints" -m udp --dport $NPU -m addrtype --dst-type LOCAL -j REJECT --reject-with icmp-port-unreachable
-A UPROXY-NO-ENDPOINTS -d 10.250.0.44/32 -p tcp -m comment --comment "shop/local has no endpoints" -m tcp --dport 443 -m addrtype --dst-type LOCAL -j REJECT --reject-with tcp-reset
-A UPROXY-NO-ENDPOINTS -d 10.250.0.44/32 -p tcp -m comment --comment "shop/local has no endpoints" -m tcp --dport 443 -m addrtype ! --src-type LOCAL -j REJECT --reject-with tcp-reset
-A UPROXY-NO-ENDPOINTS -p tcp -m comment --comment "shop/local has no endpoints" -m tcp --dport $NPL -m addrtype --dst-type LOCAL -j REJECT --reject-with tcp-reset
-A UPROXY-NO-ENDPOINTS -d 10.96.0.10/32 -p tcp -m comment --comment "shop/web:http has no endpoints" -m tcp --dport 80 -j REJECT --reject-with tcp-reset
-A UPROXY-NO-ENDPOINTS -d 10.251.0.7/32 -p tcp -m comment --comment "shop/web:http has no endpoints" -m tcp --dport 80 -j REJECT --reject-with tcp-reset
-A UPROXY-NO-ENDPOINTS -d 10.250.0.5/32 -p tcp -m comment --comment "shop/web:http has no endpoints" -m tcp --dport 80 -m addrtype --dst-type LOCAL -j REJECT --reject-with tcp-reset
-A UPROXY-NO-ENDPOINTS -d 10.250.0.5/32 -p tcp -m comment --comment "shop/web:http has no endpoints" -m tcp --dport 80 -m addrtype ! --src-type LOCAL -j REJECT --reject-with tcp-reset
-A UPROXY-NO-ENDPOINTS -p tcp -m comment --comment "shop/web:http has no endpoints" -m tcp --dport $NP -m addrtype --dst-type LOCAL -j REJECT --reject-with tcp-reset
COMMIT
*nat
:UPROXY-PORTALS-CONTAINER - [0:0]
:UPROXY-PORTALS-HOST - [0:0]
:UPROXY-NODEPORT-CONTAINER - [0:0]
:UPROXY-NODEPORT-HOST - [0:0]
:UPROXY-CANARY - [0:0]
-A UPROXY-CANARY -m comment --comment "uproxy canary: gone means the table was flushed" -j RETURN
-A UPROXY-PORTALS-CONTAINER -d 10.96.0.44/32 -p tcp -m comment --comment "shop/local" -m tcp --dport 443 -j REDIRECT --to-ports 40003
-A UPROXY-PORTALS-HOST -m mark --mark 0x2000/0x2000 -m comment --comment "uproxy dials to endpoints skip the portals" -j RETURN
-A UPROXY-PORTALS-HOST -d 10.96.0.44/32 -p tcp -m comment --comment "shop/local" -m tcp --dport 443 -j DNAT --to-destination 10.0.0.1:40003
-A UPROXY-NODEPORT-HOST -m mark --mark 0x2000/0x2000 -m comment --comment "uproxy dials to endpoints skip the portals" -j RETURN
COMMIT
`, vars), `*filter
:UPROXY-NODEPORT-NON-LOCAL - [0:0]
:UPROXY-NO-ENDPOINTS - [0:0]
:UPROXY-CANARY - [0:0]
-A UPROXY-CANARY -m comment --comment "uproxy canary: gone means the table was flushed" -j RETURN
-A UPROXY-NODEPORT-NON-LOCAL -m conntrack ! --ctstate DNAT -m comment --comment "uproxy NodePorts: not redirected" -j RETURN
-A UPROXY-NODEPORT-NON-LOCAL -m conntrack ! --ctorigdstport $SPAN6 -m comment --comment "uproxy NodePorts: not to a NodePort" -j RETURN
-A UPROXY-NODEPORT-NON-LOCAL -p udp -m comment --comment "kube-system/dns:dns" -m udp --dport 40002 -m conntrack --ctstate DNAT --ctorigdstport $NPU -j ACCEPT
-A UPROXY-NODEPORT-NON-LOCAL -p tcp -m comment --comment "shop/web:http" -m tcp --dport 40001 -m conntrack --ctstate DNAT --ctorigdstport $NP -j ACCEPT
-A UPROXY-NO-ENDPOINTS -m mark --mark 0x2000/0x2000 -m comment --comment "uproxy dials to endpoints skip the portals" -j RETURN
-A UPROXY-NO-ENDPOINTS -d fd00:96::53/128 -p udp -m comment --comment "kube-system/dns:dns has no endpoints" -m udp --dport 53 -j REJECT --reject-with icmp6-port-unreachable
-A UPROXY-NO-ENDPOINTS -p udp -m comment --comment "kube-system/dns:dns has no endpoints" -m udp --dport $NPU -m addrtype --dst-type LOCAL -j REJECT --reject-with icmp6-port-unreachable
-A UPROXY-NO-ENDPOINTS -d fd00:96::10/128 -p tcp -m comment --comment "shop/web:http has no endpoints" -m tcp --dport 80 -j REJECT --reject-with tcp-reset
-A UPROXY-NO-ENDPOINTS -d fd00:250::5/128 -p tcp -m comment --comment "shop/web:http has no endpoints" -m tcp --dport 80 -m addrtype --dst-type LOCAL -j REJECT --reject-with tcp-reset
-A UPROXY-NO-ENDPOINTS -d fd00:250::5/128 -p tcp -m comment --comment "shop/web:http has no endpoints" -m tcp --dport 80 -m addrtype ! --src-type LOCAL -j REJECT --reject-with tcp-reset
-A UPROXY-NO-ENDPOINTS -p tcp -m comment --comment "shop/web:http has no endpoints" -m tcp --dport $NP -m addrtype --dst-type LOCAL -j REJECT --reject-with tcp-reset
COMMIT
*nat
:UPROXY-PORTALS-CONTAINER - [0:0]
:UPROXY-PORTALS-HOST - [0:0]
:UPROXY-NODEPORT-CONTAINER - [0:0]
:UPROXY-NODEPORT-HOST - [0:0]
:UPROXY-CANARY - [0:0]
-A UPROXY-CANARY -m comment --comment "uproxy canary: gone means the table was flushed" -j RETURN
-A UPROXY-PORTALS-HOST -m mark --mark 0x2000/0x2000 -m comment --comment "uproxy dials to endpoints skip the portals" -j RETURN
-A UPROXY-NODEPORT-HOST -m mark --mark 0x2000/0x2000 -m comment --comment "uproxy dials to endpoints skip the portals" -j RETURN
COMMIT
`}
	for f := v4; f <= v6; f++ {
		if got := k.restores(f); len(got) != 1 || got[0] != expand(want[f], vars) {
			t.Errorf("%s restore input:\ngot:\n%s\nwant:\n%s", familyName(f), strings.Join(got, "\n---\n"), expand(want[f], vars))
		}
	}
}

// TestNFTablesRefusesPortsWithoutEndpoints: a refused key is an element of the
// no-endpoint map beside the steering one it would otherwise be in, with the
// verdict goto refuse.
func TestNFTablesRefusesPortsWithoutEndpoints(t *testing.T) {
	t.Parallel()
	portals, vars := refusedPortals(t)
	p, k := newTestNFTables(t, Config{IPv6: true})
	if err := p.Sync(portals); err != nil {
		t.Fatalf("Sync: %v", err)
	}
	// The elements, in a sorted order that does not depend on the NodePorts'.
	var elements []string
	for line := range strings.Lines(writes(k, 0)) {
		if strings.HasPrefix(line, "add element ") {
			elements = append(elements, line)
		}
	}
	slices.Sort(elements)
	got := strings.Join(elements, "")
	want := expand(`add element inet uproxy no-endpoint-external-ips4 { 10.250.0.44 . tcp . 443 comment "shop/local" : goto refuse }
add element inet uproxy no-endpoint-external-ips4 { 10.250.0.5 . tcp . 80 comment "shop/web:http" : goto refuse }
add element inet uproxy no-endpoint-external-ips6 { fd00:250::5 . tcp . 80 comment "shop/web:http" : goto refuse }
add element inet uproxy no-endpoint-nodeports4 { tcp . $NP comment "shop/web:http" : goto refuse }
add element inet uproxy no-endpoint-nodeports4 { tcp . $NPL comment "shop/local" : goto refuse }
add element inet uproxy no-endpoint-nodeports4 { udp . $NPU comment "kube-system/dns:dns" : goto refuse }
add element inet uproxy no-endpoint-nodeports6 { tcp . $NP comment "shop/web:http" : goto refuse }
add element inet uproxy no-endpoint-nodeports6 { udp . $NPU comment "kube-system/dns:dns" : goto refuse }
add element inet uproxy no-endpoint-service-ips4 { 10.96.0.10 . tcp . 80 comment "shop/web:http" : goto refuse }
add element inet uproxy no-endpoint-service-ips4 { 10.96.0.53 . udp . 53 comment "kube-system/dns:dns" : goto refuse }
add element inet uproxy no-endpoint-service-ips4 { 10.251.0.7 . tcp . 80 comment "shop/web:http" : goto refuse }
add element inet uproxy no-endpoint-service-ips6 { fd00:96::10 . tcp . 80 comment "shop/web:http" : goto refuse }
add element inet uproxy no-endpoint-service-ips6 { fd00:96::53 . udp . 53 comment "kube-system/dns:dns" : goto refuse }
add element inet uproxy service-ips4 { 10.96.0.44 . tcp . 443 comment "shop/local" : 40003 }
`, vars)
	if want = sortedLines(want); got != want {
		t.Errorf("elements:\ngot:\n%s\nwant:\n%s", got, want)
	}
}

// TestRefusalFlipsInPlace: a Service port that loses its last endpoint and
// gains one again moves between steering and refusing in the normal
// incremental sync: iptables deletes and appends its rules in place, nftables
// moves its elements from map to map; either way the result is what a fresh
// write of the same state makes, and nothing else is touched.
func TestRefusalFlipsInPlace(t *testing.T) {
	t.Parallel()
	dns := dnsPort(30053, "10.96.0.53")
	other := port("ns", "other", "", service.TCP, 80)
	other.ClusterIPs = ips("10.96.0.80")
	state := func(refuse Refusal) []Portal {
		return []Portal{{Port: dns, ProxyPort: 40001, Refuse: refuse}, {Port: other, ProxyPort: 40002}}
	}
	steered, refused := state(Refusal{}), state(refuseAll)
	// NodePorts are held by stand-ins, so the fresh writes can hold them too.
	cfg := Config{Listen: func(string, string) (io.Closer, error) { return io.NopCloser(nil), nil }}

	t.Run("iptables", func(t *testing.T) {
		k := newFakeKernel()
		p := newTestIPTables(t, k, cfg)
		steps := []struct {
			name    string
			portals []Portal
			want    string // the restore input, written in place
		}{
			{"the last endpoint goes: refused", refused, `*filter
-A UPROXY-NO-ENDPOINTS -d 10.96.0.53/32 -p udp -m comment --comment "kube-system/dns:dns has no endpoints" -m udp --dport 53 -j REJECT --reject-with icmp-port-unreachable
-A UPROXY-NO-ENDPOINTS -p udp -m comment --comment "kube-system/dns:dns has no endpoints" -m udp --dport 30053 -m addrtype --dst-type LOCAL -j REJECT --reject-with icmp-port-unreachable
COMMIT
*nat
-D UPROXY-NODEPORT-CONTAINER -p udp -m comment --comment "kube-system/dns:dns" -m udp --dport 30053 -j REDIRECT --to-ports 40001
-D UPROXY-NODEPORT-HOST -p udp -m comment --comment "kube-system/dns:dns" -m udp --dport 30053 -j DNAT --to-destination 10.0.0.1:40001
-D UPROXY-PORTALS-CONTAINER -d 10.96.0.53/32 -p udp -m comment --comment "kube-system/dns:dns" -m udp --dport 53 -j REDIRECT --to-ports 40001
-D UPROXY-PORTALS-HOST -d 10.96.0.53/32 -p udp -m comment --comment "kube-system/dns:dns" -m udp --dport 53 -j DNAT --to-destination 10.0.0.1:40001
COMMIT
`},
			{"an endpoint again: steered", steered, `*filter
-D UPROXY-NO-ENDPOINTS -d 10.96.0.53/32 -p udp -m comment --comment "kube-system/dns:dns has no endpoints" -m udp --dport 53 -j REJECT --reject-with icmp-port-unreachable
-D UPROXY-NO-ENDPOINTS -p udp -m comment --comment "kube-system/dns:dns has no endpoints" -m udp --dport 30053 -m addrtype --dst-type LOCAL -j REJECT --reject-with icmp-port-unreachable
COMMIT
*nat
-A UPROXY-NODEPORT-CONTAINER -p udp -m comment --comment "kube-system/dns:dns" -m udp --dport 30053 -j REDIRECT --to-ports 40001
-A UPROXY-NODEPORT-HOST -p udp -m comment --comment "kube-system/dns:dns" -m udp --dport 30053 -j DNAT --to-destination 10.0.0.1:40001
-A UPROXY-PORTALS-CONTAINER -d 10.96.0.53/32 -p udp -m comment --comment "kube-system/dns:dns" -m udp --dport 53 -j REDIRECT --to-ports 40001
-A UPROXY-PORTALS-HOST -d 10.96.0.53/32 -p udp -m comment --comment "kube-system/dns:dns" -m udp --dport 53 -j DNAT --to-destination 10.0.0.1:40001
COMMIT
`},
			{"refused again", refused, ""},
		}
		if err := p.Sync(steered); err != nil {
			t.Fatal(err)
		}
		jumps := len(k.ops(v4))
		for _, st := range steps {
			n := len(k.restores(v4))
			if err := p.Sync(st.portals); err != nil {
				t.Fatalf("%s: Sync: %v", st.name, err)
			}
			if got := k.restores(v4)[n:]; len(got) != 1 || (st.want != "" && got[0] != st.want) {
				t.Errorf("%s: restore input:\ngot:\n%s\nwant:\n%s", st.name, strings.Join(got, "\n---\n"), st.want)
			}
			fresh := newFakeKernel()
			if err := newTestIPTables(t, fresh, cfg).Sync(st.portals); err != nil {
				t.Fatalf("%s: fresh Sync: %v", st.name, err)
			}
			if got, want := k.state(v4), fresh.state(v4); got != want {
				t.Errorf("%s: rules:\n%s\nwant, as a fresh write:\n%s", st.name, got, want)
			}
		}
		if got := len(k.ops(v4)); got != jumps {
			t.Errorf("jumps written while flipping: got %q", k.ops(v4)[jumps:])
		}
	})

	t.Run("nftables", func(t *testing.T) {
		c := cfg
		p, k := newTestNFTables(t, c)
		steps := []struct {
			name    string
			portals []Portal
			want    string // the one transaction
		}{
			{"the last endpoint goes: refused", refused, `delete element inet uproxy nodeports4 { udp . 30053 }
delete element inet uproxy service-ips4 { 10.96.0.53 . udp . 53 }
add element inet uproxy no-endpoint-nodeports4 { udp . 30053 comment "kube-system/dns:dns" : goto refuse }
add element inet uproxy no-endpoint-service-ips4 { 10.96.0.53 . udp . 53 comment "kube-system/dns:dns" : goto refuse }
`},
			{"an endpoint again: steered", steered, `delete element inet uproxy no-endpoint-nodeports4 { udp . 30053 }
delete element inet uproxy no-endpoint-service-ips4 { 10.96.0.53 . udp . 53 }
add element inet uproxy nodeports4 { udp . 30053 comment "kube-system/dns:dns" : 40001 }
add element inet uproxy service-ips4 { 10.96.0.53 . udp . 53 comment "kube-system/dns:dns" : 40001 }
`},
		}
		if err := p.Sync(steered); err != nil {
			t.Fatal(err)
		}
		for _, st := range steps {
			n := len(k.Transactions)
			if err := p.Sync(st.portals); err != nil {
				t.Fatalf("%s: Sync: %v", st.name, err)
			}
			if got := len(k.Transactions) - n; got != 1 {
				t.Errorf("%s: got %d transactions, want 1", st.name, got)
			}
			if got := writes(k, n); got != st.want {
				t.Errorf("%s:\ngot:\n%s\nwant:\n%s", st.name, got, st.want)
			}
			fresh, fk := newTestNFTables(t, c)
			if err := fresh.Sync(st.portals); err != nil {
				t.Fatal(err)
			}
			// The fake dumps elements in the order they were added.
			if got, want := sortedLines(k.Dump()), sortedLines(fk.Dump()); got != want {
				t.Errorf("%s: table:\n%s\nwant, as a whole write makes it:\n%s", st.name, got, want)
			}
		}
	})
}

// sortedLines returns the lines of s in sorted order.
func sortedLines(s string) string {
	lines := strings.SplitAfter(s, "\n")
	slices.Sort(lines)
	return strings.Join(lines, "")
}

// TestIPTablesFilterFlushRewrites: `iptables -F` flushes the filter table
// alone, taking the NO-ENDPOINTS rules and their jumps; the canary there makes
// the next sync write everything again, jumps included.
func TestIPTablesFilterFlushRewrites(t *testing.T) {
	t.Parallel()
	k := newFakeKernel()
	p := newTestIPTables(t, k, Config{})
	empty := port("ns", "empty", "", service.TCP, 80)
	empty.ClusterIPs = ips("10.96.0.12")
	portals := []Portal{{Port: empty, ProxyPort: 40000, Refuse: refuseAll}}
	for i := range 2 {
		if err := p.Sync(portals); err != nil {
			t.Fatalf("Sync %d: %v", i, err)
		}
	}
	before := k.state(v4)
	if p.Intact() != true {
		t.Fatal("Intact before the flush: got false, want true")
	}
	k.Flush(false, "filter")
	if p.Intact() {
		t.Error("Intact after iptables -F: got true, want false")
	}
	n := len(k.restores(v4))
	if err := p.Sync(portals); err != nil {
		t.Fatalf("Sync after the flush: %v", err)
	}
	if got := len(k.restores(v4)) - n; got != 1 {
		t.Errorf("restores after the flush: got %d, want 1", got)
	}
	if got := k.state(v4); got != before {
		t.Errorf("after the flush and a sync:\n%s\nwant as before:\n%s", got, before)
	}
}

// TestRefusedNodePortHonoursNodePortAddresses: a refused NodePort is refused
// where it would have been steered, on the node's addresses inside
// --nodeport-addresses only.
func TestRefusedNodePortHonoursNodePortAddresses(t *testing.T) {
	t.Parallel()
	np := freePort(t, "tcp4")
	NP := strconv.Itoa(np)
	portals := []Portal{{Port: webPort(np), ProxyPort: 40001, Refuse: refuseAll}}
	cfg := Config{IPv6: true, NodePortAddresses: []netip.Prefix{netip.MustParsePrefix("fd00::/64")}}

	t.Run("iptables", func(t *testing.T) {
		k := newFakeKernel()
		if err := newTestIPTables(t, k, cfg).Sync(portals); err != nil {
			t.Fatalf("Sync: %v", err)
		}
		want := `-A UPROXY-NO-ENDPOINTS -d fd00::/64 -p tcp -m comment --comment "shop/web:http has no endpoints" -m tcp --dport ` + NP + ` -m addrtype --dst-type LOCAL -j REJECT --reject-with tcp-reset` + "\n"
		if got := k.restores(v6)[0]; !strings.Contains(got, want) {
			t.Errorf("IPv6 restore input lacks\n%s\ngot:\n%s", want, got)
		}
		// IPv4 has no --nodeport-addresses prefix: no NodePort, refused or not.
		if got := k.restores(v4)[0]; strings.Contains(got, "--dport "+NP) {
			t.Errorf("IPv4 restore input has a rule for the NodePort:\n%s", got)
		}
	})

	t.Run("nftables", func(t *testing.T) {
		p, k := newTestNFTables(t, cfg)
		if err := p.Sync(portals); err != nil {
			t.Fatalf("Sync: %v", err)
		}
		got := writes(k, 0)
		for _, want := range []string{
			`add rule inet uproxy no-endpoints fib daddr type local ip6 daddr @nodeport-addresses6 meta nfproto ipv6 meta l4proto . th dport vmap @no-endpoint-nodeports6 comment "NodePorts without endpoints"`,
			`add element inet uproxy no-endpoint-nodeports6 { tcp . ` + NP + ` comment "shop/web:http" : goto refuse }`,
		} {
			if !strings.Contains(got, want+"\n") {
				t.Errorf("transaction lacks\n%s\ngot:\n%s", want, got)
			}
		}
		if strings.Contains(got, "no-endpoint-nodeports4") {
			t.Errorf("transaction has an IPv4 NodePort map, which no --nodeport-addresses prefix asks for:\n%s", got)
		}
	})
}
