package iptables

import (
	"errors"
	"net/netip"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/service/servicetest"
)

// emptyV4 is the whole IPv4 restore input for a snapshot without Services: the
// shared chains, the masquerade machinery and the canaries.
const emptyV4 = `*filter
:UPROXY-SERVICES - [0:0]
:UPROXY-EXTERNAL-SERVICES - [0:0]
:UPROXY-FORWARD - [0:0]
:UPROXY-PROXY-FIREWALL - [0:0]
:UPROXY-BLOCK-LOCALNET - [0:0]
:UPROXY-PROXY-CANARY - [0:0]
-A UPROXY-PROXY-CANARY -m comment --comment "uproxy canary: gone means the table was flushed" -j RETURN
-A UPROXY-FORWARD -m comment --comment "uproxy forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A UPROXY-FORWARD -m comment --comment "uproxy forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
COMMIT
*nat
:UPROXY-SERVICES - [0:0]
:UPROXY-NODEPORTS - [0:0]
:UPROXY-POSTROUTING - [0:0]
:UPROXY-MARK-MASQ - [0:0]
:UPROXY-PROXY-CANARY - [0:0]
-A UPROXY-PROXY-CANARY -m comment --comment "uproxy canary: gone means the table was flushed" -j RETURN
-A UPROXY-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A UPROXY-POSTROUTING -j MARK --xor-mark 0x4000
-A UPROXY-POSTROUTING -m comment --comment "uproxy service traffic requiring SNAT" -j MASQUERADE --random-fully
-A UPROXY-MARK-MASQ -j MARK --or-mark 0x4000
-A UPROXY-SERVICES ! -d 127.0.0.0/8 -m addrtype --dst-type LOCAL -m comment --comment "uproxy service nodeports; NOTE: this must be the last rule in this chain" -j UPROXY-NODEPORTS
COMMIT
`

func TestRenderEmpty(t *testing.T) {
	t.Parallel()
	k := newFakeKernel()
	p, err := New(Config{IPTables: k.Fake, Conntrack: &k.ct})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Sync(snapshot()); err != nil {
		t.Fatal(err)
	}
	if got := k.last(0); got != emptyV4 {
		t.Errorf("restore input:\ngot:\n%s\nwant:\n%s", got, emptyV4)
	}
	want := []string{
		`nat -A PREROUTING -m comment --comment "uproxy kernel-mode service portals" -j UPROXY-SERVICES`,
		`nat -A OUTPUT -m comment --comment "uproxy kernel-mode service portals" -j UPROXY-SERVICES`,
		`nat -A POSTROUTING -m comment --comment "uproxy postrouting rules" -j UPROXY-POSTROUTING`,
	}
	for _, w := range want {
		if !slices.Contains(k.jumps(0), w) {
			t.Errorf("jumps: got %q, want one %q", k.jumps(0), w)
		}
	}
	if got, want := len(k.jumps(0)), len(p.n.jumps()); got != want {
		t.Errorf("jump rules: got %d, want %d", got, want)
	}
}

