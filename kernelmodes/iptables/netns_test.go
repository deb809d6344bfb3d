package iptables

import (
	"net"
	"net/netip"
	"strconv"
	"strings"
	"testing"
	"time"

	ipt "github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/service/servicetest"
	"github.com/uproxy/uproxy/test/testbed"
)

// Constructors shared with the other kernel modes' tests.
var (
	ep       = servicetest.Endpoint
	svcPort  = servicetest.Port
	addrs    = servicetest.Addrs
	snapshot = servicetest.Snapshot
)

// world is the topology of the end-to-end tests: three endpoints per family in
// the external namespace (another host), one in the pod namespace (on the node).
type world struct {
	tp                  *testbed.Topology
	extV4, extV6        []string // TCP endpoints in the external namespace
	podEP               string   // TCP endpoint in the pod namespace
	udpEP               string
	web, sticky, dns    *service.Port
	empty, local, lb    *service.Port
	self                *service.Port
	before              [2]string
	nodeIPv4, nodeIPv6  netip.Addr
	podIPv4, extClientA netip.Addr
}

func newWorld(t *testing.T) *world {
	tp := testbed.New(t, testbed.WithIPv6())
	w := &world{tp: tp, nodeIPv4: tp.NS(testbed.Node).IPv4, nodeIPv6: tp.NS(testbed.Node).IPv6, podIPv4: tp.NS(testbed.Pod).IPv4, extClientA: tp.NS(testbed.External).IPv4}
	// Someone else's rules (kube-proxy's names), which uproxy must leave alone;
	// they also create the tables, so "before" is not empty.
	for _, ipt := range []string{"iptables", "ip6tables"} {
		tp.MustExec(t, testbed.Node, ipt, "-t", "nat", "-N", "KUBE-SERVICES")
		tp.MustExec(t, testbed.Node, ipt, "-t", "nat", "-A", "PREROUTING", "-j", "KUBE-SERVICES")
		tp.MustExec(t, testbed.Node, ipt, "-t", "nat", "-A", "POSTROUTING", "-j", "RETURN")
		tp.MustExec(t, testbed.Node, ipt, "-t", "filter", "-N", "KUBE-FIREWALL")
		tp.MustExec(t, testbed.Node, ipt, "-t", "filter", "-A", "INPUT", "-j", "KUBE-FIREWALL")
	}
	w.before = [2]string{tp.SavedRules(t, false), tp.SavedRules(t, true)}
	// REJECT answers with ICMP, which the node rate-limits per destination host;
	// the redirects hairpinned traffic triggers would use up the pod's budget.
	tp.MustExec(t, testbed.Node, "sysctl", "-q", "-w", "net.ipv4.icmp_ratelimit=0")
	for i := 11; i <= 13; i++ {
		v4 := "192.168.50." + strconv.Itoa(i)
		v6 := "fd00:50::" + strconv.Itoa(i)
		tp.MustExec(t, testbed.External, "ip", "addr", "add", v4+"/24", "dev", "eth0")
		tp.MustExec(t, testbed.External, "ip", "addr", "add", v6+"/64", "dev", "eth0", "nodad")
		for _, a := range []string{v4 + ":8080", "[" + v6 + "]:8080"} {
			go testbed.ServeIdentity(tp.Listen(testbed.External, "tcp", a))
		}
		w.extV4 = append(w.extV4, v4+":8080")
		w.extV6 = append(w.extV6, "["+v6+"]:8080")
	}
	w.podEP = w.podIPv4.String() + ":8080"
	go testbed.ServeIdentity(tp.Listen(testbed.Pod, "tcp", w.podEP))
	udp := tp.ListenPacket(testbed.External, "udp", "192.168.50.11:5353")
	go testbed.ServeUDPIdentity(udp)
	w.udpEP = "192.168.50.11:5353"

	var webEPs []service.Endpoint
	for _, a := range append(append([]string{}, w.extV4...), w.extV6...) {
		webEPs = append(webEPs, ep(a, false))
	}
	w.web = svcPort("shop", "web", "http", service.TCP, 80)
	w.web.ClusterIPs = addrs("10.96.0.10", "fd00:96::10")
	w.web.ExternalIPs = addrs("10.250.0.5")
	w.web.NodePort = 30080
	w.web.Endpoints = webEPs

	w.sticky = svcPort("shop", "sticky", "", service.TCP, 80)
	w.sticky.ClusterIPs = addrs("10.96.0.11")
	w.sticky.AffinityClientIP = true
	w.sticky.AffinityTimeout = time.Minute
	w.sticky.Endpoints = webEPs[:3]

	w.dns = svcPort("kube-system", "dns", "dns", service.UDP, 53)
	w.dns.ClusterIPs = addrs("10.96.0.53")
	w.dns.NodePort = 30053
	w.dns.Endpoints = []service.Endpoint{ep(w.udpEP, false)}

	w.empty = svcPort("shop", "empty", "", service.TCP, 80)
	w.empty.ClusterIPs = addrs("10.96.0.12")

	w.local = svcPort("shop", "local", "", service.TCP, 80)
	w.local.ClusterIPs = addrs("10.96.0.13")
	w.local.NodePort = 30081
	w.local.ExternalPolicyLocal = true
	w.local.Endpoints = []service.Endpoint{ep(w.podEP, true), ep(w.extV4[0], false)}

	w.lb = svcPort("shop", "lb", "", service.TCP, 80)
	w.lb.ClusterIPs = addrs("10.96.0.14")
	w.lb.LoadBalancerIPs = addrs("10.251.0.7")
	w.lb.LoadBalancerSourceRanges = []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}
	w.lb.Endpoints = webEPs[:3]

	w.self = svcPort("shop", "self", "", service.TCP, 80)
	w.self.ClusterIPs = addrs("10.96.0.15")
	w.self.Endpoints = []service.Endpoint{ep(w.podEP, true)}
	return w
}

