package socket

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"slices"
	"time"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/record"
	"github.com/uproxy/uproxy/socket/poll"
)

// An established TCP connection moves from one proxy to another, in another
// process, without a byte lost, duplicated or reordered: the old proxy detaches
// it (Detach), its state travels as handover items (SessionItems, SessionStates,
// package handover), and the new proxy resumes it (Resume). Everything a relay
// holds of a connection is its two sockets, a splice pipe per direction while
// that holds bytes, or the bytes a short write left in user space, a few flags
// of each direction's end, and its counters: the kernel keeps the rest (what
// either peer sent and the proxy has not read, what the proxy wrote and the
// peer has not acknowledged), in sockets that both processes share until the
// old one closes its copies.

// SessionState is one detached connection: its descriptors (this process's
// own until Close, or until Resume takes them) and what its relay knew.
type SessionState struct {
	// client and backend are the connection's sockets; -1 once spent.
	client, backend int
	// up copies client to backend, down backend to client.
	up, down directionState
	// Client and Endpoint are the connection's peers.
	clientAddr, endpoint netip.AddrPort
	// fromClient: the backend socket was dialed from the client's address.
	fromClient bool
	// clientFinSent, backendFinSent: the relay shut that socket's writing
	// (passed a FIN on); the kernel keeps it shut, the flag keeps the relay
	// from doing it again.
	clientFinSent, backendFinSent bool
	backendNagle                  nagleState
	start                         time.Time
	// idleFor is how long no byte had moved when the connection was detached
	// (0 when its proxy had no idle timeout, and did not measure it);
	// keepAliveIn how long until its backend socket was due its keepalive
	// options (0: none due).
	idleFor, keepAliveIn time.Duration
	attempts             []record.Attempt
	retryRefused         bool
}

// directionState is what one direction held when detached.
type directionState struct {
	// pending is what a short write left, to be written first.
	pending []byte
	// pipeR and pipeW are the splice pipe's ends while it holds pipeN bytes
	// (-1 when none); a pipe travels by its read end alone, so a received
	// state has no pipeW.
	pipeR, pipeW, pipeN int
	splice, eof, done   bool
	bytes               int64
}

// InFlight returns the bytes the relay held in user space or in its pipes:
// those the connection's peers have not seen yet.
func (st *SessionState) InFlight() int {
	return len(st.up.pending) + st.up.pipeN + len(st.down.pending) + st.down.pipeN
}

// Endpoint returns the endpoint the connection is relayed to.
func (st *SessionState) Endpoint() netip.AddrPort { return st.endpoint }

// Close closes the state's descriptors in this process: after a successor
// confirmed it resumed the connection, the sockets live on in the successor
// and closing this process's copies sends nothing to either peer. A state
// Resume took has none left, and Close does nothing.
func (st *SessionState) Close() {
	for _, fd := range []*int{&st.client, &st.backend, &st.up.pipeR, &st.up.pipeW, &st.down.pipeR, &st.down.pipeW} {
		if *fd >= 0 {
			unix.Close(*fd)
			*fd = -1
		}
	}
}

// Reset resets the connection (see reset): a detached connection that has
// nowhere to be resumed, its Service port gone.
func (st *SessionState) Reset() { st.reset() }

// reset resets both sockets (SO_LINGER 0: an RST once the last copy of each
// closes, at once when this process holds the only one) and closes the
// pipes, whose bytes then belong to no one.
func (st *SessionState) reset() {
	for _, fd := range []*int{&st.client, &st.backend} {
		if *fd >= 0 {
			resetFD(*fd)
			*fd = -1
		}
	}
	st.Close()
}

// Detach takes up to max established connections (connected to their
// endpoint and relaying; those still dialing finish here) out of the proxy
// and returns their state, to be resumed by another proxy, usually in another
// process. Each is detached on its event loop between two events: its
// sockets leave the loop's epoll set, its timer stops, and its sockets,
// pipes holding bytes and bytes held in user space pass to the
// SessionState, whose descriptors the caller closes once a successor has
// confirmed it resumed them (or gives back to this proxy's Resume if none
// did). A detached connection is no longer the proxy's: Active does not count
// it, the Picker is told its end (Release), and its end is never reported to
// the Observer, as the proxy that resumes it reports it.
//
// Cost: per connection, two epoll_ctl (EPOLL_CTL_DEL) and a copy of the
// bytes a short write left (at most the loop's buffer, 64 KiB, and usually
// none); each loop holding some of them pauses once per call, for its share,
// while the proxy's other connections on it wait. Detach must not be called
// on an event loop.
func (p *TCPProxy) Detach(max int) ([]SessionState, error) {
	p.init()
	if max <= 0 || p.Loops == nil {
		return nil, nil
	}
	byLoop := make(map[*loop][]*tcpSession)
	p.mu.Lock()
	for s := range p.conns {
		byLoop[s.l] = append(byLoop[s.l], s)
	}
	p.mu.Unlock()
	var out []SessionState
	for _, pl := range p.Loops.Loops() {
		sessions := byLoop[loopOf(pl)]
		if len(sessions) == 0 {
			continue
		}
		if len(out) == max {
			break
		}
		// The session's state is the loop's: only there is it known whether it
		// is still open (it may have ended since the list was taken).
		err := pl.PostWait(func() {
			for _, s := range sessions {
				if len(out) == max {
					return
				}
				if s.state == open {
					out = append(out, s.detach())
				}
			}
		})
		if err != nil {
			return out, fmt.Errorf("detach connections of %s: %w", p.Service, err)
		}
	}
	return out, nil
}

