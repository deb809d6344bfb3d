package proxier

import (
	"bufio"
	"context"
	"net"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/rules"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/socket"
	"github.com/uproxy/uproxy/test/testbed"
)

// askTCP connects to addr and returns the line the backend answers.
func askTCP(addr netip.AddrPort) (string, error) {
	c, err := net.DialTimeout("tcp", addr.String(), 5*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line), err
}

// TestOwnProxySocketsAreNeverDialed: an endpoint that is one of the proxier's
// own proxy sockets is never dialed, whatever address spells it - loopback
// ones, the unspecified ones, IPv4-mapped, the node's own addresses - and
// whether the proxy sockets listen on every address or on one. Each such
// attempt is counted (result own_socket) and the connection is served by
// another endpoint; a Service whose only endpoint is its own proxy port resets
// its client at once. An address the proxy sockets do not listen on is dialed
// as any other endpoint. It runs in a network namespace of its own, whose lo
// also has the node's addresses.
func TestOwnProxySocketsAreNeverDialed(t *testing.T) {
	if !testbed.InOwnNetns(t) {
		return
	}
	// Should a proxier dial itself all the same, the loop ends at the data
	// path's share of this limit instead of the machine's.
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: 2048, Max: 2048}); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"link", "set", "lo", "up"},
		{"addr", "add", "10.1.2.3/32", "dev", "lo"},
		{"-6", "addr", "add", "fd00::3/128", "dev", "lo", "nodad"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
	w := newWorld(t)
	web4, web6 := w.tcpBackend("web", "127.0.0.5"), w.tcpBackend("web", "::1")

	tests := []struct {
		name string
		bind string // --bind-address; "" every address
		// own spell the proxy port; others are local addresses the proxy
		// sockets do not listen on.
		own, others []string
	}{
		{
			name: "proxy sockets on every address",
			own:  []string{"127.0.0.1", "127.0.0.2", "0.0.0.0", "::ffff:127.0.0.1", "10.1.2.3", "::1", "::", "fd00::3"},
		},
		{
			name:   "proxy sockets on 127.0.0.1",
			bind:   "127.0.0.1",
			own:    []string{"127.0.0.1", "0.0.0.0", "::ffff:127.0.0.1"},
			others: []string{"127.0.0.2", "10.1.2.3"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := Config{}
			if tt.bind != "" {
				cfg.BindAddress = netip.MustParseAddr(tt.bind)
			}
			p, err := New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				defer cancel()
				p.Shutdown(ctx)
			})
			svc := port("loop", service.TCP, web4, web6)
			mustSync(t, p, snapshot(svc))
			pp := p.ProxyPort(svc.Name)
			client4 := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(pp))
			client6 := netip.AddrPortFrom(netip.IPv6Loopback(), uint16(pp))

			check := func(spelling string, own bool) {
				t.Helper()
				ep := netip.AddrPortFrom(netip.MustParseAddr(spelling), uint16(pp))
				// A client of the endpoint's family: each family picks from its own.
				client, web := client4, web4
				if ep.Addr().Unmap().Is6() {
					client, web = client6, web6
				}
				if !client.Addr().Is4() && tt.bind != "" {
					return // no IPv6 proxy socket
				}
				mustSync(t, p, snapshot(port("loop", service.TCP, ep, web)))
				for i := range 3 {
					if name, err := askTCP(client); err != nil || name != "web" {
						t.Fatalf("endpoints %v and %v, connection %d: got %q, %v; want web (a proxy that dialed its own socket goes no further)", ep, web, i, name, err)
					}
				}
				refused := counterValue(t, observe.DialAttempts.WithLabelValues(svc.Name.String(), ep.String(), "own_socket"))
				if own && refused == 0 {
					t.Fatalf("endpoint %v is the proxy port: no attempt counted with result own_socket; a proxy that dialed its own socket goes no further", ep)
				}
				if !own && refused != 0 {
					t.Errorf("endpoint %v is no proxy socket: %v attempts counted with result own_socket, want none", ep, refused)
				}
			}
			for _, a := range tt.own {
				check(a, true)
			}
			for _, a := range tt.others {
				check(a, false)
			}

			// Nothing but itself: the client is reset at once.
			self := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(pp))
			mustSync(t, p, snapshot(port("loop", service.TCP, self)))
			if name, err := askTCP(client4); err == nil {
				t.Errorf("the one endpoint being the proxy port: got %q, want the connection reset", name)
			}
			attempts := len(socket.DefaultDialTimeouts)
			if got := counterValue(t, observe.DialAttempts.WithLabelValues(svc.Name.String(), self.String(), "own_socket")); got < float64(attempts) {
				t.Errorf("attempts counted with result own_socket: got %v, want at least the connection's %d", got, attempts)
			}
			for _, st := range p.DebugServices() {
				for _, e := range st.Endpoints {
					if e.ActiveConnections != 0 {
						t.Errorf("endpoint %s: %d active connections, want none", e.Address, e.ActiveConnections)
					}
				}
			}
		})
	}
}

// TestSteeredAddressesReachTheProxy: what the portals steer (a Service's
// ClusterIPs, ExternalIPs and LoadBalancer IPs with its port and protocol, its
// NodePort on the node's addresses) counts as reaching the proxy once steer
// has recorded it, and nothing else does; steer(nil), for dials that pass the
// portals, forgets it.
func TestSteeredAddressesReachTheProxy(t *testing.T) {
	o := &ownSockets{}
	local := map[netip.Addr]bool{netip.MustParseAddr("10.9.0.1"): true}
	o.local.Store(&local)
	ip := netip.MustParseAddr
	o.steer([]rules.Portal{{Port: &service.Port{
		Protocol: service.TCP, Port: 80,
		ClusterIPs:      []netip.Addr{ip("10.96.0.10"), ip("fd00:96::10")},
		ExternalIPs:     []netip.Addr{ip("192.0.2.7")},
		LoadBalancerIPs: []netip.Addr{ip("198.51.100.9")},
		NodePort:        30080,
	}}})
	for _, tc := range []struct {
		proto service.Protocol
		ep    string
		want  bool
	}{
		{service.TCP, "10.96.0.10:80", true},
		{service.TCP, "[::ffff:10.96.0.10]:80", true},
		{service.TCP, "[fd00:96::10]:80", true},
		{service.TCP, "192.0.2.7:80", true},
		{service.TCP, "198.51.100.9:80", true},
		{service.TCP, "10.9.0.1:30080", true},
		{service.TCP, "127.0.0.1:30080", true},
		{service.UDP, "10.96.0.10:80", false},
		{service.TCP, "10.96.0.10:81", false},
		{service.TCP, "10.96.0.11:80", false},
		{service.TCP, "10.244.1.5:30080", false},
	} {
		if got := o.reaches(tc.proto, netip.MustParseAddrPort(tc.ep)); got != tc.want {
			t.Errorf("reaches(%s, %s): got %v, want %v", tc.proto, tc.ep, got, tc.want)
		}
	}
	o.steer(nil)
	if o.reaches(service.TCP, netip.MustParseAddrPort("10.96.0.10:80")) {
		t.Error("reaches a ClusterIP after steer(nil): want not")
	}
}
