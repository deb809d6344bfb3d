package observe

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"k8s.io/klog/v2"
)

// ServiceState is the /debug/services view of one Service port.
type ServiceState struct {
	Name            string          `json:"name"`
	Protocol        string          `json:"protocol"`
	ClusterIPs      []string        `json:"clusterIPs"`
	ExternalIPs     []string        `json:"externalIPs,omitempty"`
	LoadBalancerIPs []string        `json:"loadBalancerIPs,omitempty"`
	Port            int             `json:"port"`
	NodePort        int             `json:"nodePort,omitempty"`
	ProxyPort       int             `json:"proxyPort"`
	SessionAffinity string          `json:"sessionAffinity"`
	AffinityTimeout int             `json:"affinityTimeoutSeconds,omitempty"`
	Scheduler       string          `json:"scheduler"`
	Endpoints       []EndpointState `json:"endpoints"`
	Affinity        []AffinityEntry `json:"affinity"`
	// NextEndpoint is where the scheduler's rotation resumes.
	NextEndpoint     string            `json:"nextEndpoint,omitempty"`
	AffinityCounters *AffinityCounters `json:"affinityCounters,omitempty"`
	ActiveClients    int               `json:"activeClients,omitempty"` // UDP client table size
	RecentEvents     []Event           `json:"recentEvents,omitempty"`
}

// EndpointState is one endpoint in ServiceState.
type EndpointState struct {
	Address           string `json:"address"`
	Ready             bool   `json:"ready"`
	Serving           bool   `json:"serving"`
	Terminating       bool   `json:"terminating"`
	Usable            bool   `json:"usable"`
	ActiveConnections int    `json:"activeConnections"`
}

// AffinityCounters count ClientIP affinity decisions of one Service port.
type AffinityCounters struct {
	Hits    uint64 `json:"hits"`
	Misses  uint64 `json:"misses"`
	Resets  uint64 `json:"resets"`
	Expired uint64 `json:"expired"`
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

// Server serves the metrics address (/metrics, /debug/services, /debug/events,
// /proxyMode) and the healthz address (/healthz, /livez).
type Server struct {
	MetricsAddr string // "" disables
	HealthzAddr string // "" disables
	Mode        string // answered by /proxyMode
	Services    ServicesView
	Events      *Events
	Health      *Health
	// Debug enables the /debug/ handlers (default on via the flag).
	Debug bool

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
		mux.Handle("/livez", s.Health)
	}
	if s.Debug {
		mux.HandleFunc("/debug/services", s.serveServices)
		mux.HandleFunc("/debug/events", s.serveEvents)
	}
	return mux
}

func (s *Server) serveServices(w http.ResponseWriter, r *http.Request) {
	var states []ServiceState
	if s.Services != nil {
		states = s.Services.DebugServices()
	}
	if states == nil {
		states = []ServiceState{}
	}
	if name := r.URL.Query().Get("service"); name != "" {
		var kept []ServiceState
		for _, st := range states {
			if st.Name == name {
				kept = append(kept, st)
			}
		}
		states = kept
	}
	writeJSON(w, map[string]any{"services": states})
}

func (s *Server) serveEvents(w http.ResponseWriter, r *http.Request) {
	n := 100
	if v := r.URL.Query().Get("limit"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n <= 0 {
			http.Error(w, "limit: want a positive integer", http.StatusBadRequest)
			return
		}
	}
	events := []Event{}
	if s.Events != nil {
		events = append(events, s.Events.Recent(r.URL.Query().Get("service"), n)...)
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

// Start binds both addresses and serves them in the background. Binding errors
// are returned at once, so a bad address is reported at start.
func (s *Server) Start() error {
	var binds []struct {
		addr string
		h    http.Handler
	}
	if s.MetricsAddr != "" {
		binds = append(binds, struct {
			addr string
			h    http.Handler
		}{s.MetricsAddr, s.MetricsHandler()})
	}
	if s.HealthzAddr != "" && s.Health != nil {
		mux := http.NewServeMux()
		mux.Handle("/healthz", s.Health)
		mux.Handle("/livez", s.Health)
		binds = append(binds, struct {
			addr string
			h    http.Handler
		}{s.HealthzAddr, mux})
	}
	for _, b := range binds {
		ln, err := net.Listen("tcp", b.addr)
		if err != nil {
			s.Stop(context.Background())
			return fmt.Errorf("listen on %s: %w", b.addr, err)
		}
		srv := &http.Server{Handler: b.h, ReadHeaderTimeout: 10 * time.Second}
		s.servers = append(s.servers, srv)
		go func() {
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				klog.ErrorS(err, "HTTP server stopped", "address", ln.Addr())
			}
		}()
		klog.InfoS("Serving", "address", ln.Addr().String())
	}
	return nil
}

// Stop shuts both servers down.
func (s *Server) Stop(ctx context.Context) {
	for _, srv := range s.servers {
		srv.Shutdown(ctx)
	}
	s.servers = nil
}
