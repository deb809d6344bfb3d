package socket

import (
	"fmt"
	"math"
	"net"
	"net/netip"
	"os"
	"slices"
	"time"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/record"
	"github.com/uproxy/uproxy/socket/poll"
)

// tcpSession is one proxied connection, owned by the loop that accepted it: every
// method runs on that loop's thread.
type tcpSession struct {
	p *TCPProxy
	l *loop
	// ln is the listener's presence on l that accepted the session: a dial that
	// finds the node short of sockets backs it off.
	ln *listenHandle

	// backend is the connected backend socket, once open (fd -1 while dialing).
	client, backend tcpSide
	// up copies client to backend, down backend to client.
	up, down tcpDirection
	state    sessionState
	// started and concurrent belong to the dialing state below (kept here,
	// beside state, where they take no word of their own).
	started    uint8
	concurrent bool
	// keepClient is the proxy's KeepClientAddress for the client, asked once;
	// short says the connection picks from the proxy's ShortCircuit.
	keepClient, short bool

	// Dialing. policy is the proxy's dial policy when the session began. dial
	// is an attempt in flight (fd >= 0), and hedges the further attempts in
	// flight that hedging (or a failure while a hedge was pending) began: with
	// no hedging there is at most one attempt in flight, in dial, and nothing
	// is allocated. started counts the attempts begun (rec.Attempts holds the
	// ended ones); nextHedge is when (loop.Now) the next hedge is due, 0 when
	// none is. concurrent is set once two attempts were in flight at a time:
	// rec.Attempts, kept in the order attempts ended, is then sorted by start.
	policy    *DialPolicy
	dial      dialAttempt
	hedges    []*dialAttempt
	nextHedge int64
	// timer, while dialing, is due at the earliest deadline of the attempts in
	// flight or the next hedge; once open it is the idle timeout
	// (TCPProxy.IdleTimeout). lastMoved is when (loop.Now) a byte last moved
	// either way: the idle timer checks it when it expires rather than being
	// moved at every transfer.
	timer     poll.Timer
	lastMoved int64
	// keepAliveAt is when (loop.Now) the backend socket is due its keepalive
	// options (see keepAliveDue); 0 once it has them, or when keepalive is off.
	keepAliveAt int64

	err error // why the session was aborted
	rec record.Conn

	// Inline storage for the common case of one attempt; a connection that
	// retries or hedges appends beyond it. An open connection keeps this for its
	// whole life, so it is kept small: 80 bytes (idle memory per connection is
	// part of the contract, see the package doc).
	attempts [1]record.Attempt
}

// dialAttempt is one dial in flight: the first event of its socket ends it,
// unless the session's timer finds its deadline passed first.
type dialAttempt struct {
	s        *tcpSession
	fd       int // -1 when no attempt is in flight here
	ep       netip.AddrPort
	start    time.Time
	deadline int64 // on the loop's clock
	source   record.Source
}

func (d *dialAttempt) Handle(ev uint32) {
	if d.s.state == dialing {
		d.s.connectEvent(d, ev)
	}
}

type sessionState uint8

const (
	dialing sessionState = iota
	open
	ended
)

// sessionEvents are the events of both sockets: edge-triggered, so a socket is
// registered once and never re-armed.
const sessionEvents = unix.EPOLLIN | unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET

// tcpSide is one socket of a session and what the loop knows of it: readable and
// writable hold until a call finds otherwise. finQueued says the peer's FIN had
// arrived when an event was taken: everything before it was queued by then, so a
// read that comes back short has reached it and the next would return EOF.
// errQueued says an error (or a hang-up) waits: the socket is read until it shows.
// reset says the peer reset the connection: the kernel has closed it already, and
// a close sends nothing, so it needs no SO_LINGER to reset it.
// nagle is where the socket stands with TCP_NODELAY (see beforeWrite).
type tcpSide struct {
	s                    *tcpSession
	fd                   int
	readable, writable   bool
	finQueued, errQueued bool
	reset                bool
	nagle                nagleState
	// finSent: the proxy half-closed this socket (its FIN went first).
	// fromClient: the backend socket was dialed from the client's address.
	finSent, fromClient bool
}

