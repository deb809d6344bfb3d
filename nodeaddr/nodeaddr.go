// Package nodeaddr lists this node's own IP addresses: where NodePorts are
// served and held, where the HOST portals send the node's own traffic, and
// what `uproxy explain` counts as local.
//
//	addrs, err := nodeaddr.List()
//	nodePortIPs := nodeaddr.In(addrs, prefixes)
package nodeaddr

import (
	"net"
	"net/netip"
)

// List returns the addresses of every interface in the network namespace of
// the calling thread, in the kernel's order, IPv4 ones unmapped.
func List() ([]netip.Addr, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil, err
	}
	out := make([]netip.Addr, 0, len(addrs))
	for _, a := range addrs {
		n, ok := a.(*net.IPNet)
		if !ok {
			continue
		}
		if ip, ok := netip.AddrFromSlice(n.IP); ok {
			out = append(out, ip.Unmap())
		}
	}
	return out, nil
}

// In returns the addresses of addrs inside one of prefixes, in order.
func In(addrs []netip.Addr, prefixes []netip.Prefix) []netip.Addr {
	var out []netip.Addr
	for _, ip := range addrs {
		for _, p := range prefixes {
			if p.Contains(ip) {
				out = append(out, ip)
				break
			}
		}
	}
	return out
}

// Primary returns the first global unicast address of each family in addrs,
// IPv4 first: the node's address when none is configured.
func Primary(addrs []netip.Addr) []netip.Addr {
	var v4, v6 netip.Addr
	for _, ip := range addrs {
		switch {
		case !ip.IsGlobalUnicast():
		case ip.Is4() && !v4.IsValid():
			v4 = ip
		case ip.Is6() && !v6.IsValid():
			v6 = ip
		}
	}
	var out []netip.Addr
	for _, ip := range []netip.Addr{v4, v6} {
		if ip.IsValid() {
			out = append(out, ip)
		}
	}
	return out
}

// routeProbes are destinations beyond any node, one per family, from the
// documentation ranges (RFC 5737, RFC 3849): only routed, never sent to.
var routeProbes = []string{"192.0.2.1:9", "[2001:db8::1]:9"}

// Routed returns, IPv4 first, the address of each family that the calling
// thread's routes give as the source toward a destination beyond the node (its
// default route's, usually): the address other hosts know the node by, which
// the first address of an interface need not be (a pod's gateway address, a
// bridge's). A family without such a route, or whose source is not a global
// unicast address, has none. It sends nothing: a UDP connect only routes.
func Routed() []netip.Addr {
	var out []netip.Addr
	for _, probe := range routeProbes {
		c, err := net.Dial("udp", probe)
		if err != nil {
			continue
		}
		a := c.LocalAddr().(*net.UDPAddr).AddrPort().Addr().Unmap()
		c.Close()
		if a.IsGlobalUnicast() {
			out = append(out, a)
		}
	}
	return out
}
