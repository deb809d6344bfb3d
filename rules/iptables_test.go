package rules

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/hashicorp/go-multierror"
	"github.com/vishvananda/netlink"
	"sigs.k8s.io/knftables"

	"github.com/uproxy/uproxy/netfilter/conntrack/conntracktest"
	"github.com/uproxy/uproxy/netfilter/nftables"
	"github.com/uproxy/uproxy/netfilter/nftables/nftablestest"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/service/servicetest"
)

var (
	nodeIPv4 = netip.MustParseAddr("10.0.0.1")
	nodeIPv6 = netip.MustParseAddr("fd00::1")
)

// The builders of the rules' tests, by their short names here.
var (
	port = servicetest.Port
	ips  = servicetest.Addrs
)

// webPort is the TCP Service port most tests program: every kind of virtual
// IP, in both families (LoadBalancer IPv4 only), and a NodePort.
func webPort(nodePort int) *service.Port {
	web := port("shop", "web", "http", service.TCP, 80)
	web.ClusterIPs = ips("10.96.0.10", "fd00:96::10")
	web.ExternalIPs = ips("10.250.0.5", "fd00:250::5")
	web.LoadBalancerIPs = ips("10.251.0.7")
	web.NodePort = nodePort
	return web
}

// dnsPort is the UDP Service port most tests program.
func dnsPort(nodePort int, clusterIPs ...string) *service.Port {
	dns := port("kube-system", "dns", "dns", service.UDP, 53)
	dns.ClusterIPs = ips(clusterIPs...)
	dns.NodePort = nodePort
	return dns
}

// freePort returns a port nothing listens on for network right now, for NodePorts
// the tests hold for real.
func freePort(t *testing.T, network string) int {
	t.Helper()
	var addr net.Addr
	if strings.HasPrefix(network, "udp") {
		pc, err := net.ListenPacket(network, ":0")
		if err != nil {
			t.Fatal(err)
		}
		addr = pc.LocalAddr()
		pc.Close()
	} else {
		ln, err := net.Listen(network, ":0")
		if err != nil {
			t.Fatal(err)
		}
		addr = ln.Addr()
		ln.Close()
	}
	_, p, _ := net.SplitHostPort(addr.String())
	n, _ := strconv.Atoi(p)
	return n
}

// newTestPortals builds a backend's Portals with newPortals from cfg, the node
// IPs of both families filled in, and releases its NodePorts when t ends.
func newTestPortals[P interface{ release() }](t *testing.T, cfg Config, newPortals func(Config) (P, error)) P {
	t.Helper()
	if cfg.NodeIPs == nil {
		cfg.NodeIPs = []netip.Addr{nodeIPv4, nodeIPv6}
	}
	p, err := newPortals(cfg)
	if err != nil {
		t.Fatalf("new portals: %v", err)
	}
	t.Cleanup(p.release)
	return p
}

func (p *IPTables) release() { p.holder.close() }
func (p *NFTables) release() { p.holder.close() }

func newTestIPTables(t *testing.T, k *fakeKernel, cfg Config) *IPTables {
	t.Helper()
	k.configure(&cfg)
	return newTestPortals(t, cfg, NewIPTables)
}

const natHead = `*nat
:UPROXY-PORTALS-CONTAINER - [0:0]
:UPROXY-PORTALS-HOST - [0:0]
:UPROXY-NODEPORT-CONTAINER - [0:0]
:UPROXY-NODEPORT-HOST - [0:0]
:UPROXY-CANARY - [0:0]
-A UPROXY-CANARY -m comment --comment "uproxy canary: gone means the table was flushed" -j RETURN
`

// filterHead starts every filter table the portals write: the chains, and the
// canary, which tells a flush of the filter table (`iptables -F`) too.
const filterHead = `*filter
:UPROXY-NODEPORT-NON-LOCAL - [0:0]
:UPROXY-NO-ENDPOINTS - [0:0]
:UPROXY-CANARY - [0:0]
-A UPROXY-CANARY -m comment --comment "uproxy canary: gone means the table was flushed" -j RETURN
`

const filterEmpty = filterHead + "COMMIT\n"

