package socket

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/socket/poll"
)

// ErrShutdown is the Err of connections reset because Shutdown's grace period ended.
var ErrShutdown = errors.New("proxy shut down")

// DefaultKeepAlive is the keepalive idle time and probe interval of a TCPProxy
// that sets none, as Go's net package.
const DefaultKeepAlive = 15 * time.Second

// maxKeepAlive is the kernel's bound on TCP_KEEPIDLE and TCP_KEEPINTVL (32767s).
const maxKeepAlive = 32767 * time.Second

// Listen opens a listener for Serve on address ("tcp", "tcp4" or "tcp6", as
// net.Listen; plain TCP, not multipath). Its socket gets the options that every
// accepted socket inherits - TCP_NODELAY and the proxy's keepalive - before it
// listens: a connection is made, and takes its options, as it enters the accept
// queue, so one queued before Serve began would otherwise have none. Serve takes
// the socket over; the listener only carries it there.
func (p *TCPProxy) Listen(ctx context.Context, network, address string) (*net.TCPListener, error) {
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var err error
		if cerr := c.Control(func(fd uintptr) { err = p.setListenerOptions(int(fd)) }); cerr != nil {
			return cerr
		}
		return err
	}}
	lc.SetMultipathTCP(false)
	ln, err := lc.Listen(ctx, network, address)
	if err != nil {
		return nil, err // a *net.OpError: "listen tcp ADDRESS: ..."
	}
	return ln.(*net.TCPListener), nil
}

// setListenerOptions gives listening socket fd the options every socket it
// accepts inherits, sparing their setsockopt calls per connection.
func (p *TCPProxy) setListenerOptions(fd int) error {
	err := unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
	if err == nil {
		err = setKeepAlive(fd, p.keepAliveSecs())
	}
	if err != nil {
		return os.NewSyscallError("setsockopt", err)
	}
	return nil
}

