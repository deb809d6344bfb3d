package service

import (
	"net/netip"
	"slices"
	"testing"
)

func TestOfFamily(t *testing.T) {
	t.Parallel()
	ips := []netip.Addr{
		netip.MustParseAddr("10.96.0.1"),
		netip.MustParseAddr("::ffff:10.96.0.2"), // IPv4-mapped: IPv4
		netip.MustParseAddr("fd00::1%eth0"),     // zone dropped
		netip.MustParseAddr("0.0.0.0"),          // unspecified: left out
		{},                                      // invalid: left out
	}
	if got, want := AddrsOfFamily(ips, false), []netip.Addr{netip.MustParseAddr("10.96.0.1"), netip.MustParseAddr("10.96.0.2")}; !slices.Equal(got, want) {
		t.Errorf("IPv4: got %v, want %v", got, want)
	}
	if got, want := AddrsOfFamily(ips, true), []netip.Addr{netip.MustParseAddr("fd00::1")}; !slices.Equal(got, want) {
		t.Errorf("IPv6: got %v, want %v", got, want)
	}
	eps := []Endpoint{
		{Addr: netip.MustParseAddrPort("[::ffff:10.244.0.1]:80")},
		{Addr: netip.MustParseAddrPort("[fd00::2]:80")},
		{},
	}
	if got, want := EndpointsOfFamily(eps, false), []netip.AddrPort{netip.MustParseAddrPort("10.244.0.1:80")}; !slices.Equal(got, want) {
		t.Errorf("IPv4 endpoints: got %v, want %v", got, want)
	}
	if got, want := EndpointsOfFamily(eps, true), []netip.AddrPort{netip.MustParseAddrPort("[fd00::2]:80")}; !slices.Equal(got, want) {
		t.Errorf("IPv6 endpoints: got %v, want %v", got, want)
	}
}

func TestInFamily(t *testing.T) {
	t.Parallel()
	v4, v6 := netip.MustParseAddr("10.96.0.1"), netip.MustParseAddr("fd00::1")
	for _, tc := range []struct {
		name         string
		p            Port
		want4, want6 bool
	}{
		{"IPv4 ClusterIP", Port{ClusterIPs: []netip.Addr{v4}, ExternalIPs: []netip.Addr{v6}}, true, false},
		{"dual-stack", Port{ClusterIPs: []netip.Addr{v4, v6}}, true, true},
		{"headless with an IPv6 ExternalIP", Port{ExternalIPs: []netip.Addr{v6}}, false, true},
		{"bare NodePort", Port{NodePort: 30080}, true, true},
	} {
		if got4, got6 := tc.p.InFamily(false), tc.p.InFamily(true); got4 != tc.want4 || got6 != tc.want6 {
			t.Errorf("%s: IPv4 %v IPv6 %v, want %v %v", tc.name, got4, got6, tc.want4, tc.want6)
		}
	}
}
