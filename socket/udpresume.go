package socket

import (
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"time"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/record"
	"github.com/uproxy/uproxy/socket/handover"
	"github.com/uproxy/uproxy/socket/poll"
)

// A UDP client entry moves from one proxy to another as a TCP connection does
// (resume.go): its connected socket to its endpoint travels, so the client
// keeps its endpoint and the endpoint keeps seeing the same source, and a
// reply on its way is read by the proxy that resumed the entry. The Service
// sockets do not travel here: the successor has its own copies (HandOver),
// and the entry replies through the one with the same local address.

// UDPClientState is a client entry taken out of a UDPProxy (DetachClients),
// to be resumed by another (ResumeClients).
type UDPClientState struct {
	fd       int // the entry's socket to its endpoint; -1 once spent
	client   netip.AddrPort
	endpoint netip.AddrPort
	// local is the address the client wrote to, on a wildcard Service socket
	// (invalid otherwise); service is that socket's local address.
	local   netip.Addr
	service string
	start   time.Time
	// idleFor is how long no datagram had moved when the entry was detached.
	idleFor           time.Duration
	bytesIn, bytesOut int64
	judged            bool
	attempt           record.Attempt
}

// Endpoint returns the entry's endpoint.
func (st *UDPClientState) Endpoint() netip.AddrPort { return st.endpoint }

// Close closes the entry's socket in this process (after a successor has
// confirmed it resumed it, closing this copy sends nothing).
func (st *UDPClientState) Close() {
	if st.fd >= 0 {
		unix.Close(st.fd)
		st.fd = -1
	}
}

// DetachClients stops reading the proxy's Service sockets and takes every
// client entry out of the proxy, in one pass of its event loop: from then on
// this proxy relays nothing, its Service sockets are closed here (the
// successor reads its own copies), and the entries' sockets and state pass
// to the returned states. The Picker is told each entry's end (Release);
// the Observer is not (the proxy that resumes an entry reports it). A
// detached entry that no one resumes is lost with its socket (Close); its
// client's next datagram makes a new one wherever it is read.
//
// Cost: one pause of the proxy's loop, an epoll_ctl per entry. It must not
// be called on an event loop.
func (p *UDPProxy) DetachClients() ([]UDPClientState, error) {
	p.init()
	if p.l == nil {
		return nil, nil
	}
	l := p.l
	var out []UDPClientState
	err := l.PostWait(func() {
		now := l.Now()
		for _, c := range p.clients {
			if !c.ended {
				out = append(out, c.detach(l, now))
			}
		}
		p.mu.Lock()
		sockets := slices.Collect(maps.Keys(p.sockets))
		p.mu.Unlock()
		for _, s := range sockets {
			s.stop(l, nil)
		}
	})
	if err != nil {
		return out, fmt.Errorf("detach the UDP clients of %s: %w", p.Service, err)
	}
	return out, nil
}

// detach takes the entry out of its loop and proxy into a state.
func (c *udpClient) detach(l *loop, now int64) UDPClientState {
	l.Cancel(&c.t)
	l.Unwatch(c.fd)
	st := UDPClientState{fd: c.fd, client: c.addr, endpoint: c.ep, local: c.local, service: c.svc.addr,
		start: c.rec.Start, idleFor: max(0, time.Duration(now-c.last)),
		bytesIn: c.bytesIn, bytesOut: c.bytesOut, judged: c.judged, attempt: c.attempt[0]}
	c.fd, c.ended = -1, true
	p := c.p
	p.mu.Lock()
	if p.clients[c.addr] == c {
		delete(p.clients, c.addr)
	}
	p.mu.Unlock()
	c.picker().Release(c.ep)
	return st
}

// ResumeClients makes the entries of states the proxy's, each replying
// through its Service socket of the same local address, with the idle time it
// had, its record (start, attempt, byte counts) going on. An entry whose
// client already has one here (a datagram this proxy read first), whose
// Service socket this proxy does not serve, past the data path's reserve, or
// arriving after Close, is dropped (its socket closed) and counted in the
// error; its client's next datagram uses the entry here, or makes one.
// ResumeClients takes the states' sockets. It must not be called on an
// event loop.
func (p *UDPProxy) ResumeClients(states []UDPClientState) (dropped int, err error) {
	p.init()
	if len(states) == 0 {
		return 0, nil
	}
	if p.l == nil {
		for i := range states {
			states[i].Close()
		}
		return len(states), fmt.Errorf("resume the UDP clients of %s: %w", p.Service, p.initErr)
	}
	l := p.l
	var errs []error
	perr := l.PostWait(func() {
		p.mu.Lock()
		closed := p.closed
		byAddr := make(map[string]*udpSocket, len(p.sockets))
		for s := range p.sockets {
			if !s.stopped {
				byAddr[s.addr] = s
			}
		}
		p.mu.Unlock()
		for i := range states {
			st := &states[i]
			if err := p.resumeClient(l, st, byAddr, closed); err != nil {
				st.Close()
				dropped++
				errs = append(errs, err)
			}
		}
	})
	if perr != nil {
		for i := range states {
			states[i].Close()
		}
		return len(states), fmt.Errorf("resume the UDP clients of %s: %w", p.Service, perr)
	}
	return dropped, errors.Join(errs...)
}

