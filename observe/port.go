package observe

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/record"
)

// PortObserver records the traffic of one Service port: it is the port's
// socket.Observer and the EjectionObserver of its balancer. It keeps the metric
// children of its Service port, and those of each endpoint from the endpoint's
// first attempt on, so a connection costs no label lookup; it records every
// connection, ejection and re-admission in the Events ring and logs them (-v=2,
// -v=1). It decides nothing: the balancer ejects endpoints whether or not anyone
// observes.
type PortObserver struct {
	service  string
	protocol string
	events   *Events // may be nil

	active      prometheus.Gauge
	bytesIn     prometheus.Counter
	bytesOut    prometheus.Counter
	connOK      prometheus.Counter
	connRetried prometheus.Counter
	connFailed  prometheus.Counter
	duration    prometheus.Observer
	reopens     prometheus.Counter
	// A port has the series of its protocol only: retries, refusals and idle
	// are nil for UDP (a session has one attempt and idles out by design),
	// expiries and moved nil for TCP.
	retries, refusals, idle prometheus.Counter
	expiries, moved         prometheus.Counter

	// stats and udpClients are set by Attach before the port serves, and read
	// without a lock afterwards.
	stats      func() BalancerStats
	udpClients func() int

	// noPortWarned is when warnNoLocalPort last logged (Unix nanoseconds).
	noPortWarned atomic.Int64

	// mu guards endpoints and the attempts arrays in them; an endpointMetrics'
	// name and dial never change, so a reader may use them after unlocking.
	mu        sync.RWMutex
	endpoints map[netip.AddrPort]*endpointMetrics
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
	o := &PortObserver{
		service:     service,
		protocol:    protocol,
		events:      events,
		active:      ActiveConnections.WithLabelValues(service),
		bytesIn:     Bytes.WithLabelValues(service, "in"),
		bytesOut:    Bytes.WithLabelValues(service, "out"),
		connOK:      Connections.WithLabelValues(service, protocol, "success"),
		connRetried: Connections.WithLabelValues(service, protocol, "retried"),
		connFailed:  Connections.WithLabelValues(service, protocol, "failed"),
		duration:    ConnectionDuration.WithLabelValues(service),
		reopens:     ProxyPortReopens.WithLabelValues(service),
		endpoints:   make(map[netip.AddrPort]*endpointMetrics),
	}
	if protocol == "UDP" {
		o.expiries = UDPExpiries.WithLabelValues(service)
		o.moved = UDPEndpointRemovals.WithLabelValues(service)
	} else {
		o.retries = Retries.WithLabelValues(service)
		o.refusals = RetryBudgetRefusals.WithLabelValues(service)
		o.idle = IdleTimeouts.WithLabelValues(service)
	}
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
	o.stats, o.udpClients = stats, udpClients
	livePorts.Lock()
	livePorts.m[o] = struct{}{}
	livePorts.Unlock()
}

func (o *PortObserver) ConnOpened(service, protocol string) { o.active.Inc() }

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
			klog.ErrorS(a.Err, "Endpoint not dialed: it is one of uproxy's own proxy sockets; counted as a failed dial, retries go to other endpoints",
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
	// session the refused series starts here, at 0, beside its successful dial.
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
	o.reopens.Inc()
	klog.InfoS("Reopened proxy port", "service", o.service, "protocol", o.protocol, "proxyPort", to, "previousProxyPort", from, "failure", failure)
}

func (o *PortObserver) ConnClosed(c *record.Conn) {
	o.active.Dec()
	n := len(c.Attempts)
	if n > 1 && o.retries != nil {
		o.retries.Add(float64(n - 1))
	}
	if c.RetryRefused && o.refusals != nil {
		o.refusals.Inc()
	}
	if c.BytesIn > 0 {
		o.bytesIn.Add(float64(c.BytesIn))
	}
	if c.BytesOut > 0 {
		o.bytesOut.Add(float64(c.BytesOut))
	}
	switch {
	case !c.Endpoint.IsValid():
		o.connFailed.Inc()
	case n > 1:
		o.connRetried.Inc()
	default:
		o.connOK.Inc()
	}
	o.duration.Observe(c.Duration.Seconds())
	if o.expiries != nil && c.Endpoint.IsValid() && c.Err == nil {
		// A UDP session that ends without error idled out (or its Service
		// port closed, which ends every session at once).
		o.expiries.Inc()
	}
	if o.idle != nil && c.IdledOut() {
		o.idle.Inc()
	}
	if o.moved != nil && errors.Is(c.Err, record.ErrEndpointRemoved) {
		o.moved.Inc()
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
	ActiveConnections.DeleteLabelValues(o.service)
	Retries.DeleteLabelValues(o.service)
	RetryBudgetRefusals.DeleteLabelValues(o.service)
	Bytes.DeleteLabelValues(o.service, "in")
	Bytes.DeleteLabelValues(o.service, "out")
	for _, outcome := range []string{"success", "retried", "failed"} {
		Connections.DeleteLabelValues(o.service, o.protocol, outcome)
	}
	ConnectionDuration.DeleteLabelValues(o.service)
	UDPExpiries.DeleteLabelValues(o.service)
	UDPEndpointRemovals.DeleteLabelValues(o.service)
	IdleTimeouts.DeleteLabelValues(o.service)
	ProxyPortReopens.DeleteLabelValues(o.service)
	o.mu.Lock()
	for _, em := range o.endpoints {
		o.deleteEndpointSeries(em.name)
	}
	clear(o.endpoints)
	o.mu.Unlock()
}

// livePorts are the attached PortObservers, read by portsCollector at scrape time.
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
	descUDPClients = prometheus.NewDesc("uproxy_udp_clients",
		"Entries in the UDP client table, by Service port.", []string{"service"}, nil)
)

func (portsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descEndpointActive, descEndpointEjected, descEndpointFailures,
		descAffinityHits, descAffinityMisses, descAffinityResets, descAffinityExpired, descUDPClients} {
		ch <- d
	}
}

func (portsCollector) Collect(ch chan<- prometheus.Metric) {
	livePorts.Lock()
	ports := make([]*PortObserver, 0, len(livePorts.m))
	for o := range livePorts.m {
		ports = append(ports, o)
	}
	livePorts.Unlock()
	for _, o := range ports {
		if o.udpClients != nil {
			ch <- prometheus.MustNewConstMetric(descUDPClients, prometheus.GaugeValue, float64(o.udpClients()), o.service)
		}
		if o.stats == nil {
			continue
		}
		st := o.stats()
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
	}
}
