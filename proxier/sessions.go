package proxier

import (
	"errors"
	"fmt"
	"sync"

	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/socket"
)

// A uproxy that hands over to its successor also hands it its established
// TCP connections: it stops accepting (StopAccepting: the successor accepts
// on its own copies of the proxy sockets), detaches them in batches
// (DetachSessions), each with the route it was on, and the successor resumes
// each on the route of the same Service port and class (ResumeSessions). A
// connection whose route the successor does not have (its Service is gone)
// is reset there. UDP client entries move too, after the TCP connections
// (DetachUDPClients, ResumeUDPClients): each keeps its endpoint.

// RouteKey names a TCP route of a Service port in any process: its Service
// port and its class (External: the route of the NodePort, ExternalIPs and
// LoadBalancer IPs).
type RouteKey struct {
	Service  service.PortName
	External bool
}

// RouteSessions are connections detached from one route.
type RouteSessions struct {
	Route  RouteKey
	States []socket.SessionState
}

// tcpRoutes returns every TCP route with its key.
func (p *Proxier) tcpRoutes() ([]RouteKey, []*route) { return p.routesOf(service.TCP) }

// routesOf returns every route of protocol with its key.
func (p *Proxier) routesOf(protocol service.Protocol) ([]RouteKey, []*route) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	var keys []RouteKey
	var routes []*route
	for _, sp := range p.ports {
		if sp.protocol != protocol {
			continue
		}
		for _, r := range sp.routes() {
			if (protocol == service.TCP && r.tcp != nil) || (protocol == service.UDP && r.udp != nil) {
				keys = append(keys, RouteKey{Service: sp.name, External: r.external})
				routes = append(routes, r)
			}
		}
	}
	return keys, routes
}

// routeOf returns the route key names for protocol (nil: none here).
func (p *Proxier) routeOf(key RouteKey, protocol service.Protocol) *route {
	p.mu.RLock()
	sp := p.ports[key.Service]
	p.mu.RUnlock()
	if sp == nil || sp.protocol != protocol {
		return nil
	}
	if key.External {
		return sp.external.Load()
	}
	return sp.cluster
}

// RouteUDPClients are UDP client entries detached from one route.
type RouteUDPClients struct {
	Route   RouteKey
	Clients []socket.UDPClientState
}

// DetachUDPClients stops reading every UDP proxy socket here and detaches
// every UDP client entry, grouped by route (socket.UDPProxy.DetachClients):
// from then on the successor, reading its own copies of the sockets, serves
// the clients. The caller closes each state once the successor resumed it.
func (p *Proxier) DetachUDPClients() ([]RouteUDPClients, error) {
	keys, routes := p.routesOf(service.UDP)
	var out []RouteUDPClients
	var errs []error
	for i, r := range routes {
		states, err := r.udp.DetachClients()
		if len(states) > 0 {
			out = append(out, RouteUDPClients{Route: keys[i], Clients: states})
		}
		errs = append(errs, err)
	}
	return out, errors.Join(errs...)
}

// ResumeUDPClients resumes the client entries on the UDP route key names;
// without such a route each is dropped (its socket closed: its client's next
// datagram makes an entry wherever it is read). It returns how many were
// dropped, and why.
func (p *Proxier) ResumeUDPClients(key RouteKey, states []socket.UDPClientState) (dropped int, err error) {
	if len(states) == 0 {
		return 0, nil
	}
	r := p.routeOf(key, service.UDP)
	if r == nil || r.udp == nil {
		for i := range states {
			states[i].Close()
		}
		return len(states), fmt.Errorf("resume %d UDP clients of %s (external %v): no such UDP route here", len(states), key.Service, key.External)
	}
	return r.udp.ResumeClients(states)
}

// StopAccepting closes this process's copies of the TCP proxy sockets; their
// connections go on. A successor holding copies of its own accepts from then
// on. UDP sockets are left to Shutdown.
//
// The routes close all at once: each close waits for its listener to leave
// its event loop, and one after another 10,000 of them took over 10 s under
// load (BenchmarkTakeOver), past the successor's wait for its first
// connections; at once, their loops take them out in a few rounds.
func (p *Proxier) StopAccepting() error {
	_, routes := p.tcpRoutes()
	errs := make([]error, len(routes))
	var wg sync.WaitGroup
	for i, r := range routes {
		wg.Go(func() { errs[i] = r.tcp.Close() })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// DetachSessions detaches up to max established TCP connections (those still
// dialing stay), grouped by route; none left gives none. The caller closes
// each state once its successor resumed it, or gives it back to
// ResumeSessions.
func (p *Proxier) DetachSessions(max int) ([]RouteSessions, error) {
	keys, routes := p.tcpRoutes()
	var out []RouteSessions
	n := 0
	for i, r := range routes {
		if n >= max {
			break
		}
		states, err := r.tcp.Detach(max - n)
		if len(states) > 0 {
			out = append(out, RouteSessions{Route: keys[i], States: states})
			n += len(states)
		}
		if err != nil {
			return out, err
		}
	}
	return out, nil
}

// ResumeSessions resumes states on the TCP route key names; when there is no
// such route (the Service port is gone, or is no longer TCP, or has no
// external route), each is reset. It returns how many were reset (those that
// could not be resumed too) and why.
func (p *Proxier) ResumeSessions(key RouteKey, states []socket.SessionState) (reset int, err error) {
	if len(states) == 0 {
		return 0, nil
	}
	r := p.routeOf(key, service.TCP)
	if r == nil || r.tcp == nil {
		for i := range states {
			states[i].Reset()
		}
		return len(states), fmt.Errorf("resume %d connections of %s (external %v): no such TCP route here", len(states), key.Service, key.External)
	}
	if err := r.tcp.Resume(states); err != nil {
		var re *socket.ResumeError
		if errors.As(err, &re) {
			return re.Reset, err
		}
		return len(states), err
	}
	return 0, nil
}
