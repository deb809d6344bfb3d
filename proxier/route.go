package proxier

import (
	"net/netip"
	"sync/atomic"

	"github.com/uproxy/uproxy/affinity"
	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/socket"
)

// Which endpoints a connection may reach depends on how it came in, as in
// kube-proxy: through a ClusterIP it gets the port's ClusterEndpoints, through
// a NodePort, ExternalIP or LoadBalancer IP its ExternalEndpoints, and in
// either case only endpoints of its own address family.
//
// The traffic class is told apart by proxy port. A Service port whose two
// classes may get different endpoints (service.Port.SplitsExternal: its
// traffic policies differ and it has external addresses) has a second proxy
// port, and the portals steer its external addresses there; every other port
// has one. The alternative, reading each connection's original destination
// (SO_ORIGINAL_DST), costs a system call per TCP connection, and has no
// counterpart for UDP: a datagram redirected to the proxy port arrives with the
// node's address as its destination, and its original one is only in
// conntrack. Two proxy ports cost nothing per connection or datagram, work the
// same for TCP and UDP, and leave the portals' cost flat (a rule's target or a
// map element's value is another port number). Whether a port has the second
// proxy port follows the Service's spec alone, so its proxy ports stay put
// while its endpoints come and go.
//
// The family needs no such help: the client's address is of the family of
// the address it connected to (NAT never changes the family), so each class
// has one balancer per family and a connection picks from its client's.

// route is one traffic class of a Service port: its proxy socket, the proxy
// serving it and the balancers it picks from. Exactly one of tcp, udp is set.
type route struct {
	// listener is the proxy socket: replaced whole, by Sync, when a failed
	// socket is reopened (listener.go).
	listener atomic.Pointer[listenerState]
	picker   *familyPicker
	tcp      *socket.TCPProxy
	udp      *socket.UDPProxy
	// endpoints are those the last update gave the route; only Sync uses them.
	endpoints []netip.AddrPort
	// external: the route serves the NodePort, ExternalIPs and LoadBalancer
	// IPs; localPolicy: the port's externalTrafficPolicy is Local (as of the
	// last update). Both decide whose address its dials carry.
	external    bool
	localPolicy atomic.Bool
}

// familyPicker is the socket.Picker of one route: a balancer per address
// family. A client gets endpoints of its own family only, as each of
// kube-proxy's per-family proxiers programs its family's endpoints only; a
// client of a family without endpoints is refused.
//
// The balancer of the Service port's primary family is made with the picker;
// the other's only once its family has endpoints (or a predecessor's memory
// of it), after which it stays. Most Service ports are of one family, and a
// balancer that never has endpoints cost 256 bytes per route: 2.5 MB of heap
// at 10k Service ports.
type familyPicker struct {
	fam     [2]atomic.Pointer[affinity.Balancer] // IPv4, IPv6
	primary uint8
}

var _ socket.Picker = (*familyPicker)(nil)

func familyIndex(a netip.Addr) int {
	if a.Unmap().Is4() {
		return 0
	}
	return 1
}

// newFamilyPicker makes the picker of a route of port.
func newFamilyPicker(scheduler string, ej affinity.Ejection, obs affinity.EjectionObserver, port *service.Port) (*familyPicker, error) {
	b, err := affinity.NewBalancer(scheduler)
	if err != nil {
		return nil, err
	}
	b.SetEjection(ej)
	// The balancer ejects endpoints from the dial reports of the socket
	// layer; the observer only hears of its decisions.
	b.SetEjectionObserver(obs)
	fp := &familyPicker{}
	if len(port.ClusterIPs) > 0 {
		fp.primary = uint8(familyIndex(port.ClusterIPs[0]))
	}
	fp.fam[fp.primary].Store(b)
	return fp, nil
}

// family returns the balancer of family f, nil when it has none.
func (fp *familyPicker) family(f int) *affinity.Balancer { return fp.fam[f].Load() }