// TCPProxy proxies the TCP connections of one Service port to its endpoints. Set the
// fields before the first Serve and do not change them afterwards.
type TCPProxy struct {
	// Service names the Service port ("namespace/name:port") in records and metrics.
	Service string
	// Picker chooses the endpoint of each attempt. Required.
	Picker Picker
	// Loops are the event loops the proxy runs on: every loop accepts, and a
	// connection stays on the loop that accepted it. Required; the owner closes
	// them once the proxy has shut down.
	Loops *poll.Group
	// DialTimeouts holds one timeout per dial attempt; nil means DefaultDialTimeouts.
	// DialHedge and RetryBudget are the rest of the dial policy (DialPolicy says
	// what each means); SetDialPolicy replaces all three while the proxy serves.
	DialTimeouts []time.Duration
	DialHedge    time.Duration
	RetryBudget  float64
	// KeepAlive turns TCP keepalive on for both sockets of every connection: after
	// KeepAlive without a packet from the peer the kernel probes it, every
	// KeepAlive, and fails the socket when the node's
	// net.ipv4.tcp_keepalive_probes (9 by default) go unanswered, or the peer
	// answers with a reset; the proxy then resets the other side too. A peer
	// that vanished without a FIN is found 150s later, by default. Zero means
	// DefaultKeepAlive, negative turns keepalive off. It is counted in whole
	// seconds, rounded up, at most 32767s. The backend socket gets its options
	// once the connection has been open for KeepAlive, sparing short connections
	// the calls; its probes go when they would have (see the package doc).
	KeepAlive time.Duration
	// IdleTimeout closes a connection through which no byte has moved, either
	// way, for that long: both sockets are reset (the record's Err wraps
	// record.ErrIdle). Zero (or negative) never closes one, as kube-proxy.
	IdleTimeout time.Duration
	// Observer is told about every connection and attempt; nil means NopObserver.
	Observer Observer
	// OwnSocket, when set, reports whether a connection to ep would reach one
	// of the sockets the proxy's owner listens on (a proxy port, under any
	// address that leads there). Such an endpoint is never dialed: the proxy
	// would accept its own connection and dial it again, without end. The
	// attempt fails at once with record.ErrOwnSocket, as the endpoint's failure,
	// so the next attempt goes to another endpoint. It is called on the event
	// loops for every attempt: it must be cheap and safe for concurrent use.
	// nil: no check.
	OwnSocket func(ep netip.AddrPort) bool
	// KeepClientAddress, when set, says whether the dials of a connection from
	// client (unmapped) carry the client's address as their source rather than
	// the node's (source.go). It is asked once per connection, on its event
	// loop: it must be cheap and safe for concurrent use. nil: never.
	KeepClientAddress func(client netip.Addr) bool
	// DialMark is the packet mark (SO_MARK) of every socket dialed to an
	// endpoint, by which the portals let the proxy's own connections pass
	// (mark.go); setting it needs CAP_NET_ADMIN (CheckDialMark). 0: none.
	DialMark uint32
	// fallback logs the first transparent dial the kernel refused.
	fallback fallbackLog
	// ShortCircuit, when set, is the Picker of the connections from the
	// clients ShortCircuits names (asked once per connection, on its event
	// loop; it must be cheap and safe for concurrent use): every report of
	// theirs goes to it, not to Picker. It is kube-proxy's short-circuit of
	// the node's own and pods' connections to the external addresses of an
	// externalTrafficPolicy Local Service, which go to every endpoint rather
	// than this node's alone.
	ShortCircuit  Picker
	ShortCircuits func(client netip.Addr) bool

	// acceptBackoff, when set, is told about each backoff of accepting - after
	// accept, or a dial of a connection it accepted, found the node short - and
	// its wait (tests use it; the default logs). It runs on an event loop.
	acceptBackoff func(err error, delay time.Duration)
	// acceptResumed, when set, is told instead of the log when accepting
	// succeeds again after backoffs: how long since the first, and how many.
	acceptResumed func(backedOff time.Duration, failures int)

	initOnce sync.Once
	// policy is the dial policy of new connections; a connection keeps the one
	// it began with.
	policy atomic.Pointer[DialPolicy]
	// budget is the retry budget's bucket, kept across policy changes.
	budget retryBudget
	// drained is closed once the proxy is closed, no Serve loop runs and no
	// connection is open; a connection resumed after that makes a new one
	// (track). Read under mu.
	drained chan struct{}

	// mu guards the fields below. Once closed (or forced), stays so.
	mu        sync.Mutex
	closed    bool
	forced    bool // Shutdown's grace ended: connections accepted from now on are reset
	isDrained bool
	serving   int
	// listeners are the sockets served (most proxies have one or two: a
	// slice costs less than a map, at 10k Service ports); conns is made
	// with the first connection.
	listeners []*tcpListener
	conns     map[*tcpSession]struct{}

	listenersClosed atomic.Bool
}

func (p *TCPProxy) init() {
	p.initOnce.Do(func() {
		p.drained = make(chan struct{})
		p.policy.CompareAndSwap(nil, &DialPolicy{Timeouts: p.DialTimeouts, Hedge: p.DialHedge, RetryBudget: p.RetryBudget})
	})
}

// SetDialPolicy makes d the dial policy of the connections accepted from now on
// (those dialing keep theirs). It is safe to call at any time, from any goroutine.
func (p *TCPProxy) SetDialPolicy(d DialPolicy) {
	p.init()
	p.policy.Store(&d)
}

// DialPolicy returns the dial policy of new connections.
func (p *TCPProxy) DialPolicy() DialPolicy {
	p.init()
	return *p.policy.Load()
}

// RetryTokens returns the tokens left in the retry budget's bucket (at most
// 10); it is meaningful while the policy has a RetryBudget.
func (p *TCPProxy) RetryTokens() float64 { return p.budget.tokens() }

// RetryBudgetSpent is how far the retry budget's bucket is below full, in
// millionths of a token: its state, for a successor (SpendRetryBudget).
func (p *TCPProxy) RetryBudgetSpent() int64 { return p.budget.spent.Load() }