func TestSyncWritesExactRestoreInput(t *testing.T) {
	t.Parallel()
	np := freePort(t, "tcp4")
	npUDP := freePort(t, "udp4")
	web := webPort(np)
	dns := dnsPort(npUDP, "10.96.0.53")
	sctp := port("shop", "sig", "", service.SCTP, 9)
	sctp.ClusterIPs = ips("10.96.0.9")
	v6only := port("shop", "six", "", service.TCP, 443)
	v6only.ClusterIPs = ips("fd00:96::443")

	NP, NPU := strconv.Itoa(np), strconv.Itoa(npUDP)
	span := strconv.Itoa(min(np, npUDP)) + ":" + strconv.Itoa(max(np, npUDP))
	tests := []struct {
		name    string
		cfg     Config
		portals []Portal
		want    [2]string // restore input per family, "" = none written
		wantErr []string  // substrings, one per error
	}{
		{
			name:    "ClusterIP ExternalIP LoadBalancer NodePort, TCP and UDP, IPv4 only",
			portals: []Portal{{Port: web, ProxyPort: 40001}, {Port: dns, ProxyPort: 40002}},
			want: [2]string{filterHead + `-A UPROXY-NODEPORT-NON-LOCAL -m conntrack ! --ctstate DNAT -m comment --comment "uproxy NodePorts: not redirected" -j RETURN
-A UPROXY-NODEPORT-NON-LOCAL -m conntrack ! --ctorigdstport ` + span + ` -m comment --comment "uproxy NodePorts: not to a NodePort" -j RETURN
-A UPROXY-NODEPORT-NON-LOCAL -p udp -m comment --comment "kube-system/dns:dns" -m udp --dport 40002 -m conntrack --ctstate DNAT --ctorigdstport ` + NPU + ` -j ACCEPT
-A UPROXY-NODEPORT-NON-LOCAL -p tcp -m comment --comment "shop/web:http" -m tcp --dport 40001 -m conntrack --ctstate DNAT --ctorigdstport ` + NP + ` -j ACCEPT
COMMIT
` + natHead + `-A UPROXY-PORTALS-CONTAINER -d 10.96.0.53/32 -p udp -m comment --comment "kube-system/dns:dns" -m udp --dport 53 -j REDIRECT --to-ports 40002
-A UPROXY-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "shop/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 40001
-A UPROXY-PORTALS-CONTAINER -d 10.251.0.7/32 -p tcp -m comment --comment "shop/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 40001
-A UPROXY-PORTALS-CONTAINER -d 10.250.0.5/32 -p tcp -m comment --comment "shop/web:http" -m tcp --dport 80 -m addrtype ! --src-type LOCAL -j REDIRECT --to-ports 40001
-A UPROXY-PORTALS-HOST -d 10.96.0.53/32 -p udp -m comment --comment "kube-system/dns:dns" -m udp --dport 53 -j DNAT --to-destination 10.0.0.1:40002
-A UPROXY-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "shop/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.1:40001
-A UPROXY-PORTALS-HOST -d 10.251.0.7/32 -p tcp -m comment --comment "shop/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.1:40001
-A UPROXY-PORTALS-HOST -d 10.250.0.5/32 -p tcp -m comment --comment "shop/web:http" -m tcp --dport 80 -m addrtype --dst-type LOCAL -j DNAT --to-destination 10.0.0.1:40001
-A UPROXY-NODEPORT-CONTAINER -p udp -m comment --comment "kube-system/dns:dns" -m udp --dport ` + NPU + ` -j REDIRECT --to-ports 40002
-A UPROXY-NODEPORT-CONTAINER -p tcp -m comment --comment "shop/web:http" -m tcp --dport ` + NP + ` -j REDIRECT --to-ports 40001
-A UPROXY-NODEPORT-HOST -p udp -m comment --comment "kube-system/dns:dns" -m udp --dport ` + NPU + ` -j DNAT --to-destination 10.0.0.1:40002
-A UPROXY-NODEPORT-HOST -p tcp -m comment --comment "shop/web:http" -m tcp --dport ` + NP + ` -j DNAT --to-destination 10.0.0.1:40001
COMMIT
`},
		},
		{
			name:    "IPv6 rules go to ip6tables, NodePortAddresses narrow NodePorts, other prefix",
			cfg:     Config{IPv6: true, ChainPrefix: "UP6", NodePortAddresses: []netip.Prefix{netip.MustParsePrefix("fd00::/64")}},
			portals: []Portal{{Port: web, ProxyPort: 40001}, {Port: v6only, ProxyPort: 40003}},
			want: [2]string{strings.ReplaceAll(filterHead+`COMMIT
`+natHead+`-A UPROXY-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "shop/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 40001
-A UPROXY-PORTALS-CONTAINER -d 10.251.0.7/32 -p tcp -m comment --comment "shop/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 40001
-A UPROXY-PORTALS-CONTAINER -d 10.250.0.5/32 -p tcp -m comment --comment "shop/web:http" -m tcp --dport 80 -m addrtype ! --src-type LOCAL -j REDIRECT --to-ports 40001
-A UPROXY-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "shop/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.1:40001
-A UPROXY-PORTALS-HOST -d 10.251.0.7/32 -p tcp -m comment --comment "shop/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.1:40001
-A UPROXY-PORTALS-HOST -d 10.250.0.5/32 -p tcp -m comment --comment "shop/web:http" -m tcp --dport 80 -m addrtype --dst-type LOCAL -j DNAT --to-destination 10.0.0.1:40001
COMMIT
`, "UPROXY-", "UP6-"), strings.ReplaceAll(filterHead+`-A UPROXY-NODEPORT-NON-LOCAL -m conntrack ! --ctstate DNAT -m comment --comment "uproxy NodePorts: not redirected" -j RETURN
-A UPROXY-NODEPORT-NON-LOCAL -m conntrack ! --ctorigdstport `+NP+` -m comment --comment "uproxy NodePorts: not to a NodePort" -j RETURN
-A UPROXY-NODEPORT-NON-LOCAL -p tcp -m comment --comment "shop/web:http" -m tcp --dport 40001 -m conntrack --ctstate DNAT --ctorigdstport `+NP+` -j ACCEPT
COMMIT
`+natHead+`-A UPROXY-PORTALS-CONTAINER -d fd00:96::443/128 -p tcp -m comment --comment "shop/six" -m tcp --dport 443 -j REDIRECT --to-ports 40003
-A UPROXY-PORTALS-CONTAINER -d fd00:96::10/128 -p tcp -m comment --comment "shop/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 40001
-A UPROXY-PORTALS-CONTAINER -d fd00:250::5/128 -p tcp -m comment --comment "shop/web:http" -m tcp --dport 80 -m addrtype ! --src-type LOCAL -j REDIRECT --to-ports 40001
-A UPROXY-PORTALS-HOST -d fd00:96::443/128 -p tcp -m comment --comment "shop/six" -m tcp --dport 443 -j DNAT --to-destination [fd00::1]:40003
-A UPROXY-PORTALS-HOST -d fd00:96::10/128 -p tcp -m comment --comment "shop/web:http" -m tcp --dport 80 -j DNAT --to-destination [fd00::1]:40001
-A UPROXY-PORTALS-HOST -d fd00:250::5/128 -p tcp -m comment --comment "shop/web:http" -m tcp --dport 80 -m addrtype --dst-type LOCAL -j DNAT --to-destination [fd00::1]:40001
-A UPROXY-NODEPORT-CONTAINER -d fd00::/64 -p tcp -m comment --comment "shop/web:http" -m tcp --dport `+NP+` -j REDIRECT --to-ports 40001
-A UPROXY-NODEPORT-HOST -d fd00::/64 -p tcp -m comment --comment "shop/web:http" -m tcp --dport `+NP+` -j DNAT --to-destination [fd00::1]:40001
COMMIT
`, "UPROXY-", "UP6-")},
		},
		{
			name:    "SCTP is skipped with an error, IPv6-only Service ignored without IPv6",
			portals: []Portal{{Port: sctp, ProxyPort: 40004}, {Port: v6only, ProxyPort: 40003}},
			want:    [2]string{filterEmpty + natHead + "COMMIT\n"},
			wantErr: []string{"portal shop/sig port 9/SCTP: protocol not supported by the userspace mode"},
		},
		{
			name:    "invalid proxy port",
			portals: []Portal{{Port: dns, ProxyPort: 0}},
			want:    [2]string{filterEmpty + natHead + "COMMIT\n"},
			wantErr: []string{"portal kube-system/dns:dns port 53/UDP: invalid proxy port 0"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			k := newFakeKernel()
			p := newTestIPTables(t, k, tt.cfg)
			err := p.Sync(tt.portals)
			var got []string
			if me, ok := err.(*multierror.Error); ok {
				for _, e := range me.Errors {
					got = append(got, e.Error())
				}
			} else if err != nil {
				t.Fatalf("Sync: got %T %v, want nil or *multierror.Error", err, err)
			}
			if strings.Join(got, "\n") != strings.Join(tt.wantErr, "\n") {
				t.Errorf("errors: got %q, want %q", got, tt.wantErr)
			}
			for f := v4; f <= v6; f++ {
				var gotText string
				if n := len(k.restores(f)); n > 1 {
					t.Fatalf("%s: got %d restores, want at most 1", familyName(f), n)
				} else if n == 1 {
					gotText = k.restores(f)[0]
				}
				if gotText != tt.want[f] {
					t.Errorf("%s restore input:\ngot:\n%s\nwant:\n%s", familyName(f), gotText, tt.want[f])
				}
			}
		})
	}
}

