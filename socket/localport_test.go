package socket

import (
	"bufio"
	"errors"
	"net"
	"net/netip"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/uproxy/uproxy/test/testbed"
)

// A node can run out of local ports toward one endpoint: every ephemeral port
// already carries a connection to it (in TIME_WAIT, mostly, after clients that
// closed first). That is the node's shortage, not the endpoint's failure: the
// attempt is recorded, the connection goes on to another endpoint at once, and
// the endpoint is not reported failed (the balancer would eject it) nor charged
// to the retry budget. A UDP client whose endpoint socket finds no port is
// turned away without a report against the endpoint either.
//
// The test runs in a network namespace of its own, with four ephemeral ports,
// two endpoints on addresses of lo that are not loopback addresses (so the
// kernel's reuse of TIME_WAIT ports for loopback does not apply), and every port
// toward the first endpoint held by an open connection.
func TestDialOutOfLocalPorts(t *testing.T) {
	if !testbed.InOwnNetns(t) {
		return
	}
	lo := loUp(t)
	a, b := netip.MustParseAddrPort("10.9.0.1:8080"), netip.MustParseAddrPort("10.9.0.2:8080")
	for _, ep := range []netip.AddrPort{a, b} {
		addr, _ := netlink.ParseAddr(ep.Addr().String() + "/32")
		if err := netlink.AddrAdd(lo, addr); err != nil {
			t.Fatal(err)
		}
	}
	for file, value := range map[string]string{"ip_local_port_range": "40000 40003", "tcp_tw_reuse": "0"} {
		if err := os.WriteFile("/proc/sys/net/ipv4/"+file, []byte(value), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, ep := range []netip.AddrPort{a, b} {
		ln, err := net.Listen("tcp", ep.String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close() })
		go testbed.ServeIdentity(ln)
	}

	picker := newCyclePicker(a, b)
	rec := &recorder{}
	p := &TCPProxy{Service: "ns/ports:tcp", Picker: picker, Observer: rec, RetryBudget: 10,
		DialTimeouts: []time.Duration{time.Second, time.Second}}
	// The proxy listens first: its port, bound, is one of the four.
	proxy := startTCPProxy(t, p)
	holdPortsToward(t, a)
	tokens := p.RetryTokens()

	const conns = 3
	for i := range conns {
		c, err := net.DialTimeout("tcp", proxy.String(), 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(5 * time.Second))
		line, err := bufio.NewReader(c).ReadString('\n')
		c.Close()
		if served, _, _ := strings.Cut(line, "|"); err != nil || served != b.String() {
			t.Fatalf("connection %d: read %q, %v; want it served by %s, the endpoint with ports left", i, line, err, b)
		}
	}
	for i, c := range rec.awaitClosed(t, conns) {
		if len(c.Attempts) != 2 || c.Attempts[0].Endpoint != a || !errors.Is(c.Attempts[0].Err, syscall.EADDRNOTAVAIL) ||
			c.Attempts[1].Endpoint != b || c.Attempts[1].Err != nil || c.Err != nil {
			t.Errorf("connection %d: attempts %+v, err %v; want %s failing with EADDRNOTAVAIL, then %s connecting", i, c.Attempts, c.Err, a, b)
		}
	}
	for _, r := range picker.dialReports() {
		if r.failed {
			t.Errorf("picker told %s failed (%v); want no failure reported for a node out of local ports", r.ep, r.err)
		}
	}
	if got := p.RetryTokens(); got < tokens {
		t.Errorf("retry budget: %.2f tokens after %d retries past a port shortage, %.2f before; want none spent", got, conns, tokens)
	}

	t.Run("udp", func(t *testing.T) {
		picker := newCyclePicker(netip.MustParseAddrPort("10.9.0.1:53"))
		rec := &recorder{}
		udp := &UDPProxy{Service: "ns/ports:udp", Picker: picker, Observer: rec}
		proxy := startUDPProxy(t, udp)
		client, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
		if err != nil {
			t.Fatal(err)
		}
		defer client.Close()
		// Every other port of the range bound: the endpoint socket's connect
		// finds none for itself.
		for port := 40000; port <= 40003; port++ {
			if held, err := net.ListenUDP("udp4", &net.UDPAddr{Port: port}); err == nil {
				defer held.Close()
			}
		}
		if _, err := client.WriteToUDPAddrPort([]byte("q"), proxy); err != nil {
			t.Fatal(err)
		}
		closed := rec.awaitClosed(t, 1)
		if err := closed[0].Err; !errors.Is(err, syscall.EAGAIN) || !strings.Contains(err.Error(), "no local port") {
			t.Errorf("UDP client turned away with %v; want the endpoint socket's EAGAIN, named as no local port", err)
		}
		if reports := picker.dialReports(); len(reports) != 0 {
			t.Errorf("picker told %+v; want nothing reported for a node out of local ports", reports)
		}
	})
}

// holdPortsToward opens connections to ep until the kernel has no local port left
// for another (EADDRNOTAVAIL), and keeps them open until the test ends.
func holdPortsToward(t *testing.T, ep netip.AddrPort) {
	t.Helper()
	for range 8 {
		c, err := net.DialTimeout("tcp", ep.String(), 5*time.Second)
		if errors.Is(err, syscall.EADDRNOTAVAIL) {
			return
		}
		if err != nil {
			t.Fatalf("dial %s: got %v, want a connection or EADDRNOTAVAIL", ep, err)
		}
		t.Cleanup(func() { c.Close() })
	}
	t.Fatalf("8 connections to %s and still local ports left; want the range of four exhausted", ep)
}
