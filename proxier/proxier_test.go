package proxier

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/service/servicetest"
	"github.com/uproxy/uproxy/test/testbed"
)

// world is a test's little universe: named TCP and UDP backends on loopback
// addresses, each answering with its own name.
type world struct {
	t        testing.TB
	backends map[string]netip.AddrPort
}

func newWorld(t testing.TB) *world { return &world{t: t, backends: map[string]netip.AddrPort{}} }

// tcpBackend starts a TCP server on ip:0 that answers every connection with
// "name\n" and closes.
func (w *world) tcpBackend(name, ip string) netip.AddrPort {
	ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		w.t.Fatal(err)
	}
	w.t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if errors.Is(err, net.ErrClosed) {
				return
			}
			if err != nil {
				// Out of descriptors (TestOutOfFileDescriptors): Linux
				// fails accept so even with no connection queued. A server
				// waits and accepts again.
				time.Sleep(10 * time.Millisecond)
				continue
			}
			io.WriteString(c, name+"\n")
			c.Close()
		}
	}()
	ap := ln.Addr().(*net.TCPAddr).AddrPort()
	w.backends[name] = ap
	return ap
}

// udpBackend answers every datagram with "name:" + datagram.
func (w *world) udpBackend(name, ip string) netip.AddrPort {
	pc, err := net.ListenPacket("udp", net.JoinHostPort(ip, "0"))
	if err != nil {
		w.t.Fatal(err)
	}
	w.t.Cleanup(func() { pc.Close() })
	go func() {
		buf := make([]byte, 65536)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			pc.WriteTo(append([]byte(name+":"), buf[:n]...), from)
		}
	}()
	ap := pc.LocalAddr().(*net.UDPAddr).AddrPort()
	w.backends[name] = ap
	return ap
}

// port is Service port default/name:p, port 80 of ClusterIP 10.96.0.1, with
// ready endpoints at eps.
func port(name string, proto service.Protocol, eps ...netip.AddrPort) *service.Port {
	p := servicetest.Port("default", name, "p", proto, 80)
	p.ClusterIPs = servicetest.Addrs("10.96.0.1")
	for _, ep := range eps {
		p.Endpoints = append(p.Endpoints, servicetest.Endpoint(ep.String(), false))
	}
	return p
}

var snapshot = servicetest.Snapshot

func newProxier(t testing.TB, cfg Config) *Proxier {
	t.Helper()
	cfg.BindAddress = netip.MustParseAddr("127.0.0.1")
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		p.Shutdown(ctx)
	})
	return p
}

func mustSync(t testing.TB, p *Proxier, s *service.Snapshot) {
	t.Helper()
	if err := p.Sync(s); err != nil {
		t.Fatalf("Sync: %v", err)
	}
}

// getTCP connects to the proxy port and returns the backend's name.
func getTCP(t testing.TB, proxyPort int) (string, error) {
	c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", proxyPort), 5*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line), err
}

func TestSyncServesTCPAndUDP(t *testing.T) {
	w := newWorld(t)
	a := w.tcpBackend("a", "127.0.0.2")
	b := w.tcpBackend("b", "127.0.0.3")
	u := w.udpBackend("u", "127.0.0.4")
	p := newProxier(t, Config{})
	mustSync(t, p, snapshot(port("tcp", service.TCP, a, b), port("udp", service.UDP, u)))

	tcpPort := p.ProxyPort(service.PortName{Namespace: "default", Name: "tcp", Port: "p"})
	seen := map[string]int{}
	for i := 0; i < 4; i++ {
		got, err := getTCP(t, tcpPort)
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		seen[got]++
	}
	if seen["a"] != 2 || seen["b"] != 2 {
		t.Errorf("round robin over 4 connections: got %v, want a:2 b:2", seen)
	}

	udpPort := p.ProxyPort(service.PortName{Namespace: "default", Name: "udp", Port: "p"})
	if got, err := pingUDP(t, udpPort); err != nil || got != "u:ping" {
		t.Errorf("UDP reply: got %q, %v; want %q", got, err, "u:ping")
	}
}