func TestSyncUnchangedWritesNothing(t *testing.T) {
	t.Parallel()
	k := newFakeKernel()
	p := newTestIPTables(t, k, Config{IPv6: true})
	svc := port("a", "b", "c", service.TCP, 80)
	svc.ClusterIPs = ips("10.96.0.1", "fd00:96::1")
	for i := range 3 {
		if err := p.Sync([]Portal{{Port: svc, ProxyPort: 40000}}); err != nil {
			t.Fatalf("Sync %d: %v", i, err)
		}
	}
	for f := v4; f <= v6; f++ {
		if got := len(k.restores(f)); got != 1 {
			t.Errorf("%s restores after 3 identical syncs: got %d, want 1", familyName(f), got)
		}
		if got := len(k.ops(f)); got != 8 {
			t.Errorf("%s jump inserts: got %d (%q), want 8", familyName(f), got, k.ops(f))
		}
		// One canary read per table (nat, filter) per sync after the first.
		if got := k.lists(f); got != 4 {
			t.Errorf("%s canary reads: got %d, want 4", familyName(f), got)
		}
	}
}

// TestSyncAfterQuietSyncSeesEveryChange: once a sync found nothing to do, a change
// of any portal input is still written, exactly as a fresh IPTables writes it.
func TestSyncAfterQuietSyncSeesEveryChange(t *testing.T) {
	t.Parallel()
	base := func() *service.Port {
		p := port("ns", "svc", "p", service.TCP, 80)
		p.ClusterIPs = ips("10.96.0.1")
		p.ExternalIPs = ips("10.250.0.1")
		p.LoadBalancerIPs = ips("192.0.2.1")
		return p
	}
	tests := []struct {
		name      string
		change    func(*testing.T, *service.Port)
		proxyPort int
	}{
		{"proxy port", func(*testing.T, *service.Port) {}, 40002},
		{"port", func(_ *testing.T, p *service.Port) { p.Port = 81 }, 40001},
		{"protocol", func(_ *testing.T, p *service.Port) { p.Protocol = service.UDP }, 40001},
		{"ClusterIP", func(_ *testing.T, p *service.Port) { p.ClusterIPs = ips("10.96.0.2") }, 40001},
		{"ExternalIP added", func(_ *testing.T, p *service.Port) { p.ExternalIPs = ips("10.250.0.1", "10.250.0.2") }, 40001},
		{"LoadBalancer IP", func(_ *testing.T, p *service.Port) { p.LoadBalancerIPs = ips("192.0.2.2") }, 40001},
		{"mapped ClusterIP", func(_ *testing.T, p *service.Port) { p.ClusterIPs = ips("::ffff:10.96.0.3") }, 40001},
		{"NodePort", func(t *testing.T, p *service.Port) { p.NodePort = freePort(t, "tcp4") }, 40001},
		{"name", func(_ *testing.T, p *service.Port) { p.Name.Port = "q" }, 40001},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			k := newFakeKernel()
			p := newTestIPTables(t, k, Config{})
			for range 2 {
				if err := p.Sync([]Portal{{Port: base(), ProxyPort: 40001}}); err != nil {
					t.Fatalf("Sync: %v", err)
				}
			}
			changed := base()
			tt.change(t, changed)
			if err := p.Sync([]Portal{{Port: changed, ProxyPort: tt.proxyPort}}); err != nil {
				t.Fatalf("Sync after change: %v", err)
			}
			p.holder.close() // frees the NodePort for the fresh IPTables
			fresh := newFakeKernel()
			if err := newTestIPTables(t, fresh, Config{}).Sync([]Portal{{Port: changed, ProxyPort: tt.proxyPort}}); err != nil {
				t.Fatalf("fresh Sync: %v", err)
			}
			if got := len(k.restores(v4)); got != 2 {
				t.Fatalf("restores: got %d, want 2", got)
			}
			if got, want := k.state(v4), fresh.state(v4); got != want {
				t.Errorf("rules after the change:\ngot:\n%s\nwant, as a fresh write:\n%s\nwritten:\n%s", got, want, k.restores(v4)[1])
			}
		})
	}
}

