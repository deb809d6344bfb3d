package service

import "net/netip"

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