// detach takes the open session out of its loop and proxy into a SessionState.
func (s *tcpSession) detach() SessionState {
	l, now := s.l, s.l.Now()
	l.Unwatch(s.client.fd)
	l.Unwatch(s.backend.fd)
	l.Cancel(&s.timer)
	st := SessionState{
		client: s.client.fd, backend: s.backend.fd,
		up: s.up.detach(), down: s.down.detach(),
		clientAddr: s.rec.Client, endpoint: s.rec.Endpoint,
		fromClient:    s.backend.fromClient,
		clientFinSent: s.client.finSent, backendFinSent: s.backend.finSent,
		backendNagle: s.backend.nagle,
		start:        s.rec.Start,
		attempts:     slices.Clone(s.rec.Attempts),
		retryRefused: s.rec.RetryRefused,
	}
	// lastMoved is kept only for an idle timeout.
	if s.p.IdleTimeout > 0 {
		st.idleFor = max(0, time.Duration(now-s.lastMoved))
	}
	if s.keepAliveAt != 0 {
		st.keepAliveIn = max(1, time.Duration(s.keepAliveAt-now))
	}
	s.client.fd, s.backend.fd = -1, -1
	s.state = detached
	s.picker().Release(s.rec.Endpoint)
	s.p.untrack(s)
	return st
}

// detach hands over the direction's pipe, when it holds bytes, and the bytes
// a short write left; the direction keeps neither.
func (d *tcpDirection) detach() directionState {
	ds := directionState{pipeR: -1, pipeW: -1, splice: d.splice, eof: d.eof, done: d.done, bytes: d.bytes}
	if d.off < len(d.pending) {
		ds.pending = slices.Clone(d.pending[d.off:])
	}
	if p := d.pipe; p != nil {
		if p.n > 0 {
			// Its descriptors are the state's now: the pipe's cleanup must not
			// close them when the garbage collector frees it.
			p.cleanup.Stop()
			ds.pipeR, ds.pipeW, ds.pipeN = p.r, p.w, p.n
		} else {
			putPipe(p)
		}
	}
	d.pipe, d.pending, d.off = nil, nil, 0
	return ds
}

// resume is the direction as it stood.
func (ds *directionState) resume() tcpDirection {
	d := tcpDirection{splice: ds.splice, eof: ds.eof, done: ds.done, bytes: ds.bytes}
	if len(ds.pending) > 0 {
		d.pending = ds.pending
	}
	if ds.pipeR >= 0 {
		p := &splicePipe{r: ds.pipeR, w: ds.pipeW, n: ds.pipeN}
		if p.w >= 0 {
			// Back in the process it came from: pooled once empty, so closed
			// by the pool's cleanup as any other.
			p.cleanup = runtime.AddCleanup(p, closePipeFDs, [2]int{p.r, p.w})
		}
		d.pipe = p
	}
	return d
}

// ResumeError is what Resume returns when some connections could not be
// resumed: each was reset (both sockets) and its descriptors closed.
type ResumeError struct {
	Reset int
	Err   error // each connection's, joined
}

func (e *ResumeError) Error() string {
	return fmt.Sprintf("%d connections could not be resumed and were reset: %v", e.Reset, e.Err)
}

func (e *ResumeError) Unwrap() error { return e.Err }

