// Package affinity is the userspace mode's balancer: it chooses the backend
// endpoint for each new connection to a Service port (IPVS's scheduler
// semantics), keeps Kubernetes' ClientIP session affinity, and ejects
// endpoints whose dials keep failing.
//
// One Balancer serves one Service port; the proxier updates it on every sync and the
// proxy sockets pick through it:
//
//	b, err := affinity.NewBalancer("lc")
//	...
//	b.Update(endpoints, clusterIP, port.AffinityClientIP, port.AffinityTimeout)
//	ep, err := b.Pick(client, tried) // tried: endpoints this connection already failed on
//	...
//	b.DialSucceeded(ep) // or b.DialFailed(ep, err): how the dial went, for outlier ejection
//	...
//	b.Release(ep) // when the connection ends
//
// The Balancer is the socket layer's Picker. It decides outlier ejection from the
// dial reports alone; SetEjectionObserver lets metrics hear of the decisions.
package affinity

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/uproxy/uproxy/service"
)

// ErrNoEndpoints is returned by Pick and Explain when the Service port has no
// endpoint. Besides errors.Is, it can be recognised by its NoEndpoints method, so
// that code classifying errors (metrics) need not link the balancer.
var ErrNoEndpoints error = noEndpointsError{}

type noEndpointsError struct{}

func (noEndpointsError) Error() string     { return "no usable endpoints" }
func (noEndpointsError) NoEndpoints() bool { return true }

// minSweep is the affinity table size below which Pick never sweeps: sweeping a small
// table would cost more than the memory it frees.
const minSweep = 1024

// MaxAffinityEntries bounds a Balancer's ClientIP affinity table (one Service
// port, one address family): each distinct client address adds an entry that
// lives for the affinity timeout (3 hours by default), and with IPv6 one client
// can use any number of addresses. A new client that finds the table full of
// live entries evicts the least recently used ones (a sixteenth of the table
// at a time, so the cost is amortised), counted in Counters.AffinityEvicted;
// their clients are scheduled afresh at their next connection.
const MaxAffinityEntries = 65536

// AffinitySample is how many affinity entries State lists at most: the most
// recently used. The count of all is AffinityEntries.
const AffinitySample = 100

// A Balancer picks endpoints for one Service port. It is safe for concurrent use; the
// zero value is not usable, call NewBalancer.
//
// Expired affinity entries are removed lazily: an entry found expired by Pick is
// rewritten in place, Update drops every expired entry, and when a Pick is about to
// add a client to a table that has reached sweepAt entries, it sweeps the whole table
// first and sets sweepAt to twice the entries that survived (at least minSweep). The
// sweeps cost amortised O(1) per new client, and the table never holds more than
// max(minSweep, twice the entries that were live at the previous sweep).
// Sweep is exported for callers that want to free memory on their own schedule.
type Balancer struct {
	now func() time.Time // replaced only by tests, before first use

	mu sync.Mutex
	// sched is the scheduler; SetScheduler changes it.
	sched scheduler
	// eps are the endpoints in the order Update gave them; index maps each address
	// (as endpointKey) to its position, when there are indexMin or more (see
	// position). Addresses are unique.
	eps   []backend
	index map[endpointKey]int32
	// next is the index after the last endpoint chosen by the scheduler (not by
	// affinity): where rr resumes and where lc, sed and nq start breaking ties.
	// 0 <= next < len(eps) whenever eps is not empty.
	next int
	// buckets maps hash buckets to eps indexes for sh and dh (nil for the others);
	// len(buckets) == 1<<bucketBits and every endpoint owns at least one bucket.
	buckets    []int32
	bucketBits uint
	dstHash    uint32

	affinity bool
	timeout  time.Duration
	// entries is the ClientIP affinity table and clients maps each entry's client
	// (as clientKey) to its position in entries, so that a hit costs one map lookup
	// and slides LastUsed in place. Every entry's ep indexes eps (Update remaps
	// them). Both are empty while affinity is off.
	clients map[clientKey]int32
	entries []entry
	sweepAt int

	counters Counters

	// ejection is the passive outlier ejection policy (see DialFailed); After 0: off.
	ejection Ejection
	// observer, if not nil, is told of every ejection and re-admission.
	observer EjectionObserver
	// ejected counts the endpoints whose ejectedUntil is set, whether or not that
	// time has passed: Pick reads the clock for ejection only while it is > 0, and
	// clears the periods that have passed.
	ejected int
}

