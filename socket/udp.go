package socket

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/klog/v2"
)

// ErrTooManyClients is the Err of a UDP client turned away because the client table
// is full (UDPProxy.MaxClients).
var ErrTooManyClients = errors.New("UDP client table full")

const (
	// DefaultUDPTimeout is the idle time after which a UDP client entry expires.
	DefaultUDPTimeout = 250 * time.Millisecond
	// DefaultUDPMaxClients bounds the UDP client table when MaxClients is zero.
	DefaultUDPMaxClients = 4096
	// maxDatagram holds any UDP payload (at most 65507 bytes over IPv4, 65527 over
	// IPv6 without jumbograms) without truncation.
	maxDatagram = 64 << 10
)

// UDPProxy proxies the UDP traffic of one Service port. Each client address gets an
// entry with its own connected socket to an endpoint; replies go back through the
// Service's socket. Set the fields before the first Serve and do not change them.
type UDPProxy struct {
	// Service names the Service port ("namespace/name:port") in records and metrics.
	Service string
	// Picker chooses the endpoint of each client entry. Required.
	Picker Picker
	// Timeout is how long a client entry lives without a datagram in either
	// direction; zero means DefaultUDPTimeout.
	Timeout time.Duration
	// MaxClients bounds the client table; datagrams from further clients are dropped
	// (each reported to ConnClosed with ErrTooManyClients). Zero means
	// DefaultUDPMaxClients.
	MaxClients int
	// Observer is told about every client entry; nil means NopObserver.
	Observer Observer

	initOnce sync.Once
	// epoch is the origin of the monotonic timestamps kept in client entries.
	epoch time.Time
	stop  chan struct{}
	// replies counts the reply goroutines, which Close waits for.
	replies sync.WaitGroup

	// mu guards the fields below. Once closed, stays closed.
	mu      sync.Mutex
	closed  bool
	sockets map[*net.UDPConn]struct{}
	clients map[netip.AddrPort]*udpClient
}

func (p *UDPProxy) init() {
	p.initOnce.Do(func() {
		p.epoch = time.Now()
		p.stop = make(chan struct{})
		p.sockets = make(map[*net.UDPConn]struct{})
		p.clients = make(map[netip.AddrPort]*udpClient)
	})
}

func (p *UDPProxy) observer() Observer {
	if p.Observer == nil {
		return NopObserver{}
	}
	return p.Observer
}

func (p *UDPProxy) timeout() time.Duration {
	if p.Timeout <= 0 {
		return DefaultUDPTimeout
	}
	return p.Timeout
}

func (p *UDPProxy) maxClients() int {
	if p.MaxClients <= 0 {
		return DefaultUDPMaxClients
	}
	return p.MaxClients
}

// now is a monotonic timestamp, cheap enough to take per datagram.
func (p *UDPProxy) now() time.Duration { return time.Since(p.epoch) }

// Serve reads datagrams from the Service's socket conn and forwards each to its
// client's endpoint until Close, after which it returns nil. conn is closed when Serve
// returns.
func (p *UDPProxy) Serve(conn *net.UDPConn) error {
	p.init()
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		conn.Close()
		return nil
	}
	p.sockets[conn] = struct{}{}
	p.mu.Unlock()
	defer func() {
		conn.Close()
		p.mu.Lock()
		delete(p.sockets, conn)
		p.mu.Unlock()
	}()

	rc, err := conn.SyscallConn()
	if err != nil {
		return fmt.Errorf("socket of %s: %w", p.Service, err)
	}
	// Each batch is forwarded before the next read, so its buffers are never shared.
	enablePktinfo(conn)
	r := newBatchReader(true)
	defer r.release()
	// forwardAll runs inside rc.Read and returns only on a read error (errno), so
	// the reader's drained state stays valid between batches (see begin).
	var delay time.Duration
	forwardAll := func(fd uintptr) bool {
		for {
			if !r.read(fd) {
				return false
			}
			if r.errno != nil {
				return true
			}
			delay = 0
			for i := range r.n {
				from, local := r.source(i)
				p.forward(conn, from, local, r.datagram(i))
			}
		}
	}
	for {
		r.begin()
		err := rc.Read(forwardAll)
		if err == nil && r.errno != nil {
			err = os.NewSyscallError("recvmmsg", r.errno)
		}
		if err != nil {
			r.release()
			if p.isClosed() {
				return nil
			}
			if !isTemporary(err) {
				return fmt.Errorf("read from %s for %s: %w", conn.LocalAddr(), p.Service, err)
			}
			delay = nextBackoff(delay)
			acceptBackoffs.Add(1)
			klog.ErrorS(err, "UDP read failed, backing off", "service", p.Service, "delay", delay)
			if !sleep(delay, p.stop) {
				return nil
			}
			continue
		}
	}
}