// nagleState is what a socket's next write needs to go out at once.
//
// A dialed socket is not given TCP_NODELAY at dial: Nagle's algorithm holds a
// small segment back only while data the peer has not acknowledged is in
// flight, and before the socket's first write nothing is. So the first write
// always goes out at once, and TCP_NODELAY is needed only before the second:
// a connection whose one request is written in one call (the usual short
// connection) never makes the call. (The client socket has the option from its
// listener, at no cost per connection.)
type nagleState uint8

const (
	noDelaySet  nagleState = iota // TCP_NODELAY is on
	nothingSent                   // off, and no write yet: the next goes out at once
	noDelayDue                    // off, and written to: set it before the next write
)

// beforeWrite is called before every write or splice to the socket: it sets
// TCP_NODELAY before the second. The option's failure is not the connection's:
// the write that follows reports a socket that is gone.
func (sd *tcpSide) beforeWrite() {
	switch sd.nagle {
	case nothingSent:
		sd.nagle = noDelayDue
	case noDelayDue:
		unix.SetsockoptInt(sd.fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
		sd.nagle = noDelaySet
	}
}

func (sd *tcpSide) Handle(ev uint32) {
	if ev&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		sd.readable = true
	}
	if ev&unix.EPOLLRDHUP != 0 {
		sd.finQueued = true
	}
	if ev&unix.EPOLLERR != 0 || ev&(unix.EPOLLHUP|unix.EPOLLRDHUP) == unix.EPOLLHUP {
		sd.errQueued = true
	}
	if ev&(unix.EPOLLOUT|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		sd.writable = true
	}
	// While dialing, client events wait for the backend (whose attempts have
	// handlers of their own, see dialAttempt).
	if s := sd.s; s.state == open {
		s.pump()
	}
}

// tcpDirection is one direction's copy. Data is read into the loop's buffer only
// while the destination is writable, and written on at once; only what it does not
// take (a short write) is kept, in pending.
// A read that fills the buffer marks a bulk transfer: from then on the direction
// splices through a pipe, and the bytes never enter user space (while a pipe can
// be had: see fill).
type tcpDirection struct {
	pending []byte
	off     int
	splice  bool
	pipe    *splicePipe // splice mode: held while it holds bytes
	eof     bool        // the source has ended; done once everything is written
	done    bool
	bytes   int64
}

func (d *tcpDirection) flushed() bool {
	return d.off == len(d.pending) && (d.pipe == nil || d.pipe.n == 0)
}

// newSession starts proxying the socket fd that ln accepted: it registers it and
// begins the first dial.
func newSession(l *loop, ln *listenHandle, fd int, client netip.AddrPort) {
	p := ln.ln.p
	s := &tcpSession{p: p, l: l, ln: ln}
	// A new connection's send buffer is empty.
	s.client = tcpSide{s: s, fd: fd, writable: true}
	s.backend = tcpSide{s: s, fd: -1}
	s.dial = dialAttempt{s: s, fd: -1}
	s.policy = p.policy.Load()
	s.timer = poll.NewTimer(s)
	s.rec = record.Conn{Service: p.Service, Protocol: "TCP", Client: client, Start: time.Now()}
	s.rec.Attempts = s.attempts[:0]
	if p.KeepClientAddress != nil {
		s.keepClient = p.KeepClientAddress(client.Addr().Unmap())
	}
	s.short = p.ShortCircuit != nil && p.ShortCircuits(client.Addr().Unmap())
	if !p.track(s) {
		resetFD(fd)
		return
	}
	p.observer().ConnOpened(p.Service, "TCP")
	if !s.readEarly() {
		return
	}
	if err := l.Watch(fd, &s.client, sessionEvents); err != nil {
		s.client.fd = -1
		resetFD(fd)
		s.end(err)
		return
	}
	s.dialNext(nil)
}

// picker is the Picker of the session's endpoints.
func (s *tcpSession) picker() Picker {
	if s.short {
		return s.p.ShortCircuit
	}
	return s.p.Picker
}

