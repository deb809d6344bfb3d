package iptables

import (
	"fmt"
	"net/netip"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/rules"
	"github.com/uproxy/uproxy/service"
)

// udpState is where one UDP Service port's traffic may go: its destinations and
// the endpoints the rules DNAT them to.
type udpState struct {
	vips     []netip.AddrPort
	nodePort int
	eps      map[netip.AddrPort]bool
}

func udpStateOf(order []*portRules) map[portKey]udpState {
	out := map[portKey]udpState{}
	for _, pr := range order {
		if pr.proto != service.UDP {
			continue
		}
		eps := make(map[netip.AddrPort]bool, len(pr.programmed))
		for _, ep := range pr.programmed {
			eps[ep] = true
		}
		out[portKey{pr.key, pr.proto}] = udpState{vips: pr.vips, nodePort: pr.nodePort, eps: eps}
	}
	return out
}

// staleFlows matches UDP conntrack flows that no longer go where the rules now
// send them. Conntrack applies NAT once per flow, so a client that keeps
// sending would stay on a removed endpoint, or keep being rejected after
// endpoints appeared, until its flow is deleted. Keys map a destination to the
// reply sources (endpoints) still allowed; an empty set allows none.
type staleFlows struct {
	vips      map[netip.AddrPort]map[netip.AddrPort]bool
	nodePorts map[uint16]map[netip.AddrPort]bool
}

// staleUDP compares the UDP view before and after a sync: every port whose
// endpoints or destinations changed, appeared or disappeared gets its flows
// checked. With no earlier view (first sync, after a restart) every port is.
func staleUDP(old, cur map[portKey]udpState) staleFlows {
	s := staleFlows{vips: map[netip.AddrPort]map[netip.AddrPort]bool{}, nodePorts: map[uint16]map[netip.AddrPort]bool{}}
	add := func(st udpState, allowed map[netip.AddrPort]bool) {
		for _, v := range st.vips {
			s.vips[v] = allowed
		}
		if st.nodePort != 0 {
			s.nodePorts[uint16(st.nodePort)] = allowed
		}
	}
	for k, st := range cur {
		if was, ok := old[k]; old != nil && ok && sameUDP(was, st) {
			continue
		}
		add(st, st.eps)
	}
	for k, was := range old {
		if _, ok := cur[k]; !ok {
			add(was, nil)
		} else if !sameUDP(was, cur[k]) {
			// Destinations the port no longer has: nothing allowed there.
			for _, v := range was.vips {
				if _, still := s.vips[v]; !still {
					s.vips[v] = nil
				}
			}
		}
	}
	return s
}

func sameUDP(a, b udpState) bool {
	if a.nodePort != b.nodePort || len(a.vips) != len(b.vips) || len(a.eps) != len(b.eps) {
		return false
	}
	for i := range a.vips {
		if a.vips[i] != b.vips[i] {
			return false
		}
	}
	for ep := range a.eps {
		if !b.eps[ep] {
			return false
		}
	}
	return true
}

func (s staleFlows) empty() bool { return len(s.vips) == 0 && len(s.nodePorts) == 0 }

// MatchConntrackFlow implements netlink.CustomConntrackFilter: a UDP flow to a
// watched destination is stale unless its reply comes from an allowed endpoint.
func (s staleFlows) MatchConntrackFlow(f *netlink.ConntrackFlow) bool {
	if f.Forward.Protocol != unix.IPPROTO_UDP {
		return false
	}
	reply, _ := netip.AddrFromSlice(f.Reverse.SrcIP)
	from := netip.AddrPortFrom(reply.Unmap(), f.Reverse.SrcPort)
	if dst, ok := netip.AddrFromSlice(f.Forward.DstIP); ok {
		if allowed, ok := s.vips[netip.AddrPortFrom(dst.Unmap(), f.Forward.DstPort)]; ok {
			return !allowed[from]
		}
	}
	if allowed, ok := s.nodePorts[f.Forward.DstPort]; ok {
		return !allowed[from]
	}
	return false
}

func (s staleFlows) delete(ct rules.ConntrackDeleter, v6 bool) error {
	fam := netlink.InetFamily(unix.AF_INET)
	if v6 {
		fam = netlink.InetFamily(unix.AF_INET6)
	}
	if _, err := ct.ConntrackDeleteFilters(netlink.ConntrackTable, fam, s); err != nil {
		return fmt.Errorf("delete stale %s UDP conntrack flows: %w", familyName(v6), err)
	}
	return nil
}