func (p *UDPProxy) isClosed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.closed
}

// forward sends one datagram from client to its entry's endpoint, creating the entry
// if needed. local is the address the client wrote to, when the socket is a
// wildcard one (invalid otherwise).
func (p *UDPProxy) forward(svc *net.UDPConn, client netip.AddrPort, local netip.Addr, b []byte) {
	// The second round covers an entry that expired between lookup and write.
	for range 2 {
		c := p.lookup(svc, client, local)
		if c == nil {
			return
		}
		c.touch()
		// Counted before the write so the count is complete once the entry's
		// socket is closed; undone if the write fails.
		c.bytesIn.Add(int64(len(b)))
		_, err := c.backend.Write(b)
		if err == nil {
			return
		}
		c.bytesIn.Add(-int64(len(b)))
		if errors.Is(err, net.ErrClosed) {
			continue
		}
		// Typically ECONNREFUSED: an earlier datagram drew an ICMP port
		// unreachable, the endpoint is gone. The client's next datagram picks again.
		c.end(fmt.Errorf("write to endpoint %s: %w", c.ep, err), true)
		return
	}
}

// lookup returns client's entry, creating it when there is room; nil means the
// datagram is dropped (the reason has been reported to the Observer).
func (p *UDPProxy) lookup(svc *net.UDPConn, client netip.AddrPort, local netip.Addr) *udpClient {
	p.mu.Lock()
	c := p.clients[client]
	full := len(p.clients) >= p.maxClients()
	closed := p.closed
	p.mu.Unlock()
	if c != nil || closed {
		return c
	}
	obs := p.observer()
	obs.ConnOpened(p.Service, "UDP")
	if full {
		p.reject(client, ErrTooManyClients)
		return nil
	}
	c, err := p.open(svc, client, local)
	if err != nil {
		p.reject(client, err)
		return nil
	}

	p.mu.Lock()
	if p.closed || len(p.clients) >= p.maxClients() || p.clients[client] != nil {
		// Another Serve loop raced this one (or Close ran): keep the table as is.
		err := ErrTooManyClients
		if p.closed {
			err = net.ErrClosed
		}
		p.mu.Unlock()
		c.backend.Close()
		p.Picker.Release(c.ep)
		c.rec.Err = err
		c.rec.Duration = time.Since(c.rec.Start)
		obs.ConnClosed(&c.rec)
		return nil
	}
	p.clients[client] = c
	p.replies.Add(1)
	p.mu.Unlock()
	go c.serveReplies()
	return c
}

// open picks an endpoint for client and connects a socket to it.
func (p *UDPProxy) open(svc *net.UDPConn, client netip.AddrPort, local netip.Addr) (*udpClient, error) {
	c := &udpClient{p: p, svc: svc, addr: client, replyFrom: replySource(local)}
	c.rec = Conn{Service: p.Service, Protocol: "UDP", Client: client, Start: time.Now()}
	ep, err := p.Picker.Pick(client.Addr().Unmap(), nil)
	if err != nil {
		return nil, fmt.Errorf("pick endpoint: %w", err)
	}
	start := time.Now()
	// net.DialUDP with a nil local address connects without binding first (unlike
	// Dialer.DialUDP), and a UDP connect never waits on the network.
	backend, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(ep))
	a := Attempt{Endpoint: ep, Start: start, Duration: time.Since(start), Err: err}
	c.attempt[0] = a
	c.rec.Attempts = c.attempt[:]
	p.observer().AttemptDone(p.Service, a)
	if err != nil {
		p.Picker.ResetAffinity(client.Addr().Unmap())
		p.Picker.Release(ep)
		return nil, fmt.Errorf("connect to endpoint %s: %w", ep, err)
	}
	c.ep = ep
	c.rec.Endpoint = ep
	c.backend = backend
	c.readFn = c.readReplies
	c.replies = newBatchReader(false)
	c.touch()
	return c, nil
}

// reject reports a client turned away before it had an entry.
func (p *UDPProxy) reject(client netip.AddrPort, err error) {
	p.observer().ConnClosed(&Conn{Service: p.Service, Protocol: "UDP", Client: client, Start: time.Now(), Err: err})
}