func TestEndpointChangeKeepsProxyPort(t *testing.T) {
	w := newWorld(t)
	a := w.tcpBackend("a", "127.0.0.2")
	b := w.tcpBackend("b", "127.0.0.3")
	p := newProxier(t, Config{})
	name := service.PortName{Namespace: "default", Name: "tcp", Port: "p"}
	mustSync(t, p, snapshot(port("tcp", service.TCP, a)))
	before := p.ProxyPort(name)

	mustSync(t, p, snapshot(port("tcp", service.TCP, b)))
	if after := p.ProxyPort(name); after != before {
		t.Fatalf("proxy port after endpoint change: got %d, want %d", after, before)
	}
	for i := 0; i < 3; i++ {
		if got, err := getTCP(t, before); err != nil || got != "b" {
			t.Fatalf("after endpoint change: got %q, %v; want b", got, err)
		}
	}
}

func TestRemovedPortCloses(t *testing.T) {
	w := newWorld(t)
	a := w.tcpBackend("a", "127.0.0.2")
	p := newProxier(t, Config{})
	mustSync(t, p, snapshot(port("tcp", service.TCP, a), port("other", service.TCP, a)))
	pp := p.ProxyPort(service.PortName{Namespace: "default", Name: "tcp", Port: "p"})
	mustSync(t, p, snapshot(port("other", service.TCP, a)))
	if got := p.ProxyPort(service.PortName{Namespace: "default", Name: "tcp", Port: "p"}); got != 0 {
		t.Errorf("removed port still has proxy port %d", got)
	}
	if _, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", pp), time.Second); err == nil {
		t.Errorf("dial of removed proxy port %d succeeded, want refused", pp)
	}
	if got := len(p.DebugServices()); got != 1 {
		t.Errorf("DebugServices: got %d ports, want 1", got)
	}
}

func TestProtocolChangeReopens(t *testing.T) {
	w := newWorld(t)
	u := w.udpBackend("u", "127.0.0.2")
	a := w.tcpBackend("a", "127.0.0.2")
	p := newProxier(t, Config{})
	mustSync(t, p, snapshot(port("svc", service.TCP, a)))
	mustSync(t, p, snapshot(port("svc", service.UDP, u)))
	st := p.DebugServices()
	if len(st) != 1 || st[0].Protocol != "UDP" {
		t.Fatalf("after protocol change: got %+v, want one UDP port", st)
	}
}

func TestPortRange(t *testing.T) {
	w := newWorld(t)
	a := w.tcpBackend("a", "127.0.0.2")
	// Find two free adjacent-ish ports by asking the kernel, then use a range of
	// exactly those two: the third Service must fail, the first two must work.
	var free []int
	for len(free) < 2 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		pn := ln.Addr().(*net.TCPAddr).Port
		ln.Close()
		if len(free) == 0 || pn == free[0]+1 {
			free = append(free, pn)
		} else {
			free = []int{pn}
			// Try pn+1 directly.
			if l2, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", pn+1)); err == nil {
				l2.Close()
				free = append(free, pn+1)
			}
		}
	}
	r := PortRange{First: free[0], Last: free[1]}
	p := newProxier(t, Config{PortRange: r})
	if err := p.Sync(snapshot(port("one", service.TCP, a), port("three", service.TCP, a), port("two", service.TCP, a))); err != nil {
		t.Fatalf("Sync: got %v, want nil: one Service port's problem must not fail the sync", err)
	}
	if errs := p.PortErrors(); len(errs) != 1 || !strings.Contains(errs[0].Error(), "default/two:p") {
		t.Fatalf("third port in a range of two: got port errors %v, want one naming default/two:p", errs)
	}
	for _, n := range []string{"one", "three"} {
		pp := p.ProxyPort(service.PortName{Namespace: "default", Name: n, Port: "p"})
		if pp < r.First || pp > r.Last {
			t.Errorf("%s: proxy port %d outside %v", n, pp, r)
		}
		if got, err := getTCP(t, pp); err != nil || got != "a" {
			t.Errorf("%s: got %q, %v; want a", n, got, err)
		}
	}
}

