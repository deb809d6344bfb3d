package observe

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/service"
)

// ServiceState is the /debug/services view of one Service port.
type ServiceState struct {
	Name            string   `json:"name"`
	Protocol        string   `json:"protocol"`
	ClusterIPs      []string `json:"clusterIPs"`
	ExternalIPs     []string `json:"externalIPs,omitempty"`
	LoadBalancerIPs []string `json:"loadBalancerIPs,omitempty"`
	Port            int      `json:"port"`
	NodePort        int      `json:"nodePort,omitempty"`
	ProxyPort       int      `json:"proxyPort"`
	// ExternalProxyPort is the proxy port of the NodePort, ExternalIPs and
	// LoadBalancer IPs when they have one of their own (their endpoints may
	// differ from the ClusterIPs'); 0 when they share ProxyPort.
	ExternalProxyPort int             `json:"externalProxyPort,omitempty"`
	SessionAffinity   string          `json:"sessionAffinity"`
	AffinityTimeout   int             `json:"affinityTimeoutSeconds,omitempty"`
	Scheduler         string          `json:"scheduler"`
	Endpoints         []EndpointState `json:"endpoints"`
	// AffinityEntries counts the live ClientIP affinity entries; Affinity
	// lists a sample of them, the most recently used (at most
	// affinity.AffinitySample per address family).
	AffinityEntries int             `json:"affinityEntries,omitempty"`
	Affinity        []AffinityEntry `json:"affinity"`
	// NextEndpoint is the endpoint the next new client (one without an
	// affinity entry, of the first family with endpoints) gets, by the
	// balancer's own decision, and NextReason says why; empty where that
	// hangs on the client's address (sh) or no balancer chooses (kernel modes).
	NextEndpoint     string            `json:"nextEndpoint,omitempty"`
	NextReason       string            `json:"nextReason,omitempty"`
	AffinityCounters *AffinityCounters `json:"affinityCounters,omitempty"`
	ActiveClients    int               `json:"activeClients,omitempty"` // UDP client table size
	// Ejection is the outlier ejection policy ("" when off), e.g. "after 3 consecutive failed dials".
	Ejection string `json:"ejection,omitempty"`
	// Policy is the port's effective retry policy, each value with where it
	// came from (modes that dial in userspace; the scheduler alone for IPVS).
	Policy *PolicyState `json:"policy,omitempty"`
	// Reopens counts the times a sync reopened the proxy port's socket after it
	// failed for good (userspace mode). ListenerError is the latest such
	// failure, and ListenerDown is true from it until the sync that reopens it.
	Reopens       int     `json:"reopens,omitempty"`
	ListenerError string  `json:"listenerError,omitempty"`
	ListenerDown  bool    `json:"listenerDown,omitempty"`
	RecentEvents  []Event `json:"recentEvents,omitempty"`
	// NextForClient is the choice the client of ?client=IP would get next (modes
	// that choose endpoints in userspace only).
	NextForClient *Choice `json:"nextForClient,omitempty"`
	// NextForClientExternal is the same client's choice through the
	// NodePort, ExternalIPs and LoadBalancer IPs, where those have a proxy
	// port of their own (ExternalProxyPort): their endpoints, and whose
	// address the dial carries, may differ from the ClusterIPs'.
	NextForClientExternal *Choice `json:"nextForClientExternal,omitempty"`
	// NotServed, when set, says why the mode does not serve the port at all
	// (its protocol, service.UnservedError): it has no proxy port, endpoints or
	// rules, and is listed so that it is not silently missing.
	NotServed string `json:"notServed,omitempty"`
	// Refused are the port's addresses that the userspace mode's portals
	// refuse rather than steer to the proxy port, for want of endpoints: a
	// connection's first packet gets a TCP reset or ICMP port unreachable,
	// before any socket. Empty when every address is steered.
	Refused []Refused `json:"refused,omitempty"`
}

// Refused is a set of a Service port's addresses that the portals refuse.
type Refused struct {
	// Addresses are "clusterIPs", or "external": the NodePort, ExternalIPs
	// and LoadBalancer IPs.
	Addresses string `json:"addresses"`
	Family    string `json:"family"` // IPv4 or IPv6
	// Reason says why, e.g. "no usable endpoint of IPv4".
	Reason string `json:"reason"`
}

// Choice is the endpoint a given client would get next from a Service port, and why.
type Choice struct {
	Client   string `json:"client"`
	Endpoint string `json:"endpoint,omitempty"`
	Sticky   bool   `json:"sticky"`
	Reason   string `json:"reason"`
	// Source is the address the dial to Endpoint would go from
	// (record.Source: client, node, hairpin), and SourceReason why; empty
	// where the mode does not dial (the kernel modes).
	Source       string `json:"source,omitempty"`
	SourceReason string `json:"sourceReason,omitempty"`
}

