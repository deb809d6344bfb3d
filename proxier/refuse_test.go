package proxier

import (
	"fmt"
	"net/netip"
	"reflect"
	"sync"
	"testing"

	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/rules"
	"github.com/uproxy/uproxy/service"
)

// portalRecorder is the Portals of these tests: it keeps what each Sync hands it.
type portalRecorder struct {
	mu   sync.Mutex
	last []rules.Portal
}

func (r *portalRecorder) Sync(portals []rules.Portal) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.last = append([]rules.Portal(nil), portals...)
	return nil
}
func (r *portalRecorder) Cleanup() error               { return nil }
func (r *portalRecorder) Intact() bool                 { return true }
func (r *portalRecorder) RepliesToClientAddress() bool { return false }

func (r *portalRecorder) portal(t *testing.T, name service.PortName) rules.Portal {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, pt := range r.last {
		if pt.Port.Name == name {
			return pt
		}
	}
	t.Fatalf("no portal for %s in %+v", name, r.last)
	return rules.Portal{}
}

// TestPortalRefusesWithoutEndpoints: the portals are told to refuse the
// addresses whose balancer has no endpoint of their family, from the same
// endpoints the balancers get (usable: ready, else serving and terminating;
// this node's under a Local traffic policy), and to steer them again once it
// has one; the proxy port stays the same throughout, and /debug/services says
// what is refused and why.
func TestPortalRefusesWithoutEndpoints(t *testing.T) {
	rec := &portalRecorder{}
	p := newProxier(t, Config{Portals: rec})
	ep4 := netip.MustParseAddrPort("127.0.0.2:8080")
	ep6 := netip.MustParseAddrPort("[::1]:8080")
	base := func(eps ...service.Endpoint) *service.Port {
		sp := port("web", service.TCP)
		sp.ClusterIPs = []netip.Addr{netip.MustParseAddr("10.96.0.1"), netip.MustParseAddr("fd00:96::1")}
		sp.NodePort = 30080
		sp.Endpoints = eps
		return sp
	}
	ready := func(a netip.AddrPort, local bool) service.Endpoint {
		return service.Endpoint{Addr: a, Ready: true, Serving: true, Local: local}
	}
	all := rules.Refusal{Cluster: [2]bool{true, true}, External: [2]bool{true, true}}
	only6 := rules.Refusal{Cluster: [2]bool{false, true}, External: [2]bool{false, true}}
	refused := func(addresses, family, reason string) observe.Refused {
		return observe.Refused{Addresses: addresses, Family: family, Reason: reason}
	}
	steps := []struct {
		name        string
		port        *service.Port
		want        rules.Refusal
		wantRefused []observe.Refused
	}{
		{"no endpoints: every address refused", base(), all, []observe.Refused{
			refused("clusterIPs", "IPv4", "no usable endpoint of IPv4"),
			refused("external", "IPv4", "no usable endpoint of IPv4"),
			refused("clusterIPs", "IPv6", "no usable endpoint of IPv6"),
			refused("external", "IPv6", "no usable endpoint of IPv6"),
		}},
		{"a ready IPv4 endpoint: IPv6 still refused", base(ready(ep4, false)), only6, []observe.Refused{
			refused("clusterIPs", "IPv6", "no usable endpoint of IPv6"),
			refused("external", "IPv6", "no usable endpoint of IPv6"),
		}},
		{"both families", base(ready(ep4, false), ready(ep6, false)), rules.Refusal{}, nil},
		{"not ready, not serving: refused", base(service.Endpoint{Addr: ep4}, service.Endpoint{Addr: ep6, Terminating: true}), all, []observe.Refused{
			refused("clusterIPs", "IPv4", "no usable endpoint of IPv4"),
			refused("external", "IPv4", "no usable endpoint of IPv4"),
			refused("clusterIPs", "IPv6", "no usable endpoint of IPv6"),
			refused("external", "IPv6", "no usable endpoint of IPv6"),
		}},
		{"serving and terminating: used, as kube-proxy does when none is ready", base(service.Endpoint{Addr: ep4, Serving: true, Terminating: true}), only6, []observe.Refused{
			refused("clusterIPs", "IPv6", "no usable endpoint of IPv6"),
			refused("external", "IPv6", "no usable endpoint of IPv6"),
		}},
		// Under externalTrafficPolicy Local the node's own and pods'
		// connections to the external addresses go to every endpoint
		// (kube-proxy's short-circuit): those addresses are refused only
		// when no endpoint of the family is anywhere.
		{"externalTrafficPolicy Local, none on this node: not refused", func() *service.Port {
			sp := base(ready(ep4, false), ready(ep6, false))
			sp.ExternalPolicyLocal = true
			return sp
		}(), rules.Refusal{}, nil},
		{"externalTrafficPolicy Local, one on this node, no IPv6 endpoint", func() *service.Port {
			sp := base(ready(ep4, true))
			sp.ExternalPolicyLocal = true
			return sp
		}(), only6, []observe.Refused{
			refused("clusterIPs", "IPv6", "no usable endpoint of IPv6"),
			refused("external", "IPv6", "no usable endpoint of IPv6 on this node (externalTrafficPolicy: Local)"),
		}},
		{"internalTrafficPolicy Local, none on this node: ClusterIPs refused", func() *service.Port {
			sp := base(ready(ep4, false), ready(ep6, false))
			sp.InternalPolicyLocal = true
			return sp
		}(), rules.Refusal{Cluster: [2]bool{true, true}}, []observe.Refused{
			refused("clusterIPs", "IPv4", "no usable endpoint of IPv4 on this node (internalTrafficPolicy: Local)"),
			refused("clusterIPs", "IPv6", "no usable endpoint of IPv6 on this node (internalTrafficPolicy: Local)"),
		}},
		{"the endpoints back: nothing refused", base(ready(ep4, false), ready(ep6, false)), rules.Refusal{}, nil},
		{"the last endpoint gone again", base(), all, []observe.Refused{
			refused("clusterIPs", "IPv4", "no usable endpoint of IPv4"),
			refused("external", "IPv4", "no usable endpoint of IPv4"),
			refused("clusterIPs", "IPv6", "no usable endpoint of IPv6"),
			refused("external", "IPv6", "no usable endpoint of IPv6"),
		}},
	}
	name := base().Name
	proxyPort := 0
	for _, st := range steps {
		mustSync(t, p, snapshot(st.port))
		pt := rec.portal(t, name)
		if pt.Refuse != st.want {
			t.Errorf("%s: Refuse: got %+v, want %+v", st.name, pt.Refuse, st.want)
		}
		if proxyPort == 0 {
			proxyPort = pt.ProxyPort
		}
		if pt.ProxyPort != proxyPort || p.ProxyPort(name) != proxyPort {
			t.Errorf("%s: proxy port: got %d (portal %d), want %d throughout", st.name, p.ProxyPort(name), pt.ProxyPort, proxyPort)
		}
		states := p.DebugServices()
		if len(states) != 1 {
			t.Fatalf("%s: DebugServices: got %d ports, want 1", st.name, len(states))
		}
		if got := states[0].Refused; !reflect.DeepEqual(got, st.wantRefused) {
			t.Errorf("%s: /debug/services refused: got %+v, want %+v", st.name, got, st.wantRefused)
		}
	}
}