// freeAdjacentPorts returns two adjacent ports free on 127.0.0.1 just now.
func freeAdjacentPorts(t *testing.T) PortRange {
	t.Helper()
	for range 100 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		pn := ln.Addr().(*net.TCPAddr).Port
		ln.Close()
		if l2, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", pn+1)); err == nil {
			l2.Close()
			return PortRange{First: pn, Last: pn + 1}
		}
	}
	t.Fatal("no two adjacent free ports")
	return PortRange{}
}

// TestNodePortIsNeverAProxyPort: a port a Service declares as its NodePort is
// never given to a proxy socket, and a proxy socket already on it moves to
// another port of the range (a NodePort is held by binding it; had it stayed,
// the NodePort's clients would reach the other Service).
func TestNodePortIsNeverAProxyPort(t *testing.T) {
	w := newWorld(t)
	a := w.tcpBackend("a", "127.0.0.2")
	r := freeAdjacentPorts(t)
	p := newProxier(t, Config{PortRange: r})
	one := port("one", service.TCP, a)
	if err := p.Sync(snapshot(one)); err != nil {
		t.Fatal(err)
	}
	name := service.PortName{Namespace: "default", Name: "one", Port: "p"}
	taken := p.ProxyPort(name)
	np := port("np", service.TCP, a)
	np.NodePort = taken
	if err := p.Sync(snapshot(np, one)); err != nil {
		t.Fatal(err)
	}
	moved := p.ProxyPort(name)
	if moved == taken || moved < r.First || moved > r.Last {
		t.Errorf("one's proxy port after np declared NodePort %d: got %d, want the other port of %v", taken, moved, r)
	}
	if got, err := getTCP(t, moved); err != nil || got != "a" {
		t.Errorf("one on its new proxy port: got %q, %v; want a", got, err)
	}
	// np's own proxy socket finds no port: the range's other one is taken.
	if pp := p.ProxyPort(service.PortName{Namespace: "default", Name: "np", Port: "p"}); pp == taken {
		t.Errorf("np got its own NodePort %d as proxy port", pp)
	}

	// The same when np's NodePort changes to one's new port: a sync that
	// changes no Service port's identity.
	np.NodePort = 0
	if err := p.Sync(snapshot(np, one)); err != nil {
		t.Fatal(err)
	}
	before := p.ProxyPort(name)
	np2 := *np
	np2.NodePort = before
	if err := p.Sync(snapshot(&np2, one)); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"one", "np"} {
		if pp := p.ProxyPort(service.PortName{Namespace: "default", Name: n, Port: "p"}); pp == before {
			t.Errorf("%s: proxy port %d after np's NodePort changed to it, want none on it", n, pp)
		}
	}

	fresh := newProxier(t, Config{PortRange: r})
	np.NodePort = r.First
	if err := fresh.Sync(snapshot(np, one)); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"one", "np"} {
		if pp := fresh.ProxyPort(service.PortName{Namespace: "default", Name: n, Port: "p"}); pp == r.First {
			t.Errorf("%s: got proxy port %d, np's NodePort", n, pp)
		}
	}
}

