package socket

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/record"
	"github.com/uproxy/uproxy/socket/poll"
	"github.com/uproxy/uproxy/test/testbed"
)

// awaitTimeout bounds every wait for a condition; conditions normally hold within
// milliseconds, the margin is for slow machines and -race.
const awaitTimeout = 20 * time.Second

// errNoEndpoints is what a cyclePicker without endpoints returns from Pick.
var errNoEndpoints = errors.New("no usable endpoints")

// cyclePicker hands out its endpoints round robin, skipping endpoints already tried
// while others remain, and records every call.
type cyclePicker struct {
	mu     sync.Mutex
	eps    []netip.AddrPort
	err    error // returned by Pick when set
	next   int
	tried  [][]netip.AddrPort // the tried argument of each Pick
	active map[netip.AddrPort]int
	resets []netip.Addr
	// reports has one entry per DialSucceeded or DialFailed, in order.
	reports []dialReport
}

// dialReport is one DialSucceeded or DialFailed told to a cyclePicker.
type dialReport struct {
	ep     netip.AddrPort
	failed bool
	err    error
}

func (r dialReport) String() string {
	if r.failed {
		return fmt.Sprintf("failed %v: %v", r.ep, r.err)
	}
	return fmt.Sprintf("succeeded %v", r.ep)
}

func newCyclePicker(eps ...netip.AddrPort) *cyclePicker {
	return &cyclePicker{eps: eps, active: make(map[netip.AddrPort]int)}
}

func (p *cyclePicker) Pick(client netip.Addr, tried []netip.AddrPort) (netip.AddrPort, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.tried = append(p.tried, slices.Clone(tried))
	if p.err != nil {
		return netip.AddrPort{}, p.err
	}
	if len(p.eps) == 0 {
		return netip.AddrPort{}, errNoEndpoints
	}
	pick := p.next
	for i := range len(p.eps) {
		if j := (p.next + i) % len(p.eps); !slices.Contains(tried, p.eps[j]) {
			pick = j
			break
		}
	}
	p.next = (pick + 1) % len(p.eps)
	p.active[p.eps[pick]]++
	return p.eps[pick], nil
}

func (p *cyclePicker) Release(ep netip.AddrPort) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.active[ep]--
}

func (p *cyclePicker) Acquire(ep netip.AddrPort) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.active[ep]++
}

func (p *cyclePicker) ResetAffinity(client netip.Addr) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.resets = append(p.resets, client)
}

func (p *cyclePicker) DialSucceeded(ep netip.AddrPort) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.reports = append(p.reports, dialReport{ep: ep})
}

func (p *cyclePicker) DialFailed(ep netip.AddrPort, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.reports = append(p.reports, dialReport{ep: ep, failed: true, err: err})
}

// dialReports returns the reports so far.
func (p *cyclePicker) dialReports() []dialReport {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.reports)
}

// unreleased returns the endpoints whose Picks and Releases do not balance.
func (p *cyclePicker) unreleased() map[netip.AddrPort]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make(map[netip.AddrPort]int)
	for ep, n := range p.active {
		if n != 0 {
			out[ep] = n
		}
	}
	return out
}

func (p *cyclePicker) resetCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.resets)
}

// recorder is an Observer keeping copies of everything it is told.
type recorder struct {
	mu       sync.Mutex
	opened   int
	attempts []record.Attempt
	closed   []record.Conn
	backoffs []time.Duration
}

func (r *recorder) BackedOff(service string, err error, delay time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.backoffs = append(r.backoffs, delay)
}

func (r *recorder) ConnOpened(service, protocol string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.opened++
}

func (r *recorder) AttemptDone(service string, a record.Attempt) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.attempts = append(r.attempts, a)
}

func (r *recorder) ConnClosed(c *record.Conn) {
	cp := *c
	cp.Attempts = slices.Clone(c.Attempts)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.closed = append(r.closed, cp)
}

