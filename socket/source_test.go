package socket

import (
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/uproxy/uproxy/record"
	"github.com/uproxy/uproxy/test/testbed"
)

// startTCPWhoAmI runs a TCP backend on ip that answers each connection with the
// client address it saw, and closes it.
func startTCPWhoAmI(t testing.TB, ip string) netip.AddrPort {
	return startTCPServer(t, ip, func(c *net.TCPConn) {
		c.Write([]byte(c.RemoteAddr().String()))
	}).addr
}

// startUDPWhoAmI runs a UDP backend on ip that answers each datagram with the
// client address it saw.
func startUDPWhoAmI(t testing.TB, ip string) netip.AddrPort {
	t.Helper()
	c := listenUDP(t, ip)
	var wg sync.WaitGroup
	wg.Go(func() {
		buf := make([]byte, 512)
		for {
			_, from, err := c.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			c.WriteToUDPAddrPort([]byte(from.String()), from)
		}
	})
	t.Cleanup(func() { c.Close(); wg.Wait() })
	return udpAddr(c)
}

// A proxy whose KeepClientAddress says so dials from the client's address, so
// the endpoint sees the client; otherwise, and when the endpoint is the client
// itself, from the node's. A transparent socket the kernel refuses falls back to
// the node's address and the connection still goes through: as root an
// endpoint of the other family refuses the bind, without privilege
// IP_TRANSPARENT itself is refused.
func TestKeepClientAddress(t *testing.T) {
	t.Parallel()
	const client = "127.0.0.5"
	root := os.Geteuid() == 0
	clientSource := record.SourceClient
	if !root {
		clientSource = record.SourceFallback
	}
	cases := []struct {
		name       string
		keep       bool
		endpointIP string
		want       record.Source
	}{
		{"node", false, "127.0.0.2", record.SourceNode},
		{"client", true, "127.0.0.2", clientSource},
		{"hairpin", true, client, record.SourceHairpin},
		{"other family", true, "::1", record.SourceFallback},
	}
	for _, proto := range []string{"tcp", "udp"} {
		for _, tc := range cases {
			t.Run(proto+"/"+tc.name, func(t *testing.T) {
				rec := &recorder{}
				keep := func(c netip.Addr) bool {
					if c != netip.MustParseAddr(client) {
						t.Errorf("KeepClientAddress asked of %v, want %s", c, client)
					}
					return tc.keep
				}
				var proxy netip.AddrPort
				if proto == "tcp" {
					ep := startTCPWhoAmI(t, tc.endpointIP)
					proxy = startTCPProxy(t, &TCPProxy{Service: "ns/who:tcp", Picker: newCyclePicker(ep), Observer: rec, KeepClientAddress: keep})
				} else {
					ep := startUDPWhoAmI(t, tc.endpointIP)
					proxy = startUDPProxy(t, &UDPProxy{Service: "ns/who:udp", Picker: newCyclePicker(ep), Observer: rec, KeepClientAddress: keep})
				}
				d := net.Dialer{LocalAddr: localAddr(proto, client), Timeout: awaitTimeout}
				c, err := d.Dial(proto, proxy.String())
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				c.SetDeadline(time.Now().Add(awaitTimeout))
				if proto == "udp" {
					c.Write([]byte("who"))
				}
				buf := make([]byte, 128)
				n, err := c.Read(buf)
				if err != nil {
					t.Fatalf("read the endpoint's answer: %v", err)
				}
				seen, err := netip.ParseAddrPort(string(buf[:n]))
				if err != nil {
					t.Fatalf("endpoint answered %q: %v", buf[:n], err)
				}
				kept := seen.Addr().Unmap() == netip.MustParseAddr(client)
				if wantKept := tc.want == record.SourceClient; kept != wantKept {
					t.Errorf("endpoint saw %v; want the client's address %s: %v", seen, client, wantKept)
				}
				rec.mu.Lock()
				attempts := rec.attempts
				rec.mu.Unlock()
				if len(attempts) != 1 || attempts[0].Source != tc.want || attempts[0].Err != nil {
					t.Errorf("attempts %+v: want one successful, with source %v", attempts, tc.want)
				}
			})
		}
	}
}

// A retry keeps the client's address too: the refused first attempt and the
// one that connects both go from it.
func TestKeepClientAddressRetry(t *testing.T) {
	// Without root TestKeepClientAddress checks the fallback.
	testbed.Needs(t, testbed.Root) // IP_TRANSPARENT needs CAP_NET_ADMIN
	const client = "127.0.0.5"
	rec := &recorder{}
	proxy := startTCPProxy(t, &TCPProxy{Service: "ns/who:tcp", Observer: rec,
		Picker:            newCyclePicker(refusedAddr(t, "127.0.0.3"), startTCPWhoAmI(t, "127.0.0.2")),
		KeepClientAddress: func(netip.Addr) bool { return true }})
	d := net.Dialer{LocalAddr: localAddr("tcp", client), Timeout: awaitTimeout}
	c, err := d.Dial("tcp", proxy.String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(awaitTimeout))
	buf := make([]byte, 128)
	n, err := c.Read(buf)
	if err != nil || !strings.HasPrefix(string(buf[:n]), client+":") {
		t.Fatalf("the endpoint saw %q (%v); want the client's address %s", buf[:n], err, client)
	}
	c.Close()
	conns := rec.awaitClosed(t, 1)
	if a := conns[0].Attempts; len(a) != 2 || a[0].Err == nil || a[0].Source != record.SourceClient || a[1].Err != nil || a[1].Source != record.SourceClient {
		t.Errorf("attempts %+v: want a failed one and a successful one, both from the client's address", a)
	}
}

func localAddr(proto, ip string) net.Addr {
	a := netip.AddrPortFrom(netip.MustParseAddr(ip), 0)
	if strings.HasPrefix(proto, "udp") {
		return net.UDPAddrFromAddrPort(a)
	}
	return net.TCPAddrFromAddrPort(a)
}

// BenchmarkTransparentDial prices a dial from the client's address against one
// from the node's, on the same short connection as BenchmarkTCPConnect (a
// 64-byte request, a 64-byte reply, the backend closing), client, proxy and
// backend in this process on loopback. cpu-us/conn is the process's CPU time
// per connection, all three together; on loopback the client's address is
// local, so this is the three system calls of the socket (source.go), not the
// portals' rules.
func BenchmarkTransparentDial(b *testing.B) {
	testbed.Needs(b, testbed.Root) // IP_TRANSPARENT needs CAP_NET_ADMIN
	for _, keep := range []bool{false, true} {
		name := map[bool]string{false: "node", true: "client"}[keep]
		b.Run(name, func(b *testing.B) {
			backend := startTCPServer(b, "127.0.0.2", replyOnce)
			p := &TCPProxy{Service: "bench/tcp:x", Picker: newCyclePicker(backend.addr),
				KeepClientAddress: func(netip.Addr) bool { return keep }}
			addr := net.TCPAddrFromAddrPort(startTCPProxy(b, p))
			d := net.Dialer{LocalAddr: localAddr("tcp", "127.0.0.5")}
			cpu := processCPU(b)
			elapsed := shortConnections(b, func() (net.Conn, error) { return d.Dial("tcp", addr.String()) })
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "conns/s")
			b.ReportMetric(float64((processCPU(b)-cpu).Microseconds())/float64(b.N), "cpu-us/conn")
		})
	}
}
