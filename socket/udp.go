package socket

import (
	"errors"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/record"
	"github.com/uproxy/uproxy/socket/poll"
)

// ErrTooManyClients is the Err of a UDP client turned away because the client table
// is full (UDPProxy.MaxClients).
var ErrTooManyClients = record.ErrTooManyClients

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
//
// A UDPProxy lives on one of its event loops (see loop.go): its Service sockets,
// its client table and every client's socket are served from that loop's thread,
// so a datagram costs no goroutine wake-up either way.
type UDPProxy struct {
	// Service names the Service port ("namespace/name:port") in records and metrics.
	Service string
	// Picker chooses the endpoint of each client entry. Required.
	Picker Picker
	// Loops are the event loops the proxy may run on; it takes one of them.
	// Required; the owner closes them once the proxy is closed.
	Loops *poll.Group
	// Timeout is how long a client entry lives without a datagram in either
	// direction; zero means DefaultUDPTimeout.
	Timeout time.Duration
	// MaxClients bounds the client table; datagrams from further clients are dropped
	// (each reported to ConnClosed with ErrTooManyClients and
	// record.DropClientTableFull, and logged with the other drops, at most once
	// per dropLogEvery). Zero means DefaultUDPMaxClients.
	MaxClients int
	// Observer is told about every client entry; nil means NopObserver.
	Observer Observer
	// OwnSocket is as TCPProxy's: a client entry whose endpoint it reports is
	// never connected (the datagram would come back in as a new client's, without
	// end); the entry fails with record.ErrOwnSocket and its datagram is dropped.
	OwnSocket func(ep netip.AddrPort) bool
	// KeepClientAddress is as TCPProxy's, asked once per client entry: the
	// entry's socket to the endpoint then sends from the client's address
	// (on a port of the node's choosing).
	KeepClientAddress func(client netip.Addr) bool
	// DialMark is as TCPProxy's, on every entry's socket to its endpoint.
	DialMark uint32
	// fallback logs the first transparent socket the kernel refused.
	fallback fallbackLog
	// ShortCircuit and ShortCircuits are as TCPProxy's, asked once per
	// client entry.
	ShortCircuit  Picker
	ShortCircuits func(client netip.Addr) bool

	// drops counts and logs the datagrams turned away; dropLogEvery, when
	// set, replaces its interval and droppedLine, when set, is given its lines
	// instead of the log (tests use both).
	drops        dropLog
	dropLogEvery time.Duration
	droppedLine  func(msg string, err error, kv ...any)

	initOnce sync.Once
	l        *loop // nil without loops (initErr)
	initErr  error

	// mu guards the fields below. The loop changes them holding mu and reads them
	// without: only it writes. Once closed, stays closed.
	mu      sync.Mutex
	closed  bool
	sockets map[*udpSocket]struct{}
	clients map[netip.AddrPort]*udpClient
}

