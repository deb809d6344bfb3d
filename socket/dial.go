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
)

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
