package socket

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/klog/v2"
)

// ErrShutdown is the Err of connections reset because Shutdown's grace period ended.
var ErrShutdown = errors.New("proxy shut down")

// ListenTCP opens a TCP proxy listener on addr with keepalive off for every accepted
// connection. A listener from net.ListenTCP instead enables keepalive on each accepted
// socket, which costs four setsockopt calls per connection.
//
// Keepalive is off on both sides of a proxied connection because the proxy relays
// bytes, not liveness: the endpoints keep their own keepalive settings, and a dead
// peer's connection ends through the other peer (its timeout or close) rather than
// through probes the proxy would pay for on every connection.
func ListenTCP(ctx context.Context, addr netip.AddrPort) (*net.TCPListener, error) {
	network := "tcp4"
	if addr.Addr().Is6() && !addr.Addr().Is4In6() {
		network = "tcp6"
	}
	lc := net.ListenConfig{KeepAlive: -1}
	ln, err := lc.Listen(ctx, network, addr.String())
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", addr, err)
	}
	return ln.(*net.TCPListener), nil
}

// backendDialer dials backends with keepalive off (see ListenTCP). Dialer.DialTCP is
// avoided on purpose: given no local address it binds to 0.0.0.0:0 before connecting,
// an extra syscall that also takes the ephemeral port from the bind range, shared by
// every destination, instead of the per-destination connect range.
var backendDialer = net.Dialer{KeepAlive: -1}

// dialTCP is the default TCPProxy.Dial.
func dialTCP(ctx context.Context, addr netip.AddrPort) (*net.TCPConn, error) {
	// A family-specific network spares the dialer its IPv4/IPv6 split of the
	// (single) address.
	network := "tcp4"
	if !addr.Addr().Unmap().Is4() {
		network = "tcp6"
	}
	c, err := backendDialer.DialContext(ctx, network, addr.String())
	if err != nil {
		return nil, err
	}
	return c.(*net.TCPConn), nil
}

// TCPProxy proxies the TCP connections of one Service port to its endpoints. Set the
// fields before the first Serve and do not change them afterwards.
type TCPProxy struct {
	// Service names the Service port ("namespace/name:port") in records and metrics.
	Service string
	// Picker chooses the endpoint of each attempt. Required.
	Picker Picker
	// DialTimeouts holds one timeout per dial attempt; nil means DefaultDialTimeouts.
	DialTimeouts []time.Duration
	// Observer is told about every connection and attempt; nil means NopObserver.
	Observer Observer
	// Dial connects to a backend and must honour ctx (its deadline is the attempt's
	// timeout). Nil means a plain TCP dial with keepalive off.
	Dial func(ctx context.Context, addr netip.AddrPort) (*net.TCPConn, error)

	// acceptBackoff, when set, is told about each temporary accept error and the wait
	// it causes (tests use it; the default logs).
	acceptBackoff func(err error, delay time.Duration)

	initOnce sync.Once
	// ctx is the parent of every dial; Shutdown cancels it once the grace period ends.
	ctx    context.Context
	cancel context.CancelFunc
	// stop is closed by Close, interrupting accept backoff waits.
	stop chan struct{}
	// drained is closed once the proxy is closed, no Serve loop runs and no
	// connection is open.
	drained chan struct{}

	// mu guards the fields below. Once closed (or forced), stays so.
	mu        sync.Mutex
	closed    bool
	forced    bool // Shutdown's grace ended: connections accepted from now on are reset
	isDrained bool
	serving   int
	listeners map[*net.TCPListener]struct{}
	conns     map[*tcpSession]struct{}
}

func (p *TCPProxy) init() {
	p.initOnce.Do(func() {
		p.ctx, p.cancel = context.WithCancel(context.Background())
		p.stop = make(chan struct{})
		p.drained = make(chan struct{})
		p.listeners = make(map[*net.TCPListener]struct{})
		p.conns = make(map[*tcpSession]struct{})
	})
}

func (p *TCPProxy) observer() Observer {
	if p.Observer == nil {
		return NopObserver{}
	}
	return p.Observer
}

func (p *TCPProxy) dialTimeouts() []time.Duration {
	if len(p.DialTimeouts) == 0 {
		return DefaultDialTimeouts
	}
	return p.DialTimeouts
}

func (p *TCPProxy) dial(ctx context.Context, addr netip.AddrPort) (*net.TCPConn, error) {
	if p.Dial != nil {
		return p.Dial(ctx, addr)
	}
	return dialTCP(ctx, addr)
}