// The jumps go in around what other programs keep in the built-in chains:
// PORTALS first, so Service IPs win; NODEPORT last, as they match every local
// destination; the INPUT accept and the NO-ENDPOINTS rejects first, before a
// firewall's final DROP.
func TestJumpRulesPlacement(t *testing.T) {
	t.Parallel()
	k := newFakeKernel()
	kube := "*nat\n:KUBE-SERVICES - [0:0]\n-A PREROUTING -j KUBE-SERVICES\n-A OUTPUT -j KUBE-SERVICES\nCOMMIT\n" +
		"*filter\n-A INPUT -j DROP\n-A FORWARD -j DROP\nCOMMIT\n"
	if err := k.Apply(false, kube); err != nil {
		t.Fatal(err)
	}
	p := newTestIPTables(t, k, Config{ChainPrefix: "UPX"})
	for range 2 { // the second sync finds every jump in place
		if err := p.Sync(nil); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []struct {
		table, chain string
		want         []string
	}{
		{"nat", "PREROUTING", []string{
			`-A PREROUTING -m comment --comment "uproxy service portals" -j UPX-PORTALS-CONTAINER`,
			`-A PREROUTING -j KUBE-SERVICES`,
			`-A PREROUTING -m addrtype --dst-type LOCAL -m comment --comment "uproxy NodePorts" -j UPX-NODEPORT-CONTAINER`,
		}},
		{"nat", "OUTPUT", []string{
			`-A OUTPUT -m comment --comment "uproxy service portals" -j UPX-PORTALS-HOST`,
			`-A OUTPUT -j KUBE-SERVICES`,
			`-A OUTPUT -m addrtype --dst-type LOCAL -m comment --comment "uproxy NodePorts" -j UPX-NODEPORT-HOST`,
		}},
		{"filter", "INPUT", []string{
			`-A INPUT -m comment --comment "uproxy NodePorts" -j UPX-NODEPORT-NON-LOCAL`,
			`-A INPUT -m conntrack --ctstate NEW -m comment --comment "uproxy Services without endpoints" -j UPX-NO-ENDPOINTS`,
			`-A INPUT -j DROP`,
		}},
		{"filter", "FORWARD", []string{
			`-A FORWARD -m conntrack --ctstate NEW -m comment --comment "uproxy Services without endpoints" -j UPX-NO-ENDPOINTS`,
			`-A FORWARD -j DROP`,
		}},
		{"filter", "OUTPUT", []string{
			`-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "uproxy Services without endpoints" -j UPX-NO-ENDPOINTS`,
		}},
	} {
		if got := k.rules(v4, c.table, c.chain); strings.Join(got, "\n") != strings.Join(c.want, "\n") {
			t.Errorf("%s %s:\ngot  %q\nwant %q", c.table, c.chain, got, c.want)
		}
	}
	if len(k.ops(v6)) != 0 || len(k.restores(v6)) != 0 {
		t.Errorf("IPv6 touched without Config.IPv6: ops %q, restores %d", k.ops(v6), len(k.restores(v6)))
	}
}

func TestCanaryLossForcesRewrite(t *testing.T) {
	t.Parallel()
	k := newFakeKernel()
	p := newTestIPTables(t, k, Config{})
	svc := port("a", "b", "", service.UDP, 53)
	svc.ClusterIPs = ips("10.96.0.53")
	sync := func() {
		t.Helper()
		if err := p.Sync([]Portal{{Port: svc, ProxyPort: 40000}}); err != nil {
			t.Fatalf("Sync: %v", err)
		}
	}
	sync()
	k.flush(v4) // someone runs iptables -t nat -F: canary and nat jumps gone, filter jump kept
	sync()
	if got := len(k.restores(v4)); got != 2 {
		t.Fatalf("restores: got %d, want 2 (rewrite after the flush)", got)
	}
	if k.restores(v4)[1] != k.restores(v4)[0] {
		t.Errorf("rewrite differs from the first write:\ngot:\n%s\nwant:\n%s", k.restores(v4)[1], k.restores(v4)[0])
	}
	// 8 jumps first, then only the 4 nat ones that the flush removed.
	if got := len(k.ops(v4)); got != 12 {
		t.Errorf("jump inserts: got %d (%q), want 12", got, k.ops(v4))
	}
	sync()
	if got := len(k.restores(v4)); got != 2 {
		t.Errorf("restores after a quiet sync: got %d, want 2", got)
	}
}

func TestRemovedServiceVanishes(t *testing.T) {
	t.Parallel()
	k := newFakeKernel()
	p := newTestIPTables(t, k, Config{})
	a := port("ns", "a", "", service.TCP, 80)
	a.ClusterIPs = ips("10.96.0.1")
	b := port("ns", "b", "", service.TCP, 80)
	b.ClusterIPs = ips("10.96.0.2")
	b.ExternalIPs = ips("10.250.0.2")
	if err := p.Sync([]Portal{{Port: a, ProxyPort: 40001}, {Port: b, ProxyPort: 40002}}); err != nil {
		t.Fatal(err)
	}
	if err := p.Sync([]Portal{{Port: a, ProxyPort: 40001}}); err != nil {
		t.Fatal(err)
	}
	if len(k.restores(v4)) != 2 {
		t.Fatalf("restores: got %d, want 2", len(k.restores(v4)))
	}
	if !strings.Contains(k.restores(v4)[0], `"ns/b"`) {
		t.Fatalf("first write lacks ns/b:\n%s", k.restores(v4)[0])
	}
	// ns/b's rules are deleted in place, ns/a's stay.
	want := `*nat
-D UPROXY-PORTALS-CONTAINER -d 10.250.0.2/32 -p tcp -m comment --comment "ns/b" -m tcp --dport 80 -m addrtype ! --src-type LOCAL -j REDIRECT --to-ports 40002
-D UPROXY-PORTALS-CONTAINER -d 10.96.0.2/32 -p tcp -m comment --comment "ns/b" -m tcp --dport 80 -j REDIRECT --to-ports 40002
-D UPROXY-PORTALS-HOST -d 10.250.0.2/32 -p tcp -m comment --comment "ns/b" -m tcp --dport 80 -m addrtype --dst-type LOCAL -j DNAT --to-destination 10.0.0.1:40002
-D UPROXY-PORTALS-HOST -d 10.96.0.2/32 -p tcp -m comment --comment "ns/b" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.1:40002
COMMIT
`
	if got := k.restores(v4)[1]; got != want {
		t.Errorf("second write:\ngot:\n%s\nwant:\n%s", got, want)
	}
	for _, chain := range []string{"UPROXY-PORTALS-CONTAINER", "UPROXY-PORTALS-HOST"} {
		if got := k.rules(v4, "nat", chain); len(got) != 1 || !strings.Contains(got[0], `"ns/a"`) {
			t.Errorf("%s after ns/b went: got %q, want ns/a's rule alone", chain, got)
		}
	}
}

func TestRestoreFailureRetriedNextSync(t *testing.T) {
	t.Parallel()
	k := newFakeKernel()
	p := newTestIPTables(t, k, Config{})
	k.FailNextRestore(false, errors.New("iptables-restore: line 3 failed"))
	err := p.Sync(nil)
	if err == nil || !strings.Contains(err.Error(), "write IPv4 portals: iptables-restore: line 3 failed") {
		t.Fatalf("Sync: got %v, want the restore failure", err)
	}
	if len(k.ops(v4)) != 0 {
		t.Errorf("jumps added although the chains were not written: %q", k.ops(v4))
	}
	if err := p.Sync(nil); err != nil {
		t.Fatalf("second Sync: %v", err)
	}
	if got := len(k.restores(v4)); got != 1 {
		t.Errorf("restores: got %d, want 1 (the retry)", got)
	}
	if got := len(k.ops(v4)); got != 8 {
		t.Errorf("jumps after retry: got %d, want 8", got)
	}
}

func TestNodePortHeldAndConflict(t *testing.T) {
	t.Parallel()
	squatter, err := net.Listen("tcp4", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	taken := squatter.Addr().(*net.TCPAddr).Port
	free := freePort(t, "tcp4")

	k := newFakeKernel()
	p := newTestIPTables(t, k, Config{})
	clash := port("ns", "clash", "", service.TCP, 80)
	clash.ClusterIPs = ips("10.96.0.1")
	clash.NodePort = taken
	ok := port("ns", "ok", "", service.TCP, 80)
	ok.ClusterIPs = ips("10.96.0.2")
	ok.NodePort = free
	twin := port("ns", "twin", "", service.TCP, 81)
	twin.ClusterIPs = ips("10.96.0.3")
	twin.NodePort = free
	portals := []Portal{{Port: clash, ProxyPort: 40001}, {Port: ok, ProxyPort: 40002}, {Port: twin, ProxyPort: 40003}}

	err = p.Sync(portals)
	var perrs []*PortalError
	if me, isMulti := err.(*multierror.Error); isMulti {
		for _, e := range me.Errors {
			var pe *PortalError
			if !errors.As(e, &pe) {
				t.Errorf("error %v: got %T, want *PortalError", e, e)
				continue
			}
			perrs = append(perrs, pe)
		}
	}
	if len(perrs) != 2 {
		t.Fatalf("Sync: got %v, want 2 PortalErrors", err)
	}
	if perrs[0].Service.Name != "twin" || perrs[0].Port != free || !strings.Contains(perrs[0].Error(), "NodePort already used by ns/ok") {
		t.Errorf("first error: got %v, want ns/twin port %d already used by ns/ok", perrs[0], free)
	}
	if perrs[1].Service.Name != "clash" || perrs[1].Port != taken || !strings.Contains(perrs[1].Error(), "address already in use") {
		t.Errorf("second error: got %v, want ns/clash port %d address already in use", perrs[1], taken)
	}
	text := k.restores(v4)[0]
	for _, want := range []string{`-d 10.96.0.1/32`, `-d 10.96.0.3/32`, `--dport ` + strconv.Itoa(free) + ` -j REDIRECT --to-ports 40002`} {
		if !strings.Contains(text, want) {
			t.Errorf("restore input lacks %q:\n%s", want, text)
		}
	}
	for _, absent := range []string{`--dport ` + strconv.Itoa(taken), `-m tcp --dport ` + strconv.Itoa(free) + ` -j REDIRECT --to-ports 40003`} {
		if strings.Contains(text, absent) {
			t.Errorf("restore input has %q, want none:\n%s", absent, text)
		}
	}
	// The held NodePort is really taken.
	if ln, err := net.Listen("tcp4", "0.0.0.0:"+strconv.Itoa(free)); err == nil {
		ln.Close()
		t.Errorf("listen on held NodePort %d: got success, want address in use", free)
	}

	// Once the squatter goes, the next Sync takes the port and programs it.
	squatter.Close()
	if err := p.Sync(portals[:2]); err != nil {
		t.Fatalf("Sync after the squatter left: %v", err)
	}
	if text := k.restores(v4)[1]; !strings.Contains(text, "--dport "+strconv.Itoa(taken)+" -j REDIRECT --to-ports 40001") {
		t.Errorf("NodePort %d not programmed after it was freed:\n%s", taken, text)
	}
	// Removing the Services releases their NodePorts.
	if err := p.Sync(nil); err != nil {
		t.Fatal(err)
	}
	for _, np := range []int{taken, free} {
		ln, err := net.Listen("tcp4", "0.0.0.0:"+strconv.Itoa(np))
		if err != nil {
			t.Errorf("listen on released NodePort %d: %v", np, err)
			continue
		}
		ln.Close()
	}
}

func flow(dst string, dport, replySport uint16) *netlink.ConntrackFlow {
	f := &netlink.ConntrackFlow{}
	f.Forward.Protocol = 17
	f.Forward.DstIP = net.ParseIP(dst)
	f.Forward.DstPort = dport
	f.Reverse.SrcPort = replySport
	return f
}

// TestStaleUDPFlows: both backends delete the flows a change left going the
// wrong way, and only after a change of UDP portals.
func TestStaleUDPFlows(t *testing.T) {
	t.Parallel()
	backends := []struct {
		name  string
		build func(t *testing.T, ct *conntracktest.Recorder) Portals
	}{
		{"iptables", func(t *testing.T, ct *conntracktest.Recorder) Portals {
			k := newFakeKernel()
			p := newTestIPTables(t, k, Config{})
			p.cfg.Conntrack = ct
			return p
		}},
		{"nftables", func(t *testing.T, ct *conntracktest.Recorder) Portals {
			p, _ := newTestNFTables(t, Config{Conntrack: ct})
			return p
		}},
	}
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			ct := &conntracktest.Recorder{}
			testStaleUDPFlows(t, b.build(t, ct), ct)
		})
	}
}