type backend struct {
	addr   netip.AddrPort
	active int
	// weight is always 1 today (EndpointSlices carry no weights); sed honours it.
	weight int

	// failures counts consecutive failed dials (reset by a success).
	failures int
	// ejections counts ejections since the last success: it doubles the next
	// period, and an endpoint with ejections > 0 is on probation (see DialFailed).
	ejections int
	// ejectedUntil is when the current ejection ends; zero when not ejected.
	ejectedUntil time.Time
}

type entry struct {
	client   netip.Addr
	ep       int32
	lastUsed time.Time
}

// clientKey and endpointKey are the map keys for addresses: plain byte arrays hash
// in one step, where netip types hash field by field. IPv4 and its IPv4-mapped IPv6
// form share a key, which is what the proxy wants (one client is one client,
// whichever socket family it came through); zones are ignored.
type (
	clientKey   [16]byte
	endpointKey [18]byte
)

func keyOfClient(a netip.Addr) clientKey { return a.As16() }

// indexMin is the fewest endpoints a Balancer keeps an index of: below it a
// walk over them finds one as fast, and a map would cost more memory than
// the endpoints themselves (most Service ports have a few).
const indexMin = 9

// position returns the position in eps of the endpoint of key k, through
// index where there is one.
func position(eps []backend, index map[endpointKey]int32, k endpointKey) (int32, bool) {
	if index != nil {
		i, ok := index[k]
		return i, ok
	}
	for i := range eps {
		if keyOfEndpoint(eps[i].addr) == k {
			return int32(i), true
		}
	}
	return 0, false
}

func keyOfEndpoint(ep netip.AddrPort) endpointKey {
	var k endpointKey
	a := ep.Addr().As16()
	copy(k[:], a[:])
	k[16], k[17] = byte(ep.Port()>>8), byte(ep.Port())
	return k
}

// NewBalancer returns a Balancer with no endpoints using the named scheduler (""
// means DefaultScheduler).
func NewBalancer(scheduler string) (*Balancer, error) {
	s, err := parseScheduler(scheduler)
	if err != nil {
		return nil, err
	}
	// index and clients stay nil until they have something to hold: most
	// Service ports have no ClientIP affinity, and a dual-stack node's
	// balancer of the family a Service has no endpoints in holds none.
	return &Balancer{
		sched:   s,
		now:     time.Now,
		sweepAt: minSweep,
	}, nil
}

// Scheduler returns the name of b's scheduler.
func (b *Balancer) Scheduler() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.sched.String()
}

// SetScheduler switches b to the named scheduler ("" means DefaultScheduler),
// keeping its endpoints, their active counts and outlier state, and the
// affinity table: a Service whose scheduler annotation changed goes on serving.
func (b *Balancer) SetScheduler(name string) error {
	s, err := parseScheduler(name)
	if err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if s == b.sched {
		return nil
	}
	b.sched = s
	b.buckets, b.bucketBits = nil, 0
	if s.hashed() {
		b.buckets, b.bucketBits = buildBuckets(b.eps)
	}
	return nil
}

