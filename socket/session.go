package socket

import (
	"fmt"
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

type sessionState uint8

const (
	dialing sessionState = iota
	open
	ended
	// detached: taken out of the proxy, its sockets and bytes in flight
	// handed to a SessionState (resume.go); it has ended here, unreported.
	detached
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
	if s.state == ended || s.state == detached || s.err != nil {
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
