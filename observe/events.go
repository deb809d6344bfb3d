package observe

import (
	"net/netip"
	"sync"
	"time"

	"github.com/uproxy/uproxy/record"
)

// Event kinds.
const (
	// KindConnection is the record of one proxied TCP connection or UDP session.
	KindConnection = "connection"
	// KindEjection says an endpoint was ejected by outlier detection.
	KindEjection = "ejection"
	// KindReadmission says an ejected endpoint answered again.
	KindReadmission = "readmission"
	// KindHandover is a handover between this uproxy and another: taken
	// from a predecessor, or refused or abandoned with a successor.
	KindHandover = "handover"
)

// Reasons of connection events.
const (
	// ReasonIdle: the idle timeout closed the connection.
	ReasonIdle = "idle"
	// ReasonBudget: the retry budget refused the connection a retry or a hedge.
	ReasonBudget = "budget"
)

// Connection outcomes.
const (
	OutcomeSuccess = "success" // served by its first attempt
	OutcomeRetried = "retried" // served after failed attempts
	OutcomeFailed  = "failed"  // no endpoint answered (or there was none)
)

// Handover outcomes (KindHandover), as uproxy_handover_total's results.
const (
	HandoverDoneOutcome      = "done"
	HandoverRefusedOutcome   = "refused"
	HandoverAbandonedOutcome = "abandoned"
)

// Event is one entry of /debug/events: a connection with every attempt it made,
// an endpoint's ejection or re-admission, or a handover between uproxies.
type Event struct {
	// ID increases by one per event recorded; clients poll with ?since=ID.
	ID       uint64    `json:"id"`
	Kind     string    `json:"kind"`
	Time     time.Time `json:"time"`
	Service  string    `json:"service"`
	Protocol string    `json:"protocol"`
	Client   string    `json:"client,omitempty"`
	// Endpoint served the connection (empty when it failed), or is the endpoint
	// ejected or re-admitted.
	Endpoint string         `json:"endpoint,omitempty"`
	Outcome  string         `json:"outcome,omitempty"`
	Attempts []EventAttempt `json:"attempts,omitempty"`
	BytesIn  int64          `json:"bytesIn"`
	BytesOut int64          `json:"bytesOut"`
	// Duration is the connection's lifetime, or the ejection's period.
	Duration   string  `json:"duration"`
	DurationMs float64 `json:"durationMs"`
	Error      string  `json:"error,omitempty"`
	// Reason explains an ejection or re-admission, why the proxy closed a
	// connection (ReasonIdle), that the retry budget refused it an attempt
	// (ReasonBudget), or why a UDP datagram was turned away before its client
	// had a session (a record.Drop: client_table_full, no_socket, ...).
	Reason string `json:"reason,omitempty"`
}

// EventAttempt is one dial of a connection Event.
type EventAttempt struct {
	Endpoint string `json:"endpoint"`
	// Source is the address the dial went from (record.Source): client,
	// node, hairpin or fallback.
	Source     string  `json:"source"`
	Result     string  `json:"result"`
	Duration   string  `json:"duration"`
	DurationMs float64 `json:"durationMs"`
	Error      string  `json:"error,omitempty"`
}

// slot holds an event as stored: plain values and the errors the socket made
// (immutable, so keeping them is safe), formatted only when read.
type slot struct {
	id       uint64
	kind     string
	time     time.Time
	service  string
	protocol string
	client   netip.AddrPort
	endpoint netip.AddrPort
	attempts []record.Attempt // reused from slot to slot: no allocation per event
	bytesIn  int64
	bytesOut int64
	duration time.Duration
	err      error
	reason   string
	outcome  string // a handover's (a connection's comes from endpoint and attempts)
}

// Events is a bounded ring of the most recent events. Every connection is
// recorded, successful ones too, so the ring shows what traffic looks like and
// not only what went wrong; recording copies a few words into a preallocated
// slot under a short lock and allocates nothing once each slot has held a
// connection with as many attempts.
type Events struct {
	// mu guards everything below. ring has a fixed length; next is the slot the
	// next event takes (the oldest once the ring is full); n counts events ever
	// recorded, so the ring holds min(n, len(ring)) of them.
	mu   sync.Mutex
	ring []slot
	next int
	n    uint64
}

// DefaultEvents is the ring size when NewEvents is given n <= 0.
const DefaultEvents = 256

// NewEvents returns a ring keeping the last n events (n <= 0: DefaultEvents).
func NewEvents(n int) *Events {
	if n <= 0 {
		n = DefaultEvents
	}
	e := &Events{ring: make([]slot, n)}
	// One backing array gives every slot room for four attempts (the default
	// number of dial timeouts), so slots need not grow one by one.
	backing := make([]record.Attempt, 4*n)
	for i := range e.ring {
		e.ring[i].attempts = backing[4*i : 4*i : 4*i+4]
	}
	return e
}

// Add records the connection c (it keeps no reference to c).
func (e *Events) Add(c *record.Conn) {
	reason := ""
	switch {
	case c.IdledOut():
		reason = ReasonIdle
	case c.RetryRefused:
		reason = ReasonBudget
	case c.Dropped != record.NotDropped:
		reason = c.Dropped.String()
	}
	e.mu.Lock()
	r := e.take()
	r.kind = KindConnection
	r.time = c.Start
	r.service, r.protocol = c.Service, c.Protocol
	r.client, r.endpoint = c.Client, c.Endpoint
	r.attempts = append(r.attempts[:0], c.Attempts...)
	r.bytesIn, r.bytesOut = c.BytesIn, c.BytesOut
	r.duration, r.err, r.reason, r.outcome = c.Duration, c.Err, reason, ""
	e.mu.Unlock()
}