// awaitClosed waits until n connections have been reported closed and returns them.
func (r *recorder) awaitClosed(t testing.TB, n int) []record.Conn {
	t.Helper()
	testbed.Await(t, awaitTimeout, fmt.Sprintf("%d ConnClosed records", n), func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return len(r.closed) >= n
	})
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.closed)
}

func (r *recorder) counts() (opened, attempts, closed int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.opened, len(r.attempts), len(r.closed)
}

// tcpServer is a backend on a real loopback listener running handle per connection.
type tcpServer struct {
	ln    *net.TCPListener
	addr  netip.AddrPort
	wg    sync.WaitGroup
	mu    sync.Mutex
	conns map[*net.TCPConn]struct{}
	once  sync.Once
}

// startTCPServer listens on ip:0 and serves each connection with handle, which
// should return once its peer is done. The server stops at the end of the test.
func startTCPServer(t testing.TB, ip string, handle func(*net.TCPConn)) *tcpServer {
	t.Helper()
	ln, err := net.ListenTCP("tcp", net.TCPAddrFromAddrPort(netip.AddrPortFrom(netip.MustParseAddr(ip), 0)))
	if err != nil {
		t.Fatalf("listen on %s: %v", ip, err)
	}
	s := &tcpServer{ln: ln, addr: ln.Addr().(*net.TCPAddr).AddrPort(), conns: make(map[*net.TCPConn]struct{})}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			c, err := ln.AcceptTCP()
			if err != nil {
				return
			}
			s.mu.Lock()
			s.conns[c] = struct{}{}
			s.mu.Unlock()
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				handle(c)
				c.Close()
				s.mu.Lock()
				delete(s.conns, c)
				s.mu.Unlock()
			}()
		}
	}()
	t.Cleanup(s.stop)
	return s
}

// stop closes the listener and every open connection and waits for the handlers.
func (s *tcpServer) stop() {
	s.once.Do(func() {
		s.ln.Close()
		s.mu.Lock()
		for c := range s.conns {
			c.Close()
		}
		s.mu.Unlock()
		s.wg.Wait()
	})
}

// echo copies everything back, then half-closes.
func echo(c *net.TCPConn) {
	io.Copy(c, c)
	c.CloseWrite()
}

// rawSocket creates a TCP socket bound to ip:0 outside Go's runtime poller and
// returns its address; listenBacklog >= 0 also puts it in the listening state.
func rawSocket(t testing.TB, ip string, listenBacklog int) (netip.AddrPort, int) {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("socket: %v", err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	a := netip.MustParseAddr(ip).As4()
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: a}); err != nil {
		t.Fatalf("bind %s:0: %v", ip, err)
	}
	if listenBacklog >= 0 {
		if err := unix.Listen(fd, listenBacklog); err != nil {
			t.Fatalf("listen: %v", err)
		}
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		t.Fatalf("getsockname: %v", err)
	}
	return netip.AddrPortFrom(netip.AddrFrom4(a), uint16(sa.(*unix.SockaddrInet4).Port)), fd
}

// refusedAddr returns an address whose port is taken by a socket that does not
// listen: a connect there is refused at once (RST), and nothing else can bind it.
func refusedAddr(t testing.TB, ip string) netip.AddrPort {
	t.Helper()
	addr, _ := rawSocket(t, ip, -1)
	return addr
}

