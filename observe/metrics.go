// Package observe makes uproxy visible and runs its every HTTP server:
// Prometheus metrics, /healthz and /livez, the health-check node ports of
// externalTrafficPolicy Local Services, the ring of recent connection events,
// and the /debug views of every Service port. It is told what happened; no
// part of the data path reads it back. Health is a report (to kubelet and
// load balancers, as kube-proxy's healthz server), not a decision of uproxy's.
package observe

import (
	"errors"
	"regexp"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/record"
)

// Registry holds every uproxy metric (and the Go and process collectors).
var Registry = prometheus.NewRegistry()

// Control plane, named as kube-proxy names them so existing dashboards work.
var (
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
	ServiceChangesTotal = prometheus.NewCounter(prometheus.CounterOpts{
		Subsystem: "kubeproxy", Name: "sync_proxy_rules_service_changes_total",
		Help: "Changes to Services seen by the proxy (a Service added, removed or changed counts once).",
	})
	ServiceChangesPending = prometheus.NewGauge(prometheus.GaugeOpts{
		Subsystem: "kubeproxy", Name: "sync_proxy_rules_service_changes_pending",
		Help: "Services changed since the last successful sync.",
	})
	EndpointChangesTotal = prometheus.NewCounter(prometheus.CounterOpts{
		Subsystem: "kubeproxy", Name: "sync_proxy_rules_endpoint_changes_total",
		Help: "Changes to the endpoints of Services seen by the proxy (one per Service whose endpoints changed).",
	})
	EndpointChangesPending = prometheus.NewGauge(prometheus.GaugeOpts{
		Subsystem: "kubeproxy", Name: "sync_proxy_rules_endpoint_changes_pending",
		Help: "Services whose endpoints changed since the last successful sync.",
	})
	IPTablesRestoreFailures = prometheus.NewCounter(prometheus.CounterOpts{
		Subsystem: "kubeproxy", Name: "sync_proxy_rules_iptables_restore_failures_total",
		Help: "Syncs whose iptables-restore failed.",
	})
	// ServicePortConflicts is set by Conflicts.Update.
	ServicePortConflicts = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "uproxy_service_port_conflicts",
		Help: "Service ports left out because another Service port already serves one of their addresses (IP, port and protocol, or NodePort and protocol).",
	})
	// SourceProblems is set by Problems.Update.
	SourceProblems = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "uproxy_source_problems",
		Help: "Problems the source found in its objects at its last update (a manifest's, an API object's that does not validate): each object is left out, or kept at its last good version, while its problem lasts; /debug/services lists them.",
	})
)

// Data path. Labels are the Service port (namespace/name:port) and, where it
// matters, the endpoint: never the client, so the series count follows the
// Services and their endpoints, not the traffic.
var (
	DialAttempts = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "uproxy_dial_attempts_total",
		Help: "Dial attempts by Service port, endpoint and result (success, refused, timeout, unreachable, reset, other; hedge_lost: abandoned when another attempt of the connection, hedged, connected first; no_local_port: every local port toward the endpoint was taken, the node's shortage; own_socket: not dialed, the endpoint is one of uproxy's own proxy sockets, or the portals steer it to one).",
	}, []string{"service", "endpoint", "result"})
	DialDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "uproxy_dial_duration_seconds",
		Help:    "How long dial attempts took, successful or not, by Service port and endpoint (a timed-out attempt lasts its timeout).",
		Buckets: prometheus.ExponentialBuckets(0.0001, 3, 11), // 100µs .. ~6s
	}, []string{"service", "endpoint"})
	Ejections = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "uproxy_endpoint_ejections_total",
		Help: "Times an endpoint was ejected by passive outlier detection (consecutive failed dials), by Service port and endpoint.",
	}, []string{"service", "endpoint"})
	// AcceptBackoffs has no Service label: a shortage of descriptors or memory is
	// the node's, whichever Service port happened to meet it.
	AcceptBackoffs = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "uproxy_accept_backoffs_total",
		Help: "Times an accept (TCP) or read (UDP) loop backed off after running short of descriptors, buffers or memory.",
	})
	Readmissions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "uproxy_endpoint_readmissions_total",
		Help: "Times an ejected endpoint was re-admitted by a successful dial, by Service port and endpoint.",
	}, []string{"service", "endpoint"})
	// DialSources has no Service label: which address a dial goes from is the
	// node's policy (kube-proxy's masquerading), the same for every Service port.
	DialSources = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "uproxy_dial_sources_total",
		Help: "Dial attempts to endpoints by source address: client (transparent: the endpoint sees the client, where kube-proxy would not masquerade), node (where it would), hairpin (the node's, for a client reaching itself), fallback (the node's, after the kernel refused a transparent socket).",
	}, []string{"source"})
)

