package proxier

import (
	"net/netip"
	"sync/atomic"

	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/nodeaddr"
	"github.com/uproxy/uproxy/rules"
	"github.com/uproxy/uproxy/service"
)

// ownSockets tells the data path which endpoints are the proxier's own proxy
// sockets, or lead to them through the portals. An endpoint that is one
// (127.0.0.1:<a proxy port>, the node's address and that port, [::1],
// 0.0.0.0 ...) would have every connection to
// its Service accepted again by the proxier, which would dial it again, and
// again, until the process ran out of descriptors. Its dials are refused
// instead (socket.TCPProxy.OwnSocket), whatever address spells it.
//
// The check runs on the event loops before every dial, so it costs one atomic
// load when the endpoint's port is no proxy port, which is nearly always; only
// an endpoint on a proxy port has its address looked up.
type ownSockets struct {
	// ports has a bit per proxy port with a socket, TCP and UDP apart (a TCP
	// endpoint on a UDP proxy port reaches nothing of the proxier's). Sync sets
	// and clears them; the loops read them.
	ports [2][1 << 16 / 64]atomic.Uint64
	// bind is where the proxy sockets listen (unset or unspecified: every
	// address of both families).
	bind netip.Addr
	// local holds the node's addresses as of the last refresh.
	local atomic.Pointer[map[netip.Addr]bool]
	// steered holds what the portals steer to proxy ports when the proxy's
	// own dials carry no mark to pass them (--dial-mark-bit -1): then a dial
	// to one of those addresses is steered back to a proxy port, a loop as an
	// own socket's is. nil when the dials pass the portals, or there are none.
	steered atomic.Pointer[steeredAddrs]
}

// steeredAddrs are the Service addresses the portals steer: every ClusterIP,
// ExternalIP and LoadBalancer IP with its port, and the NodePorts, which the
// portals steer on the node's addresses.
type steeredAddrs struct {
	vips      map[protoAddrPort]bool
	nodePorts map[protoPort]bool
}

type protoAddrPort struct {
	proto service.Protocol
	ap    netip.AddrPort
}

type protoPort struct {
	proto service.Protocol
	port  int
}

// steer records what portals steer (nil: nothing, as when the dials are
// marked to pass the portals).
func (o *ownSockets) steer(portals []rules.Portal) {
	if portals == nil {
		o.steered.Store(nil)
		return
	}
	s := &steeredAddrs{vips: map[protoAddrPort]bool{}, nodePorts: map[protoPort]bool{}}
	for _, pt := range portals {
		p := pt.Port
		for _, ips := range [...][]netip.Addr{p.ClusterIPs, p.ExternalIPs, p.LoadBalancerIPs} {
			for _, ip := range ips {
				s.vips[protoAddrPort{p.Protocol, netip.AddrPortFrom(ip.Unmap(), uint16(p.Port))}] = true
			}
		}
		if p.NodePort != 0 {
			s.nodePorts[protoPort{p.Protocol, p.NodePort}] = true
		}
	}
	o.steered.Store(s)
}

func protoIndex(p service.Protocol) int {
	if p == service.UDP {
		return 1
	}
	return 0
}

// add records a proxy socket of protocol p on port.
func (o *ownSockets) add(p service.Protocol, port int) {
	o.ports[protoIndex(p)][port/64].Or(1 << (port % 64))
}

// remove records that port has no proxy socket of protocol p any more.
func (o *ownSockets) remove(p service.Protocol, port int) {
	o.ports[protoIndex(p)][port/64].And(^uint64(1 << (port % 64)))
}

// refresh reads the node's addresses again; on failure it keeps those it has.
func (o *ownSockets) refresh() {
	addrs, err := nodeaddr.List()
	if err != nil {
		klog.ErrorS(err, "Listing node addresses for the proxy's own sockets; keeping the last list")
		return
	}
	local := make(map[netip.Addr]bool, len(addrs))
	for _, a := range addrs {
		local[a.WithZone("")] = true
	}
	o.local.Store(&local)
}

// reaches reports whether a connection of protocol p to ep would reach one of
// the proxy sockets.
func (o *ownSockets) reaches(p service.Protocol, ep netip.AddrPort) bool {
	port := int(ep.Port())
	if s := o.steered.Load(); s != nil && s.reaches(p, ep, o) {
		return true
	}
	if o.ports[protoIndex(p)][port/64].Load()&(1<<(port%64)) == 0 {
		return false
	}
	return o.leadsHere(ep.Addr())
}

// reaches reports whether the portals would steer a dial of protocol p to ep.
func (s *steeredAddrs) reaches(p service.Protocol, ep netip.AddrPort, o *ownSockets) bool {
	ep = netip.AddrPortFrom(ep.Addr().Unmap().WithZone(""), ep.Port())
	if s.vips[protoAddrPort{p, ep}] {
		return true
	}
	return s.nodePorts[protoPort{p, int(ep.Port())}] && o.leadsHere(ep.Addr())
}

// leadsHere reports whether a connection to a arrives at an address the proxy
// sockets listen on. Connections to an unspecified address go to the node's
// loopback one (127.0.0.1, ::1); every loopback address and every address of
// the node's is the node's own.
func (o *ownSockets) leadsHere(a netip.Addr) bool {
	a = a.Unmap().WithZone("")
	if o.bind.IsValid() && !o.bind.IsUnspecified() {
		bind := o.bind.Unmap()
		if a.Is4() && a.IsUnspecified() {
			return bind == netip.AddrFrom4([4]byte{127, 0, 0, 1})
		}
		if a.IsUnspecified() {
			return bind == netip.IPv6Loopback()
		}
		return a == bind
	}
	if a.IsUnspecified() || a.IsLoopback() {
		return true
	}
	if local := o.local.Load(); local != nil {
		return (*local)[a]
	}
	return false
}
