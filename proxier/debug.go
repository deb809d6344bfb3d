package proxier

import (
	"fmt"
	"net/netip"
	"sort"
	"time"

	"github.com/uproxy/uproxy/affinity"
	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/record"
	"github.com/uproxy/uproxy/rules"
	"github.com/uproxy/uproxy/service"
)

// What the proxier shows of its state: /debug/services, explain's next choice
// and the balancer figures observe exports at scrape time.

// DebugServices reports every Service port for /debug/services.
func (p *Proxier) DebugServices() []observe.ServiceState {
	p.mu.RLock()
	ports := make([]*servicePort, 0, len(p.ports))
	for _, sp := range p.ports {
		ports = append(ports, sp)
	}
	p.mu.RUnlock()
	sort.Slice(ports, func(i, j int) bool { return ports[i].name.Less(ports[j].name) })

	out := make([]observe.ServiceState, 0, len(ports))
	for _, sp := range ports {
		out = append(out, p.debugState(sp))
	}
	return out
}

func (p *Proxier) debugState(sp *servicePort) observe.ServiceState {
	port := sp.port.Load()
	pol := p.policy(port)
	st := observe.PortState(port, sp.cluster.picker.scheduler())
	st.Policy = observe.NewPolicyState(pol)
	if tcp := sp.cluster.tcp; tcp != nil && pol.RetryBudget > 0 {
		// The external route, when there is one, has a bucket of its own.
		tokens := tcp.RetryTokens()
		if ext := sp.external.Load(); ext != nil {
			tokens += ext.tcp.RetryTokens()
		}
		st.Policy.RetryTokens = &tokens
	}
	ls := sp.cluster.listener.Load()
	st.ProxyPort, st.Reopens = ls.proxyPort, ls.reopens
	if ext := sp.external.Load(); ext != nil {
		el := ext.listener.Load()
		st.ExternalProxyPort = el.proxyPort
		st.Reopens += el.reopens
	}
	if err := ls.serving.failed(); err != nil {
		st.ListenerDown, st.ListenerError = true, err.Error()
	} else if ls.lastFailure != nil {
		st.ListenerError = ls.lastFailure.Error()
	}
	if sp.protocol == service.UDP {
		st.ActiveClients = sp.udpClients()
	}
	bs := sp.state()
	balanced := make(map[netip.AddrPort]affinity.EndpointState, len(bs.Endpoints))
	for _, e := range bs.Endpoints {
		balanced[e.Addr] = e
	}
	if e := p.ejection(); e.After > 0 {
		st.Ejection = fmt.Sprintf("after %d consecutive failed dials, for %v doubling up to %v", e.After, e.Base, e.Max)
	}
	usable := make(map[netip.AddrPort]bool)
	p.mu.RLock()
	zone := p.zone
	p.mu.RUnlock()
	for _, e := range port.ClusterEndpoints(zone) {
		usable[e.Addr] = true
	}
	if sp.external.Load() != nil {
		for _, e := range port.ExternalEndpoints(zone) {
			usable[e.Addr] = true
		}
	}
	for _, e := range port.Endpoints {
		b := balanced[e.Addr]
		es := observe.EndpointState{
			Address:             e.Addr.String(),
			Ready:               e.Ready,
			Serving:             e.Serving,
			Terminating:         e.Terminating,
			Usable:              usable[e.Addr],
			ActiveConnections:   b.Active,
			ConsecutiveFailures: b.Failures,
			Ejected:             !b.EjectedUntil.IsZero(),
		}
		if es.Ejected {
			es.EjectedUntil = b.EjectedUntil.UTC().Format(time.RFC3339Nano)
		}
		st.Endpoints = append(st.Endpoints, es)
	}
	st.AffinityEntries = bs.AffinityEntries
	for _, a := range bs.Affinity {
		st.Affinity = append(st.Affinity, observe.AffinityEntry{
			Client:   a.Client.String(),
			Endpoint: a.Endpoint.String(),
			LastUsed: a.LastUsed.UTC().Format(time.RFC3339),
		})
	}
	if bs.Next.IsValid() {
		st.NextEndpoint, st.NextReason = bs.Next.String(), bs.NextReason
	}
	st.AffinityCounters = &observe.AffinityCounters{
		Hits: bs.Counters.AffinityHits, Misses: bs.Counters.AffinityMisses,
		Resets: bs.Counters.AffinityResets, Expired: bs.Counters.AffinityExpired,
		Evicted: bs.Counters.AffinityEvicted,
	}
	if p.cfg.Events != nil {
		st.RecentEvents = p.cfg.Events.Recent(st.Name, 10)
	}
	if _, none := p.cfg.Portals.(rules.None); !none {
		st.Refused = refusedAddresses(port, *sp.refusal.Load())
	}
	return st
}