// dialNext begins the next dial attempt, and goes on to the one after at once when
// an attempt fails without waiting (a refused or unroutable connect). lastErr is the
// previous attempt's error (nil for a hedge). When no attempt is left, or the
// retry budget refuses one, and none is in flight, the client is reset.
func (s *tcpSession) dialNext(lastErr error) {
	p, pol := s.p, s.policy
	timeouts := pol.timeouts()
	clientIP := s.rec.Client.Addr().Unmap()
	for int(s.started) < len(timeouts) && s.err == nil && !s.rec.RetryRefused {
		// A retry after the node ran out of local ports toward the last endpoint
		// loads no backend (that connect sent nothing), so the budget, which
		// guards the backends against retry storms, is not asked.
		budgeted := s.started > 0 && pol.RetryBudget > 0 && !isLocalPortShortage(lastErr)
		if budgeted && !p.budget.withdraw() {
			s.rec.RetryRefused = true
			s.nextHedge = 0
			break
		}
		ep, err := s.picker().Pick(clientIP, s.triedEndpoints())
		if err != nil {
			if budgeted {
				p.budget.refund()
			}
			if s.inFlight() > 0 {
				// No hedge, then; the attempts in flight may yet connect.
				s.nextHedge = 0
				break
			}
			if n := len(s.rec.Attempts); n > 0 {
				err = fmt.Errorf("pick endpoint after %d failed dial attempts (last: %v): %w", n, lastErr, err)
			} else {
				err = fmt.Errorf("pick endpoint: %w", err)
			}
			s.abort(err)
			return
		}
		if s.started == 0 && pol.RetryBudget > 0 {
			p.budget.deposit(pol.RetryBudget)
		}
		d := &s.dial
		if d.fd >= 0 {
			d = &dialAttempt{s: s, fd: -1}
		}
		d.ep, d.start = ep, time.Now()
		s.started++
		fd := -1
		var src netip.Addr
		d.source, src = sourceOf(s.keepClient, clientIP, ep)
		if p.OwnSocket != nil && p.OwnSocket(ep) {
			err = record.ErrOwnSocket
		} else {
			var fellBack error
			early := len(s.up.pending) > 0
			if fd, fellBack, err = s.l.dial(ep, unix.SOCK_STREAM, src, p.DialMark, early); fellBack != nil {
				d.source = record.SourceFallback
				p.fallback.refused(p.Service, clientIP, fellBack)
			}
		}
		if err == nil {
			if err = s.l.Watch(fd, d, sessionEvents); err == nil {
				if s.inFlight() > 0 {
					s.concurrent = true
				}
				d.fd = fd
				if d != &s.dial {
					s.hedges = append(s.hedges, d)
				}
				now := s.l.Now()
				d.deadline = now + int64(timeouts[s.started-1])
				s.nextHedge = 0
				if pol.Hedge > 0 && int(s.started) < len(timeouts) {
					s.nextHedge = now + int64(pol.Hedge)
				}
				s.armDialTimer()
				return
			}
			unix.Close(fd)
		}
		err = dialError(ep, err)
		if isShortage(err) {
			// Not the endpoint's failure: every other would fail alike. Nothing
			// is counted against it; the client is reset, and accepting more
			// waits, as when accept itself runs short.
			s.picker().Release(ep)
			s.abort(err)
			s.ln.shortage(s.l, err)
			return
		}
		lastErr = s.attemptFailed(d, err)
	}
	switch {
	case s.err != nil:
	case s.inFlight() > 0:
		s.armDialTimer()
	case s.rec.RetryRefused:
		s.abort(fmt.Errorf("%d dial attempts failed (last: %w), and the retry budget refused another: %w",
			len(s.rec.Attempts), lastErr, record.ErrRetryBudget))
	default:
		s.abort(fmt.Errorf("%d dial attempts failed, last: %w", len(s.rec.Attempts), lastErr))
	}
}

// inFlight returns the number of dial attempts in flight.
func (s *tcpSession) inFlight() int {
	n := len(s.hedges)
	if s.dial.fd >= 0 {
		n++
	}
	return n
}

// dials returns the attempts in flight, in a new slice when there is more than
// one (callers end attempts while they iterate).
func (s *tcpSession) dials() []*dialAttempt {
	if len(s.hedges) == 0 {
		if s.dial.fd >= 0 {
			return []*dialAttempt{&s.dial}
		}
		return nil
	}
	out := make([]*dialAttempt, 0, 1+len(s.hedges))
	if s.dial.fd >= 0 {
		out = append(out, &s.dial)
	}
	return append(out, s.hedges...)
}

