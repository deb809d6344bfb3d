package proxier

import (
	"net/netip"

	"github.com/uproxy/uproxy/rules"
	"github.com/uproxy/uproxy/service"
)

// Whose address a dial to an endpoint carries follows kube-proxy's
// masquerading: where kube-proxy's DNAT leaves the client's address, the
// userspace mode dials from it (a transparent dial, socket.TCPProxy's
// KeepClientAddress); where kube-proxy masquerades, from the node. That is:
//
//   - through a ClusterIP: the client's address, unless --masquerade-all, or
//     --cluster-cidr is set and the client is outside it (kube-proxy
//     masquerades off-cluster traffic to ClusterIPs);
//   - through a NodePort, ExternalIP or LoadBalancer IP: the client's address
//     only under externalTrafficPolicy Local, whose endpoints are on this
//     node, so their replies come back here;
//   - the node's own connections over loopback, and a pod reaching itself
//     (the socket layer's hairpin), from the node.
//
// The traffic class is the route's, so a Service port with external addresses
// has an external route of its own whenever client addresses are kept (see
// splits): a shared proxy port could not tell a pod's connection to the
// ClusterIP (kept) from its connection to the NodePort (masqueraded). And
// nothing is kept while the portals cannot bring the replies back
// (rules.Portals.RepliesToClientAddress): a dial from the client's address
// would then never see its answer.

// clientAddress is the userspace mode's source address policy.
type clientAddress struct {
	keep          bool // --preserve-client-address
	clusterCIDRs  []netip.Prefix
	masqueradeAll bool
	portals       rules.Portals
}

// Why a dial keeps the client's address, or does not.
const (
	keptCluster       = "a pod's connection to a ClusterIP keeps its address, as behind kube-proxy's DNAT"
	keptLocal         = "externalTrafficPolicy Local keeps the client's address"
	notKeptFlag       = "--preserve-client-address is off"
	notKeptPortals    = "the portals' rules and policy route for the replies are not in place"
	notKeptMasqAll    = "--masquerade-all: kube-proxy masquerades every connection"
	notKeptLoopback   = "the client is the node itself, over loopback"
	notKeptExternal   = "externalTrafficPolicy Cluster: kube-proxy masquerades connections to NodePorts, ExternalIPs and LoadBalancer IPs"
	notKeptOffCluster = "the client is outside --cluster-cidr: kube-proxy masquerades it"
)

// decide says whether a connection from client through a route of the given
// class (external: NodePort, ExternalIPs, LoadBalancer IPs; localPolicy: the
// port's externalTrafficPolicy is Local) dials from the client's address, and
// why. The data path and explain both ask it.
func (c *clientAddress) decide(external, localPolicy bool, client netip.Addr) (bool, string) {
	switch {
	case !c.keep:
		return false, notKeptFlag
	case !c.portals.RepliesToClientAddress():
		return false, notKeptPortals
	case c.masqueradeAll:
		return false, notKeptMasqAll
	case client.IsLoopback():
		return false, notKeptLoopback
	case external && !localPolicy:
		return false, notKeptExternal
	case external:
		return true, keptLocal
	}
	if len(c.clusterCIDRs) == 0 {
		return true, keptCluster
	}
	for _, p := range c.clusterCIDRs {
		if p.Contains(client) {
			return true, keptCluster
		}
	}
	return false, notKeptOffCluster
}

// splits reports whether port's NodePort, ExternalIPs and LoadBalancer IPs get
// a proxy port of their own: when their endpoints may differ from the
// ClusterIPs' (service.Port.SplitsExternal), and whenever client addresses are
// kept and the port has any (see above).
func (p *Proxier) splits(port *service.Port) bool {
	if port.SplitsExternal() {
		return true
	}
	return p.clientAddr.keep && (port.NodePort != 0 || len(port.ExternalIPs) > 0 || len(port.LoadBalancerIPs) > 0)
}

// keepsClient is route r's KeepClientAddress.
func (p *Proxier) keepsClient(r *route, client netip.Addr) bool {
	_, keep, _ := p.clientDecision(r, client)
	return keep
}

// clientDecision says of a connection from client through route r whether it
// is short-circuited to the cluster's endpoints (shortCircuits), and whether
// its dials keep the client's address, and why: a short-circuited connection
// is decided as a ClusterIP's. The data path and explain (NextChoice) both
// ask it.
func (p *Proxier) clientDecision(r *route, client netip.Addr) (short, keep bool, why string) {
	short = p.shortCircuits(r, client)
	keep, why = p.clientAddr.decide(r.external && !short, r.localPolicy.Load(), client)
	return short, keep, why
}

// shortCircuits reports whether a connection from client through route r goes
// to the endpoints of the port's cluster route: the node's own connections to
// the NodePort, ExternalIPs and LoadBalancer IPs of an externalTrafficPolicy
// Local Service reach every endpoint, as kube-proxy routes LOCAL-source
// traffic there. Pods' connections are not short-circuited. kube-proxy sends
// those from inside its --cluster-cidr to every endpoint too, but only a pod
// on this node gets an answer that way: a pod on another node is answered
// by the endpoint directly and its connection fails, which is what upstream's
// "should fallback to local terminating endpoints ... externalTrafficPolicy=
// Local" test expects of it ("external, and there are no local endpoints").
// A proxy that terminates the connection would instead make it succeed, so
// every pod is treated as external here, and the two rules agree for every
// client but a pod reaching its own node's external address, which upstream
// leaves to each implementation. The external route's Picker serves everyone
// but the node.
func (p *Proxier) shortCircuits(r *route, client netip.Addr) bool {
	if !r.external || !r.localPolicy.Load() {
		return false
	}
	if client.IsLoopback() {
		return true
	}
	local := p.own.local.Load()
	return local != nil && (*local)[client]
}
