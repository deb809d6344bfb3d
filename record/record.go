// Package record holds the records of proxied connections and their dial
// attempts, shared by the data path that writes them (socket) and the observers
// that read them (observe), so that neither has to link the other.
package record

import (
	"errors"
	"net/netip"
	"time"
)

// ErrIdle is the Err (wrapped) of a TCP connection the proxy closed because no
// byte moved either way for its idle timeout.
var ErrIdle = errors.New("idle timeout")

// ErrEndpointRemoved is the Err of a UDP client entry the proxy ended because its
// endpoint left the Service: the client's next datagram picks a usable one.
var ErrEndpointRemoved = errors.New("endpoint removed from the Service")

// ErrHedgeLost is the Err of a dial attempt abandoned because another attempt of
// the same connection, begun while it was pending (a hedge), connected first.
// It says nothing against its endpoint: the attempt was cut short, not failed.
var ErrHedgeLost = errors.New("hedge lost: another attempt connected first")

// ErrRetryBudget is the Err (wrapped) of a TCP connection that failed because its
// Service port's retry budget refused it another attempt.
var ErrRetryBudget = errors.New("retry budget spent")

// ErrOwnSocket is the Err (wrapped) of a dial attempt that was never made
// because its endpoint is one of the proxy's own sockets (a proxy port, under
// whatever address leads there): the proxy would accept its own connection and
// dial the endpoint again, without end. It counts as the endpoint's failure.
var ErrOwnSocket = errors.New("the endpoint is one of the proxy's own sockets, or an address the portals steer to one (with no dial mark): dialing it would loop back into the proxy")

// ErrTooManyClients is the Err of a UDP datagram turned away because its
// Service port's client table is full (DropClientTableFull).
var ErrTooManyClients = errors.New("UDP client table full")

// Drop says why a UDP datagram was turned away before its client had an entry;
// its String is the reason label of uproxy_udp_dropped_datagrams_total, one of
// a fixed few.
type Drop uint8

const (
	// NotDropped is every other record's.
	NotDropped Drop = iota
	// DropClientTableFull: the client table is full (ErrTooManyClients).
	DropClientTableFull
	// DropNoSocket: the node is short of descriptors or memory for the
	// client's socket to its endpoint.
	DropNoSocket
	// DropNoLocalPort: no local port is left toward the endpoint.
	DropNoLocalPort
	// DropNoEndpoint: no endpoint could be picked.
	DropNoEndpoint
	// NumDrops counts the values above.
	NumDrops
)

var dropNames = [NumDrops]string{"", "client_table_full", "no_socket", "no_local_port", "no_endpoint"}

func (d Drop) String() string {
	if d < NumDrops {
		return dropNames[d]
	}
	return "unknown"
}

// Attempt is one dial of one endpoint for one connection.
type Attempt struct {
	Endpoint netip.AddrPort
	Start    time.Time
	Duration time.Duration
	// Err is nil for a successful dial.
	Err error
	// Source is the source address the dial used.
	Source Source
}

// Source is the source address of a dial to an endpoint, and why.
type Source uint8

const (
	// SourceNode is the node's address: the client's is not kept where
	// kube-proxy would masquerade the connection, or not at all.
	SourceNode Source = iota
	// SourceClient is the client's own address: a transparent dial, as
	// kube-proxy's DNAT keeps it.
	SourceClient
	// SourceHairpin is the node's address for a client that reached itself
	// through its Service: as kube-proxy masquerades such a connection, or the
	// endpoint would answer itself.
	SourceHairpin
	// SourceFallback is the node's address for a dial that wanted the
	// client's: the kernel refused the transparent socket (the error is logged
	// once per Service port).
	SourceFallback
)

func (s Source) String() string {
	switch s {
	case SourceClient:
		return "client"
	case SourceHairpin:
		return "hairpin"
	case SourceFallback:
		return "fallback"
	}
	return "node"
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
	// RetryRefused is set when the retry budget refused the connection an
	// attempt (a retry or a hedge); it then made no further attempt.
	RetryRefused bool
	// Dropped is set on the record of a UDP datagram turned away before its
	// client had an entry: no session, no attempt, Err says why.
	Dropped Drop
}

// Lost reports whether the attempt was abandoned as a hedge's loser.
func (a *Attempt) Lost() bool { return a.Err == ErrHedgeLost }

// IdledOut reports whether the proxy closed the connection because it was idle
// for its idle timeout.
func (c *Conn) IdledOut() bool { return c.Err != nil && errors.Is(c.Err, ErrIdle) }