func testStaleUDPFlows(t *testing.T, p Portals, ct *conntracktest.Recorder) {
	np := freePort(t, "udp4")
	dns := port("ns", "dns", "", service.UDP, 53)
	dns.ClusterIPs = ips("10.96.0.53")
	dns.NodePort = np
	web := port("ns", "web", "", service.TCP, 80)
	web.ClusterIPs = ips("10.96.0.80")

	steps := []struct {
		name    string
		portals []Portal
		// matches maps a flow to whether it must be deleted; nil = no deletion pass.
		matches map[*netlink.ConntrackFlow]bool
	}{
		{"first sync checks every UDP destination", []Portal{{Port: dns, ProxyPort: 40001}, {Port: web, ProxyPort: 40002}}, map[*netlink.ConntrackFlow]bool{
			flow("10.96.0.53", 53, 40001):         false, // already on the right proxy port
			flow("10.96.0.53", 53, 39999):         true,  // a previous run's proxy port
			flow("10.96.0.53", 53, 53):            true,  // predates the portal
			flow("192.168.1.1", uint16(np), 1234): true,  // NodePort, not redirected here
			flow("10.96.0.80", 80, 80):            false, // TCP Service: not watched
			flow("10.96.0.54", 53, 53):            false,
		}},
		{"unchanged: no pass", []Portal{{Port: dns, ProxyPort: 40001}, {Port: web, ProxyPort: 40002}}, nil},
		{"proxy port changed", []Portal{{Port: dns, ProxyPort: 40005}, {Port: web, ProxyPort: 40002}}, map[*netlink.ConntrackFlow]bool{
			flow("10.96.0.53", 53, 40001):       true,
			flow("10.96.0.53", 53, 40005):       false,
			flow("10.0.0.1", uint16(np), 40001): true,
		}},
		{"TCP change: no pass", []Portal{{Port: dns, ProxyPort: 40005}, {Port: web, ProxyPort: 40009}}, nil},
		// A client that kept sending while the last endpoint went: its next
		// datagram must meet the REJECT, not a proxy with nothing to dial.
		{"no endpoints: refused, every flow deleted", []Portal{{Port: dns, ProxyPort: 40005, Refuse: refuseAll}, {Port: web, ProxyPort: 40009}}, map[*netlink.ConntrackFlow]bool{
			flow("10.96.0.53", 53, 40005):       true,
			flow("10.0.0.1", uint16(np), 40005): true,
		}},
		{"an endpoint again: steered", []Portal{{Port: dns, ProxyPort: 40005}, {Port: web, ProxyPort: 40009}}, map[*netlink.ConntrackFlow]bool{
			flow("10.96.0.53", 53, 40005): false,
			flow("10.96.0.53", 53, 53):    true,
		}},
		{"removed", nil, map[*netlink.ConntrackFlow]bool{
			flow("10.96.0.53", 53, 40005):       true,
			flow("10.0.0.1", uint16(np), 40005): true,
		}},
	}
	for i, st := range steps {
		if err := p.Sync(st.portals); err != nil {
			t.Fatalf("%s: Sync: %v", st.name, err)
		}
		got := ct.Filters[v4]
		ct.Filters[v4] = nil
		if st.matches == nil {
			if len(got) != 0 {
				t.Errorf("step %d %s: got %d conntrack passes, want none", i, st.name, len(got))
			}
			continue
		}
		if len(got) != 1 {
			t.Fatalf("step %d %s: got %d conntrack passes, want 1", i, st.name, len(got))
		}
		for f, want := range st.matches {
			if m := got[0].MatchConntrackFlow(f); m != want {
				t.Errorf("step %d %s: flow to %s:%d reply from :%d: got match %v, want %v", i, st.name, f.Forward.DstIP, f.Forward.DstPort, f.Reverse.SrcPort, m, want)
			}
		}
	}
}