// TestEndpointUpdatesUnderTraffic swaps endpoints while clients connect: every
// connection must reach a backend (removed endpoints are closed after the swap,
// and retries cover the window).
func TestEndpointUpdatesUnderTraffic(t *testing.T) {
	w := newWorld(t)
	var eps []netip.AddrPort
	for i := 0; i < 4; i++ {
		eps = append(eps, w.tcpBackend(fmt.Sprintf("b%d", i), fmt.Sprintf("127.0.0.%d", i+2)))
	}
	p := newProxier(t, Config{})
	mustSync(t, p, snapshot(port("tcp", service.TCP, eps[0], eps[1])))
	pp := p.ProxyPort(service.PortName{Namespace: "default", Name: "tcp", Port: "p"})

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	errs := make(chan error, 100)
	for c := 0; c < 8; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				if _, err := getTCP(t, pp); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	for i := 0; i < 50; i++ {
		mustSync(t, p, snapshot(port("tcp", service.TCP, eps[i%4], eps[(i+1)%4])))
	}
	cancel()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("connection during endpoint updates: %v", err)
	}
}

func TestDebugServices(t *testing.T) {
	w := newWorld(t)
	a := w.tcpBackend("a", "127.0.0.2")
	p := newProxier(t, Config{})
	sp := port("web", service.TCP, a)
	sp.AffinityClientIP = true
	sp.AffinityTimeout = time.Hour
	sp.Endpoints = append(sp.Endpoints, service.Endpoint{Addr: netip.MustParseAddrPort("127.0.0.9:9"), Serving: true, Terminating: true})
	mustSync(t, p, snapshot(sp))
	pp := p.ProxyPort(sp.Name)
	if _, err := getTCP(t, pp); err != nil {
		t.Fatal(err)
	}
	st := p.DebugServices()
	if len(st) != 1 {
		t.Fatalf("got %d services, want 1", len(st))
	}
	s := st[0]
	if s.Name != "default/web:p" || s.ProxyPort != pp || s.SessionAffinity != "ClientIP" || s.Scheduler != "rr" || s.Port != 80 {
		t.Errorf("got %+v", s)
	}
	if len(s.Endpoints) != 2 || !s.Endpoints[0].Usable || s.Endpoints[1].Usable {
		t.Errorf("endpoints: got %+v, want the ready one usable, the terminating one not", s.Endpoints)
	}
	if len(s.Affinity) != 1 || s.Affinity[0].Client != "127.0.0.1" || s.Affinity[0].Endpoint != a.String() {
		t.Errorf("affinity: got %+v, want 127.0.0.1 -> %s", s.Affinity, a)
	}
}

// TestFailedPortRetriedWithSameServices: a listener that could not be opened is
// retried by the next Sync even when the Snapshot names the same Service ports.
func TestFailedPortRetriedWithSameServices(t *testing.T) {
	w := newWorld(t)
	a := w.tcpBackend("a", "127.0.0.2")
	b := w.tcpBackend("b", "127.0.0.3")
	// The whole proxy port range is one port, taken by someone else at first.
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	pn := taken.Addr().(*net.TCPAddr).Port
	p := newProxier(t, Config{PortRange: PortRange{First: pn, Last: pn}})
	name := service.PortName{Namespace: "default", Name: "web", Port: "p"}

	mustSync(t, p, snapshot(port("web", service.TCP, a)))
	if errs := p.PortErrors(); len(errs) != 1 {
		t.Fatalf("with the only proxy port taken: got port errors %v, want one", errs)
	}
	taken.Close()
	mustSync(t, p, snapshot(port("web", service.TCP, b)))
	if got := p.ProxyPort(name); got != pn {
		t.Fatalf("after the port was freed: got proxy port %d, want %d", got, pn)
	}
	if errs := p.PortErrors(); len(errs) != 0 {
		t.Errorf("after the port was freed: got port errors %v, want none", errs)
	}
	if got, err := getTCP(t, pn); err != nil || got != "b" {
		t.Errorf("after the retry: got %q, %v; want b", got, err)
	}
}

