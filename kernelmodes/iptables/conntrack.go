package iptables

import (
	"net/netip"

	"github.com/uproxy/uproxy/netfilter/conntrack"
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

// staleUDP compares the UDP view before and after a sync: every port whose
// endpoints or destinations changed, appeared or disappeared gets its flows
// checked, which are stale unless their replies come from an endpoint the rules
// still DNAT to. With no earlier view (first sync, after a restart) every port
// is checked.
func staleUDP(old, cur map[portKey]udpState) conntrack.StaleUDP {
	s := conntrack.StaleUDP{VIPs: map[netip.AddrPort]conntrack.Replies{}, NodePorts: map[uint16]conntrack.Replies{}}
	add := func(st udpState, allowed conntrack.Replies) {
		for _, v := range st.vips {
			s.VIPs[v] = allowed
		}
		if st.nodePort != 0 {
			s.NodePorts[uint16(st.nodePort)] = allowed
		}
	}
	for k, st := range cur {
		if was, ok := old[k]; old != nil && ok && sameUDP(was, st) {
			continue
		}
		add(st, conntrack.Replies{From: st.eps})
	}
	for k, was := range old {
		if _, ok := cur[k]; !ok {
			add(was, conntrack.Replies{})
		} else if !sameUDP(was, cur[k]) {
			// Destinations the port no longer has: nothing allowed there.
			for _, v := range was.vips {
				if _, still := s.VIPs[v]; !still {
					s.VIPs[v] = conntrack.Replies{}
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