// SpendRetryBudget takes the bucket at least spent below full (as
// RetryBudgetSpent said of a predecessor's), so that a retry storm does
// not find a full bucket in the successor.
func (p *TCPProxy) SpendRetryBudget(spent int64) {
	spent = min(max(spent, 0), budgetBurst*tokenUnit)
	for {
		old := p.budget.spent.Load()
		if old >= spent || p.budget.spent.CompareAndSwap(old, spent) {
			return
		}
	}
}

func (p *TCPProxy) observer() Observer {
	if p.Observer == nil {
		return NopObserver{}
	}
	return p.Observer
}

// keepAliveSecs returns the keepalive idle time and interval in seconds, as the
// kernel takes them; 0 when keepalive is off.
func (p *TCPProxy) keepAliveSecs() int {
	d := p.KeepAlive
	switch {
	case d < 0:
		return 0
	case d == 0:
		d = DefaultKeepAlive
	}
	return int((min(d, maxKeepAlive) + time.Second - 1) / time.Second)
}

// Serve accepts connections on ln and proxies them on the event loops until Close
// or Shutdown, after which it returns nil; it returns an error if accepting fails
// for good. Serve takes ln's socket over: ln itself is closed at once, and the
// socket when Serve returns. Use Listen to create ln.
func (p *TCPProxy) Serve(ln *net.TCPListener) error {
	errc := make(chan error, 1)
	if err := p.Start(ln, func(err error) { errc <- err }); err != nil {
		return err
	}
	return <-errc
}

// Start is Serve without the wait: it returns Serve's error when ln cannot be
// served, and otherwise nil at once, with done called later, once, with what
// Serve would have returned. No goroutine waits in the meantime (a proxy of 10k
// Service ports would hold 10k, each with its stack); done runs on a goroutine
// of its own.
func (p *TCPProxy) Start(ln *net.TCPListener, done func(error)) error {
	addr := ln.Addr().String()
	fd, err := takeFD(ln)
	if err != nil {
		return fmt.Errorf("serve %s: %w", p.Service, err)
	}
	// The listener options again, once, in case ln was not made by Listen;
	// connections already queued then lack them.
	if err := p.setListenerOptions(fd); err != nil {
		unix.Close(fd)
		return fmt.Errorf("serve %s: %w", p.Service, err)
	}
	return p.StartFD(fd, addr, done)
}

// setKeepAlive sets TCP keepalive on socket fd: probes after secs seconds
// without a packet from the peer, then every secs seconds; secs 0 turns it off.
// TCP_KEEPCNT is left to the node (net.ipv4.tcp_keepalive_probes): how many
// unanswered probes mean a dead peer is a property of the node's network, which
// its operator tunes, not of one proxy; and leaving it spares a setsockopt per
// backend socket.
func setKeepAlive(fd, secs int) error {
	if secs == 0 {
		// Off is the kernel's default, but a caller's listener may have it on.
		return unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_KEEPALIVE, 0)
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1); err != nil {
		return err
	}
	if err := unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, secs); err != nil {
		return err
	}
	return unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, secs)
}

// isClosed reports whether Close has closed every listener.
func (p *TCPProxy) isClosed() bool { return p.listenersClosed.Load() }

// track registers a newly accepted connection; it reports false when Shutdown has
// already given up on open connections.
func (p *TCPProxy) track(s *tcpSession) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.forced {
		return false
	}
	if p.isDrained {
		// A closed proxy that drained, and resumes connections (its own,
		// given back by a successor that did not take them): it is not
		// drained any more.
		p.drained = make(chan struct{})
		p.isDrained = false
	}
	if p.conns == nil {
		p.conns = make(map[*tcpSession]struct{})
	}
	p.conns[s] = struct{}{}
	return true
}

func (p *TCPProxy) untrack(s *tcpSession) {
	p.mu.Lock()
	delete(p.conns, s)
	p.checkDrainedLocked()
	p.mu.Unlock()
}

func (p *TCPProxy) checkDrainedLocked() {
	if p.closed && !p.isDrained && p.serving == 0 && len(p.conns) == 0 {
		p.isDrained = true
		close(p.drained)
	}
}

