package observe

import (
	"errors"
	"fmt"
	"math"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/record"
)

// PortObserver records the traffic of one Service port: it is the port's
// socket.Observer and the EjectionObserver of its balancer. It counts the
// port's series itself (portsCollector exports them at scrape time), and
// keeps the metric children of each endpoint from the endpoint's first attempt
// on, so a connection costs no label lookup; it records every connection,
// ejection and re-admission in the Events ring and logs them (-v=2, -v=1). It
// decides nothing: the balancer ejects endpoints whether or not anyone
// observes.
type PortObserver struct {
	service  string
	protocol string
	events   *Events // may be nil

	// The port's series, from NewPortObserver to Forget.
	active      atomic.Int64
	retries     atomic.Uint64
	refusals    atomic.Uint64
	bytesIn     atomic.Uint64
	bytesOut    atomic.Uint64
	connOK      atomic.Uint64
	connRetried atomic.Uint64
	connFailed  atomic.Uint64
	// duration is made by the first connection to end: most Service ports
	// of a big cluster carry none through this node.
	duration atomic.Pointer[durations]
	expiries atomic.Uint64
	moved    atomic.Uint64
	// dropped counts UDP datagrams turned away, by record.Drop.
	dropped [record.NumDrops]atomic.Uint64
	idle    atomic.Uint64
	reopens atomic.Uint64

	// stats and udpClients are set by Attach before the port serves; they
	// are read under livePorts' lock.
	stats      func() BalancerStats
	udpClients func() int

	// noPortWarned is when warnNoLocalPort last logged (Unix nanoseconds).
	noPortWarned atomic.Int64

	// mu guards endpoints (nil until an endpoint's first attempt) and the
	// attempts arrays in them; an endpointMetrics' name and dial never
	// change, so a reader may use them after unlocking.
	mu        sync.RWMutex
	endpoints map[netip.AddrPort]*endpointMetrics
}

// durations is the histogram of uproxy_connection_duration_seconds for one
// Service port: counts[i] are the observations in bucket i alone (the last:
// above every bound), sum their total in seconds as float64 bits.
type durations struct {
	counts [numDurationBuckets + 1]atomic.Uint64
	sum    atomic.Uint64
}

// noDurations is the histogram of a port no connection has ended on yet;
// nothing writes to it.
var noDurations durations

func (h *durations) observe(v float64) {
	// The first bound at or above v, as Prometheus' own histograms count.
	h.counts[sort.SearchFloat64s(connectionDurationBuckets, v)].Add(1)
	for {
		old := h.sum.Load()
		if h.sum.CompareAndSwap(old, math.Float64bits(math.Float64frombits(old)+v)) {
			return
		}
	}
}

// add adds h's counts into cumulative buckets (by upper bound) and returns
// h's count and sum.
func (h *durations) add(buckets map[float64]uint64) (count uint64, sum float64) {
	for i, b := range connectionDurationBuckets {
		count += h.counts[i].Load()
		buckets[b] += count
	}
	return count + h.counts[len(connectionDurationBuckets)].Load(), math.Float64frombits(h.sum.Load())
}

type endpointMetrics struct {
	name string // the endpoint's label value
	// attempts[r] is created on the first attempt with result r.
	attempts [numResults]prometheus.Counter
	dial     prometheus.Observer
	// ownSocketLogged is set once the endpoint was logged as one of the
	// proxy's own sockets: it is logged once, and counted every time.
	ownSocketLogged atomic.Bool
}

// NewPortObserver returns the observer for service (ns/name:port) and protocol
// ("TCP" or "UDP"). events, if not nil, receives a record of every connection.
func NewPortObserver(service, protocol string, events *Events) *PortObserver {
	o := &PortObserver{service: service, protocol: protocol, events: events}
	livePorts.Lock()
	livePorts.m[o] = struct{}{}
	livePorts.Unlock()
	return o
}

// BalancerStats is what a Service port's balancer counts, read at every scrape.
type BalancerStats struct {
	Affinity  AffinityCounters
	Endpoints []EndpointStats
}

// EndpointStats is one endpoint of BalancerStats.
type EndpointStats struct {
	Addr     netip.AddrPort
	Active   int  // open connections (or UDP sessions)
	Failures int  // consecutive failed dials
	Ejected  bool // left out of new picks by outlier ejection
}