func (p *UDPProxy) resumeClient(l *loop, st *UDPClientState, byAddr map[string]*udpSocket, closed bool) error {
	what := func(err error) error {
		return fmt.Errorf("resume the UDP client %v of %s (endpoint %v): %w", st.client, p.Service, st.endpoint, err)
	}
	svc := byAddr[st.service]
	switch {
	case st.fd < 0:
		return what(errors.New("the state has no socket (resumed or closed already)"))
	case closed:
		return what(ErrShutdown)
	case svc == nil:
		return what(fmt.Errorf("no Service socket on %s here", st.service))
	case p.clients[st.client] != nil:
		return what(errors.New("the client has an entry here already"))
	case !l.keep(st.fd):
		return what(reserveError{l.fdCeiling})
	}
	c := &udpClient{p: p, svc: svc, addr: st.client, local: st.local, replyFrom: replySource(st.local),
		to: sockaddrOf(st.client), ep: st.endpoint, fd: st.fd, bytesIn: st.bytesIn, bytesOut: st.bytesOut, judged: st.judged}
	c.t = poll.NewTimer(c)
	c.short = p.ShortCircuit != nil && p.ShortCircuits(st.client.Addr().Unmap())
	c.attempt[0] = st.attempt
	c.rec = record.Conn{Service: p.Service, Protocol: "UDP", Client: st.client, Start: st.start, Endpoint: st.endpoint}
	c.rec.Attempts = c.attempt[:]
	if err := l.Watch(c.fd, c, unix.EPOLLIN|unix.EPOLLET); err != nil {
		return what(err)
	}
	st.fd = -1 // the entry's from here on
	p.observer().ConnOpened(p.Service, "UDP")
	c.picker().Acquire(c.ep)
	now := l.Now()
	c.last = now - int64(st.idleFor)
	l.Schedule(&c.t, max(0, p.timeout()-st.idleFor))
	p.mu.Lock()
	p.clients[st.client] = c
	p.mu.Unlock()
	return nil
}

// A UDPClientState travels as one handover item: its socket, and its
// encoding (version 1, big-endian):
//
//	version          1 byte
//	flags            1 byte (1: judged)
//	client, endpoint address each as a SessionState's
//	local address    as an address with port 0
//	service          uvarint length and the Service socket's local address
//	start            8 bytes, Unix nanoseconds
//	idle for         8 bytes, nanoseconds
//	bytes in, out    8 bytes each
//	attempt          as a SessionState's
const udpClientStateVersion = 1

// UDPClientItems returns the handover items of states, in batches of at most
// handover.MaxFDs (one Send each). The descriptors stay the states'.
func UDPClientItems(states []UDPClientState) [][]handover.Item {
	var batches [][]handover.Item
	for len(states) > 0 {
		n := min(len(states), handover.MaxFDs)
		batch := make([]handover.Item, n)
		for i := range batch {
			batch[i] = handover.Item{FD: states[i].fd, Meta: states[i].appendBinary(nil)}
		}
		batches = append(batches, batch)
		states = states[n:]
	}
	return batches
}

func (st *UDPClientState) appendBinary(b []byte) []byte {
	flags := byte(0)
	if st.judged {
		flags = 1
	}
	b = append(b, udpClientStateVersion, flags)
	b = appendAddrPort(b, st.client)
	b = appendAddrPort(b, st.endpoint)
	b = appendAddrPort(b, netip.AddrPortFrom(st.local, 0))
	b = binary.AppendUvarint(b, uint64(len(st.service)))
	b = append(b, st.service...)
	b = binary.BigEndian.AppendUint64(b, uint64(st.start.UnixNano()))
	b = binary.BigEndian.AppendUint64(b, uint64(st.idleFor))
	b = binary.BigEndian.AppendUint64(b, uint64(st.bytesIn))
	b = binary.BigEndian.AppendUint64(b, uint64(st.bytesOut))
	return appendAttempt(b, st.attempt)
}

// UDPClientStates decodes items made by UDPClientItems. On error it closes
// every item's descriptor and returns none.
func UDPClientStates(items []handover.Item) ([]UDPClientState, error) {
	out := make([]UDPClientState, 0, len(items))
	for _, it := range items {
		st, err := decodeUDPClientState(it)
		if err != nil {
			for _, it := range items {
				if it.FD >= 0 {
					unix.Close(it.FD)
				}
			}
			return nil, err
		}
		out = append(out, st)
	}
	return out, nil
}

func decodeUDPClientState(it handover.Item) (UDPClientState, error) {
	if it.FD < 0 {
		return UDPClientState{}, errors.New("a UDP client's state without its socket")
	}
	r := stateReader{b: it.Meta}
	if v := r.byte(); r.err == nil && v != udpClientStateVersion {
		return UDPClientState{}, fmt.Errorf("a UDP client's state of version %d, want %d", v, udpClientStateVersion)
	}
	st := UDPClientState{fd: it.FD}
	st.judged = r.byte()&1 != 0
	st.client, st.endpoint = r.addrPort(), r.addrPort()
	st.local = r.addrPort().Addr()
	st.service = string(r.bytes())
	st.start = time.Unix(0, int64(r.uint64()))
	st.idleFor = time.Duration(r.uint64())
	st.bytesIn, st.bytesOut = int64(r.uint64()), int64(r.uint64())
	st.attempt = r.attempt()
	if r.err == nil && len(r.b) != 0 {
		r.fail()
	}
	if r.err != nil {
		return UDPClientState{}, fmt.Errorf("a UDP client's state: %w", r.err)
	}
	if !st.client.IsValid() || !st.endpoint.IsValid() {
		return UDPClientState{}, errors.New("a UDP client's state without its client or endpoint")
	}
	return st, nil
}
