package affinity

import (
	"net/netip"
	"slices"
	"time"
)

// Passive outlier ejection: the proxy tells the Balancer how each dial went
// (DialFailed, DialSucceeded) and an endpoint that keeps failing is left out of
// Pick for a while, so that clients stop paying a dial timeout for a backend that
// is known to be down before its EndpointSlice says so. The Balancer decides
// alone; an EjectionObserver, if set, only hears of the decisions.
//
// The rules:
//   - Ejection.After consecutive failed dials eject an endpoint for Ejection.Base.
//   - When the period ends the endpoint is on probation: Pick may choose it again.
//     A failed dial on probation ejects it again at once, for twice the previous
//     period (up to Ejection.Max); a successful one re-admits it and forgets its
//     history.
//   - The last endpoint that is not ejected is never ejected: a Service with one
//     answering endpoint left is better served by retries than by nothing.
//   - Pick skips ejected endpoints while an endpoint that is neither ejected nor
//     already tried by the connection remains; otherwise ejection is ignored.

// Default ejection periods.
const (
	DefaultEjectionBase = time.Second
	DefaultEjectionMax  = 30 * time.Second
)

// Ejection configures passive outlier ejection. The zero value disables it.
type Ejection struct {
	// After is how many consecutive failed dials eject an endpoint; 0 disables
	// ejection.
	After int
	// Base is the length of a first ejection; 0 means DefaultEjectionBase.
	Base time.Duration
	// Max caps the doubling of repeated ejections; 0 means DefaultEjectionMax.
	Max time.Duration
}

func (e Ejection) period(previous int) time.Duration {
	base, limit := e.Base, e.Max
	if base <= 0 {
		base = DefaultEjectionBase
	}
	if limit <= 0 {
		limit = DefaultEjectionMax
	}
	d := base
	for range previous {
		if d >= limit {
			break
		}
		d *= 2
	}
	return min(d, limit)
}

// SetEjection sets the ejection policy. Turning ejection off re-admits every
// ejected endpoint.
func (b *Balancer) SetEjection(e Ejection) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.ejection = e
	if e.After <= 0 {
		for i := range b.eps {
			b.eps[i].ejections, b.eps[i].ejectedUntil = 0, time.Time{}
		}
		b.ejected = 0
	}
}

// Sibling returns a Balancer with no endpoints and b's scheduler, ejection
// policy and observer: the balancer of another address family of the same
// Service port, made when that family first has endpoints.
func (b *Balancer) Sibling() *Balancer {
	b.mu.Lock()
	defer b.mu.Unlock()
	return &Balancer{sched: b.sched, now: b.now, sweepAt: minSweep, ejection: b.ejection, observer: b.observer}
}

// An EjectionObserver is told of the ejections and re-admissions a Balancer
// decides, to record them (metrics, events, logs); ejection itself does not depend
// on it. Its methods are called after the Balancer's lock is released, on the
// goroutine or event loop that reported the dial, and must be cheap and safe for
// concurrent use.
type EjectionObserver interface {
	// Ejected says a failed dial of ep, with err, ejected it for period.
	Ejected(ep netip.AddrPort, period time.Duration, err error)
	// Readmitted says a successful dial re-admitted ep, which was ejected or on
	// probation.
	Readmitted(ep netip.AddrPort)
}

// SetEjectionObserver sets who is told of ejections and re-admissions; nil (the
// default) tells nobody.
func (b *Balancer) SetEjectionObserver(o EjectionObserver) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.observer = o
}

// DialFailed records a failed dial of ep, which may eject it (see the rules
// above); err is the dial's error, passed on to the EjectionObserver. Unknown
// endpoints are ignored.
func (b *Balancer) DialFailed(ep netip.AddrPort, err error) {
	b.mu.Lock()
	d := b.failed(ep)
	o := b.observer
	b.mu.Unlock()
	if d > 0 && o != nil {
		o.Ejected(ep, d, err)
	}
}