// Serve accepts connections on ln and proxies each in its own goroutines until Close
// or Shutdown, after which it returns nil. ln is closed when Serve returns. Use
// ListenTCP to create ln so accepted sockets carry no keepalive setup.
func (p *TCPProxy) Serve(ln *net.TCPListener) error {
	p.init()
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		ln.Close()
		return nil
	}
	p.listeners[ln] = struct{}{}
	p.serving++
	p.mu.Unlock()
	defer func() {
		ln.Close()
		p.mu.Lock()
		delete(p.listeners, ln)
		p.serving--
		p.checkDrainedLocked()
		p.mu.Unlock()
	}()

	var delay time.Duration
	for {
		c, err := ln.AcceptTCP()
		if err != nil {
			if p.isClosed() {
				return nil
			}
			if !isTemporary(err) {
				return fmt.Errorf("accept on %s for %s: %w", ln.Addr(), p.Service, err)
			}
			delay = nextBackoff(delay)
			acceptBackoffs.Add(1)
			if p.acceptBackoff != nil {
				p.acceptBackoff(err, delay)
			} else {
				klog.ErrorS(err, "Accept failed, backing off", "service", p.Service, "delay", delay)
			}
			if !sleep(delay, p.stop) {
				return nil
			}
			continue
		}
		delay = 0
		if s := p.track(c); s != nil {
			go s.serve()
		}
	}
}

func (p *TCPProxy) isClosed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.closed
}

// track registers a newly accepted connection; it returns nil (after resetting c)
// when Shutdown has already given up on open connections.
func (p *TCPProxy) track(c *net.TCPConn) *tcpSession {
	s := &tcpSession{p: p, client: c}
	s.rec = Conn{Service: p.Service, Protocol: "TCP", Start: time.Now()}
	if a, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		s.rec.Client = a.AddrPort()
	}
	s.rec.Attempts = s.attempts[:0]
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.forced {
		resetConn(c)
		return nil
	}
	p.conns[s] = struct{}{}
	return s
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
	close(p.stop)
	lns := make([]*net.TCPListener, 0, len(p.listeners))
	for ln := range p.listeners {
		lns = append(lns, ln)
	}
	p.checkDrainedLocked()
	p.mu.Unlock()

	var errs []error
	for _, ln := range lns {
		if err := ln.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
			errs = append(errs, fmt.Errorf("close listener %s of %s: %w", ln.Addr(), p.Service, err))
		}
	}
	return errors.Join(errs...)
}

// Shutdown closes the proxy and waits until every open connection has ended or ctx is
// done; then it resets the connections still open (and abandons dials in progress),
// waits for their goroutines to finish and returns ctx's error.
func (p *TCPProxy) Shutdown(ctx context.Context) error {
	err := p.Close()
	select {
	case <-p.drained:
		return err
	case <-ctx.Done():
	}
	p.mu.Lock()
	p.forced = true
	// Marking the sessions before cancelling their dials lets a failing dial see
	// that the cause is the shutdown.
	for s := range p.conns {
		s.abort(ErrShutdown)
	}
	p.cancel()
	p.mu.Unlock()
	// Every socket is closed now, so each connection's goroutines end promptly.
	<-p.drained
	return errors.Join(err, ctx.Err())
}

// Active returns the number of open connections, including those still dialing.
func (p *TCPProxy) Active() int {
	p.init()
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.conns)
}

// tcpSession is one proxied connection. Its goroutines: serve (dial, then copy client
// to backend) and copyToClient.
type tcpSession struct {
	p      *TCPProxy
	client *net.TCPConn
	// backend is set once dialed; abort reads it from other goroutines.
	backend atomic.Pointer[net.TCPConn]
	// err holds the reason of the first abort; non-nil once the session is aborted.
	err atomic.Pointer[error]
	// pending counts copy directions still running; the one ending last ends the
	// session, so rec's byte counts are complete when it does.
	pending atomic.Int32
	rec     Conn

	// Inline storage for the common case of at most four attempts.
	tried    [4]netip.AddrPort
	attempts [4]Attempt
}

