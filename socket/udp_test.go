package socket

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/record"
	"github.com/uproxy/uproxy/test/testbed"
)

// listenUDP opens an unconnected UDP socket on ip:0, closed at the end of the test.
func listenUDP(t testing.TB, ip string) *net.UDPConn {
	t.Helper()
	c, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(netip.MustParseAddr(ip), 0)))
	if err != nil {
		t.Fatalf("listen udp on %s: %v", ip, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func udpAddr(c *net.UDPConn) netip.AddrPort { return c.LocalAddr().(*net.UDPAddr).AddrPort() }

// startUDPEcho runs a UDP backend on ip that sends every datagram back.
func startUDPEcho(t testing.TB, ip string) netip.AddrPort {
	t.Helper()
	c := listenUDP(t, ip)
	var wg sync.WaitGroup
	wg.Go(func() {
		buf := make([]byte, maxDatagram)
		for {
			n, from, err := c.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			c.WriteToUDPAddrPort(buf[:n], from)
		}
	})
	t.Cleanup(func() { c.Close(); wg.Wait() })
	return udpAddr(c)
}

// deadUDPAddr returns a UDP address on ip where nothing listens: datagrams sent
// there draw an ICMP port unreachable.
func deadUDPAddr(t testing.TB, ip string) netip.AddrPort {
	t.Helper()
	c := listenUDP(t, ip)
	addr := udpAddr(c)
	c.Close()
	return addr
}

// startUDPProxy serves p on a fresh 127.0.0.1:0 socket and returns its address; a p
// without Loops gets one loop of its own. At the end of the test the proxy is
// closed and Serve must have returned nil.
func startUDPProxy(t testing.TB, p *UDPProxy) netip.AddrPort {
	t.Helper()
	if p.Loops == nil {
		p.Loops = newLoops(t, 1, nil)
	}
	conn, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- p.Serve(conn) }()
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		if err := <-served; err != nil {
			t.Errorf("Serve: got %v, want nil", err)
		}
	})
	return udpAddr(conn)
}

// dialUDPProxyAt serves p, on a loop of its own, on a socket of network bound to
// bind, and returns a client connected to it at dst (an address of the node the
// bind covers) and that address. All is closed at the end of the test.
func dialUDPProxyAt(t testing.TB, p *UDPProxy, network, bind, dst string) (*net.UDPConn, netip.AddrPort) {
	t.Helper()
	p.Loops = newLoops(t, 1, nil)
	conn, err := net.ListenUDP(network, &net.UDPAddr{IP: net.ParseIP(bind)})
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- p.Serve(conn) }()
	t.Cleanup(func() {
		p.Close()
		<-served
	})
	svc := netip.AddrPortFrom(netip.MustParseAddr(dst), uint16(conn.LocalAddr().(*net.UDPAddr).Port))
	client, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(svc))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	return client, svc
}

// exchange sends msg from c to addr and returns the first reply and its source.
func exchange(c *net.UDPConn, addr netip.AddrPort, msg []byte, wait time.Duration) ([]byte, netip.AddrPort, error) {
	if _, err := c.WriteToUDPAddrPort(msg, addr); err != nil {
		return nil, netip.AddrPort{}, fmt.Errorf("send: %w", err)
	}
	c.SetReadDeadline(time.Now().Add(wait))
	buf := make([]byte, maxDatagram)
	n, from, err := c.ReadFromUDPAddrPort(buf)
	if err != nil {
		return nil, netip.AddrPort{}, fmt.Errorf("receive: %w", err)
	}
	return buf[:n], from, nil
}

// lostExchange says what the proxy looked like once an exchange went
// unanswered: its entries, what it recorded, and whether the same datagram sent
// again is answered. UDP may lose a datagram; on loopback nothing should.
func lostExchange(p *UDPProxy, rec *recorder, client *net.UDPConn, svc netip.AddrPort, msg []byte) string {
	rec.mu.Lock()
	closed := slices.Clone(rec.closed)
	opened, backoffs := rec.opened, len(rec.backoffs)
	rec.mu.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, "entries %d, opened %d, backoffs %d", p.Clients(), opened, backoffs)
	for _, c := range closed {
		fmt.Fprintf(&b, "; closed %v to %v after %v, in %d out %d, err %v", c.Client, c.Endpoint, c.Duration, c.BytesIn, c.BytesOut, c.Err)
	}
	if _, _, err := exchange(client, svc, msg, time.Second); err != nil {
		fmt.Fprintf(&b, "; sent again: %v", err)
	} else {
		b.WriteString("; sent again: answered")
	}
	return b.String()
}