func TestCleanupRemovesOnlyWhatExists(t *testing.T) {
	t.Parallel()
	natWithOurs := `# Generated by iptables-save
*nat
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [3:180]
:KUBE-SERVICES - [0:0]
:UPROXY-PORTALS-CONTAINER - [0:0]
:UPROXY-CANARY - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A PREROUTING -m comment --comment "uproxy service portals" -j UPROXY-PORTALS-CONTAINER
-A UPROXY-PORTALS-CONTAINER -d 10.96.0.1/32 -p tcp -m comment --comment "a/b" -m tcp --dport 80 -j REDIRECT --to-ports 4000
-A UPROXY-CANARY -m comment --comment "uproxy canary: gone means the table was flushed" -j RETURN
COMMIT
*filter
:INPUT ACCEPT [0:0]
:KUBE-FIREWALL - [0:0]
-A INPUT -j KUBE-FIREWALL
COMMIT
`
	tests := []struct {
		name    string
		saved   [2]string
		saveErr [2]error
		want    [2]string
	}{
		{"nothing installed", [2]string{"*nat\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n", ""}, [2]error{}, [2]string{}},
		{"ip6tables missing", [2]string{}, [2]error{nil, fmt.Errorf("ip6tables-save: %w", exec.ErrNotFound)}, [2]string{}},
		{"partly installed", [2]string{natWithOurs, ""}, [2]error{}, [2]string{`*nat
:UPROXY-CANARY - [0:0]
:UPROXY-PORTALS-CONTAINER - [0:0]
-D PREROUTING -m comment --comment "uproxy service portals" -j UPROXY-PORTALS-CONTAINER
-X UPROXY-CANARY
-X UPROXY-PORTALS-CONTAINER
COMMIT
`}},
		{"jump left behind, chain in filter", [2]string{"", "*filter\n:INPUT ACCEPT [0:0]\n:UPROXY-NODEPORT-NON-LOCAL - [0:0]\n-A INPUT -m comment --comment \"uproxy NodePorts\" -j UPROXY-NODEPORT-NON-LOCAL\n-A INPUT -m comment --comment \"uproxy NodePorts\" -j UPROXY-NODEPORT-NON-LOCAL\nCOMMIT\n"}, [2]error{}, [2]string{"", `*filter
:UPROXY-NODEPORT-NON-LOCAL - [0:0]
-D INPUT -m comment --comment "uproxy NodePorts" -j UPROXY-NODEPORT-NON-LOCAL
-D INPUT -m comment --comment "uproxy NodePorts" -j UPROXY-NODEPORT-NON-LOCAL
-X UPROXY-NODEPORT-NON-LOCAL
COMMIT
`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			k := newFakeKernel()
			for f := v4; f <= v6; f++ {
				if err := k.Apply(f == v6, tt.saved[f]); err != nil {
					t.Fatal(err)
				}
				k.FailSave(f == v6, tt.saveErr[f])
			}
			p := newTestIPTables(t, k, Config{})
			if err := p.Cleanup(); err != nil {
				t.Fatalf("Cleanup: %v", err)
			}
			for f := v4; f <= v6; f++ {
				got := strings.Join(k.restores(f), "")
				if got != tt.want[f] {
					t.Errorf("%s restore:\ngot:\n%s\nwant:\n%s", familyName(f), got, tt.want[f])
				}
				if tt.saveErr[f] != nil {
					continue
				}
				// What is left is what others had: kube-proxy's chains and jumps.
				for _, tb := range k.State(f == v6).Tables {
					for _, c := range tb.Chains {
						if strings.HasPrefix(c.Name, "UPROXY-") {
							t.Errorf("%s: chain %s/%s left behind", familyName(f), tb.Name, c.Name)
						}
						for _, r := range c.Rules {
							if strings.Contains(r.Spec, "UPROXY-") {
								t.Errorf("%s: rule %q left behind", familyName(f), r.Text)
							}
						}
					}
				}
			}
			if tt.name == "partly installed" {
				want := []string{`-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES`}
				if got := k.rules(v4, "nat", "PREROUTING"); !slices.Equal(got, want) {
					t.Errorf("PREROUTING after Cleanup: got %q, want kube-proxy's jump alone %q", got, want)
				}
			}
		})
	}
}

