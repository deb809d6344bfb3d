package observe

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/service"
)

// HealthCheckServer answers on the healthCheckNodePort of every Service with
// externalTrafficPolicy: Local, as kube-proxy does, so that cloud load balancers
// send traffic only to nodes with local endpoints: 200 with the number of this
// node's ready endpoints when there are some and the proxy is healthy, 503
// otherwise, with kube-proxy's JSON body and headers.
//
// Call Sync after every successful sync of the mode, and Close at exit.
type HealthCheckServer struct {
	// IPs are the node addresses to listen on; if empty, every address.
	IPs []netip.Addr
	// Healthy reports whether the proxy keeps up with its source (the /healthz
	// verdict); if nil, it always does.
	Healthy func() bool
	// Listen opens a listener; if nil, net.Listen.
	Listen func(network, address string) (net.Listener, error)
	// Conns caps the connections of every health check port, with those of
	// the other HTTP servers it is shared with; nil caps nothing.
	Conns *ConnLimit

	mu    sync.Mutex
	ports map[int]*healthPort // by healthCheckNodePort
}

// healthPort is one healthCheckNodePort: the Service it answers for, its count
// of local ready endpoints (guarded by the server's mu), and its HTTP server.
type healthPort struct {
	svc    types.NamespacedName
	local  int
	server *http.Server
}

// Sync opens the ports of the Services in s that need one, closes the others and
// updates the endpoint counts. It returns the ports that could not be opened;
// those are retried on the next Sync.
func (h *HealthCheckServer) Sync(s *service.Snapshot) error {
	want := map[int]types.NamespacedName{}
	local := map[types.NamespacedName]map[netip.Addr]bool{}
	for _, p := range s.Ports {
		if !p.ExternalPolicyLocal || p.HealthCheckNodePort == 0 {
			continue
		}
		nsn := types.NamespacedName{Namespace: p.Name.Namespace, Name: p.Name.Name}
		want[p.HealthCheckNodePort] = nsn
		if local[nsn] == nil {
			local[nsn] = map[netip.Addr]bool{}
		}
		// kube-proxy counts endpoints (pods), not ports: an address serving
		// several ports of the Service counts once.
		for _, e := range p.Endpoints {
			if e.Local && e.Ready {
				local[nsn][e.Addr.Addr()] = true
			}
		}
	}

	h.mu.Lock()
	defer h.mu.Unlock()
	if h.ports == nil {
		h.ports = map[int]*healthPort{}
	}
	for port, hp := range h.ports {
		if want[port] != hp.svc {
			hp.server.Close()
			delete(h.ports, port)
			klog.V(2).InfoS("Closed health check port", "port", port, "service", hp.svc)
		}
	}
	var errs []error
	for port, nsn := range want {
		hp := h.ports[port]
		if hp == nil {
			var err error
			if hp, err = h.open(port, nsn); err != nil {
				errs = append(errs, err)
				continue
			}
			h.ports[port] = hp
		}
		hp.local = len(local[nsn])
	}
	return errors.Join(errs...)
}

// open listens on port at every address and serves it. h.mu is held.
func (h *HealthCheckServer) open(port int, nsn types.NamespacedName) (*healthPort, error) {
	hp := &healthPort{svc: nsn}
	hp.server = newHTTPServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { h.serve(w, hp) }))
	listen := h.Listen
	if listen == nil {
		listen = net.Listen
	}
	addrs := []string{":" + strconv.Itoa(port)}
	if len(h.IPs) > 0 {
		addrs = addrs[:0]
		for _, ip := range h.IPs {
			addrs = append(addrs, netip.AddrPortFrom(ip, uint16(port)).String())
		}
	}
	var lns []net.Listener
	for _, a := range addrs {
		ln, err := listen("tcp", a)
		if err != nil {
			for _, l := range lns {
				l.Close()
			}
			return nil, fmt.Errorf("health check port %d of %s: %w", port, nsn, err)
		}
		lns = append(lns, h.Conns.Listener(ln))
	}
	for _, ln := range lns {
		go func() {
			if err := hp.server.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				klog.ErrorS(err, "Health check port stopped", "port", port, "service", nsn)
			}
		}()
	}
	klog.V(2).InfoS("Opened health check port", "port", port, "service", nsn)
	return hp, nil
}

func (h *HealthCheckServer) serve(w http.ResponseWriter, hp *healthPort) {
	h.mu.Lock()
	count := hp.local
	h.mu.Unlock()
	healthy := h.Healthy == nil || h.Healthy()
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.Header().Set("X-Load-Balancing-Endpoint-Weight", strconv.Itoa(count))
	if count > 0 && healthy {
		w.WriteHeader(http.StatusOK)
	} else {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	fmt.Fprintf(w, "{\n\t\"service\": {\n\t\t\"namespace\": %q,\n\t\t\"name\": %q\n\t},\n\t\"localEndpoints\": %d,\n\t\"serviceProxyHealthy\": %v\n}\n",
		hp.svc.Namespace, hp.svc.Name, count, healthy)
}

// Close closes every health check port, letting answers in progress finish
// until ctx is done.
func (h *HealthCheckServer) Close(ctx context.Context) error {
	h.mu.Lock()
	ports := h.ports
	h.ports = nil
	h.mu.Unlock()
	// Shut down without mu: the handlers take it.
	var errs []error
	for port, hp := range ports {
		if err := hp.server.Shutdown(ctx); err != nil {
			errs = append(errs, fmt.Errorf("health check port %d: %w", port, err))
		}
	}
	return errors.Join(errs...)
}