func TestUDPProxyRoundTrip(t *testing.T) {
	t.Parallel()
	for _, size := range []int{0, 1, 1472, 9000, 65507} {
		t.Run(fmt.Sprintf("%d bytes", size), func(t *testing.T) {
			backend := startUDPEcho(t, "127.0.0.2")
			rec := &recorder{}
			picker := newCyclePicker(backend)
			p := &UDPProxy{Service: "ns/dns:udp", Picker: picker, Observer: rec, Timeout: time.Hour}
			svc := startUDPProxy(t, p)
			client := listenUDP(t, "127.0.0.1")

			msg := payload(uint64(size), size)
			for i := range 2 {
				got, from, err := exchange(client, svc, msg, awaitTimeout)
				if err != nil {
					t.Fatalf("exchange %d: %v", i, err)
				}
				if !bytes.Equal(got, msg) {
					t.Fatalf("exchange %d: got %d bytes back, want the %d sent", i, len(got), len(msg))
				}
				if from != svc {
					t.Errorf("exchange %d: reply came from %v, want the Service socket %v", i, from, svc)
				}
			}
			if n := p.Clients(); n != 1 {
				t.Errorf("Clients: got %d, want 1", n)
			}
			if err := p.Close(); err != nil {
				t.Fatal(err)
			}
			c := rec.awaitClosed(t, 1)[0]
			want := record.Conn{Service: "ns/dns:udp", Protocol: "UDP", Client: udpAddr(client), Endpoint: backend,
				BytesIn: int64(2 * size), BytesOut: int64(2 * size)}
			if c.Service != want.Service || c.Protocol != want.Protocol || c.Client != want.Client || c.Endpoint != want.Endpoint ||
				c.BytesIn != want.BytesIn || c.BytesOut != want.BytesOut || c.Err != nil || len(c.Attempts) != 1 {
				t.Errorf("record: got %+v, want %+v with one attempt", c, want)
			}
			if u := picker.unreleased(); len(u) != 0 {
				t.Errorf("Pick without Release: %v", u)
			}
			if got, want := picker.dialReports(), []dialReport{{ep: backend}}; !slices.Equal(got, want) {
				t.Errorf("dial reports to the Picker: got %v, want %v (a clean end is no failure)", got, want)
			}
		})
	}
}

func TestUDPProxyIdleExpiry(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		timeout time.Duration
		// traffic is how long the client keeps exchanging datagrams back to back;
		// the entry must outlive it.
		traffic time.Duration
	}{
		{name: "one exchange", timeout: 500 * time.Millisecond},
		// Back-to-back exchanges leave no gap near the timeout, unless the whole
		// test process stalls for that long: its loop may then run the entry's
		// timer before the echo goroutine replies, and the entry, idle that long,
		// rightly expires and loses the late reply. With a 1s timeout that
		// happened in CI while every package's tests started at once (the first
		// entry expired after 1.6s of traffic, the second lost its last reply),
		// so the timeout is 2s.
		{name: "traffic keeps the entry alive past several timeouts", timeout: 2 * time.Second, traffic: 5 * time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			backend := startUDPEcho(t, "127.0.0.2")
			rec := &recorder{}
			picker := newCyclePicker(backend)
			p := &UDPProxy{Service: "ns/dns:udp", Picker: picker, Observer: rec, Timeout: tt.timeout}
			svc := startUDPProxy(t, p)
			client := listenUDP(t, "127.0.0.1")
			msg := []byte("0123456789")
			// firstReply bounds the entry's start from above, lastSend its last
			// activity from below.
			var firstReply, lastSend time.Time
			sends := 0
			for start := time.Now(); sends == 0 || time.Since(start) < tt.traffic; sends++ {
				lastSend = time.Now()
				if _, _, err := exchange(client, svc, msg, awaitTimeout); err != nil {
					t.Fatalf("exchange %d: %v (%s)", sends, err, lostExchange(p, rec, client, svc, msg))
				}
				if sends == 0 {
					firstReply = time.Now()
				}
			}
			testbed.Await(t, awaitTimeout, "the idle entry to expire", func() bool { return p.Clients() == 0 })
			c := rec.awaitClosed(t, 1)[0]
			want := int64(sends * len(msg))
			if c.BytesIn != want || c.BytesOut != want || c.Err != nil {
				t.Errorf("record: got in %d, out %d, err %v; want in %d, out %d, err nil", c.BytesIn, c.BytesOut, c.Err, want, want)
			}
			if min := lastSend.Sub(firstReply) + tt.timeout; c.Duration < min {
				t.Errorf("entry lived %v, want at least the traffic's span plus the timeout, %v", c.Duration, min)
			}
			if u := picker.unreleased(); len(u) != 0 {
				t.Errorf("Pick without Release: %v", u)
			}
			if n := picker.resetCount(); n != 0 {
				t.Errorf("ResetAffinity calls after a clean expiry: got %d, want 0", n)
			}
			// The next datagram opens a new entry.
			if _, _, err := exchange(client, svc, msg, awaitTimeout); err != nil {
				t.Fatalf("exchange after expiry: %v", err)
			}
			if opened, _, _ := rec.counts(); opened != 2 {
				t.Errorf("entries opened: got %d, want 2", opened)
			}
		})
	}
}