// Update replaces the endpoint set and the affinity settings. dst is the Service's
// first virtual IP, hashed by dh (it may be the zero Addr). A timeout <= 0 means
// service.DefaultAffinityTimeout.
//
// Endpoints that remain keep their active counts and affinity entries; entries of
// removed endpoints are dropped, as are expired entries and, when clientIPAffinity is
// false, all entries. A changed timeout applies to existing entries at once, since
// expiry is judged against the current timeout. Duplicate and invalid addresses in
// endpoints are ignored.
func (b *Balancer) Update(endpoints []netip.AddrPort, dst netip.Addr, clientIPAffinity bool, timeout time.Duration) {
	if timeout <= 0 {
		timeout = service.DefaultAffinityTimeout
	}
	b.mu.Lock()
	defer b.mu.Unlock()

	var eps []backend
	var index map[endpointKey]int32
	if len(endpoints) > 0 {
		eps = make([]backend, 0, len(endpoints))
	}
	if len(endpoints) >= indexMin {
		index = make(map[endpointKey]int32, len(endpoints))
	}
	for _, ep := range endpoints {
		if !ep.IsValid() {
			continue
		}
		k := keyOfEndpoint(ep)
		if _, dup := position(eps, index, k); dup {
			continue
		}
		be := backend{addr: ep, weight: 1}
		if i, ok := position(b.eps, b.index, k); ok {
			// Ejection state survives syncs: an endpoint that keeps failing stays
			// known as such while its EndpointSlice still says ready.
			old := &b.eps[i]
			be.active, be.failures, be.ejections, be.ejectedUntil = old.active, old.failures, old.ejections, old.ejectedUntil
		}
		if index != nil {
			index[k] = int32(len(eps))
		}
		eps = append(eps, be)
	}
	old := b.eps
	b.eps, b.index = eps, index
	b.ejected = 0
	for i := range eps {
		if !eps[i].ejectedUntil.IsZero() {
			b.ejected++
		}
	}
	// Keep the rotation where it was rather than restarting it: with frequent
	// updates a restart would favour the first endpoints.
	if b.next >= len(eps) {
		b.next = 0
	}
	b.buckets, b.bucketBits = nil, 0
	if b.sched.hashed() {
		b.buckets, b.bucketBits = buildBuckets(eps)
	}
	b.dstHash = hashAddr(dst.Unmap())

	b.affinity, b.timeout = clientIPAffinity, timeout
	if !clientIPAffinity {
		if len(b.entries) > 0 {
			b.clients, b.entries = nil, nil
		}
		b.sweepAt = minSweep
		return
	}
	now := b.now()
	b.compact(func(e *entry) bool {
		i, ok := position(eps, index, keyOfEndpoint(old[e.ep].addr))
		if !ok {
			return false
		}
		if !b.live(e.lastUsed, now) {
			b.counters.AffinityExpired++
			return false
		}
		e.ep = i
		return true
	})
}

// live reports whether an entry last used at lastUsed is still within the timeout.
func (b *Balancer) live(lastUsed, now time.Time) bool {
	return now.Sub(lastUsed) < b.timeout
}

// Pick returns the endpoint for a new connection from client, avoiding those in tried
// unless every endpoint has been tried (then it chooses among all again). With ClientIP
// affinity, a client whose entry is live, names a current endpoint and is not in
// tried gets that endpoint again and the entry's LastUsed slides to now; otherwise
// the scheduler chooses and the entry is rewritten. The endpoint counts as active
// until Release. Pick returns ErrNoEndpoints when there is no endpoint.
//
// The choice itself is decide's, which Explain and State call too: what they
// say a client gets is what Pick gives it.
func (b *Balancer) Pick(client netip.Addr, tried []netip.AddrPort) (netip.AddrPort, error) {
	client = client.Unmap()
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.eps) == 0 {
		return netip.AddrPort{}, ErrNoEndpoints
	}
	var now time.Time
	if b.ejected > 0 || b.affinity {
		now = b.now()
	}
	if b.ejected > 0 {
		b.expireEjections(now)
	}
	d := b.decide(client, tried, now, false)
	if d.sticky {
		b.entries[d.pos].lastUsed = now
		b.eps[d.i].active++
		b.counters.AffinityHits++
		return b.eps[d.i].addr, nil
	}
	if b.affinity {
		if d.expired {
			b.counters.AffinityExpired++
		}
		b.counters.AffinityMisses++
		if !d.found && len(b.entries) >= b.sweepAt {
			b.sweepLocked(now) // moves entries, but client has none
		}
		if !d.found && len(b.entries) >= MaxAffinityEntries {
			b.evictLocked() // likewise
		}
	}
	i := d.i
	b.next = i + 1
	if b.next == len(b.eps) {
		b.next = 0
	}
	b.eps[i].active++
	if b.affinity {
		e := entry{client: client, ep: int32(i), lastUsed: now}
		if d.found {
			b.entries[d.pos] = e
		} else {
			if b.clients == nil {
				b.clients = map[clientKey]int32{}
			}
			b.clients[keyOfClient(client)] = int32(len(b.entries))
			b.entries = append(b.entries, e)
		}
	}
	return b.eps[i].addr, nil
}

