package iptables

import (
	"net/netip"

	"github.com/uproxy/uproxy/netfilter/conntrack"
	"github.com/uproxy/uproxy/service"
)

// udpStateOf is the UDP conntrack view of one family's rules: where each UDP
// Service port's traffic may go (conntrack.StaleUDPOf compares two views).
func udpStateOf(order []*portRules) map[portKey]conntrack.UDPPort {
	out := map[portKey]conntrack.UDPPort{}
	for _, pr := range order {
		if pr.proto != service.UDP {
			continue
		}
		eps := make(map[netip.AddrPort]bool, len(pr.programmed))
		for _, ep := range pr.programmed {
			eps[ep] = true
		}
		out[portKey{pr.key, pr.proto}] = conntrack.UDPPort{VIPs: pr.vips, NodePort: pr.nodePort, Endpoints: eps}
	}
	return out
}