// Attach connects the observer to its Service port's running state, read at
// scrape time: stats (may be nil) reports the balancer's endpoints and affinity
// counters, udpClients (nil for TCP) the UDP client table size. Call it once,
// before the port serves; Forget detaches.
func (o *PortObserver) Attach(stats func() BalancerStats, udpClients func() int) {
	livePorts.Lock()
	o.stats, o.udpClients = stats, udpClients
	livePorts.Unlock()
}

func (o *PortObserver) ConnOpened(service, protocol string) { o.active.Add(1) }

// BackedOff counts a pause of the port's accepting or reading after a shortage.
func (o *PortObserver) BackedOff(service string, err error, delay time.Duration) {
	AcceptBackoffs.Inc()
}

func (o *PortObserver) AttemptDone(service string, a record.Attempt) {
	r := dialResult(a.Err)
	em, attempts := o.children(a.Endpoint, r)
	attempts.Inc()
	em.dial.Observe(a.Duration.Seconds())
	if r != resultOwnSocket && int(a.Source) < len(dialSources) {
		dialSources[a.Source].Inc()
	}
	switch r {
	case resultNoLocalPort:
		o.warnNoLocalPort(em.name, a.Err)
	case resultOwnSocket:
		if !em.ownSocketLogged.Swap(true) {
			klog.ErrorS(a.Err, "Endpoint not dialed: it is one of uproxy's own proxy sockets, or the portals steer it to one; counted as a failed dial, retries go to other endpoints",
				"service", o.service, "endpoint", em.name)
		}
	}
}

// noLocalPortEvery is how often, at most, a port warns that dials ran out of local
// ports: a node that does keeps doing so for as long as its TIME_WAIT lasts.
const noLocalPortEvery = 10 * time.Second

// warnNoLocalPort logs that a dial to endpoint found no local port, with what
// to change on the node, at most once per noLocalPortEvery; the metric counts
// every such attempt.
func (o *PortObserver) warnNoLocalPort(endpoint string, err error) {
	now := time.Now().UnixNano()
	last := o.noPortWarned.Load()
	if last != 0 && now-last < int64(noLocalPortEvery) || !o.noPortWarned.CompareAndSwap(last, now) {
		return
	}
	klog.ErrorS(err, "No local port left for connections to an endpoint: dials to it fail on this node until ports free up; it is not ejected for that, and a retry goes to another endpoint",
		"service", o.service, "endpoint", endpoint,
		"hint", "this node's ports toward the endpoint are held by connections, most in TIME_WAIT: set net.ipv4.tcp_tw_reuse=1 or widen net.ipv4.ip_local_port_range")
}