// added returns the lines of input that the empty restore lacks, in order:
// what the Services contribute.
func added(input, empty string) string {
	base := map[string]bool{}
	for _, l := range strings.Split(empty, "\n") {
		base[l] = true
	}
	var out []string
	for _, l := range strings.Split(input, "\n") {
		if !base[l] {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n") + "\n"
}

var chainRef = regexp.MustCompile(`\{(SVC|SVL|EXT|FW|SEP)( [^}]*)?\}`)

// expand replaces {SVC}, {SVL}, {EXT}, {FW} and {SEP addr:port} with the chain
// names of port p.
func expand(n names, p *service.Port, s string) string {
	return chainRef.ReplaceAllStringFunc(s, func(m string) string {
		sub := chainRef.FindStringSubmatch(m)
		return n.portChain(sub[1], p.Name, p.Protocol, strings.TrimSpace(sub[2]))
	})
}

var eps = servicetest.Endpoints

func TestRenderPort(t *testing.T) {
	t.Parallel()
	three := eps("10.244.1.2:8080", "10.244.2.3:8080", "10.244.3.4:8080")
	cases := []struct {
		name string
		cfg  Config
		port func(p *service.Port)
		v6   bool
		want string
	}{
		{
			name: "ClusterIP TCP with 3 endpoints",
			port: func(p *service.Port) { p.Endpoints = three },
			want: `:{SVC} - [0:0]
:{SEP 10.244.1.2:8080} - [0:0]
:{SEP 10.244.2.3:8080} - [0:0]
:{SEP 10.244.3.4:8080} - [0:0]
-A UPROXY-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "shop/web:http cluster IP" -m tcp --dport 80 -j {SVC}
-A {SVC} -m comment --comment "shop/web:http -> 10.244.1.2:8080" -m statistic --mode random --probability 0.3333333333 -j {SEP 10.244.1.2:8080}
-A {SVC} -m comment --comment "shop/web:http -> 10.244.2.3:8080" -m statistic --mode random --probability 0.5000000000 -j {SEP 10.244.2.3:8080}
-A {SVC} -m comment --comment "shop/web:http -> 10.244.3.4:8080" -j {SEP 10.244.3.4:8080}
-A {SEP 10.244.1.2:8080} -s 10.244.1.2/32 -m comment --comment "shop/web:http" -j UPROXY-MARK-MASQ
-A {SEP 10.244.1.2:8080} -p tcp -m comment --comment "shop/web:http" -m tcp -j DNAT --to-destination 10.244.1.2:8080
-A {SEP 10.244.2.3:8080} -s 10.244.2.3/32 -m comment --comment "shop/web:http" -j UPROXY-MARK-MASQ
-A {SEP 10.244.2.3:8080} -p tcp -m comment --comment "shop/web:http" -m tcp -j DNAT --to-destination 10.244.2.3:8080
-A {SEP 10.244.3.4:8080} -s 10.244.3.4/32 -m comment --comment "shop/web:http" -j UPROXY-MARK-MASQ
-A {SEP 10.244.3.4:8080} -p tcp -m comment --comment "shop/web:http" -m tcp -j DNAT --to-destination 10.244.3.4:8080
`,
		},
		{
			name: "ClientIP affinity",
			port: func(p *service.Port) {
				p.Endpoints = three[:2]
				p.AffinityClientIP = true
				p.AffinityTimeout = 3 * time.Hour
			},
			want: `:{SVC} - [0:0]
:{SEP 10.244.1.2:8080} - [0:0]
:{SEP 10.244.2.3:8080} - [0:0]
-A UPROXY-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "shop/web:http cluster IP" -m tcp --dport 80 -j {SVC}
-A {SVC} -m comment --comment "shop/web:http -> 10.244.1.2:8080" -m recent --rcheck --seconds 10800 --reap --name {SEP 10.244.1.2:8080} --mask 255.255.255.255 --rsource -j {SEP 10.244.1.2:8080}
-A {SVC} -m comment --comment "shop/web:http -> 10.244.2.3:8080" -m recent --rcheck --seconds 10800 --reap --name {SEP 10.244.2.3:8080} --mask 255.255.255.255 --rsource -j {SEP 10.244.2.3:8080}
-A {SVC} -m comment --comment "shop/web:http -> 10.244.1.2:8080" -m statistic --mode random --probability 0.5000000000 -j {SEP 10.244.1.2:8080}
-A {SVC} -m comment --comment "shop/web:http -> 10.244.2.3:8080" -j {SEP 10.244.2.3:8080}
-A {SEP 10.244.1.2:8080} -s 10.244.1.2/32 -m comment --comment "shop/web:http" -j UPROXY-MARK-MASQ
-A {SEP 10.244.1.2:8080} -p tcp -m comment --comment "shop/web:http" -m recent --set --name {SEP 10.244.1.2:8080} --mask 255.255.255.255 --rsource -m tcp -j DNAT --to-destination 10.244.1.2:8080
-A {SEP 10.244.2.3:8080} -s 10.244.2.3/32 -m comment --comment "shop/web:http" -j UPROXY-MARK-MASQ
-A {SEP 10.244.2.3:8080} -p tcp -m comment --comment "shop/web:http" -m recent --set --name {SEP 10.244.2.3:8080} --mask 255.255.255.255 --rsource -m tcp -j DNAT --to-destination 10.244.2.3:8080
`,
		},
		{
			name: "NodePort and ExternalIP go through EXT with the masquerade mark",
			port: func(p *service.Port) {
				p.Endpoints = three[:1]
				p.NodePort = 30080
				p.ExternalIPs = addrs("203.0.113.5")
			},
			want: `:{SVC} - [0:0]
:{EXT} - [0:0]
:{SEP 10.244.1.2:8080} - [0:0]
-A UPROXY-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "shop/web:http cluster IP" -m tcp --dport 80 -j {SVC}
-A UPROXY-SERVICES -d 203.0.113.5/32 -p tcp -m comment --comment "shop/web:http external IP" -m tcp --dport 80 -j {EXT}
-A UPROXY-NODEPORTS -p tcp -m comment --comment "shop/web:http" -m tcp --dport 30080 -j {EXT}
-A {SVC} -m comment --comment "shop/web:http -> 10.244.1.2:8080" -j {SEP 10.244.1.2:8080}
-A {EXT} -m comment --comment "masquerade traffic for shop/web:http external destinations" -j UPROXY-MARK-MASQ
-A {EXT} -j {SVC}
-A {SEP 10.244.1.2:8080} -s 10.244.1.2/32 -m comment --comment "shop/web:http" -j UPROXY-MARK-MASQ
-A {SEP 10.244.1.2:8080} -p tcp -m comment --comment "shop/web:http" -m tcp -j DNAT --to-destination 10.244.1.2:8080
`,
		},
		{
			name: "NodePortAddresses (the jump itself: TestNodePortAddresses)",
			cfg:  Config{Common: proxymode.Common{NodePortAddresses: []netip.Prefix{netip.MustParsePrefix("192.168.50.0/24"), netip.MustParsePrefix("fd00::/64")}}},
			port: func(p *service.Port) {
				p.Endpoints = three[:1]
				p.NodePort = 30080
			},
			want: `:{SVC} - [0:0]
:{EXT} - [0:0]
:{SEP 10.244.1.2:8080} - [0:0]
-A UPROXY-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "shop/web:http cluster IP" -m tcp --dport 80 -j {SVC}
-A UPROXY-NODEPORTS -p tcp -m comment --comment "shop/web:http" -m tcp --dport 30080 -j {EXT}
-A {SVC} -m comment --comment "shop/web:http -> 10.244.1.2:8080" -j {SEP 10.244.1.2:8080}
-A {EXT} -m comment --comment "masquerade traffic for shop/web:http external destinations" -j UPROXY-MARK-MASQ
-A {EXT} -j {SVC}
-A {SEP 10.244.1.2:8080} -s 10.244.1.2/32 -m comment --comment "shop/web:http" -j UPROXY-MARK-MASQ
-A {SEP 10.244.1.2:8080} -p tcp -m comment --comment "shop/web:http" -m tcp -j DNAT --to-destination 10.244.1.2:8080
`,
		},
		{
			name: "LoadBalancer IP with source ranges: FW chain, then a filter DROP",
			port: func(p *service.Port) {
				p.Endpoints = three[:1]
				p.LoadBalancerIPs = addrs("198.51.100.7")
				p.LoadBalancerSourceRanges = []netip.Prefix{netip.MustParsePrefix("203.0.113.0/25"), netip.MustParsePrefix("2001:db8::/64")}
			},
			want: `-A UPROXY-PROXY-FIREWALL -d 198.51.100.7/32 -p tcp -m comment --comment "shop/web:http traffic not accepted by {FW}" -m tcp --dport 80 -j DROP
:{SVC} - [0:0]
:{EXT} - [0:0]
:{FW} - [0:0]
:{SEP 10.244.1.2:8080} - [0:0]
-A UPROXY-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "shop/web:http cluster IP" -m tcp --dport 80 -j {SVC}
-A UPROXY-SERVICES -d 198.51.100.7/32 -p tcp -m comment --comment "shop/web:http loadbalancer IP" -m tcp --dport 80 -j {FW}
-A {SVC} -m comment --comment "shop/web:http -> 10.244.1.2:8080" -j {SEP 10.244.1.2:8080}
-A {EXT} -m comment --comment "masquerade traffic for shop/web:http external destinations" -j UPROXY-MARK-MASQ
-A {EXT} -j {SVC}
-A {FW} -s 203.0.113.0/25 -m comment --comment "shop/web:http loadbalancer IP" -j {EXT}
-A {FW} -m comment --comment "other traffic to shop/web:http will be dropped by UPROXY-PROXY-FIREWALL"
-A {SEP 10.244.1.2:8080} -s 10.244.1.2/32 -m comment --comment "shop/web:http" -j UPROXY-MARK-MASQ
-A {SEP 10.244.1.2:8080} -p tcp -m comment --comment "shop/web:http" -m tcp -j DNAT --to-destination 10.244.1.2:8080
`,
		},
		{
			name: "no endpoints: REJECT in filter for every address and the NodePort",
			port: func(p *service.Port) {
				p.NodePort = 30080
				p.ExternalIPs = addrs("203.0.113.5")
				p.LoadBalancerIPs = addrs("198.51.100.7")
			},
			want: `-A UPROXY-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "shop/web:http has no endpoints" -m tcp --dport 80 -j REJECT
-A UPROXY-EXTERNAL-SERVICES -d 203.0.113.5/32 -p tcp -m comment --comment "shop/web:http has no endpoints" -m tcp --dport 80 -j REJECT
-A UPROXY-EXTERNAL-SERVICES -d 198.51.100.7/32 -p tcp -m comment --comment "shop/web:http has no endpoints" -m tcp --dport 80 -j REJECT
-A UPROXY-EXTERNAL-SERVICES ! -d 127.0.0.0/8 -m addrtype --dst-type LOCAL -p tcp -m comment --comment "shop/web:http has no endpoints" -m tcp --dport 30080 -j REJECT
`,
		},
		{
			name: "externalTrafficPolicy Local: SVL for external traffic, node traffic masqueraded to SVC",
			cfg:  Config{Common: proxymode.Common{ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}}},
			port: func(p *service.Port) {
				p.Endpoints = []service.Endpoint{ep("10.244.1.2:8080", true), ep("10.244.2.3:8080", false)}
				p.NodePort = 30080
				p.ExternalPolicyLocal = true
			},
			want: `:{SVC} - [0:0]
:{SVL} - [0:0]
:{EXT} - [0:0]
:{SEP 10.244.1.2:8080} - [0:0]
:{SEP 10.244.2.3:8080} - [0:0]
-A UPROXY-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "shop/web:http cluster IP" -m tcp --dport 80 -j {SVC}
-A UPROXY-NODEPORTS -p tcp -m comment --comment "shop/web:http" -m tcp --dport 30080 -j {EXT}
-A {SVC} -d 10.96.0.10/32 ! -s 10.244.0.0/16 -p tcp -m comment --comment "shop/web:http cluster IP" -m tcp --dport 80 -j UPROXY-MARK-MASQ
-A {SVC} -m comment --comment "shop/web:http -> 10.244.1.2:8080" -m statistic --mode random --probability 0.5000000000 -j {SEP 10.244.1.2:8080}
-A {SVC} -m comment --comment "shop/web:http -> 10.244.2.3:8080" -j {SEP 10.244.2.3:8080}
-A {SVL} -m comment --comment "shop/web:http -> 10.244.1.2:8080" -j {SEP 10.244.1.2:8080}
-A {EXT} -s 10.244.0.0/16 -m comment --comment "pod traffic for shop/web:http external destinations" -j {SVC}
-A {EXT} -m comment --comment "masquerade LOCAL traffic for shop/web:http external destinations" -m addrtype --src-type LOCAL -j UPROXY-MARK-MASQ
-A {EXT} -m comment --comment "route LOCAL traffic for shop/web:http external destinations" -m addrtype --src-type LOCAL -j {SVC}
-A {EXT} -j {SVL}
-A {SEP 10.244.1.2:8080} -s 10.244.1.2/32 -m comment --comment "shop/web:http" -j UPROXY-MARK-MASQ
-A {SEP 10.244.1.2:8080} -p tcp -m comment --comment "shop/web:http" -m tcp -j DNAT --to-destination 10.244.1.2:8080
-A {SEP 10.244.2.3:8080} -s 10.244.2.3/32 -m comment --comment "shop/web:http" -j UPROXY-MARK-MASQ
-A {SEP 10.244.2.3:8080} -p tcp -m comment --comment "shop/web:http" -m tcp -j DNAT --to-destination 10.244.2.3:8080
`,
		},
		{
			name: "externalTrafficPolicy Local without a local endpoint: the node's and pods' traffic still reach every endpoint (the rest is dropped in filter)",
			cfg:  Config{Common: proxymode.Common{ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}}},
			port: func(p *service.Port) {
				p.Endpoints = []service.Endpoint{ep("10.244.2.3:8080", false)}
				p.NodePort = 30080
				p.ExternalPolicyLocal = true
			},
			want: `-A UPROXY-EXTERNAL-SERVICES ! -d 127.0.0.0/8 -m addrtype --dst-type LOCAL -p tcp -m comment --comment "shop/web:http has no local endpoints" -m tcp --dport 30080 -j DROP
:{SVC} - [0:0]
:{EXT} - [0:0]
:{SEP 10.244.2.3:8080} - [0:0]
-A UPROXY-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "shop/web:http cluster IP" -m tcp --dport 80 -j {SVC}
-A UPROXY-NODEPORTS -p tcp -m comment --comment "shop/web:http" -m tcp --dport 30080 -j {EXT}
-A {SVC} -d 10.96.0.10/32 ! -s 10.244.0.0/16 -p tcp -m comment --comment "shop/web:http cluster IP" -m tcp --dport 80 -j UPROXY-MARK-MASQ
-A {SVC} -m comment --comment "shop/web:http -> 10.244.2.3:8080" -j {SEP 10.244.2.3:8080}
-A {EXT} -s 10.244.0.0/16 -m comment --comment "pod traffic for shop/web:http external destinations" -j {SVC}
-A {EXT} -m comment --comment "masquerade LOCAL traffic for shop/web:http external destinations" -m addrtype --src-type LOCAL -j UPROXY-MARK-MASQ
-A {EXT} -m comment --comment "route LOCAL traffic for shop/web:http external destinations" -m addrtype --src-type LOCAL -j {SVC}
-A {SEP 10.244.2.3:8080} -s 10.244.2.3/32 -m comment --comment "shop/web:http" -j UPROXY-MARK-MASQ
-A {SEP 10.244.2.3:8080} -p tcp -m comment --comment "shop/web:http" -m tcp -j DNAT --to-destination 10.244.2.3:8080
`,
		},
		{
			name: "internalTrafficPolicy Local without a local endpoint: DROP, not REJECT",
			port: func(p *service.Port) {
				p.Endpoints = three[1:2]
				p.InternalPolicyLocal = true
			},
			want: `-A UPROXY-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "shop/web:http has no local endpoints" -m tcp --dport 80 -j DROP
`,
		},
		{
			name: "internalTrafficPolicy Local: SVL from the ClusterIP",
			port: func(p *service.Port) {
				p.Endpoints = []service.Endpoint{ep("10.244.1.2:8080", true), ep("10.244.2.3:8080", false)}
				p.InternalPolicyLocal = true
			},
			want: `:{SVL} - [0:0]
:{SEP 10.244.1.2:8080} - [0:0]
-A UPROXY-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "shop/web:http cluster IP" -m tcp --dport 80 -j {SVL}
-A {SVL} -m comment --comment "shop/web:http -> 10.244.1.2:8080" -j {SEP 10.244.1.2:8080}
-A {SEP 10.244.1.2:8080} -s 10.244.1.2/32 -m comment --comment "shop/web:http" -j UPROXY-MARK-MASQ
-A {SEP 10.244.1.2:8080} -p tcp -m comment --comment "shop/web:http" -m tcp -j DNAT --to-destination 10.244.1.2:8080
`,
		},
		{
			name: "IPv6: its own addresses and endpoints, a /128 host mask",
			cfg:  Config{Common: proxymode.Common{IPv6: true}},
			v6:   true,
			port: func(p *service.Port) {
				p.ClusterIPs = addrs("10.96.0.10", "fd00:96::10")
				p.Endpoints = eps("10.244.1.2:8080", "[fd00:244:1::2]:8080")
				p.AffinityClientIP = true
				p.AffinityTimeout = time.Minute
			},
			want: `:{SVC} - [0:0]
:{SEP [fd00:244:1::2]:8080} - [0:0]
-A UPROXY-SERVICES -d fd00:96::10/128 -p tcp -m comment --comment "shop/web:http cluster IP" -m tcp --dport 80 -j {SVC}
-A {SVC} -m comment --comment "shop/web:http -> [fd00:244:1::2]:8080" -m recent --rcheck --seconds 60 --reap --name {SEP [fd00:244:1::2]:8080} --mask ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff --rsource -j {SEP [fd00:244:1::2]:8080}
-A {SVC} -m comment --comment "shop/web:http -> [fd00:244:1::2]:8080" -j {SEP [fd00:244:1::2]:8080}
-A {SEP [fd00:244:1::2]:8080} -s fd00:244:1::2/128 -m comment --comment "shop/web:http" -j UPROXY-MARK-MASQ
-A {SEP [fd00:244:1::2]:8080} -p tcp -m comment --comment "shop/web:http" -m recent --set --name {SEP [fd00:244:1::2]:8080} --mask ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff --rsource -m tcp -j DNAT --to-destination [fd00:244:1::2]:8080
`,
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			k := newFakeKernel()
			cfg := c.cfg
			cfg.IPTables, cfg.Conntrack = k.Fake, &k.ct
			p, err := New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			port := svcPort("shop", "web", "http", service.TCP, 80)
			port.ClusterIPs = addrs("10.96.0.10")
			c.port(port)
			if err := p.Sync(snapshot()); err != nil {
				t.Fatal(err)
			}
			empty := k.last(idx(c.v6))
			// A whole rewrite, so the restore holds every shared rule (a
			// partial sync would add the port's jumps to them in place).
			for _, fam := range p.fams {
				fam.written = nil
			}
			if err := p.Sync(snapshot(port)); err != nil {
				t.Fatal(err)
			}
			got := added(k.last(idx(c.v6)), empty)
			if want := expand(p.n, port, c.want); got != want {
				t.Errorf("rules added by the Service port:\ngot:\n%s\nwant:\n%s", got, want)
			}
		})
	}
}