func (p *UDPProxy) init() {
	p.initOnce.Do(func() {
		p.sockets = make(map[*udpSocket]struct{})
		p.clients = make(map[netip.AddrPort]*udpClient)
		p.drops = dropLog{p: p}
		p.drops.t = poll.NewTimer(&p.drops)
		if p.Loops == nil {
			p.initErr = errors.New("UDPProxy.Loops is nil, want the event loops to run on")
			return
		}
		p.l = loopOf(p.Loops.Next())
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

// udpSocket is one Service socket of a UDPProxy.
type udpSocket struct {
	p    *UDPProxy
	addr string
	// done is closed once the socket is out of the loop and closed; err (set before)
	// is why reading stopped for good, nil after Close.
	done    chan struct{}
	err     error
	stopped bool
	// finished ends Start's serving of the socket, on a goroutine of its own
	// once done is closed: it is set before the socket can stop.
	finished func()
	backoffWatch
}

// Serve forwards the datagrams of the Service's socket conn to each client's
// endpoint until Close, after which it returns nil; it returns an error if reading
// fails for good. Serve takes conn's socket over: conn itself is closed at once, and
// the socket when Serve returns.
func (p *UDPProxy) Serve(conn *net.UDPConn) error {
	errc := make(chan error, 1)
	if err := p.Start(conn, func(err error) { errc <- err }); err != nil {
		return err
	}
	return <-errc
}

// Start is Serve without the wait: it returns Serve's error when conn cannot
// be served, and otherwise nil at once, with done called later, once, with
// what Serve would have returned. No goroutine waits in the meantime; done
// runs on a goroutine of its own.
func (p *UDPProxy) Start(conn *net.UDPConn, done func(error)) error {
	p.init()
	if p.initErr != nil {
		conn.Close()
		return fmt.Errorf("serve %s: %w", p.Service, p.initErr)
	}
	// Replies must leave from the address each client wrote to (see pktinfo.go).
	enablePktinfo(conn)
	s := &udpSocket{p: p, addr: conn.LocalAddr().String(), done: make(chan struct{})}
	fd, err := takeFD(conn)
	if err != nil {
		return fmt.Errorf("serve %s: %w", p.Service, err)
	}
	enableGRO(fd)
	s.backoffWatch = newBackoffWatch(fd, unix.EPOLLIN|unix.EPOLLET, s)
	// Set before the socket can stop.
	s.finished = func() {
		p.mu.Lock()
		delete(p.sockets, s)
		p.mu.Unlock()
		if s.err != nil {
			done(fmt.Errorf("read from %s for %s: %w", s.addr, p.Service, s.err))
			return
		}
		done(nil)
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		unix.Close(fd)
		go done(nil)
		return nil
	}
	p.sockets[s] = struct{}{}
	p.mu.Unlock()
	l := p.l
	if !l.Post(func() {
		if s.stopped {
			return
		}
		if err := s.watch(l, s); err != nil {
			s.stop(l, err)
		}
	}) {
		unix.Close(fd)
		p.mu.Lock()
		delete(p.sockets, s)
		p.mu.Unlock()
		return fmt.Errorf("serve %s: %w", p.Service, poll.ErrClosed)
	}
	return nil
}

// takeFD moves a socket out of Go's poller into the caller's hands: it returns a
// duplicate of c's descriptor (sharing its non-blocking mode) and closes c.
func takeFD(c interface {
	SyscallConn() (syscall.RawConn, error)
	Close() error
}) (int, error) {
	defer c.Close()
	rc, err := c.SyscallConn()
	if err != nil {
		return -1, err
	}
	fd := -1
	var dupErr error
	if err := rc.Control(func(s uintptr) {
		fd, dupErr = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 0)
	}); err != nil {
		return -1, err
	}
	if dupErr != nil {
		return -1, os.NewSyscallError("fcntl", dupErr)
	}
	return fd, nil
}

// Handle reads every datagram queued on the Service socket, in batches.
func (s *udpSocket) Handle(uint32) {
	p, l := s.p, s.p.l
	r := l.serviceReader
	r.begin()
	for r.read(s.fd) {
		if r.errno != nil {
			err := os.NewSyscallError("recvmmsg", r.errno)
			r.release()
			switch actionAfter(r.errno) {
			case retryNow:
				// Reported once, for an earlier datagram: read on.
				continue
			case backOff:
				s.backoff(l, err)
			default:
				s.stop(l, err)
			}
			return
		}
		if d, n, ok := s.succeeded(l); ok {
			klog.InfoS("Reading UDP again after a shortage", "service", p.Service,
				"backedOff", d.Round(time.Millisecond), "failures", n)
		}
		for i := range r.n {
			from, local, size := r.source(i)
			p.forward(l, s, from, local, r.datagram(i), size)
		}
	}
}

// backoff stops reading for a while after a shortage (see TCP's accept).
func (s *udpSocket) backoff(l *loop, err error) {
	delay := s.backoffWatch.backoff(l)
	s.p.observer().BackedOff(s.p.Service, err, delay)
	klog.ErrorS(err, "UDP read failed, backing off", "service", s.p.Service, "delay", delay)
}

// Expire ends a backoff unless the socket has stopped.
func (s *udpSocket) Expire() {
	if !s.stopped {
		s.resume(s.p.l, s)
	}
}

// stop closes the socket, ends the clients whose replies leave by it and lets Serve
// return with err.
func (s *udpSocket) stop(l *loop, err error) {
	if s.stopped {
		return
	}
	s.stopped = true
	s.err = err
	s.backoffWatch.stop(l)
	unix.Close(s.fd)
	for _, c := range s.p.clients {
		if c.svc == s {
			c.end(l, nil, false)
		}
	}
	close(s.done)
	go s.finished()
}

// forward sends one datagram from client to its entry's endpoint, creating the entry
// if needed: or a run of datagrams of size bytes each that the kernel coalesced
// (size 0 for one datagram; gso.go). local is the address the client wrote to,
// when the socket is a wildcard one (invalid otherwise).
func (p *UDPProxy) forward(l *loop, svc *udpSocket, client netip.AddrPort, local netip.Addr, b []byte, size int) {
	c := p.clients[client]
	if c == nil {
		if c = p.open(l, svc, client, local); c == nil {
			return
		}
	}
	c.last = l.Now()
	switch err := sendRun(c.fd, b, size, nil, nil, l.oob[:], &c.noSegmentsUp); err {
	case nil:
		c.bytesIn += int64(len(b))
	case unix.EAGAIN:
		// The socket's send buffer is full: the datagram is lost, as the
		// network may lose it.
	default:
		// Typically ECONNREFUSED: an earlier datagram drew an ICMP port
		// unreachable, the endpoint is gone. The client's next datagram picks again.
		c.end(l, fmt.Errorf("write to endpoint %s: %w", c.ep, os.NewSyscallError("write", err)), true)
	}
}

// open creates client's entry: it picks an endpoint and connects a socket to it. It
// returns nil when the datagram is dropped (the reason has been reported).
func (p *UDPProxy) open(l *loop, svc *udpSocket, client netip.AddrPort, local netip.Addr) *udpClient {
	p.mu.Lock()
	closed := p.closed
	p.mu.Unlock()
	if closed || svc.stopped {
		return nil
	}
	obs := p.observer()
	obs.ConnOpened(p.Service, "UDP")
	if len(p.clients) >= p.maxClients() {
		p.reject(l, client, record.DropClientTableFull, ErrTooManyClients)
		return nil
	}
	c := &udpClient{p: p, svc: svc, addr: client, local: local, replyFrom: replySource(local), fd: -1}
	c.t = poll.NewTimer(c)
	c.rec = record.Conn{Service: p.Service, Protocol: "UDP", Client: client, Start: time.Now()}
	c.short = p.ShortCircuit != nil && p.ShortCircuits(client.Addr().Unmap())
	picker := c.picker()
	ep, err := picker.Pick(client.Addr().Unmap(), nil)
	if err != nil {
		p.reject(l, client, record.DropNoEndpoint, fmt.Errorf("pick endpoint: %w", err))
		return nil
	}
	start := time.Now()
	fd := -1
	clientIP := client.Addr().Unmap()
	keep := p.KeepClientAddress != nil && p.KeepClientAddress(clientIP)
	source, src := sourceOf(keep, clientIP, ep)
	var fellBack error
	if p.OwnSocket != nil && p.OwnSocket(ep) {
		err = record.ErrOwnSocket
	} else if fd, fellBack, err = l.dial(ep, unix.SOCK_DGRAM, src, p.DialMark, false); err == nil {
		enableGRO(fd)
		if err = l.Watch(fd, c, unix.EPOLLIN|unix.EPOLLET); err != nil {
			unix.Close(fd)
		}
	}
	// The node short of sockets or of local ports is not the endpoint at fault:
	// no attempt is counted against it, and the client keeps its affinity.
	short, drop := "", record.NotDropped
	switch {
	case isShortage(err):
		short, drop = "socket", record.DropNoSocket
	case isLocalPortShortage(err):
		short, drop = "local port", record.DropNoLocalPort
	}
	if short != "" {
		picker.Release(ep)
		p.reject(l, client, drop, fmt.Errorf("no %s for endpoint %s: %w", short, ep, err))
		return nil
	}
	if fellBack != nil {
		source = record.SourceFallback
		p.fallback.refused(p.Service, clientIP, fellBack)
	}
	a := record.Attempt{Endpoint: ep, Start: start, Duration: time.Since(start), Err: err, Source: source}
	c.attempt[0] = a
	c.rec.Attempts = c.attempt[:]
	if err != nil {
		obs.AttemptDone(p.Service, a)
		picker.DialFailed(ep, err)
		picker.ResetAffinity(client.Addr().Unmap())
		picker.Release(ep)
		c.rec.Err = fmt.Errorf("connect to endpoint %s: %w", ep, err)
		c.rec.Duration = time.Since(c.rec.Start)
		obs.ConnClosed(&c.rec)
		return nil
	}
	// A UDP connect only sets the peer: it succeeds whether or not anything
	// listens there. The attempt is judged when the endpoint shows which: by
	// its first reply (Handle) or an ICMP port unreachable (end).
	c.fd, c.ep, c.rec.Endpoint = fd, ep, ep
	c.to = sockaddrOf(client)
	c.last = l.Now()
	l.Schedule(&c.t, p.timeout())
	p.mu.Lock()
	p.clients[client] = c
	p.mu.Unlock()
	return c
}

// sockaddrOf converts a client's address for sendmsg, once per entry.
func sockaddrOf(ap netip.AddrPort) unix.Sockaddr {
	if a := ap.Addr(); a.Is4() {
		return &unix.SockaddrInet4{Addr: a.As4(), Port: int(ap.Port())}
	}
	sa := &unix.SockaddrInet6{Addr: ap.Addr().As16(), Port: int(ap.Port())}
	if z := ap.Addr().Zone(); z != "" {
		if ifi, err := net.InterfaceByName(z); err == nil {
			sa.ZoneId = uint32(ifi.Index)
		}
	}
	return sa
}

// reject reports a client's datagram turned away, for reason, before the client
// had an entry.
func (p *UDPProxy) reject(l *loop, client netip.AddrPort, reason record.Drop, err error) {
	p.drops.add(l, reason, err)
	p.observer().ConnClosed(&record.Conn{Service: p.Service, Protocol: "UDP", Client: client, Start: time.Now(), Err: err, Dropped: reason})
}

// dropLogEvery is how often, at most, a UDPProxy logs the datagrams it turned
// away: a flood may turn away every datagram, and a line for each would be a
// flood of its own.
const dropLogEvery = 10 * time.Second

// dropLog counts the datagrams a UDPProxy turned away and logs them, at most
// once per interval: the first at once, and those that follow within the
// interval in one line at its end, with how many there were by reason. Only
// the proxy's loop touches it.
type dropLog struct {
	p *UDPProxy
	// last is when (loop.Now) the last line was logged, 0 before the first;
	// first when the earliest datagram counted since was dropped.
	last, first int64
	counts      [record.NumDrops]int
	total       int
	err         error // the latest drop's
	t           poll.Timer
	pending     bool // t is armed
}

func (p *UDPProxy) dropInterval() time.Duration {
	if p.dropLogEvery > 0 {
		return p.dropLogEvery
	}
	return dropLogEvery
}

// add counts one datagram turned away for reason with err, and logs at once
// when no line has been logged for the interval; otherwise the line waits for
// the interval's end.
func (d *dropLog) add(l *loop, reason record.Drop, err error) {
	now := l.Now()
	if d.total == 0 {
		d.first = now
	}
	d.counts[reason]++
	d.total++
	d.err = err
	every := int64(d.p.dropInterval())
	if d.last == 0 || now-d.last >= every {
		d.flush(now)
		return
	}
	if !d.pending {
		d.pending = true
		l.ScheduleAt(&d.t, d.last+every)
	}
}

// Expire logs the datagrams turned away since the last line.
func (d *dropLog) Expire() {
	d.pending = false
	d.flush(d.p.l.Now())
}

// stop logs what is counted and disarms the timer, when the proxy closes.
func (d *dropLog) stop(l *loop) {
	if d.pending {
		l.Cancel(&d.t)
		d.pending = false
	}
	d.flush(l.Now())
}

// flush logs the datagrams counted since the last line, if any, and starts
// counting afresh.
func (d *dropLog) flush(now int64) {
	if d.total == 0 {
		return
	}
	p := d.p
	var reasons strings.Builder
	for r, n := range d.counts {
		if n == 0 {
			continue
		}
		if reasons.Len() > 0 {
			reasons.WriteString(", ")
		}
		fmt.Fprintf(&reasons, "%s %d", record.Drop(r), n)
		if record.Drop(r) == record.DropClientTableFull {
			fmt.Fprintf(&reasons, " (at most %d clients)", p.maxClients())
		}
	}
	kv := []any{"service", p.Service, "dropped", d.total, "reasons", reasons.String(),
		"over", time.Duration(now - d.first).Round(time.Millisecond)}
	if d.counts[record.DropNoSocket] > 0 {
		kv = append(kv, "hint", "UDP clients' sockets use the data path's descriptors, which TCP Services share: raise the open files limit, or lower the UDP client table's bound")
	}
	const msg = "UDP datagrams dropped: their clients could get no entry (counted in uproxy_udp_dropped_datagrams_total, logged at most every 10s per Service port)"
	if p.droppedLine != nil {
		p.droppedLine(msg, d.err, kv...)
	} else {
		klog.ErrorS(d.err, msg, kv...)
	}
	d.last = now
	d.counts, d.total, d.err = [record.NumDrops]int{}, 0, nil
}

// Close stops every Serve and ends every client entry.
func (p *UDPProxy) Close() error {
	p.init()
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	sockets := slices.Collect(maps.Keys(p.sockets))
	p.mu.Unlock()
	if p.l == nil {
		return nil
	}
	l := p.l
	err := l.PostWait(func() {
		for _, s := range sockets {
			s.stop(l, nil)
		}
		for _, c := range p.clients {
			c.end(l, nil, false)
		}
		p.drops.stop(l)
	})
	if err != nil {
		return fmt.Errorf("close %s: %w", p.Service, err)
	}
	return nil
}

// Retain ends the client entries whose endpoint is not in endpoints (it left the
// Service), so a client that keeps sending moves to a usable endpoint with its
// next datagram instead of staying on the removed one for as long as it talks.
// Each ended entry is reported with record.ErrEndpointRemoved. It returns how
// many it ended, once the proxy's loop has ended them.
func (p *UDPProxy) Retain(endpoints []netip.AddrPort) (int, error) {
	p.init()
	if p.l == nil {
		return 0, nil
	}
	l := p.l
	keep := make(map[netip.AddrPort]bool, len(endpoints))
	for _, ep := range endpoints {
		keep[ep] = true
	}
	ended := 0
	err := l.PostWait(func() {
		for _, c := range p.clients {
			if !keep[c.ep] {
				c.end(l, record.ErrEndpointRemoved, true)
				ended++
			}
		}
	})
	if err != nil {
		return 0, fmt.Errorf("end %s's clients of removed endpoints: %w", p.Service, err)
	}
	return ended, nil
}

// Clients returns the number of client entries.
func (p *UDPProxy) Clients() int {
	p.init()
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.clients)
}

// udpClient is one client's entry: a connected socket to its endpoint. Only the
// proxy's loop touches it.
type udpClient struct {
	p   *UDPProxy
	svc *udpSocket // the Service socket the client wrote to; replies leave by it
	// replyFrom is the control message that sends replies from the address the
	// client wrote to (nil on sockets bound to one address).
	replyFrom []byte
	local     netip.Addr // the address the client wrote to, when replyFrom is set
	addr      netip.AddrPort
	to        unix.Sockaddr // addr, for sendmsg
	ep        netip.AddrPort
	fd        int

	// last is the time (loop.Now) of the latest datagram either way; the
	// timer checks it rather than being moved per datagram.
	last              int64
	t                 poll.Timer
	bytesIn, bytesOut int64
	ended             bool
	// noSegmentsUp and noSegmentsDown are set once the kernel refused to cut a
	// coalesced run into datagrams on the way to the endpoint or to the client
	// (see sendRun).
	noSegmentsUp, noSegmentsDown bool
	// short says the entry picks from the proxy's ShortCircuit.
	short bool
	// judged is set once the entry's attempt has been reported, to the
	// Observer and the Picker: at the endpoint's first reply (a success), at
	// an ICMP port unreachable before it (a failure), or at the end of an
	// entry that had neither (reported to the Observer alone).
	judged  bool
	rec     record.Conn
	attempt [1]record.Attempt
}

// picker is the Picker of the entry's endpoint.
func (c *udpClient) picker() Picker {
	if c.short {
		return c.p.ShortCircuit
	}
	return c.p.Picker
}

// Expire ends the entry once it has been idle for the timeout, or looks again when
// it would have.
func (c *udpClient) Expire() {
	l := c.p.l
	timeout := int64(c.p.timeout())
	if idle := l.Now() - c.last; idle < timeout {
		l.Schedule(&c.t, time.Duration(timeout-idle))
		return
	}
	c.end(l, nil, false)
}

// Handle relays the endpoint's datagrams to the client through the Service socket.
func (c *udpClient) Handle(uint32) {
	l := c.p.l
	r := l.replyReader
	r.begin()
	for r.read(c.fd) {
		if r.errno != nil {
			err := r.errno
			r.release()
			c.end(l, fmt.Errorf("read from endpoint %s: %w", c.ep, os.NewSyscallError("recvmmsg", err)), true)
			return
		}
		c.last = l.Now()
		if !c.judged {
			c.answered()
		}
		for i := range r.n {
			b := r.datagram(i)
			c.bytesOut += int64(len(b))
			// A failed send to the client (buffer full, client gone) loses the
			// datagrams, as the network may; the entry lives on until it idles out.
			sendRun(c.svc.fd, b, r.segmentSize(i), c.to, c.replyFrom, l.oob[:], &c.noSegmentsDown)
		}
	}
}

// answered reports the entry's attempt a success, at the endpoint's first
// reply: only then is the endpoint known to be there, and only then may the
// Picker clear its failures.
func (c *udpClient) answered() {
	c.judged = true
	c.p.observer().AttemptDone(c.p.Service, c.attempt[0])
	c.picker().DialSucceeded(c.ep)
}

// end removes the entry from the table, closes its socket and reports it; only the
// first call counts. resetAffinity is set when the endpoint failed, so the client's
// next datagram picks afresh.
func (c *udpClient) end(l *loop, err error, resetAffinity bool) {
	if c.ended {
		return
	}
	c.ended = true
	p := c.p
	l.Cancel(&c.t)
	l.Forget(c.fd)
	unix.Close(c.fd)
	p.mu.Lock()
	if p.clients[c.addr] == c {
		delete(p.clients, c.addr)
	}
	p.mu.Unlock()
	if resetAffinity {
		c.picker().ResetAffinity(c.addr.Addr().Unmap())
	}
	c.picker().Release(c.ep)
	// An ICMP port unreachable is the UDP form of a refused dial, since a UDP
	// connect only sets the peer.
	refused := errors.Is(err, syscall.ECONNREFUSED)
	if !c.judged {
		c.judged = true
		if refused {
			// Refused before any reply: the entry's attempt failed and the
			// entry served nobody.
			c.attempt[0].Err = err
			c.rec.Endpoint = netip.AddrPort{}
		}
		// An entry that ends unanswered but unrefused (an endpoint that
		// never replies, or one that is silent by design, as a syslog
		// receiver is) proves nothing either way: its attempt is reported
		// as the connect went, and the Picker is told nothing.
		p.observer().AttemptDone(p.Service, c.attempt[0])
	}
	if refused {
		c.picker().DialFailed(c.ep, err)
	}
	c.rec.BytesIn, c.rec.BytesOut = c.bytesIn, c.bytesOut
	c.rec.Duration = time.Since(c.rec.Start)
	c.rec.Err = err
	p.observer().ConnClosed(&c.rec)
}