// children returns the metric children of ep and its attempts counter for
// result r, creating them on first use.
func (o *PortObserver) children(ep netip.AddrPort, r int) (*endpointMetrics, prometheus.Counter) {
	o.mu.RLock()
	em := o.endpoints[ep]
	var c prometheus.Counter
	if em != nil {
		c = em.attempts[r]
	}
	o.mu.RUnlock()
	if c != nil {
		return em, c
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if em = o.endpoints[ep]; em == nil {
		if o.endpoints == nil {
			o.endpoints = make(map[netip.AddrPort]*endpointMetrics)
		}
		name := ep.String()
		em = &endpointMetrics{name: name, dial: DialDuration.WithLabelValues(o.service, name)}
		o.endpoints[ep] = em
	}
	if em.attempts[r] == nil {
		em.attempts[r] = DialAttempts.WithLabelValues(o.service, em.name, resultNames[r])
	}
	return em, em.attempts[r]
}

// Ejected records that the balancer ejected ep for d after a dial failed with
// err (for UDP, a session ended by an ICMP port unreachable).
func (o *PortObserver) Ejected(ep netip.AddrPort, d time.Duration, err error) {
	r := dialResult(err)
	// A failed dial's AttemptDone came first and made these children; for a UDP
	// session refused after it had answered, the refused series starts here,
	// at 0, beside its successful attempt.
	em, _ := o.children(ep, r)
	Ejections.WithLabelValues(o.service, em.name).Inc()
	reason := fmt.Sprintf("dial failed (%s); ejected for %s", resultNames[r], d)
	klog.V(1).InfoS("Ejected endpoint", "service", o.service, "endpoint", em.name, "for", d, "err", err)
	if o.events != nil {
		o.events.AddEndpoint(KindEjection, o.service, o.protocol, ep, d, reason)
	}
}

// Readmitted records that a successful dial re-admitted ep, which the balancer
// had ejected or kept on probation.
func (o *PortObserver) Readmitted(ep netip.AddrPort) {
	em, _ := o.children(ep, resultSuccess)
	Readmissions.WithLabelValues(o.service, em.name).Inc()
	klog.V(1).InfoS("Re-admitted endpoint", "service", o.service, "endpoint", em.name)
	if o.events != nil {
		o.events.AddEndpoint(KindReadmission, o.service, o.protocol, ep, 0, "dial succeeded")
	}
}

// Reopened records that the port's proxy socket, on proxy port from, failed for
// good with failure and was reopened on proxy port to.
func (o *PortObserver) Reopened(from, to int, failure error) {
	o.reopens.Add(1)
	klog.InfoS("Reopened proxy port", "service", o.service, "protocol", o.protocol, "proxyPort", to, "previousProxyPort", from, "failure", failure)
}

func (o *PortObserver) ConnClosed(c *record.Conn) {
	o.active.Add(-1)
	if c.Dropped != record.NotDropped {
		// A datagram turned away is no session: it is counted by its
		// reason alone (the socket logs them, rate-limited).
		if c.Dropped < record.NumDrops {
			o.dropped[c.Dropped].Add(1)
		}
		if o.events != nil {
			o.events.Add(c)
		}
		return
	}
	n := len(c.Attempts)
	if n > 1 {
		o.retries.Add(uint64(n - 1))
	}
	if c.RetryRefused {
		o.refusals.Add(1)
	}
	if c.BytesIn > 0 {
		o.bytesIn.Add(uint64(c.BytesIn))
	}
	if c.BytesOut > 0 {
		o.bytesOut.Add(uint64(c.BytesOut))
	}
	switch {
	case !c.Endpoint.IsValid():
		o.connFailed.Add(1)
	case n > 1:
		o.connRetried.Add(1)
	default:
		o.connOK.Add(1)
	}
	h := o.duration.Load()
	if h == nil {
		o.duration.CompareAndSwap(nil, new(durations))
		h = o.duration.Load()
	}
	h.observe(c.Duration.Seconds())
	if c.Protocol == "UDP" && c.Endpoint.IsValid() && c.Err == nil {
		// A UDP session that ends without error idled out (or its Service
		// port closed, which ends every session at once).
		o.expiries.Add(1)
	}
	if c.IdledOut() {
		o.idle.Add(1)
	}
	if c.Protocol == "UDP" && errors.Is(c.Err, record.ErrEndpointRemoved) {
		o.moved.Add(1)
	}
	if o.events != nil {
		o.events.Add(c)
	}
	if v := klog.V(2); v.Enabled() {
		logConn(v, c)
	}
}

// logConn writes the one log line of a connection, with its attempts.
func logConn(v klog.Verbose, c *record.Conn) {
	var b strings.Builder
	for i, a := range c.Attempts {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s %s %s", a.Endpoint, resultNames[dialResult(a.Err)], a.Duration.Round(time.Microsecond))
		if a.Source != record.SourceNode {
			fmt.Fprintf(&b, " from %s", a.Source)
		}
	}
	kv := []any{
		"service", c.Service, "protocol", c.Protocol, "client", unmap(c.Client).String(),
		"outcome", outcomeOf(c), "attempts", b.String(),
		"bytesIn", c.BytesIn, "bytesOut", c.BytesOut, "duration", c.Duration,
	}
	if c.Endpoint.IsValid() {
		kv = append(kv, "endpoint", c.Endpoint.String())
	}
	if c.Err != nil {
		kv = append(kv, "err", c.Err.Error())
	}
	v.InfoS("Connection", kv...)
}

// Retain drops the per-endpoint series of endpoints not in eps, so that series
// follow the live endpoints rather than every endpoint the port ever had.
func (o *PortObserver) Retain(eps []netip.AddrPort) {
	keep := make(map[netip.AddrPort]bool, len(eps))
	for _, ep := range eps {
		keep[ep] = true
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	for ep, em := range o.endpoints {
		if keep[ep] {
			continue
		}
		delete(o.endpoints, ep)
		o.deleteEndpointSeries(em.name)
	}
}

// deleteEndpointSeries drops the series of one endpoint by their exact labels.
// DeletePartialMatch would be simpler but scans every series of a vector, which
// made removing 10k Service ports quadratic.
func (o *PortObserver) deleteEndpointSeries(name string) {
	for _, r := range resultNames {
		DialAttempts.DeleteLabelValues(o.service, name, r)
	}
	DialDuration.DeleteLabelValues(o.service, name)
	Ejections.DeleteLabelValues(o.service, name)
	Readmissions.DeleteLabelValues(o.service, name)
}

// Forget drops every metric series of the Service port (when it is removed), so
// label cardinality follows the live Services, and detaches it from scrapes.
func (o *PortObserver) Forget() {
	livePorts.Lock()
	delete(livePorts.m, o)
	livePorts.Unlock()
	o.mu.Lock()
	for _, em := range o.endpoints {
		o.deleteEndpointSeries(em.name)
	}
	clear(o.endpoints)
	o.mu.Unlock()
}

// livePorts are the PortObservers from NewPortObserver to Forget, read by
// portsCollector at scrape time; the lock also guards their stats and
// udpClients.
var livePorts = struct {
	sync.Mutex
	m map[*PortObserver]struct{}
}{m: map[*PortObserver]struct{}{}}

// portsCollector exports, at scrape time, what the balancers and UDP tables
// already count: the data path pays nothing for these series.
type portsCollector struct{}

var (
	descEndpointActive = prometheus.NewDesc("uproxy_endpoint_active_connections",
		"Open connections (or UDP sessions) per endpoint, by Service port and endpoint.", []string{"service", "endpoint"}, nil)
	descEndpointEjected = prometheus.NewDesc("uproxy_endpoint_ejected",
		"1 while an endpoint is ejected by passive outlier detection, else 0.", []string{"service", "endpoint"}, nil)
	descEndpointFailures = prometheus.NewDesc("uproxy_endpoint_consecutive_failures",
		"Consecutive failed dials of an endpoint (0 after a success).", []string{"service", "endpoint"}, nil)
	descAffinityHits = prometheus.NewDesc("uproxy_affinity_hits_total",
		"Picks answered by a live ClientIP affinity entry, by Service port.", []string{"service"}, nil)
	descAffinityMisses = prometheus.NewDesc("uproxy_affinity_misses_total",
		"Picks with ClientIP affinity on that the scheduler answered (no entry, expired, or its endpoint tried or ejected), by Service port.", []string{"service"}, nil)
	descAffinityResets = prometheus.NewDesc("uproxy_affinity_resets_total",
		"ClientIP affinity entries removed after a failed dial, by Service port.", []string{"service"}, nil)
	descAffinityExpired = prometheus.NewDesc("uproxy_affinity_expired_total",
		"ClientIP affinity entries that timed out, by Service port.", []string{"service"}, nil)
	descAffinityEvicted = prometheus.NewDesc("uproxy_affinity_evicted_total",
		"ClientIP affinity entries evicted, least recently used first, to keep the table within its bound (65536 per Service port and address family), by Service port.", []string{"service"}, nil)
	descUDPClients = prometheus.NewDesc("uproxy_udp_clients",
		"Entries in the UDP client table, by Service port.", []string{"service"}, nil)
)

func (portsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descEndpointActive, descEndpointEjected, descEndpointFailures,
		descAffinityHits, descAffinityMisses, descAffinityResets, descAffinityExpired, descAffinityEvicted, descUDPClients,
		descConnections, descRetries, descRetryBudgetRefusals, descActiveConnections, descConnectionDuration,
		descBytes, descUDPExpiries, descUDPEndpointRemovals, descUDPDropped, descIdleTimeouts, descProxyPortReopens} {
		ch <- d
	}
}

// attached is a PortObserver with what Attach gave it, read under the lock.
type attached struct {
	o          *PortObserver
	stats      func() BalancerStats
	udpClients func() int
}

func (portsCollector) Collect(ch chan<- prometheus.Metric) {
	livePorts.Lock()
	ports := make([]attached, 0, len(livePorts.m))
	for o := range livePorts.m {
		ports = append(ports, attached{o, o.stats, o.udpClients})
	}
	livePorts.Unlock()
	// Two observers of one Service port (a test's proxiers, or one being
	// replaced) make one set of series, their counts added up: a series may
	// be exported once per scrape.
	slices.SortFunc(ports, func(a, b attached) int { return strings.Compare(a.o.service, b.o.service) })
	for i := 0; i < len(ports); {
		j := i + 1
		for j < len(ports) && ports[j].o.service == ports[i].o.service {
			j++
		}
		collectCounts(ch, ports[i:j])
		i = j
	}
	for _, a := range ports {
		o := a.o
		if a.udpClients != nil {
			ch <- prometheus.MustNewConstMetric(descUDPClients, prometheus.GaugeValue, float64(a.udpClients()), o.service)
		}
		if a.stats == nil {
			continue
		}
		st := a.stats()
		for _, e := range st.Endpoints {
			ep := e.Addr.String()
			ejected := 0.0
			if e.Ejected {
				ejected = 1
			}
			ch <- prometheus.MustNewConstMetric(descEndpointActive, prometheus.GaugeValue, float64(e.Active), o.service, ep)
			ch <- prometheus.MustNewConstMetric(descEndpointEjected, prometheus.GaugeValue, ejected, o.service, ep)
			ch <- prometheus.MustNewConstMetric(descEndpointFailures, prometheus.GaugeValue, float64(e.Failures), o.service, ep)
		}
		c := st.Affinity
		ch <- prometheus.MustNewConstMetric(descAffinityHits, prometheus.CounterValue, float64(c.Hits), o.service)
		ch <- prometheus.MustNewConstMetric(descAffinityMisses, prometheus.CounterValue, float64(c.Misses), o.service)
		ch <- prometheus.MustNewConstMetric(descAffinityResets, prometheus.CounterValue, float64(c.Resets), o.service)
		ch <- prometheus.MustNewConstMetric(descAffinityExpired, prometheus.CounterValue, float64(c.Expired), o.service)
		ch <- prometheus.MustNewConstMetric(descAffinityEvicted, prometheus.CounterValue, float64(c.Evicted), o.service)
	}
}

// collectCounts exports the series the observers of one Service port count.
func collectCounts(ch chan<- prometheus.Metric, ports []attached) {
	svc := ports[0].o.service
	var active int64
	var retries, refusals, bytesIn, bytesOut, expiries, moved, idle, reopens, count uint64
	var dropped [record.NumDrops]uint64
	var sum float64
	buckets := make(map[float64]uint64, len(connectionDurationBuckets))
	// Connections by protocol, in the order first seen.
	type outcomes struct{ ok, retried, failed uint64 }
	var protocols []string
	conns := map[string]*outcomes{}
	for _, a := range ports {
		o := a.o
		active += o.active.Load()
		retries += o.retries.Load()
		refusals += o.refusals.Load()
		bytesIn += o.bytesIn.Load()
		bytesOut += o.bytesOut.Load()
		expiries += o.expiries.Load()
		moved += o.moved.Load()
		for r := range dropped {
			dropped[r] += o.dropped[r].Load()
		}
		idle += o.idle.Load()
		reopens += o.reopens.Load()
		h := o.duration.Load()
		if h == nil {
			h = &noDurations // every bucket, at zero
		}
		c, s := h.add(buckets)
		count, sum = count+c, sum+s
		oc := conns[o.protocol]
		if oc == nil {
			oc = &outcomes{}
			conns[o.protocol] = oc
			protocols = append(protocols, o.protocol)
		}
		oc.ok += o.connOK.Load()
		oc.retried += o.connRetried.Load()
		oc.failed += o.connFailed.Load()
	}
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), append([]string{svc}, labels...)...)
	}
	ch <- prometheus.MustNewConstMetric(descActiveConnections, prometheus.GaugeValue, float64(active), svc)
	// A port has the series of its protocol only: retries, refusals and idle
	// timeouts for TCP (a UDP session has one attempt and idles out by
	// design), expiries and moves for UDP.
	_, tcp := conns["TCP"]
	_, udp := conns["UDP"]
	if tcp {
		counter(descRetries, retries)
		counter(descRetryBudgetRefusals, refusals)
		counter(descIdleTimeouts, idle)
	}
	if udp {
		counter(descUDPExpiries, expiries)
		counter(descUDPEndpointRemovals, moved)
		for r := record.NotDropped + 1; r < record.NumDrops; r++ {
			counter(descUDPDropped, dropped[r], r.String())
		}
	}
	counter(descBytes, bytesIn, "in")
	counter(descBytes, bytesOut, "out")
	for _, p := range protocols {
		oc := conns[p]
		counter(descConnections, oc.ok, p, "success")
		counter(descConnections, oc.retried, p, "retried")
		counter(descConnections, oc.failed, p, "failed")
	}
	ch <- prometheus.MustNewConstHistogram(descConnectionDuration, count, sum, buckets, svc)
	counter(descProxyPortReopens, reopens)
}
