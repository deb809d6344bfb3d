package rules

import (
	"net/netip"

	"github.com/uproxy/uproxy/netfilter/conntrack"
	"github.com/uproxy/uproxy/service"
)

// udpTargets maps the UDP destinations the portals capture to the proxy port they
// lead to: virtual IP:port, and NodePort (any local address). Going from one to
// the next, the flows of the destinations that changed are deleted: REDIRECT and
// DNAT both rewrite a flow's reply source port to the proxy port, so a flow whose
// replies come from another port is going where the rules no longer send it.
// A refused destination is not captured: a client that kept sending to it
// while it was steered has its flow deleted when it becomes refused, so its
// next datagram meets the REJECT rather than a proxy with nothing to dial.
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
		for kind, ips := range [][]netip.Addr{e.clusterIPs, e.lbIPs, e.externalIPs} {
			if e.refused(f, kind != 0) {
				continue
			}
			for _, ip := range ips {
				if familyOf(ip) == f {
					t.vips[netip.AddrPortFrom(ip, uint16(e.port))] = uint16(e.proxyPortOf(kind != 0))
				}
			}
		}
		if e.nodePort != 0 && e.nodePortHeld[f] && !e.refused(f, true) {
			t.nodePorts[uint16(e.nodePort)] = uint16(e.extProxyPort)
		}
	}
	return t
}

// staleFlows deletes, for one family, the UDP flows that the portals of the
// last sync no longer lead where they went; both backends use it after each
// successful write.
type staleFlows struct {
	// last is where UDP portals led after the last sync whose stale flows were
	// deleted; nil means unknown, so every UDP destination gets checked.
	last *udpTargets
}

// sync deletes the flows of family f that changed between the last sync and
// entries. On failure the old state stays, so the next sync tries again.
func (s *staleFlows) sync(d conntrack.Deleter, entries []entry, f int) error {
	cur := udpTargetsOf(entries, f)
	if stale := diff(s.last, cur); !stale.Empty() {
		if err := stale.Delete(d, f == v6); err != nil {
			return err
		}
	}
	s.last = &cur
	return nil
}

// known reports whether the last state is known.
func (s *staleFlows) known() bool { return s.last != nil }

// forget makes the next sync check every UDP destination.
func (s *staleFlows) forget() { s.last = nil }

// diff returns the flows to delete going from old to cur: those to every
// destination whose proxy port changed, appeared or disappeared. With no old
// state (first sync, after a restart the previous process's proxy ports are
// gone) every current destination is checked.
func diff(old *udpTargets, cur udpTargets) conntrack.StaleUDP {
	s := conntrack.StaleUDP{VIPs: map[netip.AddrPort]conntrack.Replies{}, NodePorts: map[uint16]conntrack.Replies{}}
	var was udpTargets
	if old != nil {
		was = *old
	}
	changed(was.vips, cur.vips, s.VIPs)
	changed(was.nodePorts, cur.nodePorts, s.NodePorts)
	return s
}

// changed adds to stale each destination whose proxy port differs between was
// and cur: the replies allowed are those from its proxy port now, none for a
// destination that is gone.
func changed[K comparable](was, cur map[K]uint16, stale map[K]conntrack.Replies) {
	for k, p := range cur {
		if q, ok := was[k]; !ok || q != p {
			stale[k] = conntrack.Replies{Port: p}
		}
	}
	for k := range was {
		if _, ok := cur[k]; !ok {
			stale[k] = conntrack.Replies{}
		}
	}
}
