package rules

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/test/testbed"
)

// countingProxy stands in for a proxy port: an echo server on the node that
// counts what reaches it (TCP connections accepted, UDP datagrams read), so a
// test can tell a refusal at the portal from a connection accepted and reset.
type countingProxy struct {
	tcp, udp           int
	accepted, datagram atomic.Int64
}

func newCountingProxy(tp *testbed.Topology) *countingProxy {
	cp := &countingProxy{}
	ln := tp.Listen(testbed.Node, "tcp", ":0")
	cp.tcp = ln.Addr().(*net.TCPAddr).Port
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			cp.accepted.Add(1)
			go func() {
				defer c.Close()
				io.Copy(c, c)
			}()
		}
	}()
	pc := tp.ListenPacket(testbed.Node, "udp", ":0")
	cp.udp = pc.LocalAddr().(*net.UDPAddr).Port
	go func() {
		buf := make([]byte, 64<<10)
		for {
			n, from, err := pc.ReadFrom(buf)
			if errors.Is(err, net.ErrClosed) {
				return
			}
			if err == nil {
				cp.datagram.Add(1)
				pc.WriteTo(buf[:n], from)
			}
		}
	}()
	return cp
}

// refusedTCP reports why a TCP connect from role to addr was not refused at
// once (nil when it was: ECONNREFUSED, no connection ever established).
func refusedTCP(tp *testbed.Topology, role, addr string) error {
	c, err := tp.Dial(role, "tcp", addr)
	if err == nil {
		c.Close()
		return errors.New("connected, want ECONNREFUSED")
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		return fmt.Errorf("got %v, want ECONNREFUSED", err)
	}
	return nil
}

// refusedUDP reports why a datagram sent on c was not refused (nil when it
// was: the connected socket's next read fails with ECONNREFUSED, the ICMP
// port unreachable the portal answered with). On the node the send itself
// fails too, with EPERM: the output hook rejected the datagram (as with
// kube-proxy's rejects); the ICMP error is queued on the socket all the same.
func refusedUDP(c net.Conn) error {
	c.SetDeadline(time.Now().Add(testbed.DialTimeout))
	if _, err := c.Write([]byte("ping")); err != nil && !errors.Is(err, syscall.EPERM) {
		return fmt.Errorf("write: got %v, want success or EPERM", err)
	}
	buf := make([]byte, 16)
	n, err := c.Read(buf)
	if err == nil {
		return fmt.Errorf("got the reply %q, want ECONNREFUSED", buf[:n])
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		return fmt.Errorf("read: got %v, want ECONNREFUSED", err)
	}
	return nil
}

// echoes reports why an exchange on c did not come back.
func echoes(c net.Conn, msg string) error {
	if got, err := exchange(c, msg, len(msg)); got != msg {
		return fmt.Errorf("got %q (%v), want %q", got, err, msg)
	}
	return nil
}

// TestRealRefusedWithoutEndpoints: with real rules in a network namespace, a
// Service port without endpoints is refused at the portal, before any socket
// (the proxy port stays open and sees nothing): a TCP connect fails with
// ECONNREFUSED and a connected UDP socket gets ECONNREFUSED, from a pod, from
// the node and from another host, to ClusterIPs of both families, an
// ExternalIP, a LoadBalancer IP and NodePorts. An endpoint makes the same
// paths reach the proxy port; losing it refuses them again, including for a
// UDP client that kept its socket. Both backends.
func TestRealRefusedWithoutEndpoints(t *testing.T) {
	testbed.Needs(t, testbed.Netns)
	for _, b := range realBackends {
		t.Run(b.name, func(t *testing.T) { testRealRefused(t, b) })
	}
}

