package observe

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// The handovers between a uproxy and its successor (app/takeover.go). role is
// from (this process handed over) or to (it took over); result is done,
// refused (of another mode, prefix or portal backend; not a take-over
// request), or abandoned (the other side went away halfway: the process
// that handed over goes on serving).
var (
	HandoverTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "uproxy_handover_total",
		Help: "Handovers to a successor (role from) or from a predecessor (role to), by result: done, refused, abandoned.",
	}, []string{"role", "result"})
	HandoverSockets = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "uproxy_handover_sockets_total",
		Help: "Sockets handed to a successor (role from) or taken from a predecessor (role to), by kind: http, proxy, nodeport, lock.",
	}, []string{"role", "kind"})
	HandoverRefusals = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "uproxy_handover_refusals_total",
		Help: "Handovers refused, by role and reason: not_root (the peer is not root), protocol_version (another handover protocol), " +
			"not_a_request (the first message was none, or malformed), another_uproxy (another mode, --chain-prefix or --rules), " +
			"cannot_hand (the sockets could not be duplicated).",
	}, []string{"role", "reason"})
	HandoverConnections = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "uproxy_handover_connections_total",
		Help: "Established TCP connections of a handover: role from, handed (the successor has them) or kept (served and drained here); " +
			"role to, resumed or reset (their Service port is gone here, or they could not be resumed).",
	}, []string{"role", "result"})
	HandoverBytesInFlight = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "uproxy_handover_bytes_in_flight_total",
		Help: "Bytes the relay held (buffers, splice pipes) in the connections handed (role from) or taken (role to): moved with them, not lost.",
	}, []string{"role"})
	HandoverDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "uproxy_handover_duration_seconds",
		Help: "How long a handover took: role to, from the request to the last connection resumed; role from, from the request to the last connection handed.",
		// 10 ms to about 80 s.
		Buckets: prometheus.ExponentialBuckets(0.01, 2, 14),
	}, []string{"role"})
)

// HandoverRefused counts a refused handover of role for reason (see
// HandoverRefusals).
func HandoverRefused(role, reason string) {
	HandoverTotal.WithLabelValues(role, "refused").Inc()
	HandoverRefusals.WithLabelValues(role, reason).Inc()
}

// HandoverDone counts a handover of role that took d.
func HandoverDone(role string, d time.Duration) {
	HandoverTotal.WithLabelValues(role, "done").Inc()
	HandoverDuration.WithLabelValues(role).Observe(d.Seconds())
}

// ServerStarts is the serving process's start under its crash holder.
var ServerStarts = prometheus.NewGauge(prometheus.GaugeOpts{
	Name: "uproxy_server_starts",
	Help: "Starts of the serving uproxy under its crash holder (--crash-holder): 1, and one more after each crash it was restarted from; 1 without a holder.",
})

func init() {
	ServerStarts.Set(1)
	Registry.MustRegister(ServerStarts, HandoverTotal, HandoverSockets, HandoverRefusals, HandoverConnections, HandoverBytesInFlight, HandoverDuration)
}
