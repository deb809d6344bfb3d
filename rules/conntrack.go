package rules

import (
	"fmt"
	"net/netip"

	"github.com/uproxy/uproxy/service"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// udpTargets maps the UDP destinations the portals capture to the proxy port they
// lead to: virtual IP:port, and NodePort (any local address).
type udpTargets struct {
	vips      map[netip.AddrPort]uint16
	nodePorts map[uint16]uint16
}

// udpTargetsOf collects the UDP destinations of family f in entries.
func udpTargetsOf(entries []entry, f int) udpTargets {
	t := udpTargets{vips: map[netip.AddrPort]uint16{}, nodePorts: map[uint16]uint16{}}
	for i := range entries {
		e := &entries[i]
		if e.protocol != service.UDP || !e.families[f] {
			continue
		}
		for _, ips := range [][]netip.Addr{e.clusterIPs, e.lbIPs, e.externalIPs} {
			for _, ip := range ips {
				if familyOf(ip) == f {
					t.vips[netip.AddrPortFrom(ip, uint16(e.port))] = uint16(e.proxyPort)
				}
			}
		}
		if e.nodePort != 0 && e.nodePortHeld[f] {
			t.nodePorts[uint16(e.nodePort)] = uint16(e.proxyPort)
		}
	}
	return t
}

// staleFlows matches the UDP conntrack flows that no longer go where the rules
// now send them. Conntrack applies NAT once per flow, so a UDP client that keeps
// sending would otherwise stay on a proxy port that is gone, or bypass a portal
// created after its first datagram. want 0 means "no portal any more".
type staleFlows struct {
	vips      map[netip.AddrPort]uint16
	nodePorts map[uint16]uint16
}

// diff returns the flows to delete going from old to cur: every destination whose
// proxy port changed, appeared or disappeared. With no old state (first sync,
// after a restart the previous process's proxy ports are gone) every current
// destination is checked.
func diff(old *udpTargets, cur udpTargets) staleFlows {
	s := staleFlows{vips: map[netip.AddrPort]uint16{}, nodePorts: map[uint16]uint16{}}
	var was udpTargets
	if old != nil {
		was = *old
	}
	for k, p := range cur.vips {
		if q, ok := was.vips[k]; !ok || q != p {
			s.vips[k] = p
		}
	}
	for k := range was.vips {
		if _, ok := cur.vips[k]; !ok {
			s.vips[k] = 0
		}
	}
	for k, p := range cur.nodePorts {
		if q, ok := was.nodePorts[k]; !ok || q != p {
			s.nodePorts[k] = p
		}
	}
	for k := range was.nodePorts {
		if _, ok := cur.nodePorts[k]; !ok {
			s.nodePorts[k] = 0
		}
	}
	return s
}

func (s staleFlows) empty() bool { return len(s.vips) == 0 && len(s.nodePorts) == 0 }

// MatchConntrackFlow implements netlink.CustomConntrackFilter. A flow is stale
// when its original destination is watched and its reply does not come from the
// proxy port it should reach (REDIRECT and DNAT both rewrite the reply source
// port to the proxy port). A flow the portals never translated is deleted too:
// the next datagram recreates it identically, or through the new portal.
func (s staleFlows) MatchConntrackFlow(f *netlink.ConntrackFlow) bool {
	if f.Forward.Protocol != unix.IPPROTO_UDP {
		return false
	}
	if dst, ok := netip.AddrFromSlice(f.Forward.DstIP); ok {
		if want, ok := s.vips[netip.AddrPortFrom(dst.Unmap(), f.Forward.DstPort)]; ok {
			return f.Reverse.SrcPort != want
		}
	}
	if want, ok := s.nodePorts[f.Forward.DstPort]; ok {
		return f.Reverse.SrcPort != want
	}
	return false
}

// deleteStale deletes the stale flows of family f.
func deleteStale(ct ConntrackDeleter, f int, s staleFlows) error {
	fam := netlink.InetFamily(unix.AF_INET)
	if f == v6 {
		fam = netlink.InetFamily(unix.AF_INET6)
	}
	if _, err := ct.ConntrackDeleteFilters(netlink.ConntrackTable, fam, s); err != nil {
		return fmt.Errorf("delete stale %s UDP conntrack flows: %w", familyName(f), err)
	}
	return nil
}