// PortState starts the ServiceState of port, as every mode shows it: names,
// addresses, ports, affinity and scheduler, with empty (not null) endpoint and
// affinity lists for the mode to fill.
func PortState(port *service.Port, scheduler string) ServiceState {
	st := ServiceState{
		Name:            port.Name.String(),
		Protocol:        string(port.Protocol),
		ClusterIPs:      addrStrings(port.ClusterIPs),
		ExternalIPs:     addrStrings(port.ExternalIPs),
		LoadBalancerIPs: addrStrings(port.LoadBalancerIPs),
		Port:            port.Port,
		NodePort:        port.NodePort,
		SessionAffinity: "None",
		Scheduler:       scheduler,
		Endpoints:       []EndpointState{},
		Affinity:        []AffinityEntry{},
	}
	if port.AffinityClientIP {
		st.SessionAffinity = "ClientIP"
		st.AffinityTimeout = int(port.AffinityTimeout / time.Second)
	}
	return st
}

// PolicyState is a Service port's effective retry policy.
type PolicyState struct {
	DialTimeouts PolicyValue `json:"dialTimeouts"`
	DialHedge    PolicyValue `json:"dialHedge"`
	RetryBudget  PolicyValue `json:"retryBudget"`
	Scheduler    PolicyValue `json:"scheduler"`
	// RetryTokens is what the retry budget has left (at most 10 retries), while
	// there is a budget.
	RetryTokens *float64 `json:"retryTokens,omitempty"`
}

// PolicyValue is one value of a policy: From is "flag" or "annotation", and
// Source the flag (--dial-hedge) or annotation (uproxy.io/dial-hedge) it came from.
type PolicyValue struct {
	Value  string `json:"value"`
	From   string `json:"from"`
	Source string `json:"source"`
}

// NewPolicyState describes e.
func NewPolicyState(e service.EffectivePolicy) *PolicyState {
	timeouts := make([]string, len(e.DialTimeouts))
	for i, d := range e.DialTimeouts {
		timeouts[i] = d.String()
	}
	hedge, budget := "off", "off"
	if e.DialHedge > 0 {
		hedge = e.DialHedge.String()
	}
	if e.RetryBudget > 0 {
		budget = strconv.FormatFloat(e.RetryBudget, 'f', -1, 64) + "%"
	}
	return &PolicyState{
		DialTimeouts: policyValue(strings.Join(timeouts, ","), e.DialTimeoutsFrom, "--dial-timeouts", service.AnnotationDialTimeouts),
		DialHedge:    policyValue(hedge, e.DialHedgeFrom, "--dial-hedge", service.AnnotationDialHedge),
		RetryBudget:  policyValue(budget, e.RetryBudgetFrom, "--retry-budget", service.AnnotationRetryBudget),
		Scheduler:    policyValue(e.Scheduler, e.SchedulerFrom, "--scheduler", service.AnnotationScheduler),
	}
}

func policyValue(v, from, flag, annotation string) PolicyValue {
	src := flag
	if from == service.FromAnnotation {
		src = annotation
	}
	return PolicyValue{Value: v, From: from, Source: src}
}

// String says where the value came from, as "30ms (annotation uproxy.io/dial-hedge)".
func (v PolicyValue) String() string { return v.Value + " (" + v.From + " " + v.Source + ")" }

// addrStrings formats addresses for a ServiceState (never nil, so JSON shows []).
func addrStrings(addrs []netip.Addr) []string {
	out := make([]string, len(addrs))
	for i, a := range addrs {
		out[i] = a.String()
	}
	return out
}

// EndpointState is one endpoint in ServiceState.
type EndpointState struct {
	Address           string `json:"address"`
	Ready             bool   `json:"ready"`
	Serving           bool   `json:"serving"`
	Terminating       bool   `json:"terminating"`
	Usable            bool   `json:"usable"`
	ActiveConnections int    `json:"activeConnections"`
	// ConsecutiveFailures counts failed dials since the last successful one.
	ConsecutiveFailures int `json:"consecutiveFailures"`
	// Ejected is true while outlier detection keeps the endpoint out of new
	// picks, until EjectedUntil (RFC3339, UTC).
	Ejected      bool   `json:"ejected"`
	EjectedUntil string `json:"ejectedUntil,omitempty"`
	// Packets and Bytes are the kernel's counters of the endpoint's DNAT rules
	// (iptables mode). Only a connection's first packet passes the nat table, so
	// Packets counts the connections (UDP flows) the kernel sent to the endpoint,
	// whether or not they succeeded, and Bytes the size of those first packets.
	Packets uint64 `json:"packets,omitempty"`
	Bytes   uint64 `json:"bytes,omitempty"`
}