// Close stops accepting: every Serve returns and its listener is closed. Open
// connections continue until their peers end them.
func (p *TCPProxy) Close() error {
	p.init()
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	lns := slices.Clone(p.listeners)
	p.checkDrainedLocked()
	p.mu.Unlock()

	var errs []error
	for _, ln := range lns {
		if err := ln.close(); err != nil {
			errs = append(errs, fmt.Errorf("close listener %s of %s: %w", ln.addr, p.Service, err))
		}
	}
	p.listenersClosed.Store(true)
	return errors.Join(errs...)
}

// Shutdown closes the proxy and waits until every open connection has ended or ctx is
// done; then it resets the connections still open (and abandons dials in progress),
// waits for them to be gone and returns a *ShutdownExpiredError, which wraps ctx's
// error (joined to Close's, if any).
func (p *TCPProxy) Shutdown(ctx context.Context) error {
	err := p.Close()
	p.mu.Lock()
	drained := p.drained
	p.mu.Unlock()
	select {
	case <-drained:
		return err
	case <-ctx.Done():
	}
	p.mu.Lock()
	p.forced = true
	expired := &ShutdownExpiredError{Reset: len(p.conns), Err: ctx.Err()}
	for s := range p.conns {
		s.l.Post(func() { s.abort(ErrShutdown) })
	}
	drained = p.drained
	p.mu.Unlock()
	<-drained
	if err != nil {
		return errors.Join(err, expired)
	}
	return expired
}

// ShutdownExpiredError is what Shutdown returns when its context ends before the
// open connections do: the end of a grace period, not a failure. Reset
// connections were reset (or their dials abandoned).
type ShutdownExpiredError struct {
	Reset int
	Err   error // the context's
}

func (e *ShutdownExpiredError) Error() string {
	return fmt.Sprintf("%v with %d connections open; they were reset", e.Err, e.Reset)
}

func (e *ShutdownExpiredError) Unwrap() error { return e.Err }

// Active returns the number of open connections, including those still dialing.
func (p *TCPProxy) Active() int {
	p.init()
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.conns)
}

// tcpListener is one listening socket served on every event loop.
type tcpListener struct {
	p    *TCPProxy
	fd   int
	addr string
	// done is closed once the socket is out of every loop and closed.
	done chan struct{}
	// err is why accepting stopped for good (nil after Close); set before done closes.
	err error
	// finished ends Start's serving of the socket, on a goroutine of its own
	// once done is closed: it is set before the socket can be closed.
	finished func()

	// mu orders register and close: a listener is never watched after close began.
	mu      sync.Mutex
	closing bool
	handles []*listenHandle
}

// listenHandle is a listener's presence on one loop, with that loop's accept backoff.
type listenHandle struct {
	ln *tcpListener
	l  *loop
	backoffWatch
	// budget is how many connections the current event accepts at most, and
	// fullRound the loop round whose event accepted its whole budget (0: the
	// last event stopped short); see Handle.
	budget    int
	fullRound uint64
	// early is whether its clients write first (early.go).
	early earlyReads
}

const listenEvents = unix.EPOLLIN | unix.EPOLLEXCLUSIVE

// register has every loop watch the socket. It posts the watches and does not
// wait for them: a loop runs what is posted in order, so a close that follows
// finds each watch made (or failed) before it stops it, and the socket, listening
// already, queues connections until then. Waiting for each loop had cost a
// proxier opening many Service ports a wake-up of every loop, and a turn of the
// scheduler, per port (decision record 2026-12-07). A watch that fails ends the
// serving with its error, as accept failing for good does.
func (tl *tcpListener) register(all []*poll.Loop) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	if tl.closing {
		return
	}
	for _, pl := range all {
		h := &listenHandle{ln: tl, l: loopOf(pl)}
		h.backoffWatch = newBackoffWatch(tl.fd, listenEvents, h)
		tl.handles = append(tl.handles, h)
		if !pl.Post(func() {
			if err := h.watch(h.l, h); err != nil {
				tl.fail(err)
			}
		}) {
			tl.err = poll.ErrClosed
			go tl.close()
			return
		}
	}
}

// fail ends the serving of the socket with err, the first failure's, on a
// goroutine of its own (close waits for the loops, and fail runs on one).
func (tl *tcpListener) fail(err error) {
	tl.mu.Lock()
	if tl.err == nil {
		tl.err = err
	}
	tl.mu.Unlock()
	go tl.close()
}