func TestCleanupReportsSaveFailure(t *testing.T) {
	t.Parallel()
	k := newFakeKernel()
	k.FailSave(false, errors.New("iptables-save: permission denied"))
	p := newTestIPTables(t, k, Config{})
	if err := p.Cleanup(); err == nil || !strings.Contains(err.Error(), "read rules for cleanup: iptables-save: permission denied") {
		t.Errorf("Cleanup: got %v, want the save failure", err)
	}
}

// TestConfigValidation: both backends refuse a Config they cannot program,
// saying why; nftables also refuses a prefix it cannot name its table after.
func TestConfigValidation(t *testing.T) {
	t.Parallel()
	build := map[string]func(Config) error{
		"iptables": func(cfg Config) error {
			newFakeKernel().configure(&cfg)
			_, err := NewIPTables(cfg)
			return err
		},
		"nftables": func(cfg Config) error {
			cfg.NFTables = nftablestest.New(nftables.Table{Family: knftables.InetFamily, Name: "uproxy"})
			_, err := NewNFTables(cfg)
			return err
		},
	}
	tests := []struct {
		name     string
		backends []string
		cfg      Config
		want     string
	}{
		{"no IPv4 node IP", []string{"iptables", "nftables"}, Config{NodeIPs: ips("fd00::1")}, "no IPv4 node IP"},
		{"loopback is no node IP", []string{"iptables", "nftables"}, Config{NodeIPs: ips("127.0.0.1")}, "no IPv4 node IP"},
		{"no IPv6 node IP", []string{"iptables", "nftables"}, Config{NodeIPs: ips("10.0.0.1"), IPv6: true}, "no IPv6 node IP"},
		{"prefix too long", []string{"iptables", "nftables"}, Config{NodeIPs: ips("10.0.0.1"), ChainPrefix: "VERYLONGPREFIX"}, `chain prefix "VERYLONGPREFIX"`},
		{"prefix with space", []string{"iptables", "nftables"}, Config{NodeIPs: ips("10.0.0.1"), ChainPrefix: "A B"}, `chain prefix "A B"`},
		{"prefix nft cannot name a table after", []string{"nftables"}, Config{NodeIPs: ips("10.0.0.1"), ChainPrefix: "9UP"}, `nftables table name "9up"`},
		{"kube-proxy's", []string{"nftables"}, Config{NodeIPs: ips("10.0.0.1"), ChainPrefix: "KUBE-P"}, "kube* tables belong to kube-proxy"},
	}
	for _, tt := range tests {
		for _, b := range tt.backends {
			t.Run(b+"/"+tt.name, func(t *testing.T) {
				if err := build[b](tt.cfg); err == nil || !strings.Contains(err.Error(), tt.want) {
					t.Errorf("new %s portals: got %v, want an error containing %q", b, err, tt.want)
				}
			})
		}
	}
}

