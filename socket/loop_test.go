package socket

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/socket/poll/polltest"
	"github.com/uproxy/uproxy/test/testbed"
)

// Backend sockets carry the dial mark, which needs CAP_NET_ADMIN: without it
// CheckDialMark refuses.
func TestDialMark(t *testing.T) {
	err := CheckDialMark(0x2000)
	if os.Geteuid() != 0 {
		if !errors.Is(err, unix.EPERM) {
			t.Fatalf("CheckDialMark without privilege: got %v, want EPERM", err)
		}
		return
	}
	if err != nil {
		t.Fatalf("CheckDialMark as root: %v", err)
	}
	backend := startTCPServer(t, "127.0.0.2", echo)
	l := newLoop(nil) // dial needs only the loop's scratch space
	for _, sotype := range []int{unix.SOCK_STREAM, unix.SOCK_DGRAM} {
		fd, _, err := l.dial(backend.addr, sotype, netip.Addr{}, 0x2000, false)
		if err != nil {
			t.Fatal(err)
		}
		mark, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK)
		unix.Close(fd)
		if err != nil || mark != 0x2000 {
			t.Errorf("SO_MARK of a backend socket: got %#x, %v; want 0x2000", mark, err)
		}
	}
}

// The timers below run on a clock that moves only when the test says so, and
// Advance returns once the timers it made due have expired: what a timer does is
// done by then, and what it has not done it would not do without another move.

// A dial attempt times out once the loop's clock reaches its timeout, not before,
// and the next attempt goes to another endpoint.
func TestTCPDialTimeoutFollowsTheLoopClock(t *testing.T) {
	t.Parallel()
	clock := polltest.NewClock()
	loops := newLoops(t, 1, clock)
	eps := []netip.AddrPort{unansweredAddr(t, "127.0.0.2"), startTCPServer(t, "127.0.0.3", echo).addr}
	rec := &recorder{}
	p := &TCPProxy{Service: "ns/svc:tcp", Picker: newCyclePicker(eps...), Observer: rec,
		DialTimeouts: []time.Duration{time.Second, time.Second}, Loops: loops}
	client := dialProxy(t, startTCPProxy(t, p))
	testbed.Await(t, awaitTimeout, "the connection accepted", func() bool { return p.Active() == 1 })
	// The handler that accepted it has armed the dial timer once the loop has
	// moved on to a posted function.
	loops.Next().PostWait(func() {})

	clock.Advance(time.Second - time.Nanosecond)
	if _, attempts, _ := rec.counts(); attempts != 0 {
		t.Fatalf("attempts done a nanosecond before the timeout: got %d, want 0", attempts)
	}
	clock.Advance(time.Nanosecond)
	// The next attempt, to a listener on loopback, may be done too by now.
	rec.mu.Lock()
	attempts := slices.Clone(rec.attempts)
	rec.mu.Unlock()
	var ne net.Error
	if len(attempts) == 0 || attempts[0].Endpoint != eps[0] || !errors.As(attempts[0].Err, &ne) || !ne.Timeout() {
		t.Fatalf("attempts done at the timeout: got %+v, want a timeout of %v first", attempts, eps[0])
	}
	if got, err := roundTrip(client, []byte("second")); err != nil || string(got) != "second" {
		t.Fatalf("round trip through the second endpoint: got %q, %v", got, err)
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if len(rec.attempts) != 2 || rec.attempts[1].Endpoint != eps[1] || rec.attempts[1].Err != nil {
		t.Errorf("attempts: got %+v, want the timeout, then a success at %v", rec.attempts, eps[1])
	}
}

// A UDP client entry expires once it has been idle for the timeout by the loop's
// clock; a datagram in between starts the idle time again.
func TestUDPClientExpiryFollowsTheLoopClock(t *testing.T) {
	t.Parallel()
	const timeout = 250 * time.Millisecond
	clock := polltest.NewClock()
	backend := startUDPEcho(t, "127.0.0.2")
	rec := &recorder{}
	p := &UDPProxy{Service: "ns/dns:udp", Picker: newCyclePicker(backend), Observer: rec,
		Timeout: timeout, Loops: newLoops(t, 1, clock)}
	svc := startUDPProxy(t, p)
	client := listenUDP(t, "127.0.0.1")
	// The reply has passed the loop, which has marked the entry used by then.
	send := func(msg string) {
		t.Helper()
		if got, _, err := exchange(client, svc, []byte(msg), awaitTimeout); err != nil || string(got) != msg {
			t.Fatalf("exchange %q: got %q, %v", msg, got, err)
		}
	}
	send("first")

	steps := []struct {
		advance time.Duration
		send    bool // a datagram after the move
		clients int  // entries left after the move
	}{
		{advance: 200 * time.Millisecond, send: true, clients: 1}, // 200ms: used again
		{advance: 50 * time.Millisecond, clients: 1},              // 250ms: idle for 50ms only
		{advance: 199 * time.Millisecond, clients: 1},             // 449ms
		{advance: 1 * time.Millisecond, clients: 0},               // 450ms: idle for the timeout
	}
	var now time.Duration
	for _, st := range steps {
		clock.Advance(st.advance)
		now += st.advance
		if got := p.Clients(); got != st.clients {
			t.Fatalf("client entries at %v: got %d, want %d", now, got, st.clients)
		}
		if st.send {
			send("again")
		}
	}
	if c := rec.awaitClosed(t, 1)[0]; c.Err != nil || c.BytesIn != 10 || c.BytesOut != 10 {
		t.Errorf("record of the expired entry: got err %v, %d bytes in, %d out; want nil, 10, 10", c.Err, c.BytesIn, c.BytesOut)
	}
}

// After an accept runs short of descriptors, the listener is watched again once
// the loop's clock has passed the backoff, not before; the connection that waited
// is then served.
func TestAcceptBackoffResumesOnTheLoopClock(t *testing.T) {
	clock := polltest.NewClock()
	loops := newLoops(t, 1, clock)
	backend := startTCPServer(t, "127.0.0.2", echo)
	var mu sync.Mutex
	var delays []time.Duration
	p := &TCPProxy{Service: "ns/svc:tcp", Picker: newCyclePicker(backend.addr), Loops: loops}
	p.acceptBackoff = func(err error, d time.Duration) {
		mu.Lock()
		defer mu.Unlock()
		delays = append(delays, d)
	}
	addr := startTCPProxy(t, p)
	// The handle is looked up here, not on the loop: the loop must not wait for
	// the locks, which Serve holds while it waits for the loop.
	h := listenHandleOf(t, p)
	// watching reports whether the loop watches the listener.
	watching := func() bool {
		var w bool
		loops.Next().PostWait(func() { w = h.watched })
		return w
	}
	warm := dialProxy(t, addr)
	if got, err := roundTrip(warm, []byte("warm")); err != nil || string(got) != "warm" {
		t.Fatalf("round trip before descriptors run out: got %q, %v", got, err)
	}
	warm.Close()
	if !watching() {
		t.Fatal("listener not watched while serving")
	}
	clientFD, f := rawClient(t)

	st := starveDescriptors(t)
	st.fill()
	connectRaw(t, clientFD, addr)
	testbed.Await(t, awaitTimeout, "an accept backoff", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(delays) > 0
	})
	st.restore()

	clock.Advance(minBackoff - time.Nanosecond)
	if watching() {
		t.Fatalf("listener watched a nanosecond before the backoff of %v ended", minBackoff)
	}
	clock.Advance(time.Nanosecond)
	if !watching() {
		t.Fatalf("listener not watched once the backoff of %v ended", minBackoff)
	}
	fc, err := net.FileConn(f)
	if err != nil {
		t.Fatal(err)
	}
	defer fc.Close()
	fc.SetDeadline(time.Now().Add(awaitTimeout))
	if got, err := roundTrip(fc, []byte("ping")); err != nil || string(got) != "ping" {
		t.Fatalf("round trip once the backoff ended: got %q, %v, want \"ping\"", got, err)
	}
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(delays, []time.Duration{minBackoff}) {
		t.Errorf("backoffs: got %v, want one of %v", delays, minBackoff)
	}
}