// LocalhostNodePortsAccepted is kube-proxy's
// kubeproxy_iptables_localhost_nodeports_accepted_packets_total: the packets the
// iptables mode accepted on localhost NodePorts, the first of each connection.
// The kernel counts them (an nfacct object); the mode that does gives its
// reader to Set, and each scrape reads it. Absent while no mode counts.
var LocalhostNodePortsAccepted = &KernelCounter{desc: prometheus.NewDesc(
	"kubeproxy_iptables_localhost_nodeports_accepted_packets_total",
	"Packets accepted on NodePorts of the loopback addresses (the first of each connection), as the kernel counts them.", nil, nil)}

// KernelCounter exports a counter the kernel keeps, read at scrape time.
type KernelCounter struct {
	desc *prometheus.Desc
	// mu guards read and lastErr.
	mu      sync.Mutex
	read    func() (value uint64, counting bool, err error)
	lastErr string
}

// Set makes read the counter's source: counting false leaves the series out,
// an error too (logged when it changes). nil stops exporting it.
func (c *KernelCounter) Set(read func() (value uint64, counting bool, err error)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.read, c.lastErr = read, ""
}

func (c *KernelCounter) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *KernelCounter) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.read == nil {
		return
	}
	v, counting, err := c.read()
	if err != nil {
		if msg := err.Error(); msg != c.lastErr {
			c.lastErr = msg
			klog.ErrorS(err, "Reading a kernel counter for /metrics", "metric", "kubeproxy_iptables_localhost_nodeports_accepted_packets_total")
		}
		return
	}
	c.lastErr = ""
	if counting {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.CounterValue, float64(v))
	}
}

// The series of each Service port. Its PortObserver counts them in plain
// atomics and portsCollector exports them at scrape time: a metric vector's
// children (label pairs, a created timestamp and a histogram each) cost
// kilobytes per Service port, every Service port, whether or not it carries
// traffic (docs/decisions/2026-11-27-control-plane-at-scale.md).
var (
	descConnections = prometheus.NewDesc("uproxy_connections_total",
		"Proxied TCP connections and UDP client sessions by Service port, protocol and outcome: success (first attempt), retried (served after failed attempts), failed (no endpoint answered; for UDP, refused by ICMP port unreachable before any reply). UDP datagrams turned away before their client had a session are not counted here: see uproxy_udp_dropped_datagrams_total.",
		[]string{"service", "protocol", "result"}, nil)
	descRetries = prometheus.NewDesc("uproxy_retries_total",
		"Dial attempts of a connection after its first (retries after a failure, and hedges), by Service port.",
		[]string{"service"}, nil)
	descRetryBudgetRefusals = prometheus.NewDesc("uproxy_retry_budget_refusals_total",
		"TCP connections the retry budget refused a further attempt (a retry or a hedge), by Service port.",
		[]string{"service"}, nil)
	descActiveConnections = prometheus.NewDesc("uproxy_active_connections",
		"Open proxied TCP connections (including those still dialing) and UDP client sessions, by Service port.",
		[]string{"service"}, nil)
	descConnectionDuration = prometheus.NewDesc("uproxy_connection_duration_seconds",
		"Lifetime of proxied TCP connections and UDP client sessions (including dialing), by Service port.",
		[]string{"service"}, nil)
	descBytes = prometheus.NewDesc("uproxy_bytes_total",
		"Bytes proxied by Service port and direction (in: client to backend, out: backend to client; UDP: payload bytes).",
		[]string{"service", "direction"}, nil)
	descUDPExpiries = prometheus.NewDesc("uproxy_udp_client_expiries_total",
		"UDP client sessions that ended by idling out (--udp-timeout), by Service port.",
		[]string{"service"}, nil)
	descUDPEndpointRemovals = prometheus.NewDesc("uproxy_udp_clients_moved_total",
		"UDP client sessions ended because their endpoint left the Service (the client's next datagram picks a usable one), by Service port.",
		[]string{"service"}, nil)
	descUDPDropped = prometheus.NewDesc("uproxy_udp_dropped_datagrams_total",
		"UDP datagrams turned away before their client had a session, by Service port and reason: client_table_full (--udp-max-clients), no_socket (the node short of descriptors or memory for the client's socket), no_local_port (no local port left toward the endpoint), no_endpoint (no endpoint to pick).",
		[]string{"service", "reason"}, nil)
	descIdleTimeouts = prometheus.NewDesc("uproxy_idle_timeouts_total",
		"TCP connections reset after no byte moved either way for --tcp-idle-timeout, by Service port.",
		[]string{"service"}, nil)
	descProxyPortReopens = prometheus.NewDesc("uproxy_proxy_port_reopens_total",
		"Times a sync reopened a Service port's proxy socket after it failed for good, by Service port.",
		[]string{"service"}, nil)
	// connectionDurationBuckets are the upper bounds of
	// uproxy_connection_duration_seconds: 1ms .. ~70min.
	connectionDurationBuckets = prometheus.ExponentialBuckets(0.001, 4, numDurationBuckets)
)