// AffinityCounters count ClientIP affinity decisions of one Service port.
type AffinityCounters struct {
	Hits    uint64 `json:"hits"`
	Misses  uint64 `json:"misses"`
	Resets  uint64 `json:"resets"`
	Expired uint64 `json:"expired"`
	// Evicted counts live entries removed to keep the table within its bound.
	Evicted uint64 `json:"evicted"`
}

// AffinityEntry is one ClientIP affinity entry.
type AffinityEntry struct {
	Client   string `json:"client"`
	Endpoint string `json:"endpoint"`
	LastUsed string `json:"lastUsed"` // RFC3339
}

// A ServicesView reports the state of every Service port (the running mode).
type ServicesView interface {
	DebugServices() []ServiceState
}

// A ChoiceView says which endpoint client would get next from a Service port,
// through its ClusterIPs or (external) its NodePort, ExternalIPs and
// LoadBalancer IPs; the userspace mode implements it. ok is false for an
// unknown Service port.
type ChoiceView interface {
	NextChoice(service string, client netip.Addr, external bool) (c Choice, ok bool)
}

// Server serves the metrics address (/metrics, /debug/services, /debug/events,
// /proxyMode, and /debug/pprof/ with Profiling) and the healthz address
// (/healthz, /livez).
type Server struct {
	// MetricsListener and HealthzListener are the bound addresses to serve; nil
	// disables one. The program binds them before anything else, so a taken port
	// is reported as its flag's error. Stop closes them, also when Start never
	// ran.
	MetricsListener, HealthzListener net.Listener
	// MetricsAddress and HealthzAddress are the addresses the listeners were
	// bound to as asked (HOST:PORT), which the log names; empty: the
	// listener's own address.
	MetricsAddress, HealthzAddress string
	// MetricsConns and HealthzConns cap the connections each listener holds
	// open (HealthzConns with the health check ports it is shared with); nil
	// caps nothing.
	MetricsConns, HealthzConns *ConnLimit

	Mode     string // answered by /proxyMode
	Services ServicesView
	// Conflicts, if set, are listed by /debug/services.
	Conflicts *Conflicts
	// Unserved, if set, are listed among the Service ports of /debug/services.
	Unserved *Unserved
	// Problems, if set, are listed by /debug/services.
	Problems *Problems
	Events   *Events
	Health   *Health
	// Debug enables the /debug/ handlers (default on via the flag).
	Debug bool
	// Profiling serves Go's profiles under /debug/pprof/ (kube-proxy's
	// --profiling): CPU, heap after a forced GC (heap?gc=1), goroutines.
	Profiling bool

	servers []*http.Server
}

// MetricsHandler returns the handler of the metrics address.
func (s *Server) MetricsHandler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(Registry, promhttp.HandlerOpts{}))
	mux.HandleFunc("/proxyMode", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fmt.Fprint(w, s.Mode)
	})
	if s.Health != nil {
		mux.Handle("/healthz", s.Health)
		mux.Handle("/livez", s.Health.Livez())
	}
	if s.Debug {
		mux.HandleFunc("/debug/services", s.serveServices)
		mux.HandleFunc("/debug/events", s.serveEvents)
		mux.HandleFunc("/debug/memory", serveMemory)
		mux.HandleFunc("/debug/{$}", servePage)
		mux.Handle("/debug", http.RedirectHandler("/debug/", http.StatusMovedPermanently))
	}
	if s.Profiling {
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}
	return mux
}

// serveServices answers /debug/services[?service=NAME][&client=IP]: the state of
// every Service port, and the address conflicts (those of NAME: the ones it
// serves or is left out by).
func (s *Server) serveServices(w http.ResponseWriter, r *http.Request) {
	var client netip.Addr
	if v := r.URL.Query().Get("client"); v != "" {
		var err error
		if client, err = netip.ParseAddr(v); err != nil {
			http.Error(w, fmt.Sprintf("client %q: want an IP address", v), http.StatusBadRequest)
			return
		}
	}
	var states []ServiceState
	if s.Services != nil {
		states = s.Services.DebugServices()
	}
	if s.Unserved != nil {
		states = slices.Concat(states, s.Unserved.List())
	}
	if states == nil {
		states = []ServiceState{}
	}
	conflicts := []ConflictState{}
	if s.Conflicts != nil {
		conflicts = s.Conflicts.List()
	}
	if name := r.URL.Query().Get("service"); name != "" {
		kept := []ServiceState{}
		for _, st := range states {
			if st.Name == name {
				kept = append(kept, st)
			}
		}
		states = kept
		keptConflicts := []ConflictState{}
		for _, c := range conflicts {
			if c.ServedBy == name || c.LeftOut == name {
				keptConflicts = append(keptConflicts, c)
			}
		}
		conflicts = keptConflicts
	}
	if cv, ok := s.Services.(ChoiceView); ok && client.IsValid() {
		for i := range states {
			if c, ok := cv.NextChoice(states[i].Name, client, false); ok {
				states[i].NextForClient = &c
			}
			if states[i].ExternalProxyPort == 0 {
				continue
			}
			if c, ok := cv.NextChoice(states[i].Name, client, true); ok {
				states[i].NextForClientExternal = &c
			}
		}
	}
	body := map[string]any{"mode": s.Mode, "services": states, "conflicts": conflicts}
	if s.Problems != nil {
		body["problems"], body["problemCount"] = s.Problems.List()
	}
	leftOut := []string{}
	if pv, ok := s.Services.(PortErrorsView); ok {
		for _, err := range pv.PortErrors() {
			leftOut = append(leftOut, err.Error())
		}
	}
	body["leftOut"] = leftOut
	writeJSON(w, body)
}