// triedEndpoints returns the endpoints of the attempts begun so far, ended or in
// flight, in loop-owned storage (valid until the next call on the loop: Pick
// keeps none of it).
func (s *tcpSession) triedEndpoints() []netip.AddrPort {
	tried := s.l.tried[:0]
	for _, a := range s.rec.Attempts {
		tried = append(tried, a.Endpoint)
	}
	if s.dial.fd >= 0 {
		tried = append(tried, s.dial.ep)
	}
	for _, d := range s.hedges {
		tried = append(tried, d.ep)
	}
	s.l.tried = tried // keeps what append grew
	return tried
}

// done takes attempt d out of flight, leaving its socket to the caller.
func (s *tcpSession) done(d *dialAttempt) {
	d.fd = -1
	if d != &s.dial {
		if i := slices.Index(s.hedges, d); i >= 0 {
			s.hedges = slices.Delete(s.hedges, i, i+1)
		}
	}
}

// closeDial takes d's socket out of the loop and closes it.
func (s *tcpSession) closeDial(d *dialAttempt) {
	s.l.Forget(d.fd)
	unix.Close(d.fd)
}

// armDialTimer sets the timer to the earliest deadline of the attempts in
// flight, or the next hedge if that comes first.
func (s *tcpSession) armDialTimer() {
	next := int64(math.MaxInt64)
	if s.dial.fd >= 0 {
		next = s.dial.deadline
	}
	for _, d := range s.hedges {
		next = min(next, d.deadline)
	}
	if s.nextHedge != 0 {
		next = min(next, s.nextHedge)
	}
	if next == math.MaxInt64 {
		s.l.Cancel(&s.timer)
		return
	}
	s.l.ScheduleAt(&s.timer, next)
}

// dial opens a non-blocking socket of sotype (SOCK_STREAM or SOCK_DGRAM) to ep,
// with the dial mark mark (0: none), and connects it: from src when it is valid (a transparent
// dial, source.go), else from the node. A TCP socket gets TCP_NODELAY before its
// second write (nagleState) and its keepalive later, if the connection lasts
// (keepAliveDue); a nil error means its connect is in progress (or done): the
// socket's first output event ends it. A UDP connect only sets the peer.
// fellBack is the kernel's refusal of a transparent socket, after which the
// dial went from the node. early says bytes wait to be written the moment a TCP
// socket connects: the last ACK of its handshake is held back to go out with
// them (early.go).
func (l *loop) dial(ep netip.AddrPort, sotype int, src netip.Addr, mark uint32, early bool) (fd int, fellBack, err error) {
	family, sa := l.sockaddr(ep)
	fd, err = unix.Socket(family, sotype|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, nil, os.NewSyscallError("socket", err)
	}
	if !l.keep(fd) {
		unix.Close(fd)
		return -1, nil, os.NewSyscallError("socket", reserveError{l.fdCeiling})
	}
	if err := setMark(fd, mark); err != nil {
		unix.Close(fd)
		return -1, nil, err
	}
	if src.IsValid() {
		if err := transparent(fd, sotype, src); err != nil {
			unix.Close(fd)
			fd, _, rerr := l.dial(ep, sotype, netip.Addr{}, mark, early)
			return fd, err, rerr
		}
	}
	if early {
		// On a connecting socket the option only delays that ACK (by up to
		// the delayed-ACK timer, were nothing written); its failure costs
		// the segment it would have saved, nothing more.
		unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_DEFER_ACCEPT, 1)
	}
	err = unix.Connect(fd, sa)
	// A TCP connect goes on in the background after EINPROGRESS, and also after
	// EINTR (a signal came first; connect(2), POSIX): either way the socket's
	// first output event ends it, and connecting again would only say EALREADY.
	// A UDP connect only sets the peer; it never waits, so never sees EINTR.
	if sotype == unix.SOCK_STREAM && (err == unix.EINPROGRESS || err == unix.EINTR) {
		err = nil
	}
	if err != nil {
		unix.Close(fd)
		return -1, nil, os.NewSyscallError("connect", err)
	}
	return fd, nil, nil
}

// sockaddr returns ep's address family and socket address, in loop-owned storage
// (valid until the next call): a dial then allocates no address.
func (l *loop) sockaddr(ep netip.AddrPort) (int, unix.Sockaddr) {
	if a := ep.Addr().Unmap(); a.Is4() {
		l.sa4.Addr, l.sa4.Port = a.As4(), int(ep.Port())
		return unix.AF_INET, &l.sa4
	}
	l.sa6.Addr, l.sa6.Port = ep.Addr().As16(), int(ep.Port())
	return unix.AF_INET6, &l.sa6
}