// made returns the balancer of family f, making it when it has none.
func (fp *familyPicker) made(f int) *affinity.Balancer {
	if b := fp.fam[f].Load(); b != nil {
		return b
	}
	b := fp.fam[fp.primary].Load().Sibling()
	if fp.fam[f].CompareAndSwap(nil, b) {
		return b
	}
	return fp.fam[f].Load()
}

// each returns the balancers the picker has, with their families.
func (fp *familyPicker) each() []familyBalancer {
	out := make([]familyBalancer, 0, 2)
	for f := range fp.fam {
		if b := fp.fam[f].Load(); b != nil {
			out = append(out, familyBalancer{f, b})
		}
	}
	return out
}

type familyBalancer struct {
	family int
	*affinity.Balancer
}

// scheduler is the name of the picker's scheduler.
func (fp *familyPicker) scheduler() string { return fp.fam[fp.primary].Load().Scheduler() }

func (fp *familyPicker) Pick(client netip.Addr, tried []netip.AddrPort) (netip.AddrPort, error) {
	b := fp.family(familyIndex(client))
	if b == nil {
		return netip.AddrPort{}, affinity.ErrNoEndpoints
	}
	return b.Pick(client, tried)
}

// The reports below are of endpoints Pick gave, whose balancer exists.

func (fp *familyPicker) Release(ep netip.AddrPort) {
	if b := fp.family(familyIndex(ep.Addr())); b != nil {
		b.Release(ep)
	}
}

func (fp *familyPicker) Acquire(ep netip.AddrPort) {
	if b := fp.family(familyIndex(ep.Addr())); b != nil {
		b.Acquire(ep)
	}
}

func (fp *familyPicker) ResetAffinity(client netip.Addr) {
	if b := fp.family(familyIndex(client)); b != nil {
		b.ResetAffinity(client)
	}
}

func (fp *familyPicker) DialSucceeded(ep netip.AddrPort) {
	if b := fp.family(familyIndex(ep.Addr())); b != nil {
		b.DialSucceeded(ep)
	}
}

func (fp *familyPicker) DialFailed(ep netip.AddrPort, err error) {
	if b := fp.family(familyIndex(ep.Addr())); b != nil {
		b.DialFailed(ep, err)
	}
}

// setScheduler switches every family's balancer to scheduler.
func (fp *familyPicker) setScheduler(scheduler string) error {
	for _, b := range fp.each() {
		if err := b.SetScheduler(scheduler); err != nil {
			return err
		}
	}
	return nil
}

// update hands each family's balancer the endpoints of its family; dh hashes
// the first ClusterIP of the family.
func (fp *familyPicker) update(eps []netip.AddrPort, port *service.Port) {
	var byFam [2][]netip.AddrPort
	for _, ep := range eps {
		f := familyIndex(ep.Addr())
		byFam[f] = append(byFam[f], ep)
	}
	var dst [2]netip.Addr
	for _, ip := range port.ClusterIPs {
		if f := familyIndex(ip); !dst[f].IsValid() {
			dst[f] = ip
		}
	}
	for f := range fp.fam {
		b := fp.family(f)
		if b == nil && len(byFam[f]) == 0 {
			continue
		}
		if b == nil {
			b = fp.made(f)
		}
		b.Update(byFam[f], dst[f], port.AffinityClientIP, port.AffinityTimeout)
	}
}

// routes returns sp's routes: the cluster one, then the external one if any.
func (sp *servicePort) routes() []*route {
	if ext := sp.external.Load(); ext != nil {
		return []*route{sp.cluster, ext}
	}
	return []*route{sp.cluster}
}

// balancers returns every balancer of sp, the cluster route's first.
func (sp *servicePort) balancers() []*affinity.Balancer {
	var out []*affinity.Balancer
	for _, r := range sp.routes() {
		for _, fb := range r.picker.each() {
			out = append(out, fb.Balancer)
		}
	}
	return out
}

