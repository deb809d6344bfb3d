package nftables

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/knftables"

	"github.com/uproxy/uproxy/netfilter/nftables"
	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/service/servicetest"
	"github.com/uproxy/uproxy/test/testbed"
)

// udpAsk sends payload on c and returns the reply.
func udpAsk(c net.Conn, payload string) (string, error) {
	c.SetDeadline(time.Now().Add(testbed.DialTimeout))
	if _, err := c.Write([]byte(payload)); err != nil {
		return "", err
	}
	buf := make([]byte, 256)
	n, err := c.Read(buf)
	return string(buf[:n]), err
}

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
	tp                      *testbed.Topology
	extV4, extV6            []string // TCP endpoints in the external namespace
	podEP                   string   // TCP endpoint in the pod namespace
	udpEPs                  []string
	web, sticky, dns        *service.Port
	empty, local, lb        *service.Port
	self, noLocal, internal *service.Port
	before                  string
	nodeIPv4, nodeIPv6      netip.Addr
	podIPv4, extClientA     netip.Addr
}

// foreign is what other programs keep in the node's nftables: kube-proxy's
// table and chains (through iptables-nft), which uproxy must leave alone.
func foreign(t testing.TB, tp *testbed.Topology) {
	tp.MustExec(t, testbed.Node, "nft", "add table inet kube-proxy")
	tp.MustExec(t, testbed.Node, "nft", "add chain inet kube-proxy services { type nat hook prerouting priority dstnat; }")
	tp.MustExec(t, testbed.Node, "nft", "add rule inet kube-proxy services ip daddr 10.96.0.99 tcp dport 80 dnat ip to 192.168.50.11:8080")
	for _, ipt := range []string{"iptables", "ip6tables"} {
		tp.MustExec(t, testbed.Node, ipt, "-t", "nat", "-N", "KUBE-SERVICES")
		tp.MustExec(t, testbed.Node, ipt, "-t", "nat", "-A", "PREROUTING", "-j", "KUBE-SERVICES")
		tp.MustExec(t, testbed.Node, ipt, "-t", "filter", "-N", "KUBE-FIREWALL")
		tp.MustExec(t, testbed.Node, ipt, "-t", "filter", "-A", "INPUT", "-j", "KUBE-FIREWALL")
	}
}

func newWorld(t *testing.T) *world {
	tp := testbed.New(t, testbed.WithIPv6())
	w := &world{tp: tp, nodeIPv4: tp.NS(testbed.Node).IPv4, nodeIPv6: tp.NS(testbed.Node).IPv6, podIPv4: tp.NS(testbed.Pod).IPv4, extClientA: tp.NS(testbed.External).IPv4}
	foreign(t, tp)
	w.before = tp.NFTRuleset(t)
	// REJECT answers with ICMP, which the node rate-limits per destination host.
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
	for _, a := range []string{"192.168.50.11:5353", "192.168.50.12:5353"} {
		go testbed.ServeUDPIdentity(tp.ListenPacket(testbed.External, "udp", a))
		w.udpEPs = append(w.udpEPs, a)
	}

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
	w.sticky.ClusterIPs = addrs("10.96.0.11", "fd00:96::11")
	w.sticky.AffinityClientIP = true
	w.sticky.AffinityTimeout = time.Minute
	w.sticky.Endpoints = webEPs

	w.dns = svcPort("kube-system", "dns", "dns", service.UDP, 53)
	w.dns.ClusterIPs = addrs("10.96.0.53")
	w.dns.NodePort = 30053
	w.dns.Endpoints = []service.Endpoint{ep(w.udpEPs[0], false)}

	w.empty = svcPort("shop", "empty", "", service.TCP, 80)
	w.empty.ClusterIPs = addrs("10.96.0.12", "fd00:96::12")
	w.empty.NodePort = 30083

	w.local = svcPort("shop", "local", "", service.TCP, 80)
	w.local.ClusterIPs = addrs("10.96.0.13")
	w.local.NodePort = 30081
	w.local.ExternalPolicyLocal = true
	w.local.Endpoints = []service.Endpoint{ep(w.podEP, true), ep(w.extV4[0], false)}

	w.lb = svcPort("shop", "lb", "", service.TCP, 80)
	w.lb.ClusterIPs = addrs("10.96.0.14")
	w.lb.LoadBalancerIPs = addrs("10.251.0.7")
	w.lb.LoadBalancerSourceRanges = []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16"), netip.MustParsePrefix("10.244.1.0/24")}
	w.lb.Endpoints = webEPs[:3]

	w.self = svcPort("shop", "self", "", service.TCP, 80)
	w.self.ClusterIPs = addrs("10.96.0.15")
	w.self.Endpoints = []service.Endpoint{ep(w.podEP, true)}

	w.noLocal = svcPort("shop", "no-local", "", service.TCP, 80)
	w.noLocal.ClusterIPs = addrs("10.96.0.16")
	w.noLocal.NodePort = 30082
	w.noLocal.ExternalPolicyLocal = true
	w.noLocal.Endpoints = webEPs[:1]

	w.internal = svcPort("shop", "internal", "", service.TCP, 80)
	w.internal.ClusterIPs = addrs("10.96.0.17")
	w.internal.InternalPolicyLocal = true
	w.internal.Endpoints = webEPs[:1]
	return w
}