// DialSucceeded records a successful dial of ep: its failure count and ejection
// history are cleared, which re-admits it if it was ejected or on probation.
// Unknown endpoints are ignored.
func (b *Balancer) DialSucceeded(ep netip.AddrPort) {
	b.mu.Lock()
	readmitted := b.succeeded(ep)
	o := b.observer
	b.mu.Unlock()
	if readmitted && o != nil {
		o.Readmitted(ep)
	}
}

// failed counts a failed dial of ep and returns how long ep is now ejected for (0
// when this failure did not eject it). b.mu must be held.
func (b *Balancer) failed(ep netip.AddrPort) time.Duration {
	i, ok := position(b.eps, b.index, keyOfEndpoint(ep))
	if !ok {
		return 0
	}
	e := &b.eps[i]
	e.failures++
	if b.ejection.After <= 0 {
		return 0
	}
	now := b.now()
	if e.ejectedUntil.After(now) {
		return 0 // a dial begun before the ejection
	}
	if e.ejections == 0 && e.failures < b.ejection.After {
		return 0
	}
	if !b.otherAvailable(int(i), now) {
		return 0
	}
	d := b.ejection.period(e.ejections)
	if e.ejectedUntil.IsZero() {
		b.ejected++
	}
	e.ejectedUntil = now.Add(d)
	e.ejections++
	b.counters.Ejections++
	return d
}

// succeeded clears ep's failures and ejection history and reports whether ep was
// ejected or on probation, that is, whether this success re-admitted it. b.mu
// must be held.
func (b *Balancer) succeeded(ep netip.AddrPort) (readmitted bool) {
	i, ok := position(b.eps, b.index, keyOfEndpoint(ep))
	if !ok {
		return false
	}
	e := &b.eps[i]
	e.failures = 0
	readmitted = e.ejections > 0
	e.ejections = 0
	if !e.ejectedUntil.IsZero() {
		e.ejectedUntil = time.Time{}
		b.ejected--
	}
	if readmitted {
		b.counters.Readmissions++
	}
	return readmitted
}

// otherAvailable reports whether an endpoint other than eps[i] is not ejected at now.
func (b *Balancer) otherAvailable(i int, now time.Time) bool {
	for j := range b.eps {
		if j != i && !b.eps[j].ejectedUntil.After(now) {
			return true
		}
	}
	return false
}

// countEjected returns how many endpoints are ejected at now.
func (b *Balancer) countEjected(now time.Time) int {
	n := 0
	for j := range b.eps {
		if b.eps[j].ejectedUntil.After(now) {
			n++
		}
	}
	return n
}

// expireEjections clears the ejection periods that ended by now (the endpoints
// stay on probation: their ejections count is kept).
func (b *Balancer) expireEjections(now time.Time) {
	for j := range b.eps {
		if e := &b.eps[j]; !e.ejectedUntil.IsZero() && !e.ejectedUntil.After(now) {
			e.ejectedUntil = time.Time{}
			b.ejected--
		}
	}
}

// ejectFilter tells the schedulers whether to leave ejected endpoints out. The
// zero value leaves nothing out.
type ejectFilter struct {
	on  bool
	now time.Time
}

func (f ejectFilter) skips(e *backend) bool { return f.on && e.ejectedUntil.After(f.now) }

// ejectFilter returns the filter for a pick at now: on when some endpoint is
// ejected and another is neither ejected nor in tried, so the pick still finds one.
func (b *Balancer) ejectFilter(tried []netip.AddrPort, now time.Time) ejectFilter {
	any, avail := false, false
	for j := range b.eps {
		e := &b.eps[j]
		if e.ejectedUntil.After(now) {
			any = true
		} else if len(tried) == 0 || !slices.Contains(tried, e.addr) {
			avail = true
		}
	}
	return ejectFilter{on: any && avail, now: now}
}
