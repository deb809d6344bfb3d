package service

import (
	"net/netip"
	"slices"
	"testing"
)

func TestOfFamily(t *testing.T) {
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
