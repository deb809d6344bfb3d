package iptables

import (
	"net"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/test/testbed"
)

// TestRealLocalhostNodePorts serves NodePorts on 127.0.0.0/8 in a node of its
// own: connections from the node to 127.0.0.1:NodePort reach an endpoint on
// another host, masqueraded, and are counted; ::1 serves nothing (IPv6 has no
// route_localnet); and the guard keeps the other host away from the node's
// loopback services, which route_localnet would otherwise expose.
func TestRealLocalhostNodePorts(t *testing.T) {
	testbed.Needs(t, testbed.IPTables)
	w := newWorld(t)
	tp := w.tp
	node := tp.NS(testbed.Node)
	sysctl := func(role, key string) string {
		t.Helper()
		out, err := tp.Exec(role, "sysctl", "-n", key)
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(string(out))
	}
	if got := sysctl(testbed.Node, routeLocalnet); got != "0" {
		t.Fatalf("route_localnet before the first sync: got %s, want 0", got)
	}
	var p *Proxier
	if err := tp.Run(testbed.Node, func() (err error) {
		p, err = New(Config{Common: proxymode.Common{IPv6: true}, LocalhostNodePorts: true})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	w.sync(t, p, w.snapshot())
	if got := sysctl(testbed.Node, routeLocalnet); got != "1" {
		t.Errorf("route_localnet after the first sync: got %s, want 1", got)
	}

	t.Run("what was written is what iptables-save reads back", func(t *testing.T) {
		// The shared nat chains are edited against the kernel's text after a
		// restart: a rule written in another spelling would be rewritten.
		saved := tp.SavedRules(t, false)
		for _, line := range strings.Split(string(p.fams[0].sharedNAT)+string(p.fams[0].sharedFilter), "\n") {
			ours := strings.Contains(line, "127.0.0.0/8") || strings.HasPrefix(line, "-A UPROXY-NODEPORTS ")
			if ours && !strings.Contains(saved, line+"\n") {
				t.Errorf("rule %q not in iptables-save as written:\n%s", line, saved)
			}
		}
		for _, want := range []string{"-m nfacct --nfacct-name  uproxy_localhost_nps_pkts", guardRule, strings.TrimPrefix(inputJump, "filter "), strings.TrimPrefix(outputJump, "filter ")} {
			if !strings.Contains(saved, want) {
				t.Errorf("iptables-save lacks %q", want)
			}
		}
	})

	before, counting, err := p.LocalhostNodePortPackets()
	if err != nil || !counting {
		t.Fatalf("LocalhostNodePortPackets: counting %v, %v; want counting", counting, err)
	}
	const conns = 10
	t.Run("TCP from the node to 127.0.0.1:NodePort reaches an endpoint, masqueraded", func(t *testing.T) {
		for _, to := range []string{"127.0.0.1:30080", "127.0.0.2:30080"} {
			for range conns / 2 {
				got, client, err := tp.Ask(testbed.Node, to)
				if err != nil {
					t.Fatalf("%s from the node: %v", to, err)
				}
				if host, _, _ := net.SplitHostPort(client); !inList(got, w.extV4) || host != node.IPv4.String() {
					t.Fatalf("%s from the node: got endpoint %s seeing %s, want one of %q seeing the node's %s", to, got, client, w.extV4, node.IPv4)
				}
			}
		}
	})
	t.Run("the count grows by the connections", func(t *testing.T) {
		after, _, err := p.LocalhostNodePortPackets()
		if err != nil || after-before != conns {
			t.Errorf("localhost NodePort packets: got %d more (%v), want %d", after-before, err, conns)
		}
	})
	t.Run("externalTrafficPolicy Local from 127.0.0.1: masqueraded to every endpoint", func(t *testing.T) {
		got, client, err := tp.Ask(testbed.Node, "127.0.0.1:30081")
		if host, _, _ := net.SplitHostPort(client); err != nil || (got != w.podEP && got != w.extV4[0]) || strings.HasPrefix(host, "127.") {
			t.Errorf("127.0.0.1:30081: got %s seeing %s (%v), want an endpoint seeing a node address", got, client, err)
		}
	})
	t.Run("UDP from the node to 127.0.0.1:NodePort", func(t *testing.T) {
		c, err := tp.Dial(testbed.Node, "udp", "127.0.0.1:30053")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(testbed.DialTimeout))
		c.Write([]byte("q"))
		buf := make([]byte, 100)
		n, err := c.Read(buf)
		if want := w.udpEP + "|q"; string(buf[:n]) != want {
			t.Errorf("UDP 127.0.0.1:30053: got %q (%v), want %q", buf[:n], err, want)
		}
	})
	t.Run("[::1]:NodePort is not served", func(t *testing.T) {
		if err := tp.DialQuick(testbed.Node, "[::1]:30080"); err == nil {
			t.Errorf("[::1]:30080 from the node: got a connection, want none (IPv6 has no route_localnet)")
		}
	})
	t.Run("NodePorts on the node IP still answer", func(t *testing.T) {
		if got, _, err := tp.Ask(testbed.External, node.IPv4.String()+":30080"); err != nil || !inList(got, w.extV4) {
			t.Errorf("NodePort from external: got %q (%v)", got, err)
		}
	})

	t.Run("a restarted mode takes its rules and count over", func(t *testing.T) {
		var again *Proxier
		if err := tp.Run(testbed.Node, func() (err error) {
			again, err = New(Config{Common: proxymode.Common{IPv6: true}, LocalhostNodePorts: true})
			return err
		}); err != nil {
			t.Fatal(err)
		}
		w.sync(t, again, w.snapshot())
		if got, _, err := tp.Ask(testbed.Node, "127.0.0.1:30080"); err != nil || !inList(got, w.extV4) {
			t.Errorf("127.0.0.1:30080 after a restart: got %q (%v)", got, err)
		}
		// conns, the Local and the UDP NodePort's, and this one.
		if n, _, err := again.LocalhostNodePortPackets(); err != nil || n != before+conns+3 {
			t.Errorf("count after a restart and one more connection: got %d (%v), want %d kept and grown", n, err, before+conns+3)
		}
	})

	t.Run("another host cannot reach the node's loopback services", func(t *testing.T) {
		// A service only the node should reach, and a host next to it that
		// routes 127.0.0.53 to the node, as an attacker on the link would
		// (CVE-2020-8558).
		secret := tp.Listen(testbed.Node, "tcp", "127.0.0.53:7777")
		go testbed.ServeIdentity(secret)
		for _, cmd := range [][]string{
			{"sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1"},
			{"ip", "rule", "add", "pref", "100", "lookup", "local"},
			{"ip", "rule", "del", "pref", "0"},
			{"ip", "route", "add", "127.0.0.53/32", "via", node.IPv4.String(), "table", "100"},
			{"ip", "rule", "add", "pref", "10", "to", "127.0.0.53/32", "lookup", "100"},
		} {
			tp.MustExec(t, testbed.External, cmd...)
		}
		if err := tp.DialQuick(testbed.External, "127.0.0.53:7777"); err == nil {
			t.Errorf("the node's 127.0.0.53:7777 from the host next to it: got a connection, want it dropped")
		}
		// The same path without the guard: the test can tell.
		tp.MustExec(t, testbed.Node, "iptables", "-F", p.n.blockLocalnet)
		if got, _, err := tp.Ask(testbed.External, "127.0.0.53:7777"); err != nil || got != "127.0.0.53:7777" {
			t.Fatalf("without the guard: got %q (%v), want the loopback service reached (else this test cannot fail)", got, err)
		}
		p.fams[0].written = nil // a whole sync writes the guard again
		w.sync(t, p, w.snapshot())
		if err := tp.DialQuick(testbed.External, "127.0.0.53:7777"); err == nil {
			t.Errorf("after a whole sync: the loopback service is reachable again from the next host")
		}
		// The node itself still reaches it.
		if got, _, err := tp.Ask(testbed.Node, "127.0.0.53:7777"); err != nil || got != "127.0.0.53:7777" {
			t.Errorf("the node to its own 127.0.0.53:7777: got %q (%v)", got, err)
		}
	})

	t.Run("Cleanup removes the guard and the counter, and leaves route_localnet", func(t *testing.T) {
		if err := tp.Run(testbed.Node, p.Cleanup); err != nil {
			t.Fatal(err)
		}
		if got := tp.SavedRules(t, false); got != w.before[0] {
			t.Errorf("IPv4 after Cleanup:\ngot:\n%s\nwant:\n%s", got, w.before[0])
		}
		if got := sysctl(testbed.Node, routeLocalnet); got != "1" {
			t.Errorf("route_localnet after Cleanup: got %s, want 1 (kube-proxy leaves it too)", got)
		}
		// The counter is gone: a rule naming it is refused again.
		if out, err := tp.Exec(testbed.Node, "iptables", "-A", "OUTPUT", "-m", "nfacct", "--nfacct-name", "uproxy_localhost_nps_pkts"); err == nil {
			t.Errorf("a rule naming the counter after Cleanup: accepted (%s), want refused: the counter should be gone", out)
		}
	})
}

func inList(s string, list []string) bool {
	for _, l := range list {
		if l == s {
			return true
		}
	}
	return false
}
