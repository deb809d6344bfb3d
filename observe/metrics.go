// Package observe makes uproxy visible: Prometheus metrics, health endpoints, and the
// /debug views of every Service port.
package observe

import (
	"errors"
	"net/netip"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/uproxy/uproxy/socket"
)

// Registry holds every uproxy metric (and the Go and process collectors).
var Registry = prometheus.NewRegistry()

var (
	// Control plane, named as kube-proxy names them so existing dashboards work.
	SyncDuration = prometheus.NewHistogram(prometheus.HistogramOpts{
		Subsystem: "kubeproxy", Name: "sync_proxy_rules_duration_seconds",
		Help:    "How long one sync of the proxy's state took, in seconds.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 15),
	})
	SyncLastTimestamp = prometheus.NewGauge(prometheus.GaugeOpts{
		Subsystem: "kubeproxy", Name: "sync_proxy_rules_last_timestamp_seconds",
		Help: "The last time the proxy's state was successfully synced (Unix seconds).",
	})
	SyncLastQueuedTimestamp = prometheus.NewGauge(prometheus.GaugeOpts{
		Subsystem: "kubeproxy", Name: "sync_proxy_rules_last_queued_timestamp_seconds",
		Help: "The last time a change was queued for sync (Unix seconds).",
	})
	NetworkProgrammingDuration = prometheus.NewHistogram(prometheus.HistogramOpts{
		Subsystem: "kubeproxy", Name: "network_programming_duration_seconds",
		Help:    "Time from an endpoints change in the source to the proxy having programmed it, in seconds.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 20),
	})

	// Data path.
	Connections = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "uproxy_connections_total",
		Help: "Proxied TCP connections and UDP client sessions, by Service port, protocol and result (success, failed).",
	}, []string{"service", "protocol", "result"})
	DialAttempts = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "uproxy_dial_attempts_total",
		Help: "Dial attempts by Service port, endpoint and result (success, refused, timeout, unreachable, reset, other).",
	}, []string{"service", "endpoint", "result"})
	Retries = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "uproxy_retries_total",
		Help: "Dial attempts that followed a failed attempt of the same connection, by Service port.",
	}, []string{"service"})
	ActiveConnections = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "uproxy_active_connections",
		Help: "Open proxied TCP connections and UDP client sessions, by Service port.",
	}, []string{"service"})
	Bytes = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "uproxy_bytes_total",
		Help: "Bytes proxied by Service port and direction (in: client to backend, out: backend to client).",
	}, []string{"service", "direction"})
)

func init() {
	Registry.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		SyncDuration, SyncLastTimestamp, SyncLastQueuedTimestamp, NetworkProgrammingDuration,
		Connections, DialAttempts, Retries, ActiveConnections, Bytes,
	)
}

// DialResult classifies a dial error for the result label: success, refused,
// timeout, unreachable, reset or other.
func DialResult(err error) string {
	switch {
	case err == nil:
		return "success"
	case errors.Is(err, syscall.ECONNREFUSED):
		return "refused"
	case errors.Is(err, syscall.ETIMEDOUT), isTimeout(err):
		return "timeout"
	case errors.Is(err, syscall.EHOSTUNREACH), errors.Is(err, syscall.ENETUNREACH):
		return "unreachable"
	case errors.Is(err, syscall.ECONNRESET):
		return "reset"
	case errors.Is(err, socket.ErrNoEndpoints):
		return "no-endpoints"
	}
	return "other"
}

func isTimeout(err error) bool {
	var t interface{ Timeout() bool }
	return errors.As(err, &t) && t.Timeout()
}

// PortObserver is the socket.Observer of one Service port: it keeps the metric
// children of its Service so the connection path does no label lookups beyond the
// first per endpoint.
type PortObserver struct {
	service    string
	active     prometheus.Gauge
	retries    prometheus.Counter
	bytesIn    prometheus.Counter
	bytesOut   prometheus.Counter
	connOK     prometheus.Counter
	connFailed prometheus.Counter
	events     *Events // may be nil

	mu       sync.RWMutex
	attempts map[attemptKey]prometheus.Counter
}

type attemptKey struct {
	ep     netip.AddrPort
	result string
}

// NewPortObserver returns the observer for service (ns/name:port) and protocol.
// events, if not nil, receives a record of every connection.
func NewPortObserver(service, protocol string, events *Events) *PortObserver {
	return &PortObserver{
		service:    service,
		active:     ActiveConnections.WithLabelValues(service),
		retries:    Retries.WithLabelValues(service),
		bytesIn:    Bytes.WithLabelValues(service, "in"),
		bytesOut:   Bytes.WithLabelValues(service, "out"),
		connOK:     Connections.WithLabelValues(service, protocol, "success"),
		connFailed: Connections.WithLabelValues(service, protocol, "failed"),
		events:     events,
		attempts:   make(map[attemptKey]prometheus.Counter),
	}
}

var _ socket.Observer = (*PortObserver)(nil)

func (o *PortObserver) ConnOpened(service, protocol string) { o.active.Inc() }

func (o *PortObserver) AttemptDone(service string, a socket.Attempt) {
	k := attemptKey{a.Endpoint, DialResult(a.Err)}
	o.mu.RLock()
	c := o.attempts[k]
	o.mu.RUnlock()
	if c == nil {
		c = DialAttempts.WithLabelValues(o.service, a.Endpoint.String(), k.result)
		o.mu.Lock()
		o.attempts[k] = c
		o.mu.Unlock()
	}
	c.Inc()
}

func (o *PortObserver) ConnClosed(c *socket.Conn) {
	o.active.Dec()
	if n := len(c.Attempts); n > 1 {
		o.retries.Add(float64(n - 1))
	}
	if c.BytesIn > 0 {
		o.bytesIn.Add(float64(c.BytesIn))
	}
	if c.BytesOut > 0 {
		o.bytesOut.Add(float64(c.BytesOut))
	}
	if c.Endpoint.IsValid() {
		o.connOK.Inc()
	} else {
		o.connFailed.Inc()
	}
	if o.events != nil {
		o.events.Add(c)
	}
}

// Forget drops the metric series of the Service port (when it is removed), so
// label cardinality follows the live Services.
func (o *PortObserver) Forget() {
	ActiveConnections.DeleteLabelValues(o.service)
	Retries.DeleteLabelValues(o.service)
	Bytes.DeleteLabelValues(o.service, "in")
	Bytes.DeleteLabelValues(o.service, "out")
	Connections.DeletePartialMatch(prometheus.Labels{"service": o.service})
	DialAttempts.DeletePartialMatch(prometheus.Labels{"service": o.service})
}

// SyncObserved records one sync in the kube-proxy metrics.
func SyncObserved(start time.Time, took time.Duration, err error) {
	SyncDuration.Observe(took.Seconds())
	if err == nil {
		SyncLastTimestamp.Set(float64(start.Add(took).UnixNano()) / 1e9)
	}
}