// unansweredAddr returns an address where a connect is never answered: a listener
// with backlog 0 whose accept queue is already full (nobody accepts), so the kernel
// drops further SYNs and a connect only ends by its own timeout.
func unansweredAddr(t testing.TB, ip string) netip.AddrPort {
	t.Helper()
	addr, _ := rawSocket(t, ip, 0)
	// The first connection completes into the queue and fills it.
	filler, err := net.DialTimeout("tcp", addr.String(), 5*time.Second)
	if err != nil {
		t.Fatalf("fill accept queue of %s: %v", addr, err)
	}
	t.Cleanup(func() { filler.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr.String()); err == nil {
		c.Close()
		t.Fatalf("connect to the full listener %s succeeded, want it unanswered", addr)
	} else if ne, ok := err.(net.Error); !ok || !ne.Timeout() {
		t.Fatalf("connect to the full listener %s: got %v, want a timeout", addr, err)
	}
	return addr
}

// newLoops starts n event loops on clock (nil: the real clock) and closes them at
// the end of the test. Cleanups run last registered first: the loops are closed
// after the proxies started on them later are shut down.
func newLoops(t testing.TB, n int, clock poll.Clock) *poll.Group {
	t.Helper()
	g, err := poll.New(poll.Config{Loops: n, Clock: clock})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := g.Close(); err != nil {
			t.Errorf("close event loops: %v", err)
		}
	})
	return g
}

// startTCPProxy serves p on a fresh 127.0.0.1:0 listener and returns its address;
// a p without Loops gets one loop of its own. At the end of the test the proxy is
// shut down and Serve must have returned nil.
func startTCPProxy(t testing.TB, p *TCPProxy) netip.AddrPort {
	t.Helper()
	if p.Loops == nil {
		p.Loops = newLoops(t, 1, nil)
	}
	ln, err := p.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return serveTCPProxy(t, p, ln)
}

// serveTCPProxy serves p on ln and returns its address; at the end of the test
// the proxy is shut down and Serve must have returned nil.
func serveTCPProxy(t testing.TB, p *TCPProxy, ln *net.TCPListener) netip.AddrPort {
	t.Helper()
	served := make(chan error, 1)
	go func() { served <- p.Serve(ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := p.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: got %v, want nil", err)
		}
		if err := <-served; err != nil {
			t.Errorf("Serve: got %v, want nil", err)
		}
	})
	return ln.Addr().(*net.TCPAddr).AddrPort()
}

func dialProxy(t testing.TB, addr netip.AddrPort) *net.TCPConn {
	t.Helper()
	c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(addr))
	if err != nil {
		t.Fatalf("dial proxy %s: %v", addr, err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(awaitTimeout))
	return c
}

// roundTrip writes msg and reads the same number of bytes back.
func roundTrip(c net.Conn, msg []byte) ([]byte, error) {
	if _, err := c.Write(msg); err != nil {
		return nil, fmt.Errorf("write: %w", err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		return nil, fmt.Errorf("read: %w", err)
	}
	return got, nil
}

// exchangeAll writes b to c, then half-closes it, while it reads everything c
// returns until EOF: both directions at once, as a bulk transfer needs.
func exchangeAll(c *net.TCPConn, b []byte) ([]byte, error) {
	written := make(chan error, 1)
	go func() {
		_, err := c.Write(b)
		if err == nil {
			err = c.CloseWrite()
		}
		written <- err
	}()
	got, err := io.ReadAll(c)
	if err != nil {
		return got, fmt.Errorf("read: got %w after %d bytes, want EOF", err, len(got))
	}
	if err := <-written; err != nil {
		return got, fmt.Errorf("write: %w", err)
	}
	return got, nil
}

// isReset reports whether err is a connection reset.
func isReset(err error) bool { return errors.Is(err, syscall.ECONNRESET) }

// connectAndRead connects to addr and reads one byte, returning the first error: a
// reset may arrive before connect has even returned.
func connectAndRead(addr netip.AddrPort) error {
	c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(addr))
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(awaitTimeout))
	_, err = c.Read(make([]byte, 1))
	return err
}

// resetConn closes c with an RST instead of a FIN (SO_LINGER with a zero timeout).
func resetConn(c *net.TCPConn) {
	c.SetLinger(0)
	c.Close()
}

// loUp brings lo up, in a test's network namespace of its own (InOwnNetns),
// and returns it.
func loUp(t *testing.T) netlink.Link {
	t.Helper()
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		t.Fatal(err)
	}
	return lo
}
