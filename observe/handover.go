package observe

import "github.com/prometheus/client_golang/prometheus"

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
)

func init() { Registry.MustRegister(HandoverTotal, HandoverSockets) }