// dialError wraps a dial's failure as Go's dialer would report it
// ("dial tcp 10.0.0.1:80: connect: connection refused").
func dialError(ep netip.AddrPort, err error) error {
	return &net.OpError{Op: "dial", Net: "tcp", Addr: net.TCPAddrFromAddrPort(ep), Err: err}
}

// connectEvent ends attempt d on its socket's first event: an error or hang-up
// fails it, output readiness completes it.
func (s *tcpSession) connectEvent(d *dialAttempt, ev uint32) {
	if ev&(unix.EPOLLERR|unix.EPOLLHUP) != 0 {
		errno, err := unix.GetsockoptInt(d.fd, unix.SOL_SOCKET, unix.SO_ERROR)
		if err == nil {
			err = unix.ECONNRESET
			if errno != 0 {
				err = unix.Errno(errno)
			}
		}
		s.closeDial(d)
		s.dialNext(s.attemptFailed(d, dialError(d.ep, os.NewSyscallError("connect", err))))
		return
	}
	if ev&unix.EPOLLOUT == 0 {
		return
	}
	s.l.Cancel(&s.timer)
	p := s.p
	a := record.Attempt{Endpoint: d.ep, Start: d.start, Duration: time.Since(d.start), Source: d.source}
	s.rec.Attempts = append(s.rec.Attempts, a)
	p.observer().AttemptDone(p.Service, a)
	s.picker().DialSucceeded(a.Endpoint)
	// The socket becomes the backend's; its events go there from now on.
	s.backend = tcpSide{s: s, fd: d.fd, nagle: nothingSent, fromClient: d.source == record.SourceClient}
	s.l.Rehandle(d.fd, &s.backend)
	s.rec.Endpoint = d.ep
	s.done(d)
	for _, o := range s.dials() {
		s.lose(o)
	}
	s.state = open
	s.armOpenTimer()
	// The side takes in the event (writable, and whatever else it said), and
	// the copy begins.
	s.backend.Handle(ev)
}

// lose abandons attempt d, still in flight when another connected: it is closed
// and recorded with record.ErrHedgeLost. It is not reported as a failure - it
// was cut short, not refused or timed out - and if it had in fact connected
// already (its event not yet handled), that is reported as the success it is.
func (s *tcpSession) lose(d *dialAttempt) {
	p := s.p
	established := false
	if info, err := unix.GetsockoptTCPInfo(d.fd, unix.IPPROTO_TCP, unix.TCP_INFO); err == nil {
		established = info.State == tcpEstablished
	}
	s.l.Forget(d.fd)
	if established {
		// The backend accepted a connection that will carry nothing: a reset
		// tells it so at once, and leaves no TIME_WAIT here.
		resetFD(d.fd)
	} else {
		unix.Close(d.fd)
	}
	a := record.Attempt{Endpoint: d.ep, Start: d.start, Duration: time.Since(d.start), Err: record.ErrHedgeLost, Source: d.source}
	s.rec.Attempts = append(s.rec.Attempts, a)
	p.observer().AttemptDone(p.Service, a)
	if established {
		s.picker().DialSucceeded(d.ep)
	}
	s.picker().Release(d.ep)
	s.done(d)
}

// tcpEstablished is the kernel's TCP_ESTABLISHED, the tcpi_state of a connected
// socket (include/net/tcp_states.h).
const tcpEstablished = 1