// udpClients counts the UDP client entries of every route of sp.
func (sp *servicePort) udpClients() int {
	n := 0
	for _, r := range sp.routes() {
		if r.udp != nil {
			n += r.udp.Clients()
		}
	}
	return n
}

// portStats reads every balancer of sp for the metrics scrape, in observe's
// terms: an endpoint that two balancers hold (both traffic classes) is one
// series, with the sum of its activity.
func portStats(sp *servicePort) func() observe.BalancerStats {
	return func() observe.BalancerStats {
		var st observe.BalancerStats
		at := map[netip.AddrPort]int{}
		for _, b := range sp.balancers() {
			c, eps := b.Stats()
			st.Affinity.Hits += c.AffinityHits
			st.Affinity.Misses += c.AffinityMisses
			st.Affinity.Resets += c.AffinityResets
			st.Affinity.Expired += c.AffinityExpired
			st.Affinity.Evicted += c.AffinityEvicted
			for _, e := range eps {
				// Stats leaves EjectedUntil zero once the ejection has ended.
				es := observe.EndpointStats{Addr: e.Addr, Active: e.Active, Failures: e.Failures, Ejected: !e.EjectedUntil.IsZero()}
				i, ok := at[e.Addr]
				if !ok {
					at[e.Addr] = len(st.Endpoints)
					st.Endpoints = append(st.Endpoints, es)
					continue
				}
				m := &st.Endpoints[i]
				m.Active += es.Active
				m.Failures = max(m.Failures, es.Failures)
				m.Ejected = m.Ejected || es.Ejected
			}
		}
		return st
	}
}

// state merges the states of every balancer of sp for /debug/services, in the
// terms of one balancer: endpoints held twice are merged as in portStats,
// affinity entries and counters are added up, and Next (with its reason) is
// the cluster route's, of the first family with endpoints, IPv4 first.
func (sp *servicePort) state() affinity.State {
	var out affinity.State
	at := map[netip.AddrPort]int{}
	cluster := len(sp.cluster.picker.each())
	for k, b := range sp.balancers() {
		s := b.State()
		out.Scheduler, out.ClientIPAffinity, out.AffinityTimeoutSeconds = s.Scheduler, s.ClientIPAffinity, s.AffinityTimeoutSeconds
		if k < cluster && !out.Next.IsValid() && len(s.Endpoints) > 0 {
			out.Next, out.NextReason = s.Next, s.NextReason
		}
		for _, e := range s.Endpoints {
			i, ok := at[e.Addr]
			if !ok {
				at[e.Addr] = len(out.Endpoints)
				out.Endpoints = append(out.Endpoints, e)
				continue
			}
			m := &out.Endpoints[i]
			m.Active += e.Active
			m.Failures = max(m.Failures, e.Failures)
			m.Ejections = max(m.Ejections, e.Ejections)
			if e.EjectedUntil.After(m.EjectedUntil) {
				m.EjectedUntil = e.EjectedUntil
			}
		}
		out.Affinity = append(out.Affinity, s.Affinity...)
		out.AffinityEntries += s.AffinityEntries
		c := &out.Counters
		c.AffinityHits += s.Counters.AffinityHits
		c.AffinityMisses += s.Counters.AffinityMisses
		c.AffinityResets += s.Counters.AffinityResets
		c.AffinityExpired += s.Counters.AffinityExpired
		c.AffinityEvicted += s.Counters.AffinityEvicted
		c.Ejections += s.Counters.Ejections
		c.Readmissions += s.Counters.Readmissions
	}
	return out
}

// explain says which endpoint client would get next through route r.
func (r *route) explain(client netip.Addr) (affinity.Choice, error) {
	b := r.picker.family(familyIndex(client))
	if b == nil {
		return affinity.Choice{}, affinity.ErrNoEndpoints
	}
	return b.Explain(client)
}