// decision is the choice of a Pick, worked out without changing anything.
type decision struct {
	// i is the chosen endpoint's index in eps.
	i int
	// sticky: the client's affinity entry chose it.
	sticky bool
	// found: the client has an affinity entry, at pos in entries; expired:
	// that entry is past its timeout; ejectedEntry: it names an ejected
	// endpoint, so the scheduler chose instead.
	found, expired, ejectedEntry bool
	pos                          int32
	// skip is the ejection filter the scheduler ran with.
	skip ejectFilter
}

// decide works out what Pick does for client at now, having tried tried: Pick
// carries the decision out, Explain and State word it, so that a view of the
// next choice cannot differ from the choice. newClient asks for a client
// without an affinity entry (client is then not looked up). It changes no
// state. b.mu must be held and eps not empty; now must be set when endpoints
// are ejected or affinity is on.
func (b *Balancer) decide(client netip.Addr, tried []netip.AddrPort, now time.Time, newClient bool) decision {
	if b.allTried(tried) {
		tried = nil
	}
	var d decision
	if b.ejected > 0 {
		d.skip = b.ejectFilter(tried, now)
	}
	if b.affinity && !newClient {
		d.pos, d.found = b.clients[keyOfClient(client)]
		if d.found {
			e := &b.entries[d.pos]
			ep := &b.eps[e.ep]
			switch {
			case !b.live(e.lastUsed, now):
				d.expired = true
			case slices.Contains(tried, ep.addr):
			case d.skip.skips(ep):
				d.ejectedEntry = true
			default:
				d.i, d.sticky = int(e.ep), true
				return d
			}
		}
	}
	d.i = b.schedule(client, tried, d.skip)
	return d
}

// allTried reports whether tried covers every endpoint. It cannot when it is shorter
// than the set (the common case, answered without a scan).
func (b *Balancer) allTried(tried []netip.AddrPort) bool {
	if len(tried) < len(b.eps) {
		return false
	}
	for i := range b.eps {
		if !slices.Contains(tried, b.eps[i].addr) {
			return false
		}
	}
	return true
}

// Release ends one activity begun by Pick on ep. Releasing an endpoint that has since
// left the set does nothing; an endpoint that left and came back restarted its count
// at zero, so the count is never taken below zero.
func (b *Balancer) Release(ep netip.AddrPort) {
	k := keyOfEndpoint(ep)
	b.mu.Lock()
	defer b.mu.Unlock()
	if i, ok := position(b.eps, b.index, k); ok && b.eps[i].active > 0 {
		b.eps[i].active--
	}
}

// Acquire counts one more activity on ep without a Pick: a connection that
// came already connected to ep (one resumed from another process), which
// Release ends as it does a Pick's. An endpoint not in the set is not counted,
// as Release of it does nothing.
func (b *Balancer) Acquire(ep netip.AddrPort) {
	k := keyOfEndpoint(ep)
	b.mu.Lock()
	defer b.mu.Unlock()
	if i, ok := position(b.eps, b.index, k); ok {
		b.eps[i].active++
	}
}