// serve runs in the connection's first goroutine: it dials, then copies client to
// backend while copyToClient copies the other way.
func (s *tcpSession) serve() {
	p := s.p
	p.observer().ConnOpened(p.Service, "TCP")
	backend, err := s.dial()
	if err != nil {
		if e := s.err.Load(); e != nil {
			err = *e
		}
		// A reset tells the client at once that nobody will answer, rather than
		// an accepted connection that closes as if the backend had.
		resetConn(s.client)
		s.end(err)
		return
	}
	s.backend.Store(backend)
	// abort may have run between the dial and the Store, seeing no backend (the
	// atomics order it: either it saw the backend or this Load sees its mark).
	if s.err.Load() != nil {
		resetConn(backend)
	}
	s.pending.Store(2)
	go s.copyToClient(backend)
	n, err := spliceStream(backend, s.client)
	s.rec.BytesIn = n
	s.endDirection(err, backend, "client to backend")
}

// copyToClient copies backend to client; it is the connection's second goroutine.
func (s *tcpSession) copyToClient(backend *net.TCPConn) {
	n, err := spliceStream(s.client, backend)
	s.rec.BytesOut = n
	s.endDirection(err, s.client, "backend to client")
}

// dial tries endpoints until one connects, one attempt per dial timeout.
func (s *tcpSession) dial() (*net.TCPConn, error) {
	p := s.p
	obs := p.observer()
	client := s.rec.Client.Addr().Unmap()
	tried := s.tried[:0]
	var lastErr error
	for _, timeout := range p.dialTimeouts() {
		ep, err := p.Picker.Pick(client, tried)
		if err != nil {
			if n := len(s.rec.Attempts); n > 0 {
				return nil, fmt.Errorf("pick endpoint after %d failed dial attempts (last: %v): %w", n, lastErr, err)
			}
			return nil, fmt.Errorf("pick endpoint: %w", err)
		}
		tried = append(tried, ep)
		// start precedes the context so Duration >= timeout whenever it fires.
		start := time.Now()
		ctx, cancel := context.WithTimeout(p.ctx, timeout)
		c, err := p.dial(ctx, ep)
		a := Attempt{Endpoint: ep, Start: start, Duration: time.Since(start), Err: err}
		cancel()
		s.rec.Attempts = append(s.rec.Attempts, a)
		obs.AttemptDone(p.Service, a)
		if err == nil {
			s.rec.Endpoint = ep
			return c, nil
		}
		// The client's sticky endpoint just failed it: let the next pick move on.
		p.Picker.ResetAffinity(client)
		p.Picker.Release(ep)
		lastErr = err
		if s.err.Load() != nil || p.ctx.Err() != nil {
			break
		}
	}
	return nil, fmt.Errorf("%d dial attempts failed, last: %w", len(s.rec.Attempts), lastErr)
}

// endDirection ends one copy direction: a clean EOF from the source is passed on as
// a half-close of dst; anything else aborts the connection, resetting both sides.
//
// The direction ending last skips the half-close: the Close that follows sends the
// same FIN (dst's send side is still open and its receive side has already seen
// EOF, so nothing unread turns the close into a reset), one syscall fewer.
func (s *tcpSession) endDirection(err error, dst *net.TCPConn, what string) {
	if err != nil && s.err.Load() == nil {
		s.abort(fmt.Errorf("copy %s: %w", what, err))
	}
	// pending is 1 only when the other direction has ended already.
	if err == nil && s.pending.Load() > 1 {
		// Errors are ignored: if dst is gone, the other direction fails and aborts.
		dst.CloseWrite()
	}
	if s.pending.Add(-1) == 0 {
		s.client.Close()
		s.backend.Load().Close()
		s.p.Picker.Release(s.rec.Endpoint)
		var err error
		if e := s.err.Load(); e != nil {
			err = *e
		}
		s.end(err)
	}
}

// abort resets both sides once; later calls do nothing. Closing the sockets makes
// both copy directions return.
func (s *tcpSession) abort(err error) {
	if !s.err.CompareAndSwap(nil, &err) {
		return
	}
	resetConn(s.client)
	if b := s.backend.Load(); b != nil {
		resetConn(b)
	}
}

// end delivers the connection's record and forgets it.
func (s *tcpSession) end(err error) {
	s.rec.Err = err
	s.rec.Duration = time.Since(s.rec.Start)
	s.p.observer().ConnClosed(&s.rec)
	s.p.untrack(s)
}

// resetConn closes c with an RST instead of a FIN (SO_LINGER with a zero timeout).
func resetConn(c *net.TCPConn) {
	c.SetLinger(0)
	c.Close()
}