// loopResources returns the ids of the goroutines running event loops and counts
// the epoll descriptors of the process. Ids, not a count: a loop closed by an
// earlier test may still be returning when a count is taken.
func loopResources(t *testing.T) (goroutines map[string]bool, epolls int) {
	t.Helper()
	buf := make([]byte, 1<<20)
	goroutines = make(map[string]bool)
	for _, g := range strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
		// Every loop goroutine, started or not yet, names its creator.
		if strings.Contains(g, "created by github.com/uproxy/uproxy/socket/poll.New ") {
			id, _, _ := strings.Cut(strings.TrimPrefix(g, "goroutine "), " ")
			goroutines[id] = true
		}
	}
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if link, _ := os.Readlink("/proc/self/fd/" + e.Name()); link == "anon_inode:[eventpoll]" {
			epolls++
		}
	}
	return goroutines, epolls
}

// The proxier owns its event loops: New starts them, Shutdown stops them once the
// connection still open at the end of the grace period is reset, and a Sync after
// Shutdown is refused.
func TestShutdownStopsTheEventLoops(t *testing.T) {
	// A backend that keeps every connection open.
	ln, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		var held []net.Conn
		defer func() {
			for _, c := range held {
				c.Close()
			}
		}()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			held = append(held, c)
		}
	}()
	g0, e0 := loopResources(t)
	p, err := New(Config{BindAddress: netip.MustParseAddr("127.0.0.1"), EventLoops: 2})
	if err != nil {
		t.Fatal(err)
	}
	ours, e := loopResources(t)
	if e != e0+2 {
		t.Errorf("epoll descriptors with two loops: got %d, want %d", e, e0+2)
	}
	for id := range g0 {
		delete(ours, id)
	}
	if len(ours) != 2 {
		t.Errorf("loop goroutines started by New: got %d, want 2", len(ours))
	}
	held := port("held", service.TCP, ln.Addr().(*net.TCPAddr).AddrPort())
	mustSync(t, p, snapshot(held))
	c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", p.ProxyPort(held.Name)))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	testbed.Await(t, 10*time.Second, "the connection to become active", func() bool {
		return p.DebugServices()[0].Endpoints[0].ActiveConnections == 1
	})

	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := p.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Shutdown with a connection held open: got %v, want the grace period's end", err)
	}
	if _, err := c.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("client after Shutdown: got %v, want its connection ended", err)
	}
	// left counts our loop goroutines still running.
	left := func(g map[string]bool) (n int) {
		for id := range ours {
			if g[id] {
				n++
			}
		}
		return n
	}
	testbed.AwaitNoError(t, 10*time.Second, "the loops to end after Shutdown", func() error {
		if g, e := loopResources(t); left(g) != 0 || e != e0 {
			return fmt.Errorf("%d of the loop goroutines and %d epoll descriptors, want 0 and %d as before New", left(g), e, e0)
		}
		return nil
	})
	if err := p.Sync(snapshot(held)); err == nil || !strings.Contains(err.Error(), "shut down") {
		t.Errorf("Sync after Shutdown: got %v, want an error saying it is shut down", err)
	}
	if err := p.Shutdown(context.Background()); err != nil {
		t.Errorf("second Shutdown: got %v, want nil", err)
	}
}

// A UDP client that keeps talking, from one source port and well within
// --udp-timeout, moves off an endpoint as soon as a sync removes it from the
// Service: its next datagram is answered by the endpoint that remains, and the
// move is counted.
func TestUDPClientMovesOffARemovedEndpoint(t *testing.T) {
	w := newWorld(t)
	x := w.udpBackend("x", "127.0.0.5")
	y := w.udpBackend("y", "127.0.0.6")
	p := newProxier(t, Config{UDPTimeout: time.Hour})
	mustSync(t, p, snapshot(port("dns", service.UDP, x, y)))
	udpPort := p.ProxyPort(service.PortName{Namespace: "default", Name: "dns", Port: "p"})
	c, err := net.Dial("udp", fmt.Sprintf("127.0.0.1:%d", udpPort))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ask := func() string {
		t.Helper()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write([]byte("q")); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 100)
		n, err := c.Read(buf)
		if err != nil {
			t.Fatalf("reply: %v", err)
		}
		return strings.TrimSuffix(string(buf[:n]), ":q")
	}
	first := ask()
	for range 3 {
		if got := ask(); got != first {
			t.Fatalf("a client entry's datagrams: answered by %s then %s, want one endpoint", first, got)
		}
	}
	remaining, removed := y, "x"
	if first == "y" {
		remaining, removed = x, "y"
	}
	before := seriesValue(t, "uproxy_udp_clients_moved_total", map[string]string{"service": "default/dns:p"})
	mustSync(t, p, snapshot(port("dns", service.UDP, remaining)))
	for i := range 3 {
		if got := ask(); got == removed {
			t.Fatalf("datagram %d after %s left the Service: still answered by it", i, removed)
		}
	}
	if got := seriesValue(t, "uproxy_udp_clients_moved_total", map[string]string{"service": "default/dns:p"}) - before; got != 1 {
		t.Errorf("uproxy_udp_clients_moved_total grew by %v, want 1", got)
	}
}