const numDurationBuckets = 12

func init() {
	Registry.MustRegister(
		// Beside the memstats: the live heap the last GC marked
		// (go_gc_heap_live_bytes), which after a forced one (with --profiling,
		// /debug/pprof/heap?gc=1) is what the Services held cost.
		collectors.NewGoCollector(collectors.WithGoCollectorRuntimeMetrics(
			collectors.GoRuntimeMetricsRule{Matcher: regexp.MustCompile(`^/gc/heap/live:bytes$`)})),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		SyncDuration, SyncLastTimestamp, SyncLastQueuedTimestamp, NetworkProgrammingDuration,
		ServiceChangesTotal, ServiceChangesPending, EndpointChangesTotal, EndpointChangesPending,
		IPTablesRestoreFailures, ServicePortConflicts, SourceProblems,
		DialAttempts, DialDuration, Ejections, Readmissions, AcceptBackoffs, DialSources,
		LocalhostNodePortsAccepted,
		portsCollector{},
	)
}

// Dial results, the values of the result label of uproxy_dial_attempts_total.
const (
	resultSuccess = iota
	resultRefused
	resultTimeout
	resultUnreachable
	resultReset
	resultOther
	// resultHedgeLost is an attempt abandoned because a hedge connected first.
	resultHedgeLost
	// resultNoLocalPort is a connect that found every local port toward the
	// endpoint taken: the node's shortage, not the endpoint's failure.
	resultNoLocalPort
	// resultOwnSocket is an attempt never made: the endpoint is one of the
	// proxy's own sockets (record.ErrOwnSocket).
	resultOwnSocket
	numResults
)

var resultNames = [numResults]string{"success", "refused", "timeout", "unreachable", "reset", "other", "hedge_lost", "no_local_port", "own_socket"}

// DialResult classifies a dial error for the result label: success, refused,
// timeout, unreachable, reset, other, hedge_lost, no_local_port or own_socket (no-endpoints for a connection that had no
// endpoint to dial).
func DialResult(err error) string {
	if isNoEndpoints(err) {
		return "no-endpoints"
	}
	return resultNames[dialResult(err)]
}

// isNoEndpoints recognises the balancer's "no usable endpoints" error by its
// behaviour, as isTimeout does timeouts, rather than by linking the balancer.
func isNoEndpoints(err error) bool {
	var n interface{ NoEndpoints() bool }
	return errors.As(err, &n) && n.NoEndpoints()
}

func dialResult(err error) int {
	switch {
	case err == nil:
		return resultSuccess
	case errors.Is(err, record.ErrHedgeLost):
		return resultHedgeLost
	case errors.Is(err, record.ErrOwnSocket):
		return resultOwnSocket
	case errors.Is(err, syscall.ECONNREFUSED):
		return resultRefused
	case errors.Is(err, syscall.ETIMEDOUT), isTimeout(err):
		return resultTimeout
	case errors.Is(err, syscall.EHOSTUNREACH), errors.Is(err, syscall.ENETUNREACH):
		return resultUnreachable
	case errors.Is(err, syscall.ECONNRESET):
		return resultReset
	case errors.Is(err, syscall.EADDRNOTAVAIL):
		return resultNoLocalPort
	}
	return resultOther
}

func isTimeout(err error) bool {
	var t interface{ Timeout() bool }
	return errors.As(err, &t) && t.Timeout()
}

// SyncObserved records one sync in the kube-proxy metrics.
func SyncObserved(start time.Time, took time.Duration, err error) {
	SyncDuration.Observe(took.Seconds())
	if err == nil {
		SyncLastTimestamp.Set(float64(start.Add(took).UnixNano()) / 1e9)
	}
}

// dialSources are DialSources' children by record.Source, made once so that a
// dial costs no label lookup.
var dialSources = func() (c [record.SourceFallback + 1]prometheus.Counter) {
	for s := range c {
		c[s] = DialSources.WithLabelValues(record.Source(s).String())
	}
	return c
}()
