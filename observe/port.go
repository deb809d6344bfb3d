package observe

import (
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/affinity"
	"github.com/uproxy/uproxy/socket"
)

// PortObserver is the socket.Observer of one Service port. It keeps the metric
// children of its Service port, and those of each endpoint from the endpoint's
// first attempt on, so a connection costs no label lookup; it records every
// connection in the Events ring, logs it at -v=2, and feeds the port's Balancer
// the result of every dial for outlier ejection.
type PortObserver struct {
	service  string
	protocol string
	events   *Events // may be nil

	active      prometheus.Gauge
	retries     prometheus.Counter
	bytesIn     prometheus.Counter
	bytesOut    prometheus.Counter
	connOK      prometheus.Counter
	connRetried prometheus.Counter
	connFailed  prometheus.Counter
	duration    prometheus.Observer
	expiries    prometheus.Counter

	// balancer and udpClients are set by Attach before the port serves, and read
	// without a lock afterwards.
	balancer   *affinity.Balancer
	udpClients func() int

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
}

// NewPortObserver returns the observer for service (ns/name:port) and protocol
// ("TCP" or "UDP"). events, if not nil, receives a record of every connection.
func NewPortObserver(service, protocol string, events *Events) *PortObserver {
	return &PortObserver{
		service:     service,
		protocol:    protocol,
		events:      events,
		active:      ActiveConnections.WithLabelValues(service),
		retries:     Retries.WithLabelValues(service),
		bytesIn:     Bytes.WithLabelValues(service, "in"),
		bytesOut:    Bytes.WithLabelValues(service, "out"),
		connOK:      Connections.WithLabelValues(service, protocol, "success"),
		connRetried: Connections.WithLabelValues(service, protocol, "retried"),
		connFailed:  Connections.WithLabelValues(service, protocol, "failed"),
		duration:    ConnectionDuration.WithLabelValues(service),
		expiries:    UDPExpiries.WithLabelValues(service),
		endpoints:   make(map[netip.AddrPort]*endpointMetrics),
	}
}

var _ socket.Observer = (*PortObserver)(nil)

// Attach connects the observer to its Service port's running state: b (may be
// nil) is told the result of every dial (Failed, Succeeded) for outlier
// ejection and is read at scrape time for active connections, ejections and
// affinity counters; udpClients (nil for TCP) reports the UDP client table size.
// Call it once, before the port serves; Forget detaches.
func (o *PortObserver) Attach(b *affinity.Balancer, udpClients func() int) {
	o.balancer, o.udpClients = b, udpClients
	livePorts.Lock()
	livePorts.m[o] = struct{}{}
	livePorts.Unlock()
}

func (o *PortObserver) ConnOpened(service, protocol string) { o.active.Inc() }

func (o *PortObserver) AttemptDone(service string, a socket.Attempt) {
	em, attempts := o.children(a.Endpoint, dialResult(a.Err))
	attempts.Inc()
	em.dial.Observe(a.Duration.Seconds())
	if o.balancer == nil {
		return
	}
	if a.Err == nil {
		if o.balancer.Succeeded(a.Endpoint) {
			o.readmitted(em, a.Endpoint)
		}
		return
	}
	if d := o.balancer.Failed(a.Endpoint); d > 0 {
		o.ejected(em, a, d)
	}
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

func (o *PortObserver) ejected(em *endpointMetrics, a socket.Attempt, d time.Duration) {
	Ejections.WithLabelValues(o.service, em.name).Inc()
	reason := fmt.Sprintf("dial failed (%s); ejected for %s", resultNames[dialResult(a.Err)], d)
	klog.V(1).InfoS("Ejected endpoint", "service", o.service, "endpoint", em.name, "for", d, "err", a.Err)
	if o.events != nil {
		o.events.AddEndpoint(KindEjection, o.service, o.protocol, a.Endpoint, d, reason)
	}
}

func (o *PortObserver) readmitted(em *endpointMetrics, ep netip.AddrPort) {
	Readmissions.WithLabelValues(o.service, em.name).Inc()
	klog.V(1).InfoS("Re-admitted endpoint", "service", o.service, "endpoint", em.name)
	if o.events != nil {
		o.events.AddEndpoint(KindReadmission, o.service, o.protocol, ep, 0, "dial succeeded")
	}
}

func (o *PortObserver) ConnClosed(c *socket.Conn) {
	o.active.Dec()
	n := len(c.Attempts)
	if n > 1 {
		o.retries.Add(float64(n - 1))
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
	if c.Protocol == "UDP" && c.Endpoint.IsValid() {
		switch {
		case c.Err == nil:
			// A UDP session that ends without error idled out (or its Service
			// port closed, which ends every session at once).
			o.expiries.Inc()
		case o.balancer != nil && dialResult(c.Err) == resultRefused:
			// A UDP connect never fails; an ICMP port unreachable from the
			// endpoint is the UDP form of a refused dial.
			if d := o.balancer.Failed(c.Endpoint); d > 0 {
				em, _ := o.children(c.Endpoint, resultRefused)
				o.ejected(em, socket.Attempt{Endpoint: c.Endpoint, Err: c.Err}, d)
			}
		}
	}
	if o.events != nil {
		o.events.Add(c)
	}
	if v := klog.V(2); v.Enabled() {
		logConn(v, c)
	}
}

// logConn writes the one log line of a connection, with its attempts.
func logConn(v klog.Verbose, c *socket.Conn) {
	var b strings.Builder
	for i, a := range c.Attempts {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s %s %s", a.Endpoint, resultNames[dialResult(a.Err)], a.Duration.Round(time.Microsecond))
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
	Bytes.DeleteLabelValues(o.service, "in")
	Bytes.DeleteLabelValues(o.service, "out")
	for _, outcome := range []string{"success", "retried", "failed"} {
		Connections.DeleteLabelValues(o.service, o.protocol, outcome)
	}
	ConnectionDuration.DeleteLabelValues(o.service)
	UDPExpiries.DeleteLabelValues(o.service)
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

// portsCollector exports, at scrape time, what the Balancers and UDP tables
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
	now := time.Now()
	for _, o := range ports {
		if o.udpClients != nil {
			ch <- prometheus.MustNewConstMetric(descUDPClients, prometheus.GaugeValue, float64(o.udpClients()), o.service)
		}
		if o.balancer == nil {
			continue
		}
		c, eps := o.balancer.Stats()
		for _, e := range eps {
			ep := e.Addr.String()
			ejected := 0.0
			if e.EjectedUntil.After(now) {
				ejected = 1
			}
			ch <- prometheus.MustNewConstMetric(descEndpointActive, prometheus.GaugeValue, float64(e.Active), o.service, ep)
			ch <- prometheus.MustNewConstMetric(descEndpointEjected, prometheus.GaugeValue, ejected, o.service, ep)
			ch <- prometheus.MustNewConstMetric(descEndpointFailures, prometheus.GaugeValue, float64(e.Failures), o.service, ep)
		}
		ch <- prometheus.MustNewConstMetric(descAffinityHits, prometheus.CounterValue, float64(c.AffinityHits), o.service)
		ch <- prometheus.MustNewConstMetric(descAffinityMisses, prometheus.CounterValue, float64(c.AffinityMisses), o.service)
		ch <- prometheus.MustNewConstMetric(descAffinityResets, prometheus.CounterValue, float64(c.AffinityResets), o.service)
		ch <- prometheus.MustNewConstMetric(descAffinityExpired, prometheus.CounterValue, float64(c.AffinityExpired), o.service)
	}
}