// refusedAddresses words r, the Refusal the portals were given for port, for
// the families and kinds of address port has.
func refusedAddresses(port *service.Port, r rules.Refusal) []observe.Refused {
	var out []observe.Refused
	for _, v6 := range []bool{false, true} {
		if !port.InFamily(v6) {
			continue
		}
		family := "IPv4"
		if v6 {
			family = "IPv6"
		}
		classes := []struct {
			addresses string
			external  bool
			has       bool
			local     bool // the class's traffic policy is Local
			policy    string
		}{
			{"clusterIPs", false, len(service.AddrsOfFamily(port.ClusterIPs, v6)) > 0, port.InternalPolicyLocal, "internalTrafficPolicy"},
			{"external", true, port.NodePort != 0 || len(service.AddrsOfFamily(port.ExternalIPs, v6)) > 0 || len(service.AddrsOfFamily(port.LoadBalancerIPs, v6)) > 0,
				port.ExternalPolicyLocal, "externalTrafficPolicy"},
		}
		for _, c := range classes {
			if !c.has || !r.Refused(c.external, v6) {
				continue
			}
			reason := "no usable endpoint of " + family
			if c.local {
				reason += " on this node (" + c.policy + ": Local)"
			}
			out = append(out, observe.Refused{Addresses: c.addresses, Family: family, Reason: reason})
		}
	}
	return out
}

// NextChoice says which endpoint client would get next from the Service port
// named service (ns/name:port), through its ClusterIPs or, when external,
// through its NodePort, ExternalIPs and LoadBalancer IPs, and from which
// address the dial would go, and why, without changing any state. It asks
// what a connection of the data path asks (clientDecision), of the route that
// serves those addresses.
func (p *Proxier) NextChoice(service string, client netip.Addr, external bool) (observe.Choice, bool) {
	p.mu.RLock()
	var sp *servicePort
	for name, s := range p.ports {
		if name.String() == service {
			sp = s
			break
		}
	}
	p.mu.RUnlock()
	if sp == nil {
		return observe.Choice{}, false
	}
	r := sp.cluster
	if ext := sp.external.Load(); external && ext != nil {
		r = ext
	}
	short, keep, why := p.clientDecision(r, client)
	picked := r
	if short {
		picked = sp.cluster
	}
	out := observe.Choice{Client: client.String()}
	c, err := picked.explain(client)
	if err != nil {
		out.Reason = err.Error()
		return out, true
	}
	out.Endpoint, out.Sticky, out.Reason = c.Endpoint.String(), c.Sticky, c.Reason
	switch {
	case !keep:
		out.Source = record.SourceNode.String()
	case c.Endpoint.Addr().Unmap() == client:
		out.Source, why = record.SourceHairpin.String(), "the client is the endpoint itself: kube-proxy masquerades a pod reaching itself"
	default:
		out.Source = record.SourceClient.String()
	}
	out.SourceReason = why
	return out, true
}

var _ observe.ChoiceView = (*Proxier)(nil)