// A PortErrorsView says which Service ports the mode's last sync left out,
// and why (no proxy port free, a NodePort held by another program); the
// userspace mode implements it.
type PortErrorsView interface {
	PortErrors() []error
}

// serveEvents answers /debug/events with the filters of Query as parameters:
// service, kind, outcome, since, limit (default 100).
func (s *Server) serveEvents(w http.ResponseWriter, r *http.Request) {
	v := r.URL.Query()
	q := Query{Service: v.Get("service"), Kind: v.Get("kind"), Outcome: v.Get("outcome"), Limit: 100}
	if l := v.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n <= 0 {
			http.Error(w, "limit: want a positive integer", http.StatusBadRequest)
			return
		}
		q.Limit = n
	}
	if since := v.Get("since"); since != "" {
		n, err := strconv.ParseUint(since, 10, 64)
		if err != nil {
			http.Error(w, "since: want an event id", http.StatusBadRequest)
			return
		}
		q.Since = n
	}
	switch q.Kind {
	case "", KindConnection, KindEjection, KindReadmission, KindHandover:
	default:
		http.Error(w, "kind: want connection, ejection, readmission or handover", http.StatusBadRequest)
		return
	}
	switch q.Outcome {
	case "", OutcomeSuccess, OutcomeRetried, OutcomeFailed, HandoverDoneOutcome, HandoverRefusedOutcome, HandoverAbandonedOutcome:
	default:
		http.Error(w, "outcome: want success, retried or failed (connections), or done, refused or abandoned (handovers)", http.StatusBadRequest)
		return
	}
	events := []Event{}
	if s.Events != nil {
		events = s.Events.Query(q)
	}
	writeJSON(w, map[string]any{"events": events})
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		klog.V(2).InfoS("Writing debug response failed", "err", err)
	}
}

// Start serves both listeners in the background.
func (s *Server) Start() {
	type serve struct {
		ln    net.Listener
		asked string
		h     http.Handler
		conns *ConnLimit
	}
	var serves []serve
	if s.MetricsListener != nil {
		serves = append(serves, serve{s.MetricsListener, s.MetricsAddress, s.MetricsHandler(), s.MetricsConns})
	}
	if s.HealthzListener != nil && s.Health != nil {
		mux := http.NewServeMux()
		mux.Handle("/healthz", s.Health)
		mux.Handle("/livez", s.Health.Livez())
		serves = append(serves, serve{s.HealthzListener, s.HealthzAddress, mux, s.HealthzConns})
	}
	for _, b := range serves {
		ln := b.conns.Listener(b.ln)
		srv := newHTTPServer(b.h)
		s.servers = append(s.servers, srv)
		go func() {
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				klog.ErrorS(err, "HTTP server stopped", "address", ln.Addr())
			}
		}()
		klog.InfoS("Serving", "address", shownAddress(b.asked, ln))
	}
}

// shownAddress is the address to name for ln, bound to asked: asked itself,
// with the port the kernel chose when asked for port 0. The listener's own
// address is not what was asked for a wildcard: Go listens on 0.0.0.0 with a
// socket of both families, whose address reads [::].
func shownAddress(asked string, ln net.Listener) string {
	host, port, err := net.SplitHostPort(asked)
	if err != nil {
		return ln.Addr().String()
	}
	if port == "0" {
		if ta, ok := ln.Addr().(*net.TCPAddr); ok {
			port = strconv.Itoa(ta.Port)
		}
	}
	return net.JoinHostPort(host, port)
}

// Stop shuts both servers down.
func (s *Server) Stop(ctx context.Context) {
	for _, srv := range s.servers {
		srv.Shutdown(ctx)
	}
	s.servers = nil
	// Shutdown closed the listeners it served; these may never have been.
	for _, ln := range []net.Listener{s.MetricsListener, s.HealthzListener} {
		if ln != nil {
			ln.Close()
		}
	}
}