// AddEndpoint records an ejection or re-admission (kind) of ep.
func (e *Events) AddEndpoint(kind, service, protocol string, ep netip.AddrPort, d time.Duration, reason string) {
	e.mu.Lock()
	r := e.take()
	r.kind = kind
	r.time = time.Now()
	r.service, r.protocol = service, protocol
	r.client, r.endpoint = netip.AddrPort{}, ep
	r.attempts = r.attempts[:0]
	r.bytesIn, r.bytesOut = 0, 0
	r.duration, r.err, r.reason, r.outcome = d, nil, reason, ""
	e.mu.Unlock()
}

// AddHandover records a handover (KindHandover): outcome is done, refused
// or abandoned, reason what happened in words, d how long it took. e may be
// nil (--events 0).
func (e *Events) AddHandover(outcome, reason string, d time.Duration) {
	if e == nil {
		return
	}
	e.mu.Lock()
	r := e.take()
	r.kind = KindHandover
	r.time = time.Now()
	r.service, r.protocol = "", ""
	r.client, r.endpoint = netip.AddrPort{}, netip.AddrPort{}
	r.attempts = r.attempts[:0]
	r.bytesIn, r.bytesOut = 0, 0
	r.duration, r.err, r.reason, r.outcome = d, nil, reason, outcome
	e.mu.Unlock()
}

// take returns the slot of a new event, with its id set. e.mu is held.
func (e *Events) take() *slot {
	e.n++
	r := &e.ring[e.next]
	r.id = e.n
	if e.next++; e.next == len(e.ring) {
		e.next = 0
	}
	return r
}

// Query selects events. The zero Query selects every event.
type Query struct {
	Service string // "" for every Service port
	Kind    string // "" for every kind
	Outcome string // "" for every outcome (connections only have one)
	Since   uint64 // only events with a greater ID
	Limit   int    // at most this many (<= 0: no limit)
}

func (q *Query) match(r *slot) bool {
	return (q.Service == "" || r.service == q.Service) &&
		(q.Kind == "" || r.kind == q.Kind) &&
		(q.Outcome == "" || (r.kind == KindConnection && outcome(r.endpoint, len(r.attempts)) == q.Outcome) ||
			(r.kind == KindHandover && r.outcome == q.Outcome)) &&
		r.id > q.Since
}

// Query returns the events q selects, newest first.
func (e *Events) Query(q Query) []Event {
	e.mu.Lock()
	defer e.mu.Unlock()
	held := len(e.ring)
	if e.n < uint64(held) {
		held = int(e.n)
	}
	out := []Event{}
	for k := 1; k <= held && (q.Limit <= 0 || len(out) < q.Limit); k++ {
		i := e.next - k
		if i < 0 {
			i += len(e.ring)
		}
		r := &e.ring[i]
		if r.id <= q.Since {
			break // older ones all have smaller ids
		}
		if q.match(r) {
			out = append(out, r.event())
		}
	}
	return out
}

// Recent returns up to n events of service ("" for all), newest first.
func (e *Events) Recent(service string, n int) []Event {
	return e.Query(Query{Service: service, Limit: n})
}

func (r *slot) event() Event {
	ev := Event{
		ID:         r.id,
		Kind:       r.kind,
		Time:       r.time,
		Service:    r.service,
		Protocol:   r.protocol,
		BytesIn:    r.bytesIn,
		BytesOut:   r.bytesOut,
		Duration:   r.duration.String(),
		DurationMs: ms(r.duration),
		Reason:     r.reason,
	}
	if r.client.IsValid() {
		ev.Client = unmap(r.client).String()
	}
	if r.endpoint.IsValid() {
		ev.Endpoint = r.endpoint.String()
	}
	if r.err != nil {
		ev.Error = r.err.Error()
	}
	if r.kind == KindHandover {
		ev.Outcome = r.outcome
	}
	if r.kind == KindConnection {
		ev.Outcome = outcome(r.endpoint, len(r.attempts))
		ev.Attempts = make([]EventAttempt, len(r.attempts))
		for i, a := range r.attempts {
			ev.Attempts[i] = EventAttempt{
				Endpoint:   a.Endpoint.String(),
				Source:     a.Source.String(),
				Result:     resultNames[dialResult(a.Err)],
				Duration:   a.Duration.String(),
				DurationMs: ms(a.Duration),
			}
			if a.Err != nil {
				ev.Attempts[i].Error = a.Err.Error()
			}
		}
	}
	return ev
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func outcome(served netip.AddrPort, attempts int) string {
	switch {
	case !served.IsValid():
		return OutcomeFailed
	case attempts > 1:
		return OutcomeRetried
	}
	return OutcomeSuccess
}

func outcomeOf(c *record.Conn) string { return outcome(c.Endpoint, len(c.Attempts)) }

// unmap shows an IPv4 client of a dual-stack listener as IPv4.
func unmap(ap netip.AddrPort) netip.AddrPort { return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()) }
