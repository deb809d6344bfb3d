package conntrack

import (
	"errors"
	"net"
	"net/netip"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/netfilter/conntrack/conntracktest"
)

// flow is a conntrack flow: original destination dst, reply source reply (what
// NAT made of the destination).
func flow(proto uint8, dst, reply string) *netlink.ConntrackFlow {
	d, r := netip.MustParseAddrPort(dst), netip.MustParseAddrPort(reply)
	f := &netlink.ConntrackFlow{}
	f.Forward.Protocol = proto
	f.Forward.SrcIP = net.ParseIP("10.244.9.9")
	f.Forward.DstIP = net.IP(d.Addr().AsSlice())
	f.Forward.DstPort = d.Port()
	f.Reverse.SrcIP = net.IP(r.Addr().AsSlice())
	f.Reverse.SrcPort = r.Port()
	return f
}

func TestStaleUDP(t *testing.T) {
	s := StaleUDP{
		VIPs: map[netip.AddrPort]Replies{
			netip.MustParseAddrPort("10.96.0.53:53"): {Port: 40001},                                                                     // a proxy port
			netip.MustParseAddrPort("10.96.0.54:53"): {From: map[netip.AddrPort]bool{netip.MustParseAddrPort("10.244.1.2:5353"): true}}, // endpoints
			netip.MustParseAddrPort("[fd00::53]:53"): {Port: 40002},
			netip.MustParseAddrPort("10.96.0.55:53"): {}, // gone
		},
		NodePorts: map[uint16]Replies{30053: {Port: 40001}},
	}
	for _, tc := range []struct {
		name  string
		flow  *netlink.ConntrackFlow
		stale bool
	}{
		{"answered by its proxy port", flow(unix.IPPROTO_UDP, "10.96.0.53:53", "10.0.0.1:40001"), false},
		{"answered by its proxy port on another address", flow(unix.IPPROTO_UDP, "10.96.0.53:53", "127.0.0.1:40001"), false},
		{"answered by an old proxy port", flow(unix.IPPROTO_UDP, "10.96.0.53:53", "10.0.0.1:39999"), true},
		{"never translated", flow(unix.IPPROTO_UDP, "10.96.0.53:53", "10.96.0.53:53"), true},
		{"answered by a kept endpoint", flow(unix.IPPROTO_UDP, "10.96.0.54:53", "10.244.1.2:5353"), false},
		{"answered by a removed endpoint", flow(unix.IPPROTO_UDP, "10.96.0.54:53", "10.244.2.3:5353"), true},
		{"an endpoint's port on another address", flow(unix.IPPROTO_UDP, "10.96.0.54:53", "10.244.2.2:5353"), true},
		{"a destination with no rule any more", flow(unix.IPPROTO_UDP, "10.96.0.55:53", "10.0.0.1:40001"), true},
		{"IPv6", flow(unix.IPPROTO_UDP, "[fd00::53]:53", "[fd00::1]:40002"), false},
		{"IPv6, old proxy port", flow(unix.IPPROTO_UDP, "[fd00::53]:53", "[fd00::1]:40001"), true},
		{"NodePort on any local address", flow(unix.IPPROTO_UDP, "192.168.50.7:30053", "192.168.50.7:40001"), false},
		{"NodePort, old proxy port", flow(unix.IPPROTO_UDP, "192.168.50.7:30053", "192.168.50.7:40009"), true},
		{"unwatched destination", flow(unix.IPPROTO_UDP, "10.96.0.99:53", "10.0.0.1:1"), false},
		{"TCP is never matched", flow(unix.IPPROTO_TCP, "10.96.0.53:53", "10.0.0.1:39999"), false},
	} {
		if got := s.MatchConntrackFlow(tc.flow); got != tc.stale {
			t.Errorf("%s: got stale %v, want %v", tc.name, got, tc.stale)
		}
	}
	if s.Empty() || !(StaleUDP{}).Empty() {
		t.Errorf("Empty: got %v for a watching filter, %v for none", s.Empty(), (StaleUDP{}).Empty())
	}
}

type failing struct{}

func (failing) ConntrackDeleteFilters(netlink.ConntrackTableType, netlink.InetFamily, ...netlink.CustomConntrackFilter) (uint, error) {
	return 0, errors.New("netlink: operation not permitted")
}

func TestDelete(t *testing.T) {
	s := StaleUDP{NodePorts: map[uint16]Replies{30053: {}}}
	var r conntracktest.Recorder
	for _, v6 := range []bool{false, true, true} {
		if err := s.Delete(&r, v6); err != nil {
			t.Fatal(err)
		}
	}
	if len(r.Filters[0]) != 1 || len(r.Filters[1]) != 2 {
		t.Errorf("filters by family: got %d IPv4, %d IPv6; want 1, 2", len(r.Filters[0]), len(r.Filters[1]))
	}
	if got := r.Filters[1][0].MatchConntrackFlow(flow(unix.IPPROTO_UDP, "[fd00::1]:30053", "[fd00::1]:1")); !got {
		t.Errorf("the recorded filter does not match what s matches")
	}
	if err := s.Delete(failing{}, true); err == nil || !strings.Contains(err.Error(), "delete stale IPv6 UDP conntrack flows: netlink: operation not permitted") {
		t.Errorf("got %v, want the failure with the family", err)
	}
}