func TestUDPProxyTableBound(t *testing.T) {
	t.Parallel()
	backend := startUDPEcho(t, "127.0.0.2")
	rec := &recorder{}
	p := &UDPProxy{Service: "ns/dns:udp", Picker: newCyclePicker(backend), Observer: rec, MaxClients: 2, Timeout: time.Hour}
	svc := startUDPProxy(t, p)
	for i := range 2 {
		c := listenUDP(t, "127.0.0.1")
		if _, _, err := exchange(c, svc, []byte("in"), awaitTimeout); err != nil {
			t.Fatalf("client %d: %v", i, err)
		}
	}
	extra := listenUDP(t, "127.0.0.1")
	if _, err := extra.WriteToUDPAddrPort([]byte("one too many"), svc); err != nil {
		t.Fatal(err)
	}
	recs := rec.awaitClosed(t, 1)
	if c := recs[0]; !errors.Is(c.Err, ErrTooManyClients) || c.Client != udpAddr(extra) {
		t.Errorf("record: got client %v err %v, want client %v err %v", c.Client, c.Err, udpAddr(extra), ErrTooManyClients)
	}
	if n := p.Clients(); n != 2 {
		t.Errorf("Clients: got %d, want 2", n)
	}
}

// Datagrams turned away are logged, at most one line per interval per Service
// port: the first at once, the rest at the interval's end with their count,
// and each record says why.
func TestUDPProxyDropsAreLoggedRateLimited(t *testing.T) {
	t.Parallel()
	backend := startUDPEcho(t, "127.0.0.2")
	rec := &recorder{}
	type line struct {
		at time.Time
		kv string
	}
	var mu sync.Mutex
	var lines []line
	p := &UDPProxy{Service: "ns/dns:udp", Picker: newCyclePicker(backend), Observer: rec, MaxClients: 1, Timeout: time.Hour}
	const every = 300 * time.Millisecond
	p.dropLogEvery = every
	p.droppedLine = func(msg string, err error, kv ...any) {
		mu.Lock()
		defer mu.Unlock()
		lines = append(lines, line{time.Now(), fmt.Sprint(kv...)})
	}
	svc := startUDPProxy(t, p)
	if _, _, err := exchange(listenUDP(t, "127.0.0.1"), svc, []byte("in"), awaitTimeout); err != nil {
		t.Fatal(err)
	}
	const extra = 20
	start := time.Now()
	for range extra {
		if _, err := listenUDP(t, "127.0.0.1").WriteToUDPAddrPort([]byte("one too many"), svc); err != nil {
			t.Fatal(err)
		}
	}
	recs := rec.awaitClosed(t, extra)
	for i, c := range recs {
		if c.Dropped != record.DropClientTableFull || !errors.Is(c.Err, ErrTooManyClients) {
			t.Errorf("record %d: got dropped %v err %v, want %v, %v", i, c.Dropped, c.Err, record.DropClientTableFull, ErrTooManyClients)
		}
	}
	testbed.Await(t, awaitTimeout, "a second line", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(lines) >= 2
	})
	time.Sleep(every) // no third line: nothing was dropped since
	mu.Lock()
	defer mu.Unlock()
	if len(lines) != 2 {
		t.Fatalf("lines: got %d %v, want 2", len(lines), lines)
	}
	for i, want := range []string{"dropped1", fmt.Sprintf("dropped%d", extra-1)} {
		if !strings.Contains(lines[i].kv, "ns/dns:udp") || !strings.Contains(lines[i].kv, want+"reasons") ||
			!strings.Contains(lines[i].kv, "client_table_full") || !strings.Contains(lines[i].kv, "at most 1 clients") {
			t.Errorf("line %d: got %q, want the Service port, %s, client_table_full (at most 1 clients)", i, lines[i].kv, want)
		}
	}
	if gap := lines[1].at.Sub(lines[0].at); gap < every-20*time.Millisecond {
		t.Errorf("second line %v after the first (which came %v after the drops began), want at least %v", gap, lines[0].at.Sub(start), every)
	}
}