// close takes the socket out of every loop, closes it and ends Serve. It must not
// run on a loop (it waits for each).
func (tl *tcpListener) close() error {
	tl.mu.Lock()
	if tl.closing {
		tl.mu.Unlock()
		<-tl.done
		return nil
	}
	tl.closing = true
	tl.mu.Unlock()
	for _, h := range tl.handles {
		h.l.PostWait(func() { h.stop(h.l) })
	}
	err := unix.Close(tl.fd)
	close(tl.done)
	go tl.finished()
	if err != nil {
		return os.NewSyscallError("close", err)
	}
	return nil
}

// acceptBatch bounds the connections one event accepts, so one busy listener does
// not starve the rest of the loop; the listener is level-triggered and comes back.
const acceptBatch = 32

// Handle accepts up to the handle's budget of connections, and never looks for
// one more than the kernel has queued: an accept4 that finds the queue empty is
// far from free, because the kernel makes the new socket and its file before it
// looks and frees them again (BenchmarkEmptyAccept: over ten times a system
// call that does nothing, and five times the call that reads the queue's
// length). The budget is one connection, so a
// connection arriving alone costs one accept4 and nothing more. The listener
// is level-triggered: connections left queued make epoll report it again in
// the next round, and an event that comes right after a whole budget asks the
// kernel how many wait (the listener's TCP_INFO, whose tcpi_unacked is its
// accept queue's length: a cheap call) and takes them, up to acceptBatch. A
// burst is thus drained in rounds of 1, then as many as are queued, and an
// accept4 finds the queue empty only when another loop took a connection first.
func (h *listenHandle) Handle(uint32) {
	tl, l := h.ln, h.l
	round := l.Round()
	h.budget = 1
	if h.fullRound != 0 && round == h.fullRound+1 {
		// At least one: epoll reported a connection queued, whatever
		// the count says, and a budget of none would spin on it.
		h.budget = max(1, min(l.acceptQueue(tl.fd), acceptBatch))
	}
	h.fullRound = 0
	for range h.budget {
		fd, client, err := l.accept(tl.fd)
		if err == nil && !l.keep(fd) {
			// The reserve's: the client is reset, as when accept fails for
			// want of descriptors, and accepting waits likewise.
			resetFD(fd)
			h.backoff(l, os.NewSyscallError("accept4", reserveError{l.fdCeiling}), "Accept failed, backing off")
			return
		}
		switch {
		case err == nil:
			newSession(l, h, fd, client)
			if !h.watched {
				// Its dial ran short of sockets: backing off.
				return
			}
			if d, n, ok := h.succeeded(l); ok {
				h.resumed(d, n)
			}
			continue
		case err == unix.EAGAIN:
			l.emptyAccepts++
			return
		}
		switch actionAfter(err) {
		case retryNow:
			// That connection is gone, and took its place in the queue
			// with it: the next one is taken (within the same batch).
			continue
		case backOff:
			h.backoff(l, os.NewSyscallError("accept4", err), "Accept failed, backing off")
			return
		}
		// The socket itself is broken (shut down, say): Serve reports it, and
		// its owner may open another.
		h.unwatch(l)
		tl.mu.Lock()
		if tl.err == nil {
			tl.err = os.NewSyscallError("accept4", err)
		}
		tl.mu.Unlock()
		go tl.close()
		return
	}
	h.fullRound = round
}

// backoff stops accepting on this loop for a while after accept ran short of
// descriptors or memory, or such a shortage failed an accepted connection's
// dial: the listener stays readable, and accepting at once would meet the same
// error.
func (h *listenHandle) backoff(l *loop, err error, msg string) {
	delay := h.backoffWatch.backoff(l)
	h.ln.p.observer().BackedOff(h.ln.p.Service, err, delay)
	if f := h.ln.p.acceptBackoff; f != nil {
		f(err, delay)
	} else {
		klog.ErrorS(err, msg, "service", h.ln.p.Service, "delay", delay)
	}
}

