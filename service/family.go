package service

import (
	"net/netip"
	"slices"
)

// AddrsOfFamily returns the usable addresses of ips (valid, specified) of one
// family (IPv6 when v6), unmapped and without zone: how a family's rules name
// a Service's addresses.
func AddrsOfFamily(ips []netip.Addr, v6 bool) []netip.Addr {
	var out []netip.Addr
	for _, ip := range ips {
		if ip.IsValid() && !ip.IsUnspecified() && ip.Unmap().Is6() == v6 {
			out = append(out, ip.Unmap().WithZone(""))
		}
	}
	return out
}

// EndpointsOfFamily returns the addresses of eps of one family (IPv6 when v6),
// unmapped.
func EndpointsOfFamily(eps []Endpoint, v6 bool) []netip.AddrPort {
	var out []netip.AddrPort
	for _, e := range eps {
		if e.Addr.IsValid() && e.Addr.Addr().Unmap().Is6() == v6 {
			out = append(out, netip.AddrPortFrom(e.Addr.Addr().Unmap(), e.Addr.Port()))
		}
	}
	return out
}

// InFamily reports whether the rules of one family (IPv6 when v6) program p:
// the family of its ClusterIPs, else of its ExternalIPs and LoadBalancer IPs,
// else (a bare NodePort) every family.
func (p *Port) InFamily(v6 bool) bool {
	for _, ips := range [][]netip.Addr{p.ClusterIPs, append(slices.Clip(p.ExternalIPs), p.LoadBalancerIPs...)} {
		if has4, has6 := len(AddrsOfFamily(ips, false)) > 0, len(AddrsOfFamily(ips, true)) > 0; has4 || has6 {
			return (v6 && has6) || (!v6 && has4)
		}
	}
	return true
}