// ResetAffinity forgets client's sticky endpoint; the proxy calls it after a failed
// dial so that the client's next connection is scheduled afresh.
func (b *Balancer) ResetAffinity(client netip.Addr) {
	k := keyOfClient(client)
	b.mu.Lock()
	defer b.mu.Unlock()
	pos, ok := b.clients[k]
	if !ok {
		return
	}
	// Move the last entry into the hole so entries stays dense.
	last := int32(len(b.entries) - 1)
	if pos != last {
		b.entries[pos] = b.entries[last]
		b.clients[keyOfClient(b.entries[pos].client)] = pos
	}
	b.entries[last] = entry{}
	b.entries = b.entries[:last]
	delete(b.clients, k)
	b.counters.AffinityResets++
}

// Sweep removes the affinity entries expired at now and returns how many it removed.
func (b *Balancer) Sweep(now time.Time) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.sweepLocked(now)
}

func (b *Balancer) sweepLocked(now time.Time) int {
	removed := b.compact(func(e *entry) bool { return b.live(e.lastUsed, now) })
	b.counters.AffinityExpired += uint64(removed)
	b.sweepAt = max(minSweep, 2*len(b.entries))
	return removed
}

// evictLocked removes the least recently used entries, a sixteenth of the
// bound, to make room in a table full of live ones. b.mu must be held.
func (b *Balancer) evictLocked() {
	keep := MaxAffinityEntries - MaxAffinityEntries/16
	if len(b.entries) <= keep {
		return
	}
	// The cutoff is the lastUsed of the newest entry to go: every entry used
	// at or before it goes (ties may take a few more).
	used := make([]int64, len(b.entries))
	for i := range b.entries {
		used[i] = b.entries[i].lastUsed.UnixNano()
	}
	slices.Sort(used)
	cutoff := used[len(used)-keep-1]
	b.counters.AffinityEvicted += uint64(b.compact(func(e *entry) bool { return e.lastUsed.UnixNano() > cutoff }))
}

// compact keeps the entries for which keep returns true (keep may modify them), in
// order, and returns how many it dropped.
func (b *Balancer) compact(keep func(*entry) bool) int {
	before := len(b.entries)
	w := 0
	for r := range b.entries {
		e := &b.entries[r]
		if !keep(e) {
			delete(b.clients, keyOfClient(e.client))
			continue
		}
		if w != r {
			b.entries[w] = *e
			b.clients[keyOfClient(e.client)] = int32(w)
		}
		w++
	}
	clear(b.entries[w:])
	b.entries = b.entries[:w]
	// Neither maps nor slices give memory back when they shrink; rebuild a table
	// that emptied out so a burst of clients does not pin its memory for the life
	// of the Service.
	if before > minSweep && w < before/4 {
		b.entries = slices.Clone(b.entries)
		b.clients = make(map[clientKey]int32, w)
		for i, e := range b.entries {
			b.clients[keyOfClient(e.client)] = int32(i)
		}
	}
	return before - w
}

// Peek returns the endpoint Pick would return for client with nothing tried, and
// whether it would come from an affinity entry, without changing any state (no active
// count, no rotation, no entry, no counter). It is for explaining, not for dialing.
func (b *Balancer) Peek(client netip.Addr) (ep netip.AddrPort, sticky bool, err error) {
	c, err := b.Explain(client)
	return c.Endpoint, c.Sticky, err
}

// Choice is the endpoint a client would get next, and why.
type Choice struct {
	Endpoint netip.AddrPort `json:"endpoint"`
	// Sticky is true when the choice comes from the client's affinity entry.
	Sticky bool `json:"sticky"`
	// Reason says in words why this endpoint: the affinity entry, or the
	// scheduler's rule, and which endpoints were skipped as ejected.
	Reason string `json:"reason"`
}

// Explain is Peek with the reason: the choice Pick would make for client with
// nothing tried, changing no state.
func (b *Balancer) Explain(client netip.Addr) (Choice, error) {
	client = client.Unmap()
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.eps) == 0 {
		return Choice{}, ErrNoEndpoints
	}
	now := b.now()
	return b.word(b.decide(client, nil, now, false), client, now), nil
}

