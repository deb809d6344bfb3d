package socket

import (
	"net/netip"
	"time"

	"github.com/uproxy/uproxy/record"
)

// A Picker chooses backends for one Service port and is told how each dial of
// them went. affinity.Balancer is the real one.
//
// The dial reports are part of Picker rather than an optional interface found by
// a type assertion: the Picker judges its endpoints (the Balancer ejects one that
// keeps failing), and a Picker that stopped taking the reports must fail to
// compile where it is handed to a proxy, not silently stop ejecting.
type Picker interface {
	// Pick returns the endpoint for a new connection (or UDP flow) from client,
	// avoiding those in tried while any other remains. The endpoint counts as active
	// until Release is called for it.
	Pick(client netip.Addr, tried []netip.AddrPort) (netip.AddrPort, error)
	// Release ends one activity begun by Pick or Acquire.
	Release(ep netip.AddrPort)
	// Acquire counts ep active, as Pick does the endpoint it returns, for a
	// connection that came to the proxy already connected to ep: one resumed
	// from another process (TCPProxy.Resume). It is part of Picker, as the
	// dial reports are, so that a Picker whose active counts would miss the
	// resumed connections fails to compile rather than balancing on them.
	Acquire(ep netip.AddrPort)
	// ResetAffinity forgets client's sticky endpoint (after a failed dial).
	ResetAffinity(client netip.Addr)
	// DialSucceeded says a dial of ep, returned by Pick, connected; for a UDP
	// session, whose connect only sets the peer, that ep sent its first reply.
	DialSucceeded(ep netip.AddrPort)
	// DialFailed says a dial of ep, returned by Pick, failed with err; so does a
	// UDP session that ep ended with an ICMP port unreachable (ECONNREFUSED):
	// a UDP connect only sets the peer, so that is how a UDP endpoint refuses.
	// A UDP session that ends with neither a reply nor a refusal is reported
	// neither way.
	// A dial that failed because this node ran short of sockets or memory is
	// not reported: it says nothing about ep.
	DialFailed(ep netip.AddrPort, err error)
}

// An Observer is told about every connection. Its methods are called on the event
// loops, several at once, so they must be safe for concurrent use, cheap, and
// never block: a slow Observer stalls every connection of its loop. It only
// records: what the proxy decides (which endpoint, whether to retry) depends on
// the Picker alone, so any Observer, or none, leaves the traffic as it is.
type Observer interface {
	// ConnOpened is called once a connection (TCP) or UDP client session has been
	// accepted, before any dial.
	ConnOpened(service, protocol string)
	// AttemptDone is called after each dial attempt, before the Picker is told.
	// A UDP session's one attempt is done when its endpoint first replies, or
	// refuses (its Err then ECONNREFUSED), or else when the session ends.
	AttemptDone(service string, a record.Attempt)
	// ConnClosed is called once the connection (or UDP session) has ended, with its
	// full record; c must not be retained after the call returns.
	ConnClosed(c *record.Conn)
	// BackedOff is called each time accepting (TCP) or reading (UDP) pauses for
	// delay after err said the node ran short of descriptors, buffers or memory.
	BackedOff(service string, err error, delay time.Duration)
}

// NopObserver ignores everything; it is the Observer when none is set.
type NopObserver struct{}

func (NopObserver) ConnOpened(string, string)              {}
func (NopObserver) AttemptDone(string, record.Attempt)     {}
func (NopObserver) ConnClosed(*record.Conn)                {}
func (NopObserver) BackedOff(string, error, time.Duration) {}