func TestNodePortAddresses(t *testing.T) {
	t.Parallel()
	k := newFakeKernel()
	p, err := New(Config{Common: proxymode.Common{IPv6: true, NodePortAddresses: []netip.Prefix{netip.MustParsePrefix("192.168.50.7/24")}}, IPTables: k.Fake, Conntrack: &k.ct})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Sync(snapshot()); err != nil {
		t.Fatal(err)
	}
	jump := `-A UPROXY-SERVICES -d 192.168.50.0/24 -m comment --comment "uproxy service nodeports; NOTE: this must be the last rule in this chain" -j UPROXY-NODEPORTS` + "\n"
	if v4 := k.last(0); !strings.Contains(v4, jump) || strings.Contains(v4, "--dst-type LOCAL") {
		t.Errorf("IPv4: want only the jump %q, got:\n%s", jump, v4)
	}
	if v6 := k.last(1); strings.Contains(v6, "-j UPROXY-NODEPORTS") {
		t.Errorf("IPv6 without a NodePort address: got a NodePort jump, want none:\n%s", v6)
	}
}

func TestChainNames(t *testing.T) {
	t.Parallel()
	name := service.PortName{Namespace: "a-very-long-namespace-name", Name: "and-an-even-longer-service-name", Port: "port"}
	for _, prefix := range []string{"UPROXY", "U", "ABCDEFGHI"} {
		n := namesOf(prefix)
		for _, kind := range portKinds {
			c := n.portChain(kind, name, service.TCP, "10.0.0.1:80")
			if len(c) > maxChainName {
				t.Errorf("prefix %s: %s is %d characters, want at most %d", prefix, c, len(c), maxChainName)
			}
			if !n.isPortChain(c) {
				t.Errorf("isPortChain(%s): got false, want true", c)
			}
		}
		for _, c := range append(n.natChains(), n.filterChains()...) {
			if len(c) > maxChainName || n.isPortChain(c) {
				t.Errorf("fixed chain %s: length %d, isPortChain %v", c, len(c), n.isPortChain(c))
			}
		}
	}
	n := namesOf("UPROXY")
	for _, c := range []string{"UPROXY-PORTALS-CONTAINER", "UPROXY-NODEPORT-HOST", "UPROXY-CANARY", "KUBE-SVC-ABCDEFGHIJKLMNOP", "UPROXY-SVC-SHORT"} {
		if n.isPortChain(c) {
			t.Errorf("isPortChain(%s): got true, want false (not ours)", c)
		}
	}
	a := n.portChain("SEP", name, service.TCP, "10.0.0.1:80")
	if b := n.portChain("SEP", name, service.UDP, "10.0.0.1:80"); a == b {
		t.Errorf("TCP and UDP SEP chains share the name %s", a)
	}
}