// listenHandleOf waits for p's only listener to be watched on its only loop,
// and returns its handle.
func listenHandleOf(t *testing.T, p *TCPProxy) *listenHandle {
	t.Helper()
	p.init() // Serve may not have made p.listeners yet
	var h *listenHandle
	testbed.Await(t, awaitTimeout, "the listener's handle", func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		for _, tl := range p.listeners {
			tl.mu.Lock()
			if len(tl.handles) == 1 {
				h = tl.handles[0]
			}
			tl.mu.Unlock()
		}
		return h != nil
	})
	return h
}

// A connection that arrives alone is accepted with one accept4, none finding
// the queue empty; a burst queued while the loop was busy is served whole, in
// rounds of one connection and then as many as the kernel says are queued (up
// to acceptBatch), no accept finding the queue empty.
func TestAcceptBudget(t *testing.T) {
	t.Parallel()
	loops := newLoops(t, 1, nil)
	lp := loops.Next()
	backend := startTCPServer(t, "127.0.0.2", echo)
	p := &TCPProxy{Service: "ns/svc:tcp", Picker: newCyclePicker(backend.addr), Loops: loops}
	addr := startTCPProxy(t, p)
	h := listenHandleOf(t, p)
	read := func() (empty uint64, budget int) {
		lp.PostWait(func() { empty, budget = h.l.emptyAccepts, h.budget })
		return
	}

	for i := range 20 {
		c := dialProxy(t, addr)
		msg := []byte(fmt.Sprintf("alone %d", i))
		if got, err := roundTrip(c, msg); err != nil || !bytes.Equal(got, msg) {
			t.Fatalf("connection %d: got %q, %v, want %q", i, got, err, msg)
		}
		c.Close()
	}
	if empty, budget := read(); empty != 0 || budget != 1 {
		t.Errorf("after 20 connections one at a time: %d accepts found the queue empty with a budget of %d, want 0 and 1", empty, budget)
	}

	// The loop sleeps while the connections queue up in the kernel, which
	// completes their handshakes without it.
	const burst = 40
	release := make(chan struct{})
	lp.Post(func() { <-release })
	conns := make([]*net.TCPConn, burst)
	for i := range conns {
		conns[i] = dialProxy(t, addr)
	}
	close(release)
	for i, c := range conns {
		msg := []byte(fmt.Sprintf("burst %d", i))
		if got, err := roundTrip(c, msg); err != nil || !bytes.Equal(got, msg) {
			t.Fatalf("burst connection %d: got %q, %v, want %q", i, got, err, msg)
		}
	}
	// Rounds of 1, then 32 of the 39 queued, then the last 7.
	if empty, budget := read(); empty != 0 || budget != burst-1-acceptBatch {
		t.Errorf("after a burst of %d: %d accepts found the queue empty with a last budget of %d, want 0 and %d", burst, empty, budget, burst-1-acceptBatch)
	}
}
