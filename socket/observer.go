package socket

import (
	"errors"
	"net/netip"
	"time"
)

// ErrNoEndpoints is returned by a Picker that has no usable endpoint.
var ErrNoEndpoints = errors.New("no usable endpoints")

// A Picker chooses backends for one Service port. affinity.Balancer is the real one.
type Picker interface {
	// Pick returns the endpoint for a new connection (or UDP flow) from client,
	// avoiding those in tried while any other remains. The endpoint counts as active
	// until Release is called for it.
	Pick(client netip.Addr, tried []netip.AddrPort) (netip.AddrPort, error)
	// Release ends one activity begun by Pick.
	Release(ep netip.AddrPort)
	// ResetAffinity forgets client's sticky endpoint (after a failed dial).
	ResetAffinity(client netip.Addr)
}

// Attempt is one dial of one endpoint for one connection.
type Attempt struct {
	Endpoint netip.AddrPort
	Start    time.Time
	Duration time.Duration
	// Err is nil for a successful dial.
	Err error
}

// Conn is the record of one proxied TCP connection, or one UDP client session.
type Conn struct {
	Service  string // the Service port's name, namespace/name:port
	Protocol string // "TCP" or "UDP"
	Client   netip.AddrPort
	Start    time.Time
	Attempts []Attempt
	// Endpoint is the endpoint that served the connection (zero when every attempt failed).
	Endpoint netip.AddrPort
	// BytesIn counts client to backend, BytesOut backend to client (datagram
	// payload bytes for UDP).
	BytesIn, BytesOut int64
	Duration          time.Duration
	// Err is why the connection failed or ended abnormally (nil for a clean end).
	Err error
}

// An Observer is told about every connection. Its methods are called from the
// connection's goroutines and must be safe for concurrent use and cheap.
type Observer interface {
	// ConnOpened is called once a connection (TCP) or UDP client session has been
	// accepted, before any dial.
	ConnOpened(service, protocol string)
	// AttemptDone is called after each dial attempt.
	AttemptDone(service string, a Attempt)
	// ConnClosed is called once the connection (or UDP session) has ended, with its
	// full record; c must not be retained after the call returns.
	ConnClosed(c *Conn)
}

// NopObserver ignores everything; it is the Observer when none is set.
type NopObserver struct{}

func (NopObserver) ConnOpened(string, string)   {}
func (NopObserver) AttemptDone(string, Attempt) {}
func (NopObserver) ConnClosed(*Conn)            {}