func TestPartialSync(t *testing.T) {
	t.Parallel()
	k := newFakeKernel()
	p, err := New(Config{IPTables: k.Fake, Conntrack: &k.ct})
	if err != nil {
		t.Fatal(err)
	}
	web := svcPort("shop", "web", "", service.TCP, 80)
	web.ClusterIPs = addrs("10.96.0.10")
	web.Endpoints = eps("10.244.1.2:8080", "10.244.2.3:8080")
	api := svcPort("shop", "api", "", service.TCP, 443)
	api.ClusterIPs = addrs("10.96.0.11")
	api.Endpoints = eps("10.244.1.9:8443")
	gone := svcPort("shop", "gone", "", service.TCP, 80)
	gone.ClusterIPs = addrs("10.96.0.12")
	gone.Endpoints = eps("10.244.1.7:80")
	if err := p.Sync(snapshot(web, api, gone)); err != nil {
		t.Fatal(err)
	}
	if !p.fams[0].lastWasFull {
		t.Fatalf("first sync: got partial, want full")
	}

	// web loses an endpoint, gone goes away, api stays as it was.
	web2 := *web
	web2.Endpoints = web.Endpoints[:1]
	if err := p.Sync(snapshot(&web2, api)); err != nil {
		t.Fatal(err)
	}
	in := k.last(0)
	if p.fams[0].lastWasFull {
		t.Errorf("second sync: got full, want partial")
	}
	chain := func(kind string, port *service.Port, ep string) string {
		return p.n.portChain(kind, port.Name, port.Protocol, ep)
	}
	for _, c := range []struct {
		what, line string
		want       bool
	}{
		{"web's SVC rewritten", "-A " + chain("SVC", web, "") + " ", true},
		{"web's kept SEP rewritten", "-A " + chain("SEP", web, "10.244.1.2:8080") + " ", true},
		{"web's removed SEP deleted", "-X " + chain("SEP", web, "10.244.2.3:8080") + "\n", true},
		{"gone's SVC deleted", "-X " + chain("SVC", gone, "") + "\n", true},
		{"gone's SEP deleted", "-X " + chain("SEP", gone, "10.244.1.7:80") + "\n", true},
		{"api's SVC untouched", ":" + chain("SVC", api, ""), false},
		{"api's SEP untouched", chain("SEP", api, "10.244.1.9:8443"), false},
		{"gone's jump deleted from SERVICES in place", "-D " + p.n.services + " -d 10.96.0.12/32 ", true},
		{"SERVICES not rewritten", ":" + p.n.services + " ", false},
		{"api's jump untouched", "-d 10.96.0.11/32", false},
	} {
		if got := strings.Contains(in, c.line); got != c.want {
			t.Errorf("%s: %q in the restore: got %v, want %v\n%s", c.what, c.line, got, c.want, in)
		}
	}
	if chains := k.natChains(0); !chains[chain("SVC", web, "")] || chains[chain("SVC", gone, "")] {
		t.Errorf("kernel chains after the partial sync: got %v, want web's SVC and not gone's", chains)
	}

	// Only web's endpoint moves: web's chains are written, and neither table's
	// shared chains, whose text is the same.
	web3 := web2
	web3.Endpoints = eps("10.244.1.4:8080")
	if err := p.Sync(snapshot(&web3, api)); err != nil {
		t.Fatal(err)
	}
	if in := k.last(0); !strings.Contains(in, ":"+chain("SVC", web, "")) || strings.Contains(in, "*filter") || strings.Contains(in, ":"+p.n.services+" ") {
		t.Errorf("sync after web's endpoint moved: want web's chains and no shared chain, got:\n%s", in)
	}
	if err := p.Sync(snapshot(&web2, api)); err != nil {
		t.Fatal(err)
	}

	// Nothing changed: nothing is written.
	n := len(k.restores(0))
	if err := p.Sync(snapshot(&web2, api)); err != nil {
		t.Fatal(err)
	}
	if got := k.restores(0)[n:]; len(got) != 0 {
		t.Errorf("unchanged sync: got restores %q, want none", got)
	}
	// Only a shared chain changes (a new ExternalIP without endpoints): the
	// shared chains are written, no port chain.
	api2 := *api
	api2.Endpoints = nil
	if err := p.Sync(snapshot(&web2, &api2)); err != nil {
		t.Fatal(err)
	}
	if in := k.last(0); strings.Contains(in, ":"+chain("SVC", web, "")) || !strings.Contains(in, "shop/api has no endpoints") {
		t.Errorf("sync after api lost its endpoints: want the REJECT and no web chain, got:\n%s", in)
	}
}