func TestUDPProxyDeadBackendRepick(t *testing.T) {
	t.Parallel()
	dead := deadUDPAddr(t, "127.0.0.3")
	live := startUDPEcho(t, "127.0.0.2")
	rec := &recorder{}
	picker := newCyclePicker(dead, live)
	p := &UDPProxy{Service: "ns/dns:udp", Picker: picker, Observer: rec, Timeout: time.Hour}
	svc := startUDPProxy(t, p)
	client := listenUDP(t, "127.0.0.1")

	// Like any UDP client, resend until answered: the datagrams that went to the
	// dead endpoint are lost.
	msg := []byte("anyone there?")
	var got []byte
	var from netip.AddrPort
	testbed.Await(t, awaitTimeout, "a reply", func() bool {
		var err error
		got, from, err = exchange(client, svc, msg, 50*time.Millisecond)
		return err == nil
	})
	if !bytes.Equal(got, msg) || from != svc {
		t.Errorf("reply: got %q from %v, want %q from %v", got, from, msg, svc)
	}
	// The entry refused before any reply served nobody: its record has no
	// endpoint, and its one attempt failed with the refusal.
	c := rec.awaitClosed(t, 1)[0]
	if c.Endpoint.IsValid() || !errors.Is(c.Err, syscall.ECONNREFUSED) ||
		len(c.Attempts) != 1 || c.Attempts[0].Endpoint != dead || !errors.Is(c.Attempts[0].Err, syscall.ECONNREFUSED) {
		t.Errorf("record of the failed entry: got endpoint %v err %v attempts %+v, want no endpoint, ECONNREFUSED, one attempt of %v failed with ECONNREFUSED",
			c.Endpoint, c.Err, c.Attempts, dead)
	}
	if n := picker.resetCount(); n < 1 {
		t.Errorf("ResetAffinity calls: got %d, want at least 1", n)
	}
	if n := p.Clients(); n != 1 {
		t.Errorf("Clients: got %d, want 1 (the entry on the live endpoint)", n)
	}
	// The connect to the dead endpoint succeeded, as UDP connects do, and is
	// no success: the ICMP port unreachable that ended its entry is told to
	// the Picker as its failure, and live's reply as live's success.
	reports := picker.dialReports()
	want := []dialReport{{ep: dead, failed: true}, {ep: live}}
	if !slices.EqualFunc(reports, want, func(r, w dialReport) bool { return r.ep == w.ep && r.failed == w.failed }) ||
		!errors.Is(reports[0].err, syscall.ECONNREFUSED) {
		t.Errorf("dial reports to the Picker: got %v, want %v with ECONNREFUSED", reports, want)
	}
}

// An endpoint that takes datagrams and never answers (nor refuses) is not
// known to be there: its entries idle out with no report to the Picker, so
// they neither clear an earlier failure nor count as one. Its attempt is
// recorded as its connect went.
func TestUDPProxySilentEndpointIsNotJudged(t *testing.T) {
	t.Parallel()
	silent := udpAddr(listenUDP(t, "127.0.0.4")) // bound, never read
	rec := &recorder{}
	picker := newCyclePicker(silent)
	p := &UDPProxy{Service: "ns/syslog:udp", Picker: picker, Observer: rec, Timeout: 20 * time.Millisecond}
	svc := startUDPProxy(t, p)
	const clients = 3
	for range clients {
		c := listenUDP(t, "127.0.0.1")
		if _, err := c.WriteToUDPAddrPort([]byte("a log line"), svc); err != nil {
			t.Fatal(err)
		}
	}
	for i, c := range rec.awaitClosed(t, clients) {
		if c.Endpoint != silent || c.Err != nil || len(c.Attempts) != 1 || c.Attempts[0].Err != nil {
			t.Errorf("record %d: got endpoint %v err %v attempts %+v, want %v, no error, one attempt without error", i, c.Endpoint, c.Err, c.Attempts, silent)
		}
	}
	if _, attempts, _ := rec.counts(); attempts != clients {
		t.Errorf("attempts reported to the Observer: got %d, want %d", attempts, clients)
	}
	if reports := picker.dialReports(); len(reports) != 0 {
		t.Errorf("dial reports to the Picker: got %v, want none", reports)
	}
}

