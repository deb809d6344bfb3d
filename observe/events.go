package observe

import (
	"sync"
	"time"

	"github.com/uproxy/uproxy/socket"
)

// Event is the record of one connection that needed more than one attempt or
// failed: the retries users come to see.
type Event struct {
	Time     time.Time      `json:"time"`
	Service  string         `json:"service"`
	Protocol string         `json:"protocol"`
	Client   string         `json:"client"`
	Endpoint string         `json:"endpoint,omitempty"`
	Attempts []EventAttempt `json:"attempts"`
	BytesIn  int64          `json:"bytesIn"`
	BytesOut int64          `json:"bytesOut"`
	Duration string         `json:"duration"`
	Error    string         `json:"error,omitempty"`
}

// EventAttempt is one dial of an Event.
type EventAttempt struct {
	Endpoint string `json:"endpoint"`
	Result   string `json:"result"`
	Duration string `json:"duration"`
	Error    string `json:"error,omitempty"`
}

// Events is a bounded ring of the most recent Events. Connections served by their
// first attempt are not recorded: they are the common case and cost nothing here.
type Events struct {
	mu   sync.Mutex
	ring []Event // len == cap once full; next is the oldest
	next int
	size int
}

// NewEvents returns a ring keeping the last n events (n <= 0: 256).
func NewEvents(n int) *Events {
	if n <= 0 {
		n = 256
	}
	return &Events{size: n}
}

// Add records c if it was retried or failed.
func (e *Events) Add(c *socket.Conn) {
	if len(c.Attempts) <= 1 && c.Endpoint.IsValid() {
		return
	}
	ev := Event{
		Time:     c.Start,
		Service:  c.Service,
		Protocol: c.Protocol,
		Client:   c.Client.String(),
		BytesIn:  c.BytesIn,
		BytesOut: c.BytesOut,
		Duration: c.Duration.String(),
		Attempts: make([]EventAttempt, len(c.Attempts)),
	}
	if c.Endpoint.IsValid() {
		ev.Endpoint = c.Endpoint.String()
	}
	if c.Err != nil {
		ev.Error = c.Err.Error()
	}
	for i, a := range c.Attempts {
		ea := EventAttempt{Endpoint: a.Endpoint.String(), Result: DialResult(a.Err), Duration: a.Duration.String()}
		if a.Err != nil {
			ea.Error = a.Err.Error()
		}
		ev.Attempts[i] = ea
	}
	e.mu.Lock()
	if len(e.ring) < e.size {
		e.ring = append(e.ring, ev)
	} else {
		e.ring[e.next] = ev
		e.next = (e.next + 1) % e.size
	}
	e.mu.Unlock()
}

// Recent returns up to n events, newest first, for service ("" for all).
func (e *Events) Recent(service string, n int) []Event {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []Event
	for i := len(e.ring) - 1; i >= 0 && len(out) < n; i-- {
		ev := e.ring[(e.next+i)%len(e.ring)]
		if service == "" || ev.Service == service {
			out = append(out, ev)
		}
	}
	return out
}