// Close stops every Serve, ends every client entry and waits for their goroutines.
func (p *UDPProxy) Close() error {
	p.init()
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	close(p.stop)
	var errs []error
	for conn := range p.sockets {
		if err := conn.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
			errs = append(errs, fmt.Errorf("close socket %s of %s: %w", conn.LocalAddr(), p.Service, err))
		}
	}
	clients := make([]*udpClient, 0, len(p.clients))
	for _, c := range p.clients {
		clients = append(clients, c)
	}
	p.mu.Unlock()
	for _, c := range clients {
		c.end(nil, false)
	}
	p.replies.Wait()
	return errors.Join(errs...)
}

// Clients returns the number of client entries.
func (p *UDPProxy) Clients() int {
	p.init()
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.clients)
}

// udpClient is one client's entry: a connected socket to its endpoint and the
// goroutine relaying replies.
type udpClient struct {
	p   *UDPProxy
	svc *net.UDPConn // the Service socket the client wrote to; replies leave by it
	// replyFrom is the control message that sends replies from the address the
	// client wrote to (nil on sockets bound to one address).
	replyFrom []byte
	addr      netip.AddrPort
	ep        netip.AddrPort
	backend   *net.UDPConn
	readFn    func(fd uintptr) bool // readReplies, bound once rather than per wait
	replies   *batchReader          // reads backend; used only by the reply goroutine

	// last is the time (UDPProxy.now) of the latest datagram either way.
	last              atomic.Int64
	bytesIn, bytesOut atomic.Int64
	// readErr is the error that stopped readReplies; only the reply goroutine uses it.
	readErr error

	endOnce sync.Once
	err     error // why the entry ended; set inside endOnce
	rec     Conn
	attempt [1]Attempt
}

func (c *udpClient) touch() { c.last.Store(int64(c.p.now())) }

// end removes the entry from the table and closes its socket, which stops the reply
// goroutine; only the first call counts. resetAffinity is set when the endpoint
// failed, so the client's next datagram picks afresh.
func (c *udpClient) end(err error, resetAffinity bool) {
	c.endOnce.Do(func() {
		c.err = err
		p := c.p
		p.mu.Lock()
		if p.clients[c.addr] == c {
			delete(p.clients, c.addr)
		}
		p.mu.Unlock()
		if resetAffinity {
			p.Picker.ResetAffinity(c.addr.Addr().Unmap())
		}
		c.backend.Close()
	})
}

// serveReplies relays the endpoint's datagrams to the client until the entry idles
// out, the endpoint fails or the entry is ended elsewhere; then it reports the entry.
func (c *udpClient) serveReplies() {
	p := c.p
	defer p.replies.Done()
	timeout := p.timeout()
	rc, err := c.backend.SyscallConn()
	if err != nil {
		c.end(fmt.Errorf("endpoint socket %s: %w", c.ep, err), false)
	} else {
		c.backend.SetReadDeadline(time.Now().Add(timeout))
		for {
			c.replies.begin()
			err := rc.Read(c.readFn)
			switch {
			case err == nil:
				c.end(fmt.Errorf("read from endpoint %s: %w", c.ep, c.readErr), true)
			case errors.Is(err, os.ErrDeadlineExceeded):
				// The deadline is moved only when it fires, not per datagram.
				if idle := p.now() - time.Duration(c.last.Load()); idle < timeout {
					c.backend.SetReadDeadline(time.Now().Add(timeout - idle))
					continue
				}
				c.end(nil, false)
			default:
				// Closed by end elsewhere (a failed write, Close); no-op then.
				c.end(fmt.Errorf("read from endpoint %s: %w", c.ep, err), false)
			}
			break
		}
	}
	// end has completed (sync.Once orders it before this point), so c.err is set.
	c.end(nil, false)
	p.Picker.Release(c.ep)
	c.rec.BytesIn = c.bytesIn.Load()
	c.rec.BytesOut = c.bytesOut.Load()
	c.rec.Duration = time.Since(c.rec.Start)
	c.rec.Err = c.err
	p.observer().ConnClosed(&c.rec)
}

// readReplies drains the endpoint socket, writing each datagram back to the client
// through the Service socket. It runs inside RawConn.Read: returning false waits
// for the socket to become readable again (or the deadline), true stops on readErr.
func (c *udpClient) readReplies(fd uintptr) bool {
	r := c.replies
	for {
		if !r.read(fd) {
			return false
		}
		if r.errno != nil {
			c.readErr = r.errno
			r.release()
			return true
		}
		c.touch()
		for i := range r.n {
			b := r.datagram(i)
			c.bytesOut.Add(int64(len(b)))
			// A failed send to the client (buffer full, client gone) loses one
			// datagram, as the network may; the entry lives on until it idles out.
			c.svc.WriteMsgUDPAddrPort(b, c.replyFrom, c.addr)
		}
	}
}
