// Package conntrack deletes the UDP conntrack flows that a change of rules left
// going the wrong way, for every mode and packet filter backend, and sets the
// conntrack sysctls (table size, timeouts) as kube-proxy does at start.
//
// Conntrack applies NAT once per flow, at its first packet. A UDP client that
// keeps sending therefore stays where its first datagram went — a proxy port
// that is gone, a removed endpoint, or straight to a virtual IP that had no rule
// yet — until its flow is deleted:
//
//	stale := conntrack.StaleUDP{VIPs: map[netip.AddrPort]conntrack.Replies{vip: {Port: proxyPort}}}
//	err := stale.Delete(conntrack.Netlink(), false)
//
// The sysctls are written once, where they differ, in the process's network
// namespace (the table's size only in the initial one):
//
//	changes, err := conntrack.Sysctls{TCPCloseWaitTimeout: time.Hour}.Set()
package conntrack

import (
	"fmt"
	"net/netip"
	"slices"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Deleter deletes conntrack flows; *netlink.Handle implements it.
type Deleter interface {
	ConntrackDeleteFilters(table netlink.ConntrackTableType, family netlink.InetFamily, filters ...netlink.CustomConntrackFilter) (uint, error)
}

// Netlink returns the Deleter of the network namespace the calling thread is in
// at each call.
func Netlink() Deleter {
	// A zero Handle opens a netlink socket per request, in the namespace of the
	// calling thread at that moment (NewHandle would pin the namespace of creation).
	return &netlink.Handle{}
}

// Replies are where the flows to one destination may be answered from now. The
// zero Replies allow nothing: the destination has no rule any more.
type Replies struct {
	// Port allows replies from this source port, any address: REDIRECT and
	// DNAT to a local proxy port rewrite the reply's source port to the proxy
	// port, its address being whichever local one the flow reached. 0: none.
	Port uint16
	// From allows replies from exactly these endpoints (DNAT to an endpoint).
	From map[netip.AddrPort]bool
}

func (r Replies) allow(from netip.AddrPort) bool {
	return r.Port != 0 && from.Port() == r.Port || r.From[from]
}

// StaleUDP matches the UDP flows to watched destinations whose replies come from
// somewhere the rules no longer send them. A flow the rules never translated
// matches too: the next datagram recreates it, through the rules as they are.
type StaleUDP struct {
	// VIPs are destinations by original address and port.
	VIPs map[netip.AddrPort]Replies
	// NodePorts are destinations by original port alone: any local address.
	NodePorts map[uint16]Replies
}

// Empty reports whether s watches no destination.
func (s StaleUDP) Empty() bool { return len(s.VIPs) == 0 && len(s.NodePorts) == 0 }

// MatchConntrackFlow implements netlink.CustomConntrackFilter.
func (s StaleUDP) MatchConntrackFlow(f *netlink.ConntrackFlow) bool {
	if f.Forward.Protocol != unix.IPPROTO_UDP {
		return false
	}
	reply, _ := netip.AddrFromSlice(f.Reverse.SrcIP)
	from := netip.AddrPortFrom(reply.Unmap(), f.Reverse.SrcPort)
	if dst, ok := netip.AddrFromSlice(f.Forward.DstIP); ok {
		if r, ok := s.VIPs[netip.AddrPortFrom(dst.Unmap(), f.Forward.DstPort)]; ok {
			return !r.allow(from)
		}
	}
	if r, ok := s.NodePorts[f.Forward.DstPort]; ok {
		return !r.allow(from)
	}
	return false
}

// Delete deletes the matching flows of one family (IPv6 when v6) through d.
func (s StaleUDP) Delete(d Deleter, v6 bool) error {
	fam, name := netlink.InetFamily(unix.AF_INET), "IPv4"
	if v6 {
		fam, name = netlink.InetFamily(unix.AF_INET6), "IPv6"
	}
	if _, err := d.ConntrackDeleteFilters(netlink.ConntrackTable, fam, s); err != nil {
		return fmt.Errorf("delete stale %s UDP conntrack flows: %w", name, err)
	}
	return nil
}

// UDPPort is where the traffic of one UDP Service port may go after a sync of a
// mode that DNATs to endpoints: its destinations and the endpoints the rules
// send them to. A mode keeps one view (a map by Service port) per family.
type UDPPort struct {
	VIPs      []netip.AddrPort
	NodePort  int
	Endpoints map[netip.AddrPort]bool
}

// StaleUDPOf compares the UDP views before and after a sync: every Service
// port whose endpoints or destinations changed, appeared or disappeared gets
// its flows checked, which are stale unless their replies come from an
// endpoint the rules still send to. With no earlier view (old nil: the first
// sync, or after a restart) every port is checked.
func StaleUDPOf[K comparable](old, cur map[K]UDPPort) StaleUDP {
	s := StaleUDP{VIPs: map[netip.AddrPort]Replies{}, NodePorts: map[uint16]Replies{}}
	add := func(st UDPPort, allowed Replies) {
		for _, v := range st.VIPs {
			s.VIPs[v] = allowed
		}
		if st.NodePort != 0 {
			s.NodePorts[uint16(st.NodePort)] = allowed
		}
	}
	for k, st := range cur {
		if was, ok := old[k]; old != nil && ok && was.equal(st) {
			continue
		}
		add(st, Replies{From: st.Endpoints})
	}
	for k, was := range old {
		if _, ok := cur[k]; !ok {
			add(was, Replies{})
		} else if !was.equal(cur[k]) {
			// Destinations the port no longer has: nothing allowed there.
			for _, v := range was.VIPs {
				if _, still := s.VIPs[v]; !still {
					s.VIPs[v] = Replies{}
				}
			}
		}
	}
	return s
}

func (a UDPPort) equal(b UDPPort) bool {
	if a.NodePort != b.NodePort || len(a.Endpoints) != len(b.Endpoints) || !slices.Equal(a.VIPs, b.VIPs) {
		return false
	}
	for ep := range a.Endpoints {
		if !b.Endpoints[ep] {
			return false
		}
	}
	return true
}