func TestFullSyncAfterCanaryLossOrFailure(t *testing.T) {
	t.Parallel()
	k := newFakeKernel()
	p, err := New(Config{IPTables: k.Fake, Conntrack: &k.ct})
	if err != nil {
		t.Fatal(err)
	}
	web := svcPort("shop", "web", "", service.TCP, 80)
	web.ClusterIPs = addrs("10.96.0.10")
	web.Endpoints = eps("10.244.1.2:8080")
	s := snapshot(web)
	// A chain a previous process left behind, which a full sync must delete.
	leftover := p.n.portChain("SVC", service.PortName{Namespace: "old", Name: "svc"}, service.TCP, "")
	if err := k.Apply(false, "*nat\n:"+leftover+" - [0:0]\nCOMMIT\n"); err != nil {
		t.Fatal(err)
	}
	steps := []struct {
		name   string
		before func()
		full   bool
	}{
		{"first sync", func() {}, true},
		{"unchanged", func() {}, false},
		{"after iptables -t nat -F", func() { k.Flush(false, "nat") }, true},
		{"after the full one", func() {}, false},
		{"after a failed restore", func() {
			k.FailNextRestore(false, errors.New("boom"))
			moved := *web
			moved.Endpoints = eps("10.244.1.3:8080")
			if err := p.Sync(snapshot(&moved)); err == nil {
				t.Errorf("sync with a failing restore: got nil error")
			}
		}, true},
	}
	for _, st := range steps {
		st.before()
		inserts := k.inserts(0)
		n := len(k.restores(0))
		if err := p.Sync(s); err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		if got := p.fams[0].lastWasFull; got != st.full {
			t.Errorf("%s: full sync got %v, want %v", st.name, got, st.full)
		}
		written := false
		for _, in := range k.restores(0)[n:] {
			written = written || strings.Contains(in, ":"+p.n.portChain("SVC", web.Name, web.Protocol, ""))
		}
		if written != st.full {
			t.Errorf("%s: web's chains written: got %v, want %v", st.name, written, st.full)
		}
		if st.full && st.name == "after iptables -t nat -F" && k.inserts(0) == inserts {
			t.Errorf("%s: jumps not re-inserted", st.name)
		}
	}
	if k.natChains(0)[leftover] {
		t.Errorf("leftover chain %s survived the full sync", leftover)
	}
}