// A Service's policy annotations override the flags for its port, and a change
// of them applies at the next sync without reopening the proxy port.
func TestPolicyFollowsAnnotations(t *testing.T) {
	w := newWorld(t)
	a := w.tcpBackend("a", "127.0.0.2")
	p := newProxier(t, Config{Scheduler: "rr", DialHedge: 50 * time.Millisecond, DialTimeouts: []time.Duration{time.Second}})
	hedge := time.Duration(0)
	sp := port("web", service.TCP, a)
	sp.Policy = service.Policy{Scheduler: "lc", DialHedge: &hedge}
	mustSync(t, p, snapshot(sp))
	pp := p.ProxyPort(sp.Name)
	check := func(when, scheduler, hedge, hedgeFrom string) {
		t.Helper()
		st := p.DebugServices()[0]
		if st.Scheduler != scheduler || st.Policy.Scheduler.Value != scheduler {
			t.Errorf("%s: got scheduler %q (policy %+v), want %q", when, st.Scheduler, st.Policy.Scheduler, scheduler)
		}
		if st.Policy.DialHedge.Value != hedge || st.Policy.DialHedge.From != hedgeFrom {
			t.Errorf("%s: got hedge %+v, want %s from %s", when, st.Policy.DialHedge, hedge, hedgeFrom)
		}
		if st.Policy.DialTimeouts.Value != "1s" || st.Policy.DialTimeouts.From != service.FromFlag {
			t.Errorf("%s: got dial timeouts %+v, want 1s from the flag", when, st.Policy.DialTimeouts)
		}
		if got := p.ProxyPort(sp.Name); got != pp {
			t.Errorf("%s: proxy port %d, want %d kept", when, got, pp)
		}
		p.mu.RLock()
		running := p.ports[sp.Name]
		p.mu.RUnlock()
		if got, _ := time.ParseDuration(strings.Replace(hedge, "off", "0s", 1)); running.cluster.tcp.DialPolicy().Hedge != got || running.cluster.picker.scheduler() != scheduler {
			t.Errorf("%s: the proxy dials with %+v and the balancer schedules %s, want hedge %s and %s",
				when, running.cluster.tcp.DialPolicy(), running.cluster.picker.scheduler(), hedge, scheduler)
		}
		if name, err := getTCP(t, pp); err != nil || name != "a" {
			t.Errorf("%s: through the proxy: got %q, %v, want a", when, name, err)
		}
	}
	check("with annotations", "lc", "off", service.FromAnnotation)
	changed := port("web", service.TCP, a)
	mustSync(t, p, snapshot(changed))
	check("annotations removed", "rr", "50ms", service.FromFlag)
}

// pingUDP sends "ping" to 127.0.0.1:port and returns the reply (within 5 s).
func pingUDP(t *testing.T, port int) (string, error) {
	t.Helper()
	c, err := net.Dial("udp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	c.Write([]byte("ping"))
	buf := make([]byte, 100)
	n, err := c.Read(buf)
	return string(buf[:n]), err
}