// Expire is the dial timer while dialing - an attempt's deadline, or the next
// hedge - and the idle timeout once open: it closes the connection if no byte
// has moved since the timeout began, and otherwise looks again when it would
// have.
func (s *tcpSession) Expire() {
	switch s.state {
	case dialing:
		now := s.l.Now()
		var lastErr error
		failed := false
		for _, d := range s.dials() {
			if d.deadline <= now {
				s.closeDial(d)
				lastErr = s.attemptFailed(d, dialError(d.ep, os.ErrDeadlineExceeded))
				failed = true
			}
		}
		hedge := s.nextHedge != 0 && s.nextHedge <= now
		if hedge {
			s.nextHedge = 0
		}
		if failed || hedge {
			s.dialNext(lastErr)
		} else {
			s.armDialTimer()
		}
	case open:
		if !s.keepAliveDue() {
			return
		}
		timeout := s.p.IdleTimeout
		if idle := time.Duration(s.l.Now() - s.lastMoved); timeout <= 0 || idle < timeout {
			s.scheduleOpen(timeout - idle)
			return
		}
		// A reset, not a FIN, on both sides: an idle connection may be idle
		// in the middle of an exchange, and a FIN would tell a peer that
		// reads to the end that what it got was all; a reset says the
		// connection was cut. Nor does a reset leave a socket behind
		// retransmitting its FIN to a peer that vanished.
		s.abort(fmt.Errorf("no byte either way for %v: %w", timeout, record.ErrIdle))
	}
}

// armOpenTimer arms the timer of a connection that has just opened: for its
// keepalive options, when keepalive is on (see keepAliveDue), and for its idle
// timeout, when set.
func (s *tcpSession) armOpenTimer() {
	if s.p.IdleTimeout <= 0 && s.p.KeepAlive < 0 {
		return
	}
	now := s.l.Now()
	s.lastMoved = now
	if secs := s.p.keepAliveSecs(); secs > 0 {
		s.keepAliveAt = now + int64(secs)*int64(time.Second)
	}
	s.scheduleOpen(s.p.IdleTimeout)
}

// scheduleOpen arms an open connection's timer for whichever comes first: its
// idle timeout, idleIn from now (when the proxy has one), or its keepalive
// options; with neither pending it leaves the timer disarmed.
func (s *tcpSession) scheduleOpen(idleIn time.Duration) {
	d, armed := idleIn, s.p.IdleTimeout > 0
	if s.keepAliveAt != 0 {
		if due := time.Duration(s.keepAliveAt - s.l.Now()); !armed || due < d {
			d, armed = due, true
		}
	}
	if armed {
		s.l.Schedule(&s.timer, d)
	}
}

// keepAliveDue gives the backend socket its keepalive options (SO_KEEPALIVE,
// TCP_KEEPIDLE, TCP_KEEPINTVL) once its connection has been open for
// TCPProxy.KeepAlive, from the session's timer; a connection that ends sooner
// never makes these three system calls, of the nine that set one up with
// keepalive at dial. Nothing a peer could notice changes: the kernel measures a
// socket's idle time from the last segment it received, not from the calls, so
// a socket given its options then, idle since it connected, is probed at once -
// just when it would have been with the options from the dial - and one that
// has heard from its peer since is probed KeepAlive after that, as before. The
// first probe is late only by however late the loop runs the timer. (The client
// socket inherits its options from the listener, at no cost per connection.)
// It reports false when a call failed and the session was aborted.
func (s *tcpSession) keepAliveDue() bool {
	if s.keepAliveAt == 0 || s.l.Now() < s.keepAliveAt {
		return true
	}
	s.keepAliveAt = 0
	if err := setKeepAlive(s.backend.fd, s.p.keepAliveSecs()); err != nil {
		s.abort(fmt.Errorf("set keepalive on the backend socket: %w", os.NewSyscallError("setsockopt", err)))
		return false
	}
	return true
}

// attemptFailed records the failure of attempt d (whose socket is closed), takes
// it out of flight, and returns err.
func (s *tcpSession) attemptFailed(d *dialAttempt, err error) error {
	p := s.p
	a := record.Attempt{Endpoint: d.ep, Start: d.start, Duration: time.Since(d.start), Err: err, Source: d.source}
	s.rec.Attempts = append(s.rec.Attempts, a)
	p.observer().AttemptDone(p.Service, a)
	if !isLocalPortShortage(err) {
		// Out of local ports toward the endpoint says nothing about it: it is
		// not ejected for that, but the next attempt goes elsewhere all the same.
		s.picker().DialFailed(d.ep, err)
	}
	// The client's sticky endpoint just failed it: let the next pick move on.
	s.picker().ResetAffinity(s.rec.Client.Addr().Unmap())
	s.picker().Release(d.ep)
	s.done(d)
	return err
}