// Resume makes the connections of states the proxy's, each on one of its
// loops (spread as new work is), relaying where it stood: the bytes a pipe or
// a short write held are written first, in order; a direction whose end was
// passed on stays ended, and a socket whose writing was shut stays shut; the
// idle timeout counts from the last byte moved before the detach. The Picker
// counts each active on its endpoint (Acquire) and the Observer hears of it
// as opened; its end is reported as any other's, with the record it began
// with (its start, attempts and byte counts). Resume takes the states'
// descriptors (each state is spent: Close does nothing more) and returns once
// every connection is registered. A connection that cannot be resumed - a
// descriptor past the data path's reserve (reserve.go), a pipe that does not
// hold what its state says, a socket that cannot be watched, a proxy past
// Shutdown's grace - is reset and counted in a *ResumeError; none is leaked.
//
// Cost: per connection, two epoll_ctl (add), and an ioctl FIONREAD per pipe
// that came with it; its first events then come at once (a socket added to
// an epoll set reports the readiness it has). Resume must not be called on an
// event loop.
func (p *TCPProxy) Resume(states []SessionState) error {
	p.init()
	if len(states) == 0 {
		return nil
	}
	var errs []error
	failed := 0
	if p.Loops == nil {
		for i := range states {
			states[i].reset()
		}
		return &ResumeError{Reset: len(states), Err: fmt.Errorf("resume connections of %s: TCPProxy.Loops is nil", p.Service)}
	}
	byLoop := make(map[*poll.Loop][]*SessionState)
	var order []*poll.Loop
	for i := range states {
		pl := p.Loops.Next()
		if _, ok := byLoop[pl]; !ok {
			order = append(order, pl)
		}
		byLoop[pl] = append(byLoop[pl], &states[i])
	}
	for _, pl := range order {
		sts := byLoop[pl]
		var loopErrs []error
		err := pl.PostWait(func() {
			l := loopOf(pl)
			for _, st := range sts {
				if err := p.resume(l, st); err != nil {
					loopErrs = append(loopErrs, err)
				}
			}
		})
		if err != nil {
			for _, st := range sts {
				st.reset()
			}
			failed += len(sts)
			errs = append(errs, fmt.Errorf("resume %d connections of %s: %w", len(sts), p.Service, err))
			continue
		}
		failed += len(loopErrs)
		errs = append(errs, loopErrs...)
	}
	if failed > 0 {
		return &ResumeError{Reset: failed, Err: errors.Join(errs...)}
	}
	return nil
}

// resume registers one connection on l, which runs it.
func (p *TCPProxy) resume(l *loop, st *SessionState) error {
	if err := st.check(l); err != nil {
		err = fmt.Errorf("resume connection from %v to %v of %s: %w", st.clientAddr, st.endpoint, p.Service, err)
		st.reset()
		return err
	}
	s := &tcpSession{p: p, l: l, state: open}
	// The sides learn what their sockets can do from the events of their
	// registration.
	s.client = tcpSide{s: s, fd: st.client, finSent: st.clientFinSent}
	s.backend = tcpSide{s: s, fd: st.backend, finSent: st.backendFinSent, fromClient: st.fromClient, nagle: st.backendNagle}
	s.dial = dialAttempt{s: s, fd: -1}
	s.policy = p.policy.Load()
	s.timer = poll.NewTimer(s)
	s.rec = record.Conn{Service: p.Service, Protocol: "TCP", Client: st.clientAddr, Start: st.start,
		Endpoint: st.endpoint, RetryRefused: st.retryRefused}
	s.rec.Attempts = append(s.attempts[:0], st.attempts...)
	s.short = p.ShortCircuit != nil && p.ShortCircuits(st.clientAddr.Addr().Unmap())
	s.up, s.down = st.up.resume(), st.down.resume()
	// The descriptors are the session's from here on.
	st.client, st.backend = -1, -1
	st.up.pipeR, st.up.pipeW, st.down.pipeR, st.down.pipeW = -1, -1, -1, -1
	if !p.track(s) {
		err := fmt.Errorf("resume connection from %v to %v of %s: %w", s.rec.Client, s.rec.Endpoint, p.Service, ErrShutdown)
		s.backend.close(l, true)
		s.client.close(l, true)
		for _, d := range []*tcpDirection{&s.up, &s.down} {
			if d.pipe != nil {
				putPipe(d.pipe)
			}
		}
		return err
	}
	p.observer().ConnOpened(p.Service, "TCP")
	s.picker().Acquire(s.rec.Endpoint)
	for _, sd := range []*tcpSide{&s.client, &s.backend} {
		if err := l.Watch(sd.fd, sd, sessionEvents); err != nil {
			err = fmt.Errorf("resume connection from %v to %v of %s: %w", s.rec.Client, s.rec.Endpoint, p.Service, err)
			s.abort(err)
			return err
		}
	}
	now := l.Now()
	if st.keepAliveIn > 0 {
		s.keepAliveAt = now + int64(st.keepAliveIn)
	}
	if p.IdleTimeout > 0 || s.keepAliveAt != 0 {
		s.lastMoved = now - int64(st.idleFor)
		s.scheduleOpen(p.IdleTimeout - st.idleFor)
	}
	return nil
}

// check makes sure the state can be resumed on l: its sockets are there, the
// data path may keep its descriptors, and each pipe holds what it says.
func (st *SessionState) check(l *loop) error {
	if st.client < 0 || st.backend < 0 {
		return errors.New("the state has no sockets (resumed or closed already)")
	}
	for _, fd := range []int{st.client, st.backend, st.up.pipeR, st.down.pipeR} {
		if fd >= 0 && !l.keep(fd) {
			return reserveError{l.fdCeiling}
		}
	}
	for _, ds := range []*directionState{&st.up, &st.down} {
		if ds.pipeR < 0 {
			continue
		}
		n, err := unix.IoctlGetInt(ds.pipeR, unix.TIOCINQ) // FIONREAD
		if err != nil {
			return fmt.Errorf("a pipe's bytes: %w", os.NewSyscallError("ioctl FIONREAD", err))
		}
		if n != ds.pipeN {
			return fmt.Errorf("a pipe holds %d bytes, its state says %d", n, ds.pipeN)
		}
	}
	return nil
}