func TestUDPProxyManyClients(t *testing.T) {
	const clients = 100
	loops := newLoops(t, 1, nil)
	baseline := runtime.NumGoroutine()
	eps := []netip.AddrPort{startUDPEcho(t, "127.0.0.2"), startUDPEcho(t, "127.0.0.3")}
	rec := &recorder{}
	picker := newCyclePicker(eps...)
	p := &UDPProxy{Service: "ns/dns:udp", Picker: picker, Observer: rec, Timeout: time.Hour}
	p.Loops = loops
	conn, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- p.Serve(conn) }()
	svc := udpAddr(conn)

	// Each client keeps its socket (and port) to the end of the test, so no two
	// share an address.
	socks := make([]*net.UDPConn, clients)
	for i := range socks {
		socks[i] = listenUDP(t, "127.0.0.1")
	}
	errs := make(chan error, clients)
	var wg sync.WaitGroup
	for i, c := range socks {
		wg.Go(func() {
			msg := fmt.Appendf(nil, "client %d", i)
			// Datagrams may be dropped when many arrive at once: resend until answered.
			deadline := time.Now().Add(awaitTimeout)
			for time.Now().Before(deadline) {
				got, _, err := exchange(c, svc, msg, 200*time.Millisecond)
				if errors.Is(err, os.ErrDeadlineExceeded) {
					continue
				}
				if err != nil || !bytes.Equal(got, msg) {
					errs <- fmt.Errorf("client %d: got %q, %v, want %q", i, got, err, msg)
				}
				return
			}
			errs <- fmt.Errorf("client %d: no reply within %s", i, awaitTimeout)
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if n := p.Clients(); n != clients {
		t.Errorf("Clients: got %d, want %d", n, clients)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-served; err != nil {
		t.Errorf("Serve: got %v, want nil", err)
	}
	if n := p.Clients(); n != 0 {
		t.Errorf("Clients after Close: got %d, want 0", n)
	}
	if _, _, closed := rec.counts(); closed != clients {
		t.Errorf("records after Close: got %d, want %d", closed, clients)
	}
	if u := picker.unreleased(); len(u) != 0 {
		t.Errorf("Pick without Release: %v", u)
	}
	// Only the two echo backends, ended by the test's cleanup, remain.
	testbed.Await(t, awaitTimeout, "the proxy's goroutines to end", func() bool { return runtime.NumGoroutine() <= baseline+2 })
}

// udpBind is a Service socket's network and bind, and the address a client
// writes to (see dialUDPProxyAt).
type udpBind struct {
	name, network, bind, dst string
}

// wildcardBinds bind the Service socket to a wildcard address, each with a
// destination that is not the address the kernel would answer from.
var wildcardBinds = []udpBind{
	{"IPv4 wildcard", "udp4", "0.0.0.0", "127.0.0.3"},
	{"dual-stack wildcard, IPv4 client", "udp", "::", "127.0.0.3"},
	{"dual-stack wildcard, IPv6 client", "udp", "::", "::1"},
}

// TestUDPProxyWildcardRepliesFromDestination binds the Service socket to a
// wildcard address and writes to a loopback address that is not the one the
// kernel would answer from: the reply must still come from the address written
// to, as conntrack and connected clients require.
func TestUDPProxyWildcardRepliesFromDestination(t *testing.T) {
	t.Parallel()
	for _, tt := range wildcardBinds {
		t.Run(tt.name, func(t *testing.T) {
			backend := startUDPEcho(t, "127.0.0.2")
			p := &UDPProxy{Service: "ns/dns:udp", Picker: newCyclePicker(backend), Timeout: time.Hour}
			// A connected client, as a resolver's: it only accepts replies from svc.
			client, svc := dialUDPProxyAt(t, p, tt.network, tt.bind, tt.dst)
			for i := range 2 {
				if _, err := client.Write([]byte("ping")); err != nil {
					t.Fatal(err)
				}
				client.SetReadDeadline(time.Now().Add(awaitTimeout))
				buf := make([]byte, 64)
				n, err := client.Read(buf)
				if err != nil || string(buf[:n]) != "ping" {
					t.Fatalf("exchange %d through %s: got %q, %v; want the echo from %s", i, tt.bind, buf[:n], err, svc)
				}
			}
		})
	}
}

// A client whose socket cannot be made because the process is out of descriptors
// loses its datagram, and nothing is counted against the endpoint.
func TestUDPProxyOutOfFilesSparesTheEndpoint(t *testing.T) {
	backend := startUDPEcho(t, "127.0.0.2")
	rec := &recorder{}
	picker := newCyclePicker(backend)
	p := &UDPProxy{Service: "ns/dns:udp", Picker: picker, Observer: rec, Timeout: time.Hour}
	svc := startUDPProxy(t, p)
	warm, starved := listenUDP(t, "127.0.0.1"), listenUDP(t, "127.0.0.1")
	if _, _, err := exchange(warm, svc, []byte("warm"), awaitTimeout); err != nil {
		t.Fatalf("exchange before descriptors run out: %v", err)
	}

	st := starveDescriptors(t)
	st.fill()
	if _, err := starved.WriteToUDPAddrPort([]byte("lost"), svc); err != nil {
		t.Fatal(err)
	}
	c := rec.awaitClosed(t, 1)[0]
	st.restore()
	if !errors.Is(c.Err, syscall.EMFILE) || len(c.Attempts) != 0 || c.Client != udpAddr(starved) {
		t.Errorf("record of the starved client: %+v; want EMFILE, no attempt", c)
	}
	if got, _, err := exchange(starved, svc, []byte("again"), awaitTimeout); err != nil || string(got) != "again" {
		t.Fatalf("exchange once descriptors are back: got %q, %v", got, err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	rec.awaitClosed(t, 3)
	nothingCounted(t, rec, picker, 2)
}

// A client that keeps sending stays on its endpoint only while the endpoint is in
// the Service: Retain without it ends the entry (reported as ErrEndpointRemoved),
// and the client's next datagram, from the same source port, goes to the
// endpoint that remains.
func TestUDPProxyRetainMovesClientsOffRemovedEndpoints(t *testing.T) {
	t.Parallel()
	a := startUDPEcho(t, "127.0.0.2")
	b := startUDPEcho(t, "127.0.0.3")
	rec := &recorder{}
	picker := newCyclePicker(a, b)
	p := &UDPProxy{Service: "ns/dns:udp", Picker: picker, Observer: rec, Timeout: time.Hour}
	svc := startUDPProxy(t, p)
	client := listenUDP(t, "127.0.0.1")
	if _, _, err := exchange(client, svc, []byte("one"), awaitTimeout); err != nil {
		t.Fatalf("first datagram: %v", err)
	}
	if n, err := p.Retain([]netip.AddrPort{a, b}); err != nil || n != 0 {
		t.Fatalf("Retain of both endpoints: ended %d (%v), want 0", n, err)
	}
	picker.mu.Lock()
	picker.eps = []netip.AddrPort{b}
	picker.mu.Unlock()
	n, err := p.Retain([]netip.AddrPort{b})
	if err != nil || n != 1 {
		t.Fatalf("Retain without %v: ended %d (%v), want 1", a, n, err)
	}
	closed := rec.awaitClosed(t, 1)
	if c := closed[0]; c.Endpoint != a || !errors.Is(c.Err, record.ErrEndpointRemoved) {
		t.Errorf("ended entry: endpoint %v, err %v; want %v, ErrEndpointRemoved", c.Endpoint, c.Err, a)
	}
	if _, _, err := exchange(client, svc, []byte("two"), awaitTimeout); err != nil {
		t.Fatalf("datagram after the removal: %v", err)
	}
	if got := picker.unreleased(); got[b] != 1 || got[a] != 0 {
		t.Errorf("active entries after the removal: got %v, want one on %v and none on %v", got, b, a)
	}
}