// pump moves whatever both directions can move now, and ends the session once both
// are done or one fails.
func (s *tcpSession) pump() {
	moved := s.up.bytes + s.down.bytes
	if err := s.move(&s.up, &s.client, &s.backend, &s.down); err != nil {
		s.abort(fmt.Errorf("copy client to backend: %w", err))
		return
	}
	if err := s.move(&s.down, &s.backend, &s.client, &s.up); err != nil {
		s.abort(fmt.Errorf("copy backend to client: %w", err))
		return
	}
	// The clock is read only when a byte moved, and only for an idle timeout.
	if s.p.IdleTimeout > 0 && s.up.bytes+s.down.bytes != moved {
		s.lastMoved = s.l.Now()
	}
	if s.up.done && s.down.done {
		s.finish()
	}
}

// move copies src to dst until one of them would block. When src has ended and
// everything is written, the end is passed on as a half-close of dst - unless the
// other direction has ended too, when the close that follows sends the same FIN.
func (s *tcpSession) move(d *tcpDirection, src, dst *tcpSide, other *tcpDirection) error {
	for !d.done {
		if !d.flushed() {
			if !dst.writable {
				return nil
			}
			if err := d.flush(dst); err != nil {
				return err
			}
			continue
		}
		if d.eof {
			d.done = true
			if !other.done {
				// An error means dst is gone; the other direction finds out.
				unix.Shutdown(dst.fd, unix.SHUT_WR)
				dst.finSent = true
			}
			return nil
		}
		// Nothing is read that dst cannot take now: the kernel holds it meanwhile,
		// and the source's sender feels the backpressure.
		if !src.readable || !dst.writable {
			return nil
		}
		if d.splice {
			if err := d.fill(s.l, src); err != nil {
				return err
			}
			continue
		}
		buf := s.l.buf
		n, err := unix.Read(src.fd, buf)
		switch {
		case err == unix.EAGAIN:
			src.readable = false
			continue
		case err == unix.EINTR:
			continue
		case err != nil:
			src.peerFailed(err)
			return os.NewSyscallError("read", err)
		case n == 0:
			d.eof = true
			continue
		case n == len(buf):
			d.splice = true
		case src.errQueued:
			// Read on until the error shows.
		case src.finQueued:
			// The short read reached the FIN: no need to read the EOF.
			src.readable = false
			d.eof = true
		default:
			// A short read took everything queued; the next arrival is a new edge.
			src.readable = false
		}
		written, err := write(dst, buf[:n], d.eof)
		if err != nil {
			return err
		}
		d.bytes += int64(written)
		if written < n {
			d.pending = append(d.pending[:0], buf[written:n]...)
			d.off = 0
		}
	}
	return nil
}

// write writes b to dst once, returning how much it took; a full socket clears
// dst.writable and is not an error. last says the FIN follows at once (shutdown
// or close), and b goes out with it: sendto with MSG_MORE holds the bytes in the
// socket until the FIN's call pushes both in one segment (early.go).
func write(dst *tcpSide, b []byte, last bool) (int, error) {
	dst.beforeWrite()
	for {
		var n int
		var err error
		if last {
			n, err = sendMore(dst.fd, b)
		} else {
			n, err = unix.Write(dst.fd, b)
		}
		switch err {
		case nil:
			return n, nil
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			dst.writable = false
			return 0, nil
		}
		dst.peerFailed(err)
		if last {
			return 0, os.NewSyscallError("sendto", err)
		}
		return 0, os.NewSyscallError("write", err)
	}
}

// peerFailed notes a call's error on the socket: after the peer's reset
// (ECONNRESET, or EPIPE for a write after it) the kernel has closed the
// connection, and closing the socket sends nothing whatever SO_LINGER says.
func (sd *tcpSide) peerFailed(err error) {
	if err == unix.ECONNRESET || err == unix.EPIPE {
		sd.reset = true
	}
}

// flush writes what an earlier move kept back, from pending or the pipe.
func (d *tcpDirection) flush(dst *tcpSide) error {
	if d.off < len(d.pending) {
		n, err := write(dst, d.pending[d.off:], false)
		if err != nil {
			return err
		}
		d.off += n
		d.bytes += int64(n)
		if d.off == len(d.pending) {
			d.pending, d.off = d.pending[:0], 0
		}
		return nil
	}
	dst.beforeWrite()
	for {
		n, err := unix.Splice(d.pipe.r, nil, dst.fd, nil, d.pipe.n, spliceFlags)
		switch err {
		case nil:
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			dst.writable = false
			return nil
		default:
			dst.peerFailed(err)
			return os.NewSyscallError("splice", err)
		}
		d.pipe.n -= int(n)
		d.bytes += n
		if d.pipe.n == 0 {
			putPipe(d.pipe)
			d.pipe = nil
		}
		return nil
	}
}