func (w *world) ports() []*service.Port {
	return []*service.Port{w.web, w.sticky, w.dns, w.empty, w.local, w.lb, w.self, w.noLocal, w.internal}
}

func (w *world) snapshot() *service.Snapshot { return snapshot(w.ports()...) }

func (w *world) sync(t testing.TB, p *Proxier, s *service.Snapshot) {
	t.Helper()
	if err := w.tp.Run(testbed.Node, func() error { return p.Sync(s) }); err != nil {
		t.Fatalf("Sync: %v", err)
	}
}

func (w *world) intact(p *Proxier) bool {
	var ok bool
	w.tp.Run(testbed.Node, func() error { ok = p.Intact(); return nil })
	return ok
}

func TestRealNFTablesMode(t *testing.T) {
	testbed.Needs(t, testbed.NFTables)
	w := newWorld(t)
	tp := w.tp
	var p *Proxier
	if err := tp.Run(testbed.Node, func() (err error) {
		p, err = New(Config{Common: proxymode.Common{IPv6: true, ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}}})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	w.sync(t, p, w.snapshot())
	if !p.lastWasFull || !w.intact(p) {
		t.Fatalf("first sync: full %v intact %v, want both", p.lastWasFull, w.intact(p))
	}
	if t.Failed() {
		return
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

	t.Run("chains do not grow with Services", func(t *testing.T) {
		out, err := tp.Exec(testbed.Node, "nft", "list", "table", "inet", "uproxy-kernel")
		if err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		chains := strings.Count(string(out), "chain ")
		// 6 base chains, 7 per family; the affinity Service: one per family.
		if want := 6 + 2*7 + 2; chains != want {
			t.Errorf("chains: got %d, want %d:\n%s", chains, want, out)
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
	check := func(t *testing.T, from, to string, want []string) {
		t.Helper()
		got, _, err := tp.Ask(from, to)
		if err != nil || !inSet(got, want) {
			t.Errorf("%s from %s: got endpoint %q (%v), want one of %q", to, from, got, err, want)
		}
	}
	for _, pt := range []struct {
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
		{"externalTrafficPolicy Local without local endpoints: the node itself reaches any", testbed.Node, w.nodeIPv4.String() + ":30082", w.extV4[:1]},
		{"externalTrafficPolicy Local: its ClusterIP reaches any endpoint", testbed.Pod, "10.96.0.13:80", []string{w.podEP, w.extV4[0]}},
	} {
		t.Run(pt.name, func(t *testing.T) { check(t, pt.from, pt.to, pt.want) })
	}

	t.Run("masquerading: hairpin and external traffic to the node, pods keep their address", func(t *testing.T) {
		for _, c := range []struct{ from, to, want string }{
			{testbed.Pod, "10.96.0.15:80", tp.NS(testbed.Pod).GatewayIPv4.String()},
			{testbed.Pod, "10.96.0.10:80", w.podIPv4.String()},
			{testbed.External, w.nodeIPv4.String() + ":30080", w.nodeIPv4.String()},
		} {
			_, client, err := tp.Ask(c.from, c.to)
			if err != nil {
				t.Fatal(err)
			}
			if host, _, _ := net.SplitHostPort(client); host != c.want {
				t.Errorf("%s from %s: the endpoint saw %s, want %s", c.to, c.from, host, c.want)
			}
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
			got, err := udpAsk(conn, "q")
			conn.Close()
			if want := w.udpEPs[0] + "|q"; got != want {
				t.Errorf("UDP %s from %s: got %q (%v), want %q", c.to, c.from, got, err, want)
			}
		}
	})

	t.Run("UDP client moves when its endpoint is replaced: stale conntrack flow deleted", func(t *testing.T) {
		conn, err := tp.Dial(testbed.Pod, "udp", "10.96.0.53:53")
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		if got, err := udpAsk(conn, "a"); got != w.udpEPs[0]+"|a" {
			t.Fatalf("before: got %q (%v), want %q", got, err, w.udpEPs[0]+"|a")
		}
		moved := *w.dns
		moved.Endpoints = []service.Endpoint{ep(w.udpEPs[1], false)}
		ports := w.ports()
		ports[2] = &moved
		w.sync(t, p, snapshot(ports...))
		// The old endpoint still answers: only the flow's deletion moves the client.
		if got, err := udpAsk(conn, "b"); got != w.udpEPs[1]+"|b" {
			t.Errorf("after the change, same socket: got %q (%v), want %q", got, err, w.udpEPs[1]+"|b")
		}
		w.sync(t, p, w.snapshot())
	})

	t.Run("no endpoints: refused (ClusterIP, IPv6 ClusterIP, NodePort)", func(t *testing.T) {
		for _, c := range []struct{ from, to string }{
			{testbed.Pod, "10.96.0.12:80"},
			{testbed.Node, "10.96.0.12:80"},
			{testbed.Pod, "[fd00:96::12]:80"},
			{testbed.External, w.nodeIPv4.String() + ":30083"},
		} {
			err := tp.DialQuick(c.from, c.to)
			if err == nil || !strings.Contains(err.Error(), "refused") {
				t.Errorf("dial %s from %s: got %v, want connection refused", c.to, c.from, err)
			}
		}
	})

	t.Run("dropped: LB IP from outside loadBalancerSourceRanges, Local policies without local endpoints", func(t *testing.T) {
		for _, c := range []struct{ from, to string }{
			{testbed.External, "10.251.0.7:80"},
			{testbed.Pod, "10.96.0.17:80"},
			{testbed.External, w.nodeIPv4.String() + ":30082"},
		} {
			err := tp.DialQuick(c.from, c.to)
			if err == nil || strings.Contains(err.Error(), "refused") {
				t.Errorf("dial %s from %s: got %v, want a timeout", c.to, c.from, err)
			}
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

	t.Run("ClientIP affinity sticks to one endpoint per client, and clients spread", func(t *testing.T) {
		for _, c := range []struct {
			from, to string
			eps      []string
		}{
			{testbed.Pod, "10.96.0.11:80", w.extV4},
			{testbed.Node, "10.96.0.11:80", w.extV4},
			{testbed.Pod, "[fd00:96::11]:80", w.extV6},
		} {
			seen := map[string]int{}
			for range 30 {
				got, _, err := tp.Ask(c.from, c.to)
				if err != nil {
					t.Fatal(err)
				}
				seen[got]++
			}
			if len(seen) != 1 {
				t.Errorf("endpoints for one client (%s to %s): got %v, want exactly one", c.from, c.to, seen)
			}
			for got := range seen {
				if !inSet(got, c.eps) {
					t.Errorf("%s from %s: got %s, want one of %v", c.to, c.from, got, c.eps)
				}
			}
		}
	})

	t.Run("Find reads the elements of a destination through nft", func(t *testing.T) {
		var found []Element
		err := tp.Run(testbed.Node, func() error {
			nft, err := knftables.New(knftables.InetFamily, "uproxy-kernel")
			if err != nil {
				return err
			}
			found, err = Find(t.Context(), nft, netip.MustParseAddrPort("10.96.0.12:80"), "tcp", false)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		if len(found) != 1 || found[0].Set != "reject4" || found[0].Key != "10.96.0.12 . tcp . 80" || found[0].Service != "shop/empty" {
			t.Errorf("Find(10.96.0.12:80): got %+v, want the reject4 element of shop/empty", found)
		}
		err = tp.Run(testbed.Node, func() error {
			nft, err := knftables.New(knftables.InetFamily, "uproxy-kernel")
			if err != nil {
				return err
			}
			found, err = Find(t.Context(), nft, netip.AddrPortFrom(w.nodeIPv4, 30080), "tcp", true)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		var slots int
		for _, e := range found {
			if e.Set == "np-backends4-3" && e.Service == "shop/web:http" {
				slots++
			}
		}
		if slots != 3 {
			t.Errorf("Find(NodePort 30080): got %+v, want 3 slots of np-backends4-3", found)
		}
	})

	t.Run("partial sync changes one Service's elements", func(t *testing.T) {
		cut := *w.web
		cut.Endpoints = append(append([]service.Endpoint{}, w.web.Endpoints[:2]...), w.web.Endpoints[3:]...)
		ports := w.ports()
		ports[0] = &cut
		w.sync(t, p, snapshot(ports...))
		if p.lastWasFull {
			t.Errorf("sync after an endpoint change: got full, want partial")
		}
		for range 30 {
			check(t, testbed.Pod, "10.96.0.10:80", w.extV4[:2])
		}
		w.sync(t, p, w.snapshot())
		if p.lastWasFull {
			t.Errorf("sync back: got full, want partial")
		}
		check(t, testbed.Pod, "10.96.0.10:80", w.extV4)
	})

	t.Run("element changes over netlink leave what nft would have written", func(t *testing.T) {
		// Every kind of element a partial sync changes: count maps of both
		// families and of NodePorts, key sets (masquerade, Local policy,
		// reject, drop), hairpin pairs; each deleted and added again, with
		// the endpoint counts the table has maps for (a new one goes through
		// nft, with its rule). A second table, written whole by nft at every
		// step, must hold the same elements.
		moved := *w.web
		moved.Endpoints = append([]service.Endpoint{ep(w.podEP, true)}, w.web.Endpoints[1:]...)
		filled := *w.empty
		filled.Endpoints = []service.Endpoint{ep(w.extV4[1], false)}
		emptied := *w.internal
		emptied.Endpoints = nil
		steps := [][]*service.Port{
			{&moved, w.sticky, w.dns, &filled, w.local, w.lb, w.self, w.noLocal, &emptied},
			{&moved, w.sticky, &filled, w.lb, w.self, &emptied}, // dns, local and no-local gone
			w.ports(),
		}
		var whole *Proxier
		if err := tp.Run(testbed.Node, func() (err error) {
			whole, err = New(Config{Common: proxymode.Common{ChainPrefix: "UPXCHK", IPv6: true, ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}}})
			return err
		}); err != nil {
			t.Fatal(err)
		}
		defer tp.Run(testbed.Node, whole.Cleanup)
		before := p.cfg.NFTables
		counting := &countingKernel{Kernel: before}
		p.cfg.NFTables = counting
		defer func() { p.cfg.NFTables = before }()
		for i, ports := range steps {
			w.sync(t, p, snapshot(ports...))
			if p.lastWasFull {
				t.Fatalf("step %d: got a whole write, want a partial one", i)
			}
			whole.mu.Lock()
			whole.written = nil
			whole.mu.Unlock()
			w.sync(t, whole, snapshot(ports...))
			if got, want := elementsIn(t, tp, "uproxy-kernel"), elementsIn(t, tp, "upxchk-kernel"); got != want {
				t.Errorf("step %d: elements after the partial write:\n%s\nwritten whole by nft:\n%s", i, got, want)
			}
		}
		if counting.elementWrites != len(steps) {
			t.Errorf("WriteElements: got %d calls, want %d (one per partial sync)", counting.elementWrites, len(steps))
		}
		if err := tp.Run(testbed.Node, whole.Cleanup); err != nil {
			t.Fatal(err)
		}
		check(t, testbed.Pod, "10.96.0.10:80", w.extV4)
	})

	for _, flush := range []struct {
		name string
		cmd  []string
	}{
		{"nft flush table", []string{"nft", "flush", "table", "inet", "uproxy-kernel"}},
		{"nft delete table", []string{"nft", "delete", "table", "inet", "uproxy-kernel"}},
		{"nft flush ruleset", []string{"nft", "flush", "ruleset"}},
	} {
		t.Run(flush.name+" then Sync restores service", func(t *testing.T) {
			tp.MustExec(t, testbed.Node, flush.cmd...)
			if flush.name == "nft flush ruleset" {
				// The other programs restore their own.
				foreign(t, tp)
			}
			if err := tp.DialQuick(testbed.Pod, "10.96.0.10:80"); err == nil {
				t.Fatalf("dial after the flush: got a connection, want none (nothing should serve the ClusterIP)")
			}
			if w.intact(p) {
				t.Fatalf("Intact after %s: got true, want false", flush.name)
			}
			w.sync(t, p, w.snapshot())
			if !p.lastWasFull || !w.intact(p) {
				t.Errorf("sync after a flush: full %v intact %v, want both", p.lastWasFull, w.intact(p))
			}
			check(t, testbed.Pod, "10.96.0.10:80", w.extV4)
			check(t, testbed.External, w.nodeIPv4.String()+":30080", w.extV4)
			check(t, testbed.Pod, "10.96.0.11:80", w.extV4)
		})
	}

	t.Run("Cleanup restores the ruleset exactly", func(t *testing.T) {
		if err := tp.Run(testbed.Node, p.Cleanup); err != nil {
			t.Fatalf("Cleanup: %v", err)
		}
		if got := tp.NFTRuleset(t); got != w.before {
			t.Errorf("ruleset after Cleanup:\ngot:\n%s\nwant:\n%s", got, w.before)
		}
	})

	t.Run("standalone Cleanup after a fresh Sync restores the ruleset exactly", func(t *testing.T) {
		w.sync(t, p, w.snapshot())
		for range 2 { // the second finds nothing to remove
			if err := tp.Run(testbed.Node, func() error { return Cleanup("") }); err != nil {
				t.Fatalf("Cleanup: %v", err)
			}
			if got := tp.NFTRuleset(t); got != w.before {
				t.Errorf("ruleset after Cleanup:\ngot:\n%s\nwant:\n%s", got, w.before)
			}
		}
	})
}

// countingKernel counts the element writes that went through netlink.
type countingKernel struct {
	nftables.Kernel
	elementWrites int
}

func (k *countingKernel) WriteElements(ctx context.Context, changes nftables.ElementChanges) error {
	k.elementWrites++
	return k.Kernel.WriteElements(ctx, changes)
}

// elementsIn lists every element of every set and map of table (as nft reads
// them back, comments included), sorted: the kernel's order of a hash set's
// elements is its own. The affinity sets, which the kernel fills with
// clients, are left out.
func elementsIn(t *testing.T, tp *testbed.Topology, table string) string {
	t.Helper()
	var lines []string
	err := tp.Run(testbed.Node, func() error {
		nft, err := knftables.New(knftables.InetFamily, table)
		if err != nil {
			return err
		}
		for _, kind := range []string{"set", "map"} {
			names, err := nft.List(t.Context(), kind+"s")
			if err != nil {
				return err
			}
			for _, name := range names {
				if strings.HasPrefix(name, "aff") && kind == "set" {
					continue
				}
				elems, err := nft.ListElements(t.Context(), kind, name)
				if err != nil {
					return err
				}
				for _, e := range elems {
					comment := ""
					if e.Comment != nil {
						comment = *e.Comment
					}
					lines = append(lines, fmt.Sprintf("%s %s: %v -> %v (%s)", kind, name, e.Key, e.Value, comment))
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(lines)
	return strings.Join(lines, "\n")
}