func (w *world) snapshot() *service.Snapshot {
	return snapshot(w.web, w.sticky, w.dns, w.empty, w.local, w.lb, w.self)
}

func (w *world) sync(t testing.TB, p *Proxier, s *service.Snapshot) {
	t.Helper()
	if err := w.tp.Run(testbed.Node, func() error { return p.Sync(s) }); err != nil {
		t.Fatalf("Sync: %v", err)
	}
}

func TestRealIPTablesMode(t *testing.T) {
	testbed.Needs(t, testbed.IPTables)
	w := newWorld(t)
	tp := w.tp
	var p *Proxier
	if err := tp.Run(testbed.Node, func() (err error) {
		p, err = New(Config{Common: proxymode.Common{IPv6: true}})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	w.sync(t, p, w.snapshot())
	if !p.fams[0].lastWasFull || !p.fams[1].lastWasFull {
		t.Fatalf("first sync full: got %v/%v, want true/true", p.fams[0].lastWasFull, p.fams[1].lastWasFull)
	}

	t.Run("no process serves the node: the rules are all in the kernel", func(t *testing.T) {
		out, err := tp.Exec(testbed.Node, "ss", "-Htuln")
		if err != nil {
			t.Fatal(err)
		}
		if s := strings.TrimSpace(string(out)); s != "" {
			t.Fatalf("listening sockets in the node namespace: got %q, want none", s)
		}
	})

	inSet := func(got string, set []string) bool {
		for _, s := range set {
			if s == got {
				return true
			}
		}
		return false
	}
	paths := []struct {
		name, from, to string
		want           []string
	}{
		{"ClusterIP from pod", testbed.Pod, "10.96.0.10:80", w.extV4},
		{"ClusterIP from node", testbed.Node, "10.96.0.10:80", w.extV4},
		{"ClusterIP IPv6 from pod", testbed.Pod, "[fd00:96::10]:80", w.extV6},
		{"ClusterIP IPv6 from node", testbed.Node, "[fd00:96::10]:80", w.extV6},
		{"NodePort from external", testbed.External, w.nodeIPv4.String() + ":30080", w.extV4},
		{"NodePort IPv6 from external", testbed.External, "[" + w.nodeIPv6.String() + "]:30080", w.extV6},
		{"NodePort from node", testbed.Node, w.nodeIPv4.String() + ":30080", w.extV4},
		{"ExternalIP from external", testbed.External, "10.250.0.5:80", w.extV4},
		{"ExternalIP from pod", testbed.Pod, "10.250.0.5:80", w.extV4},
		{"LoadBalancer IP from an allowed source", testbed.Pod, "10.251.0.7:80", w.extV4},
		{"hairpin: pod to a Service backed by itself", testbed.Pod, "10.96.0.15:80", []string{w.podEP}},
	}
	check := func(t *testing.T, from, to string, want []string) {
		t.Helper()
		got, _, err := tp.Ask(from, to)
		if err != nil || !inSet(got, want) {
			t.Errorf("%s from %s: got endpoint %q (%v), want one of %q", to, from, got, err, want)
		}
	}
	for _, pt := range paths {
		t.Run(pt.name, func(t *testing.T) { check(t, pt.from, pt.to, pt.want) })
	}

	t.Run("hairpin traffic is masqueraded to the node", func(t *testing.T) {
		_, client, err := tp.Ask(testbed.Pod, "10.96.0.15:80")
		if err != nil {
			t.Fatal(err)
		}
		if host, _, _ := net.SplitHostPort(client); host != tp.NS(testbed.Pod).GatewayIPv4.String() {
			t.Errorf("client seen by the endpoint: got %s, want the node's %s", host, tp.NS(testbed.Pod).GatewayIPv4)
		}
	})

	t.Run("UDP ClusterIP from pod and NodePort from external", func(t *testing.T) {
		for _, c := range []struct{ from, to string }{
			{testbed.Pod, "10.96.0.53:53"},
			{testbed.External, w.nodeIPv4.String() + ":30053"},
		} {
			conn, err := tp.Dial(c.from, "udp", c.to)
			if err != nil {
				t.Fatal(err)
			}
			conn.SetDeadline(time.Now().Add(testbed.DialTimeout))
			conn.Write([]byte("q"))
			buf := make([]byte, 100)
			n, err := conn.Read(buf)
			conn.Close()
			if want := w.udpEP + "|q"; string(buf[:n]) != want {
				t.Errorf("UDP %s from %s: got %q (%v), want %q", c.to, c.from, buf[:n], err, want)
			}
		}
	})

	t.Run("no endpoints: REJECT", func(t *testing.T) {
		err := tp.DialQuick(testbed.Pod, "10.96.0.12:80")
		if err == nil || !strings.Contains(err.Error(), "refused") {
			t.Errorf("dial Service without endpoints: got %v, want connection refused", err)
		}
	})

	t.Run("LoadBalancer IP from a source outside loadBalancerSourceRanges is dropped", func(t *testing.T) {
		if err := tp.DialQuick(testbed.External, "10.251.0.7:80"); err == nil {
			t.Errorf("dial from external: got a connection, want none")
		}
	})

	t.Run("externalTrafficPolicy Local: node's endpoint only, client IP kept", func(t *testing.T) {
		for range 20 {
			got, client, err := tp.Ask(testbed.External, w.nodeIPv4.String()+":30081")
			if err != nil {
				t.Fatal(err)
			}
			host, _, _ := net.SplitHostPort(client)
			if got != w.podEP || host != w.extClientA.String() {
				t.Fatalf("got endpoint %s seeing client %s, want %s seeing %s", got, host, w.podEP, w.extClientA)
			}
		}
	})

	t.Run("300 connections spread over 3 endpoints", func(t *testing.T) {
		counts := map[string]int{}
		for range 300 {
			got, _, err := tp.Ask(testbed.Pod, "10.96.0.10:80")
			if err != nil {
				t.Fatal(err)
			}
			counts[got]++
		}
		for _, e := range w.extV4 {
			if c := counts[e]; c < 45 || c > 165 {
				t.Errorf("endpoint %s: got %d of 300, want 45 to 165 (15%%-55%%); all: %v", e, c, counts)
			}
		}
	})

	t.Run("counters count the connections", func(t *testing.T) {
		var cs []EndpointCounters
		if err := tp.Run(testbed.Node, func() (err error) { cs, err = p.Counters(); return err }); err != nil {
			t.Fatal(err)
		}
		var web uint64
		for _, c := range cs {
			if c.Service == w.web.Name && c.Endpoint.Addr().Is4() {
				web += c.Packets
			}
		}
		if web < 300 {
			t.Errorf("web IPv4 DNAT packets: got %d, want at least 300 (%+v)", web, cs)
		}
	})

	t.Run("ClientIP affinity sticks to one endpoint", func(t *testing.T) {
		seen := map[string]int{}
		for range 30 {
			got, _, err := tp.Ask(testbed.Pod, "10.96.0.11:80")
			if err != nil {
				t.Fatal(err)
			}
			seen[got]++
		}
		if len(seen) != 1 {
			t.Errorf("endpoints for one client: got %v, want exactly one", seen)
		}
	})

	t.Run("partial sync rewrites one Service and removes its stale chain", func(t *testing.T) {
		removed := w.web.Endpoints[2]
		gone := p.n.portChain("SEP", w.web.Name, w.web.Protocol, removed.Addr.String())
		if !strings.Contains(tp.SavedRules(t, false), ":"+gone+" ") {
			t.Fatalf("SEP chain %s of %s not in iptables-save before", gone, removed)
		}
		cut := *w.web
		cut.Endpoints = append(append([]service.Endpoint{}, w.web.Endpoints[:2]...), w.web.Endpoints[3:]...)
		w.sync(t, p, snapshot(&cut, w.sticky, w.dns, w.empty, w.local, w.lb, w.self))
		if p.fams[0].lastWasFull {
			t.Errorf("sync after an endpoint change: got full, want partial")
		}
		if s := tp.SavedRules(t, false); strings.Contains(s, gone) {
			t.Errorf("SEP chain %s still present after its endpoint went", gone)
		}
		for range 30 {
			check(t, testbed.Pod, "10.96.0.10:80", w.extV4[:2])
		}
		w.sync(t, p, w.snapshot())
	})

	t.Run("iptables -t nat -F then Sync restores service", func(t *testing.T) {
		tp.MustExec(t, testbed.Node, "iptables", "-t", "nat", "-F")
		// The other program restores its own rules, as it would.
		tp.MustExec(t, testbed.Node, "iptables", "-t", "nat", "-A", "PREROUTING", "-j", "KUBE-SERVICES")
		tp.MustExec(t, testbed.Node, "iptables", "-t", "nat", "-A", "POSTROUTING", "-j", "RETURN")
		if err := tp.DialQuick(testbed.Pod, "10.96.0.10:80"); err == nil {
			t.Fatalf("dial after flush: got a connection, want none (nothing should serve the ClusterIP)")
		}
		w.sync(t, p, w.snapshot())
		if !p.fams[0].lastWasFull {
			t.Errorf("sync after a flush: got partial, want full")
		}
		check(t, testbed.Pod, "10.96.0.10:80", w.extV4)
		check(t, testbed.External, w.nodeIPv4.String()+":30080", w.extV4)
	})

	t.Run("Cleanup restores iptables-save exactly", func(t *testing.T) {
		if err := tp.Run(testbed.Node, p.Cleanup); err != nil {
			t.Fatalf("Cleanup: %v", err)
		}
		for i, v6 := range []bool{false, true} {
			if got := tp.SavedRules(t, v6); got != w.before[i] {
				t.Errorf("%s after Cleanup:\ngot:\n%s\nwant:\n%s", ipt.FamilyName(v6), got, w.before[i])
			}
		}
	})

	t.Run("standalone Cleanup after a fresh Sync restores iptables-save exactly", func(t *testing.T) {
		w.sync(t, p, w.snapshot())
		for range 2 { // the second finds nothing to remove
			if err := tp.Run(testbed.Node, func() error { return Cleanup("") }); err != nil {
				t.Fatalf("Cleanup: %v", err)
			}
			for i, v6 := range []bool{false, true} {
				if got := tp.SavedRules(t, v6); got != w.before[i] {
					t.Errorf("%s after Cleanup:\ngot:\n%s\nwant:\n%s", ipt.FamilyName(v6), got, w.before[i])
				}
			}
		}
	})
}