// resumed logs, once, that accepting works again after failures backoffs over
// backedOff, so that a log that reported the shortage also reports its end.
func (h *listenHandle) resumed(backedOff time.Duration, failures int) {
	p := h.ln.p
	if f := p.acceptResumed; f != nil {
		f(backedOff, failures)
		return
	}
	klog.InfoS("Accepting again after a shortage", "service", p.Service,
		"backedOff", backedOff.Round(time.Millisecond), "failures", failures)
}

// shortage backs the listener off after a dial of a connection it accepted found
// the node short of sockets: accepting more would only reset them too. Nothing
// is done if it is backing off already, or closing (then it is not watched).
func (h *listenHandle) shortage(l *loop, err error) {
	if h.watched {
		h.backoff(l, err, "No socket for a backend, backing off accepts")
	}
}

// Expire ends a backoff: the listener is watched again, unless it is closing.
func (h *listenHandle) Expire() {
	h.ln.mu.Lock()
	closing := h.ln.closing
	h.ln.mu.Unlock()
	if !closing {
		h.resume(h.l, h)
	}
}

// acceptQueue returns how many connections wait in the accept queue of the
// listening socket lfd (tcpi_unacked of its TCP_INFO, the only part of it that
// is read), or 1 when the kernel does not say.
func (l *loop) acceptQueue(lfd int) int {
	n := uint32(unsafe.Offsetof(l.tcpInfo.Unacked) + unsafe.Sizeof(l.tcpInfo.Unacked))
	_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(lfd), unix.IPPROTO_TCP, unix.TCP_INFO,
		uintptr(unsafe.Pointer(&l.tcpInfo)), uintptr(unsafe.Pointer(&n)), 0)
	if errno != 0 || uintptr(n) < unsafe.Offsetof(l.tcpInfo.Unacked)+unsafe.Sizeof(l.tcpInfo.Unacked) {
		return 1
	}
	return int(l.tcpInfo.Unacked)
}

// accept takes one connection from the listening socket lfd, non-blocking, and
// returns it with the client's address, decoded without allocating.
func (l *loop) accept(lfd int) (int, netip.AddrPort, error) {
	l.rsaLen = unix.SizeofSockaddrAny
	fd, _, errno := unix.Syscall6(unix.SYS_ACCEPT4, uintptr(lfd),
		uintptr(unsafe.Pointer(&l.rsa)), uintptr(unsafe.Pointer(&l.rsaLen)),
		unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0, 0)
	if errno != 0 {
		return -1, netip.AddrPort{}, errno
	}
	return int(fd), rawAddrPort(&l.rsa), nil
}

// localAddr returns fd's own address and port (getsockname), decoded without
// allocating; the zero AddrPort when the call fails.
func (l *loop) localAddr(fd int) netip.AddrPort {
	l.rsaLen = unix.SizeofSockaddrAny
	_, _, errno := unix.Syscall(unix.SYS_GETSOCKNAME, uintptr(fd),
		uintptr(unsafe.Pointer(&l.rsa)), uintptr(unsafe.Pointer(&l.rsaLen)))
	if errno != 0 {
		return netip.AddrPort{}
	}
	return rawAddrPort(&l.rsa)
}

// rawAddrPort decodes a socket address as the kernel wrote it; the zero
// AddrPort for anything but IPv4 and IPv6.
func rawAddrPort(rsa *unix.RawSockaddrAny) netip.AddrPort {
	switch rsa.Addr.Family {
	case unix.AF_INET:
		sa := (*unix.RawSockaddrInet4)(unsafe.Pointer(rsa))
		return netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), ntohs(sa.Port))
	case unix.AF_INET6:
		sa := (*unix.RawSockaddrInet6)(unsafe.Pointer(rsa))
		return netip.AddrPortFrom(netip.AddrFrom16(sa.Addr), ntohs(sa.Port))
	}
	return netip.AddrPort{}
}

// ntohs reads a port as the kernel stores it (network byte order).
func ntohs(p uint16) uint16 {
	b := (*[2]byte)(unsafe.Pointer(&p))
	return uint16(b[0])<<8 | uint16(b[1])
}