func TestStaleUDPFlows(t *testing.T) {
	t.Parallel()
	k := newFakeKernel()
	p, err := New(Config{IPTables: k.Fake, Conntrack: &k.ct})
	if err != nil {
		t.Fatal(err)
	}
	dns := svcPort("kube-system", "dns", "", service.UDP, 53)
	dns.ClusterIPs = addrs("10.96.0.53")
	dns.NodePort = 30053
	dns.Endpoints = eps("10.244.1.2:5353", "10.244.2.3:5353")
	web := svcPort("shop", "web", "", service.TCP, 80)
	web.ClusterIPs = addrs("10.96.0.10")
	web.Endpoints = eps("10.244.1.2:8080")
	sync := func(ports ...*service.Port) []netlink.CustomConntrackFilter {
		t.Helper()
		n := len(k.ct.Filters[0])
		if err := p.Sync(snapshot(ports...)); err != nil {
			t.Fatal(err)
		}
		return k.ct.Filters[0][n:]
	}
	flow := func(dst string, reply string) *netlinkFlow { return newFlow(dst, reply) }

	first := sync(dns, web)
	if len(first) != 1 {
		t.Fatalf("first sync: got %d conntrack passes, want 1 (every UDP Service checked)", len(first))
	}
	if again := sync(dns, web); len(again) != 0 {
		t.Errorf("unchanged sync: got %d conntrack passes, want 0", len(again))
	}
	cut := *dns
	cut.Endpoints = dns.Endpoints[:1]
	got := sync(&cut, web)
	if len(got) != 1 {
		t.Fatalf("endpoint removed: got %d conntrack passes, want 1", len(got))
	}
	for _, c := range []struct {
		name        string
		f           *netlinkFlow
		wantDeleted bool
	}{
		{"flow to the removed endpoint", flow("10.96.0.53:53", "10.244.2.3:5353"), true},
		{"flow to the kept endpoint", flow("10.96.0.53:53", "10.244.1.2:5353"), false},
		{"NodePort flow to the removed endpoint", flow("192.168.50.1:30053", "10.244.2.3:5353"), true},
		{"unrelated flow", flow("10.96.0.99:53", "10.244.2.3:5353"), false},
	} {
		if del := got[0].MatchConntrackFlow(c.f.flow()); del != c.wantDeleted {
			t.Errorf("%s: deleted got %v, want %v", c.name, del, c.wantDeleted)
		}
	}
	got = sync(web)
	if len(got) != 1 || !got[0].MatchConntrackFlow(flow("10.96.0.53:53", "10.244.1.2:5353").flow()) {
		t.Errorf("Service removed: its flows must all be deleted, got %d passes", len(got))
	}
}