func testRealRefused(t *testing.T, b realBackend) {
	tp, before := kubeNode(t, b)
	node := tp.NS(testbed.Node)
	// The node answers refused UDP with ICMP, which it rate-limits per
	// destination host; every check here sends one.
	tp.MustExec(t, testbed.Node, "sysctl", "-q", "-w", "net.ipv4.icmp_ratelimit=0")
	tp.MustExec(t, testbed.Node, "sysctl", "-q", "-w", "net.ipv6.icmp.ratelimit=0")

	proxy := newCountingProxy(tp)
	web := webPort(30080)
	dns := dnsPort(30053, "10.96.0.53", "fd00:96::53")
	other := port("shop", "other", "", service.TCP, 80)
	other.ClusterIPs = ips("10.96.0.80")
	// The proxier's Refusal of a Service port without endpoints, and with one.
	noEndpoints, oneEndpoint := RefusalOf(nil, nil), RefusalOf(
		[]netip.AddrPort{netip.MustParseAddrPort("10.244.0.5:8080"), netip.MustParseAddrPort("[fd00:244::5]:8080")},
		[]netip.AddrPort{netip.MustParseAddrPort("10.244.0.5:8080"), netip.MustParseAddrPort("[fd00:244::5]:8080")})
	portals := func(r Refusal) []Portal {
		return []Portal{
			{Port: dns, ProxyPort: proxy.udp, Refuse: r},
			{Port: other, ProxyPort: proxy.tcp},
			{Port: web, ProxyPort: proxy.tcp, Refuse: r},
		}
	}
	p, writes := b.build(t, Config{NodeIPs: []netip.Addr{node.IPv4, node.IPv6}, IPv6: true, DialMark: testDialMark})
	// Cleanup runs even when a check below fails, as t.Cleanup: the
	// namespaces go anyway, but a Cleanup that fails is a failure.
	cleaned := false
	t.Cleanup(func() {
		if !cleaned {
			tp.Run(testbed.Node, p.Cleanup)
		}
	})
	sync := func(t *testing.T, r Refusal) {
		t.Helper()
		if err := tp.Run(testbed.Node, func() error { return p.Sync(portals(r)) }); err != nil {
			t.Fatalf("Sync: %v", err)
		}
	}

	at := func(ip netip.Addr, port int) string { return netip.AddrPortFrom(ip, uint16(port)).String() }
	tcpPaths := []struct{ name, from, to string }{
		{"ClusterIP from pod", testbed.Pod, at(web.ClusterIPs[0], 80)},
		{"ClusterIP from node", testbed.Node, at(web.ClusterIPs[0], 80)},
		{"IPv6 ClusterIP from pod", testbed.Pod, at(web.ClusterIPs[1], 80)},
		{"IPv6 ClusterIP from node", testbed.Node, at(web.ClusterIPs[1], 80)},
		{"ExternalIP from external", testbed.External, at(web.ExternalIPs[0], 80)},
		{"IPv6 ExternalIP from pod", testbed.Pod, at(web.ExternalIPs[1], 80)},
		{"LoadBalancer IP from external", testbed.External, at(web.LoadBalancerIPs[0], 80)},
		{"NodePort from external", testbed.External, at(node.IPv4, 30080)},
		{"IPv6 NodePort from external", testbed.External, at(node.IPv6, 30080)},
		{"NodePort from node", testbed.Node, at(node.IPv4, 30080)},
	}
	udpPaths := []struct{ name, from, to string }{
		{"ClusterIP from pod", testbed.Pod, at(dns.ClusterIPs[0], 53)},
		{"ClusterIP from node", testbed.Node, at(dns.ClusterIPs[0], 53)},
		{"IPv6 ClusterIP from pod", testbed.Pod, at(dns.ClusterIPs[1], 53)},
		{"IPv6 ClusterIP from node", testbed.Node, at(dns.ClusterIPs[1], 53)},
		{"NodePort from external", testbed.External, at(node.IPv4, 30053)},
	}
	// udpClients are connected sockets kept across the flips, one per path:
	// a client that keeps its flow must be refused again once the endpoint goes.
	udpClients := make([]net.Conn, len(udpPaths))
	for i, pt := range udpPaths {
		c, err := tp.Dial(pt.from, "udp", pt.to)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		udpClients[i] = c
	}
	refused := func(t *testing.T) {
		t.Helper()
		accepted, datagrams := proxy.accepted.Load(), proxy.datagram.Load()
		for _, pt := range tcpPaths {
			if err := refusedTCP(tp, pt.from, pt.to); err != nil {
				t.Errorf("TCP %s (%s): %v", pt.name, pt.to, err)
			}
		}
		for i, pt := range udpPaths {
			if err := refusedUDP(udpClients[i]); err != nil {
				t.Errorf("UDP %s (%s): %v", pt.name, pt.to, err)
			}
		}
		if n := proxy.accepted.Load() - accepted; n != 0 {
			t.Errorf("the proxy port accepted %d connections, want 0: refused at the portal, not accepted and reset", n)
		}
		if n := proxy.datagram.Load() - datagrams; n != 0 {
			t.Errorf("the proxy port read %d datagrams, want 0", n)
		}
		// A Service port with endpoints is steered meanwhile.
		c, err := tp.Dial(testbed.Pod, "tcp", "10.96.0.80:80")
		if err != nil {
			t.Fatalf("TCP to a Service port with endpoints: %v", err)
		}
		defer c.Close()
		if err := echoes(c, "other"); err != nil {
			t.Errorf("TCP to a Service port with endpoints: %v", err)
		}
	}
	steered := func(t *testing.T) {
		t.Helper()
		for _, pt := range tcpPaths {
			c, err := tp.Dial(pt.from, "tcp", pt.to)
			if err != nil {
				t.Errorf("TCP %s (%s): %v, want the proxy port", pt.name, pt.to, err)
				continue
			}
			if err := echoes(c, "tcp "+pt.name); err != nil {
				t.Errorf("TCP %s (%s): %v", pt.name, pt.to, err)
			}
			c.Close()
		}
		for i, pt := range udpPaths {
			if err := echoes(udpClients[i], "udp "+pt.name); err != nil {
				t.Errorf("UDP %s (%s), the client's socket kept: %v", pt.name, pt.to, err)
			}
		}
	}

	sync(t, noEndpoints)
	t.Run("the kernel holds the rejects as written", func(t *testing.T) {
		if ipt, ok := p.(*IPTables); ok {
			for f := v4; f <= v6; f++ {
				got := tp.SavedRules(t, f == v6)
				for line := range strings.Lines(string(ipt.fams[f].written)) {
					if strings.HasPrefix(line, "-A ") && !strings.Contains(got, line) {
						t.Errorf("%s: rule %q missing from iptables-save:\n%s", familyName(f), line, got)
					}
				}
			}
			return
		}
		out, err := tp.Exec(testbed.Node, "nft", "list", "table", "inet", "uproxy")
		if err != nil {
			t.Fatal(err)
		}
		for _, want := range []string{
			`10.96.0.10 . tcp . 80 comment "shop/web:http" : goto refuse`,
			`fd00:96::53 . udp . 53 comment "kube-system/dns:dns" : goto refuse`,
			`udp . 30053 comment "kube-system/dns:dns" : goto refuse`,
			"type filter hook forward priority -110; policy accept;",
			"meta l4proto tcp reject with tcp reset",
		} {
			if !strings.Contains(string(out), want) {
				t.Errorf("nft list table lacks %q:\n%s", want, out)
			}
		}
	})
	t.Run("no endpoints: refused", refused)
	t.Run("an ExternalIP the node does not own is not refused from the node", func(t *testing.T) {
		// The node's own connections are steered to an ExternalIP only when
		// it owns the address; otherwise they reach the real host, refused or not.
		tp.MustExec(t, testbed.External, "ip", "addr", "add", "10.250.0.5/32", "dev", "lo")
		defer tp.MustExec(t, testbed.External, "ip", "addr", "del", "10.250.0.5/32", "dev", "lo")
		go testbed.ServeIdentity(tp.Listen(testbed.External, "tcp", "10.250.0.5:80"))
		if got, _, err := tp.Ask(testbed.Node, "10.250.0.5:80"); err != nil || got != "10.250.0.5:80" {
			t.Errorf("node to ExternalIP: got %q (%v), want the real host 10.250.0.5:80", got, err)
		}
	})
	t.Run("an endpoint appears: steered to the proxy port", func(t *testing.T) {
		n := *writes
		sync(t, oneEndpoint)
		// One restore per family, or one nftables transaction: incremental.
		if got, want := *writes-n, map[string]int{"iptables": 2, "nftables": 1}[b.name]; got != want {
			t.Errorf("writes: got %d, want %d", got, want)
		}
		steered(t)
	})
	t.Run("the last endpoint goes: refused again", func(t *testing.T) {
		sync(t, noEndpoints)
		refused(t)
	})
	t.Run("Cleanup restores the ruleset exactly", func(t *testing.T) {
		cleaned = true
		if err := tp.Run(testbed.Node, p.Cleanup); err != nil {
			t.Fatalf("Cleanup: %v", err)
		}
		if got := rulesets(t, tp); got != before {
			t.Errorf("after Cleanup:\ngot:\n%s\nwant:\n%s", got, before)
		}
	})
}