// word says why d chose its endpoint for client (the zero Addr: a new client).
func (b *Balancer) word(d decision, client netip.Addr, now time.Time) Choice {
	ep := &b.eps[d.i]
	var note string
	if b.affinity && client.IsValid() {
		switch {
		case d.sticky:
			lastUsed := b.entries[d.pos].lastUsed
			left := b.timeout - now.Sub(lastUsed)
			return Choice{Endpoint: ep.addr, Sticky: true, Reason: fmt.Sprintf(
				"ClientIP affinity: %s is pinned to %s (last used %s ago, entry expires in %s unless used again)",
				client, ep.addr, now.Sub(lastUsed).Round(time.Millisecond), left.Round(time.Millisecond))}
		case d.expired:
			note = fmt.Sprintf("affinity entry for %s (endpoint %s) expired; ", client, b.eps[b.entries[d.pos].ep].addr)
		case d.ejectedEntry:
			pinned := &b.eps[b.entries[d.pos].ep]
			note = fmt.Sprintf("affinity entry for %s names %s, which is ejected until %s; ", client, pinned.addr, pinned.ejectedUntil.Format(time.RFC3339))
		case !d.found:
			note = fmt.Sprintf("no affinity entry for %s yet; ", client)
		}
	}
	reason := note + b.scheduleReason(d.i, client)
	if d.skip.on {
		var ej []string
		for j := range b.eps {
			if d.skip.skips(&b.eps[j]) {
				ej = append(ej, b.eps[j].addr.String())
			}
		}
		reason += "; skipping ejected " + strings.Join(ej, ", ")
	} else if b.countEjected(now) > 0 {
		reason += "; every endpoint is ejected, so ejection is ignored"
	}
	return Choice{Endpoint: ep.addr, Reason: reason}
}

// scheduleReason words why the scheduler chose eps[i].
func (b *Balancer) scheduleReason(i int, client netip.Addr) string {
	e := &b.eps[i]
	switch b.sched {
	case leastConnection:
		return fmt.Sprintf("scheduler lc: %s has the fewest active connections (%d)", e.addr, e.active)
	case shortestExpectedDelay:
		return fmt.Sprintf("scheduler sed: %s has the shortest expected delay ((active %d + 1) / weight %d)", e.addr, e.active, e.weight)
	case neverQueue:
		if e.active == 0 {
			return fmt.Sprintf("scheduler nq: %s is idle", e.addr)
		}
		return fmt.Sprintf("scheduler nq: no endpoint is idle; %s has the shortest expected delay (active %d)", e.addr, e.active)
	case sourceHashing:
		return fmt.Sprintf("scheduler sh: the hash of client %s maps to %s", client, e.addr)
	case destinationHashing:
		return fmt.Sprintf("scheduler dh: the hash of the Service IP maps to %s", e.addr)
	}
	return fmt.Sprintf("scheduler rr: %s is next in the rotation", e.addr)
}

// Counters are cumulative over a Balancer's life.
type Counters struct {
	// AffinityHits counts Picks answered by a live affinity entry.
	AffinityHits uint64 `json:"affinityHits"`
	// AffinityMisses counts Picks with affinity on that the scheduler had to answer
	// (no entry, an expired one, or its endpoint gone or tried).
	AffinityMisses uint64 `json:"affinityMisses"`
	// AffinityResets counts entries removed by ResetAffinity.
	AffinityResets uint64 `json:"affinityResets"`
	// AffinityExpired counts entries that timed out, whether found by Pick, Update or
	// a sweep.
	AffinityExpired uint64 `json:"affinityExpired"`
	// AffinityEvicted counts live entries removed to keep the table within
	// MaxAffinityEntries.
	AffinityEvicted uint64 `json:"affinityEvicted"`
	// Ejections counts endpoints ejected by DialFailed; Readmissions counts
	// ejected or probation endpoints that DialSucceeded re-admitted.
	Ejections    uint64 `json:"ejections"`
	Readmissions uint64 `json:"readmissions"`
}