// fill splices what src holds into a pipe (taking one from the pool). When no
// pipe can be had (the process or the node is out of descriptors or memory, or
// the data path's share of descriptors is used up: reserve.go) the
// direction goes back to copying through the loop's buffer, which needs nothing
// more: the connection is not at fault, and resetting it would free no more than
// its own two sockets. The next read that fills the buffer tries a pipe again.
func (d *tcpDirection) fill(l *loop, src *tcpSide) error {
	if d.pipe == nil {
		p, err := getPipe(l)
		if err != nil {
			d.splice = false
			return nil
		}
		d.pipe = p
	}
	for {
		n, err := unix.Splice(src.fd, nil, d.pipe.w, nil, maxSplice, spliceFlags)
		switch err {
		case nil:
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			src.readable = false
			putPipe(d.pipe)
			d.pipe = nil
			return nil
		default:
			src.peerFailed(err)
			return os.NewSyscallError("splice", err)
		}
		if n == 0 {
			putPipe(d.pipe)
			d.pipe = nil
			d.eof = true
			return nil
		}
		d.pipe.n = int(n)
		return nil
	}
}

// finish ends a session both of whose directions ended cleanly.
func (s *tcpSession) finish() {
	// A dial from the client's address whose FIN went first leaves its
	// TIME_WAIT on the node; it is ended (timewait.go), before the client's
	// socket closes, so a client that waits for the end of its connection
	// finds it gone when it connects again.
	var local netip.AddrPort
	if s.backend.fromClient && s.backend.finSent {
		local = s.l.localAddr(s.backend.fd)
	}
	s.backend.close(s.l, false)
	if local.IsValid() {
		endTimeWait(local, s.rec.Endpoint)
	}
	s.client.close(s.l, false)
	s.picker().Release(s.rec.Endpoint)
	s.end(nil)
}

// abort ends the session with err, resetting both sockets (a dial in flight is
// abandoned and recorded as a failed attempt). Later calls do nothing.
func (s *tcpSession) abort(err error) {
	if s.state == ended || s.err != nil {
		return
	}
	s.err = err
	switch s.state {
	case dialing:
		for _, d := range s.dials() {
			s.closeDial(d)
			s.attemptFailed(d, dialError(d.ep, err))
		}
	case open:
		s.backend.close(s.l, true)
		s.picker().Release(s.rec.Endpoint)
	}
	// A reset tells the client at once that nobody will answer, rather than an
	// accepted connection that closes as if the backend had.
	s.client.close(s.l, true)
	s.end(err)
}

// close takes the side's socket out of l and closes it, with an RST when reset
// (unless its peer reset it already). The side is left as before its first
// socket, ready for the next dial attempt.
func (sd *tcpSide) close(l *loop, reset bool) {
	if sd.fd < 0 {
		return
	}
	l.Forget(sd.fd)
	if reset && !sd.reset {
		resetFD(sd.fd)
	} else {
		unix.Close(sd.fd)
	}
	*sd = tcpSide{s: sd.s, fd: -1}
}

// end delivers the connection's record and forgets it.
func (s *tcpSession) end(err error) {
	s.l.Cancel(&s.timer)
	s.state = ended
	for _, d := range []*tcpDirection{&s.up, &s.down} {
		if d.pipe != nil {
			putPipe(d.pipe)
			d.pipe = nil
		}
		d.pending = nil
	}
	if s.concurrent {
		slices.SortStableFunc(s.rec.Attempts, func(a, b record.Attempt) int { return a.Start.Compare(b.Start) })
	}
	s.rec.BytesIn, s.rec.BytesOut = s.up.bytes, s.down.bytes
	s.rec.Err = err
	s.rec.Duration = time.Since(s.rec.Start)
	s.p.observer().ConnClosed(&s.rec)
	s.p.untrack(s)
}

// resetFD closes fd with an RST instead of a FIN (SO_LINGER with a zero timeout).
func resetFD(fd int) {
	unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1})
	unix.Close(fd)
}