func TestNoneDoesNothing(t *testing.T) {
	t.Parallel()
	var p Portals = None{}
	if err := p.Sync([]Portal{{Port: port("a", "b", "", service.TCP, 80), ProxyPort: 1}}); err != nil {
		t.Errorf("Sync: got %v, want nil", err)
	}
	if err := p.Cleanup(); err != nil {
		t.Errorf("Cleanup: got %v, want nil", err)
	}
}

// TestPortalsEditedInPlace: portals that come and go are deleted and appended
// in place, after each chain's fixed rules; what else changes, or more than
// maxPortalDeletes rules going, rewrites the chains. Either way the kernel
// holds what a fresh write holds.
func TestPortalsEditedInPlace(t *testing.T) {
	t.Parallel()
	k := newFakeKernel()
	// The NodePort is held by a stand-in, so the fresh writes below can hold it too.
	cfg := Config{DialMark: testDialMark, Listen: func(string, string) (io.Closer, error) { return io.NopCloser(nil), nil }}
	p := newTestIPTables(t, k, cfg)
	portals := func(n int, nodePort int) []Portal {
		var out []Portal
		for i := range n {
			sp := port("ns", "svc-"+strconv.Itoa(i), "", service.TCP, 80)
			sp.ClusterIPs = ips(fmt.Sprintf("10.96.%d.%d", i>>8, i&0xff))
			if i == 0 {
				sp.NodePort = nodePort
			}
			out = append(out, Portal{Port: sp, ProxyPort: 40000 + i})
		}
		return out
	}
	np := 30080
	for _, st := range []struct {
		name    string
		portals []Portal
		inPlace bool
	}{
		{"first", portals(70, 0), false},
		{"one more", portals(71, 0), true},
		{"one fewer", portals(70, 0), true},
		// 65 portals of two rules each go: 130 deletions.
		{"many fewer", portals(5, 0), false},
		{"many more", portals(70, 0), true},
		// A NodePort moves the NON-LOCAL chain's guards, which are fixed rules.
		{"a NodePort", portals(70, np), false},
	} {
		n := len(k.restores(v4))
		if err := p.Sync(st.portals); err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		in := k.restores(v4)[n]
		if inPlace := !strings.Contains(in, "\n:"); inPlace != st.inPlace {
			t.Errorf("%s: written in place: got %v, want %v:\n%s", st.name, inPlace, st.inPlace, in)
		}
		for _, chain := range []string{"UPROXY-PORTALS-HOST", "UPROXY-NODEPORT-HOST"} {
			if rules := k.rules(v4, "nat", chain); len(rules) == 0 || !strings.Contains(rules[0], "-j RETURN") {
				t.Errorf("%s: %s does not start with the own-dial RETURN: %q", st.name, chain, rules)
			}
		}
		fresh := newFakeKernel()
		if err := newTestIPTables(t, fresh, cfg).Sync(st.portals); err != nil {
			t.Fatalf("%s: fresh Sync: %v", st.name, err)
		}
		if got, want := k.state(v4), fresh.state(v4); got != want {
			t.Errorf("%s: rules:\n%s\nwant, as a fresh write:\n%s", st.name, got, want)
		}
	}
}