// TestNoPortalsNoRefusal: with --rules none nothing refuses, and
// /debug/services says nothing is.
func TestNoPortalsNoRefusal(t *testing.T) {
	p := newProxier(t, Config{})
	mustSync(t, p, snapshot(port("web", service.TCP)))
	if got := p.DebugServices()[0].Refused; got != nil {
		t.Errorf("refused with --rules none: got %+v, want none", got)
	}
}

// TestRemovedNodePortLeavesThePortals: a UDP Service port with a NodePort
// removed from among many others (a sync of a few changes, which may walk
// beside the last one) leaves the portals and closes its proxy sockets,
// whichever way the sync takes: upstream's "should update nodePort: udp"
// asks the NodePort to go quiet once its Service is deleted.
func TestRemovedNodePortLeavesThePortals(t *testing.T) {
	w := newWorld(t)
	u := w.udpBackend("u", "127.0.0.2")
	rec := &portalRecorder{}
	p := newProxier(t, Config{Portals: rec, KeepClientAddress: true})
	var ports []*service.Port
	for i := range 20 {
		sp := port(fmt.Sprintf("svc-%02d", i), service.UDP, u)
		sp.NodePort = 30100 + i
		ports = append(ports, sp)
	}
	mustSync(t, p, snapshot(ports...))
	gone := ports[7].Name
	pp := p.ProxyPort(gone)
	if pp == 0 {
		t.Fatalf("%s has no proxy port", gone)
	}
	mustSync(t, p, snapshot(append(append([]*service.Port(nil), ports[:7]...), ports[8:]...)...))
	if got := p.ProxyPort(gone); got != 0 {
		t.Errorf("removed port still has proxy port %d", got)
	}
	rec.mu.Lock()
	for _, pt := range rec.last {
		if pt.Port.Name == gone {
			t.Errorf("the portals still have the removed port: %+v", pt)
		}
	}
	if len(rec.last) != 19 {
		t.Errorf("the portals have %d ports; want 19", len(rec.last))
	}
	rec.mu.Unlock()
	if got, err := pingUDP(t, pp); err == nil {
		t.Errorf("the removed port's proxy port %d answered %q; want nothing", pp, got)
	}
}