// State is a copy of a Balancer's state, for /debug/services and explain.
type State struct {
	Scheduler string          `json:"scheduler"`
	Endpoints []EndpointState `json:"endpoints"`
	// Next is the endpoint the next new client (one without an affinity entry)
	// gets, by the decision Pick makes (ejected endpoints skipped), and
	// NextReason says why; both zero when there are no endpoints, or with the sh
	// scheduler, where the choice hangs on the client's address.
	Next                   netip.AddrPort `json:"next"`
	NextReason             string         `json:"nextReason,omitempty"`
	ClientIPAffinity       bool           `json:"clientIPAffinity"`
	AffinityTimeoutSeconds float64        `json:"affinityTimeoutSeconds,omitempty"`
	// AffinityEntries counts the live entries; Affinity holds the
	// AffinitySample most recently used of them, ordered by client.
	AffinityEntries int      `json:"affinityEntries,omitempty"`
	Affinity        []Entry  `json:"affinity,omitempty"`
	Counters        Counters `json:"counters"`
}

// EndpointState is one endpoint with its active connections (or UDP flows) and its
// outlier state.
type EndpointState struct {
	Addr   netip.AddrPort `json:"addr"`
	Active int            `json:"active"`
	// Failures counts consecutive failed dials.
	Failures int `json:"failures,omitempty"`
	// EjectedUntil is when the current ejection ends (zero: not ejected).
	EjectedUntil time.Time `json:"ejectedUntil,omitzero"`
	// Ejections counts ejections since the last successful dial.
	Ejections int `json:"ejections,omitempty"`
}

// Entry is one ClientIP affinity entry.
type Entry struct {
	Client   netip.Addr     `json:"client"`
	Endpoint netip.AddrPort `json:"endpoint"`
	LastUsed time.Time      `json:"lastUsed"`
}

// Stats returns b's counters and endpoints: State without the affinity table, cheap
// enough for every metrics scrape.
func (b *Balancer) Stats() (Counters, []EndpointState) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.counters, b.endpointStates(b.now())
}

func (b *Balancer) endpointStates(now time.Time) []EndpointState {
	out := make([]EndpointState, len(b.eps))
	for i, e := range b.eps {
		out[i] = EndpointState{Addr: e.addr, Active: e.active, Failures: e.failures, Ejections: e.ejections}
		if e.ejectedUntil.After(now) {
			out[i].EjectedUntil = e.ejectedUntil
		}
	}
	return out
}

// State returns a snapshot of b, with a sample of its affinity table (see
// AffinitySample). Expired entries that have not been swept yet are left out.
func (b *Balancer) State() State {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.now()
	s := State{
		Scheduler:        b.sched.String(),
		Endpoints:        b.endpointStates(now),
		ClientIPAffinity: b.affinity,
		Counters:         b.counters,
	}
	if len(b.eps) > 0 && b.sched != sourceHashing {
		c := b.word(b.decide(netip.Addr{}, nil, now, true), netip.Addr{}, now)
		s.Next, s.NextReason = c.Endpoint, c.Reason
	}
	if b.affinity {
		s.AffinityTimeoutSeconds = b.timeout.Seconds()
		for _, e := range b.entries {
			if b.live(e.lastUsed, now) {
				s.AffinityEntries++
				s.Affinity = append(s.Affinity, Entry{Client: e.client, Endpoint: b.eps[e.ep].addr, LastUsed: e.lastUsed})
			}
		}
		if len(s.Affinity) > AffinitySample {
			slices.SortFunc(s.Affinity, func(x, y Entry) int { return y.LastUsed.Compare(x.LastUsed) })
			s.Affinity = slices.Clip(s.Affinity[:AffinitySample])
		}
		slices.SortFunc(s.Affinity, func(x, y Entry) int { return x.Client.Compare(y.Client) })
	}
	return s
}
