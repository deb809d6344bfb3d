package service

import (
	"cmp"
	"fmt"
	"iter"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Claim is one address a Service port is reached at: a virtual IP (ClusterIP,
// ExternalIP or LoadBalancer ingress IP) with the Service's port, or a NodePort,
// which is reached on every node address. Two Service ports with a Claim in
// common cannot both be served: whichever rule matched first would take every
// connection, and the other Service's clients would be answered by the wrong
// backends or reset.
type Claim struct {
	// Addr is the virtual IP; the zero Addr for a NodePort.
	Addr     netip.Addr
	Port     int
	Protocol Protocol
}

// NodePort reports whether c is a NodePort (reached on every node address).
func (c Claim) NodePort() bool { return !c.Addr.IsValid() }

// String formats c as 10.96.0.10:80/TCP, [fd00::10]:80/TCP or nodePort 30080/TCP.
func (c Claim) String() string {
	if c.NodePort() {
		return "nodePort " + strconv.Itoa(c.Port) + "/" + string(c.Protocol)
	}
	return netip.AddrPortFrom(c.Addr, uint16(c.Port)).String() + "/" + string(c.Protocol)
}

// ClaimList is a list of Claims, formatted for people (logs, tables) as
// "10.96.0.10:80/TCP nodePort 30080/TCP".
type ClaimList []Claim

func (l ClaimList) String() string {
	var b strings.Builder
	for i, c := range l {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(c.String())
	}
	return b.String()
}

// Claims returns every address p is reached at: its ClusterIPs, ExternalIPs and
// LoadBalancer IPs with its port, then its NodePort.
func (p *Port) Claims() ClaimList { return slices.Collect(p.claims()) }

func (p *Port) claims() iter.Seq[Claim] {
	return func(yield func(Claim) bool) {
		for _, ips := range [...][]netip.Addr{p.ClusterIPs, p.ExternalIPs, p.LoadBalancerIPs} {
			for _, ip := range ips {
				if !yield(Claim{Addr: ip, Port: p.Port, Protocol: p.Protocol}) {
					return
				}
			}
		}
		if p.NodePort != 0 {
			yield(Claim{Port: p.NodePort, Protocol: p.Protocol})
		}
	}
}

// Conflict is a Service port left out of a Snapshot because another Service
// port already serves one of its addresses. It is one of the Snapshot's Errors
// too.
type Conflict struct {
	// Claim is the address both ports claim (the first one found, when they share several).
	Claim Claim
	// ServedBy keeps the address; LeftOut is not served at all until the
	// address is free, so that what runs always matches a Service's spec.
	ServedBy, LeftOut PortName
}

func (c *Conflict) Error() string {
	return fmt.Sprintf("%s: %s is already served by %s", portLabel(c.LeftOut), c.Claim, portLabel(c.ServedBy))
}

// portLabel names a Service port in prose: "ns/name port http", or "ns/name"
// for the only port of a Service, which has no name.
func portLabel(n PortName) string {
	if n.Port == "" {
		return n.Namespace + "/" + n.Name
	}
	return n.Namespace + "/" + n.Name + " port " + n.Port
}

// conflicts is what the Builder decided about shared addresses in its last
// Build that looked at them.
type conflicts struct {
	// owners is the Service port that serves each claimed address.
	owners map[Claim]PortName
	// leftOut are the Service ports not served, and list the same in name order.
	leftOut map[PortName]*Conflict
	list    []*Conflict
}

// resolve decides which Service ports are served when several claim one address,
// given the Services of a Build (each with its Ports) and the previous decision.
//
// The established owner of an address keeps it: a port is established when it
// served every address it claims in the previous Build, and then none of its
// addresses can be claimed by another established port (owners are unique), so
// the established ports are all served. The other ports (new ones, and those
// that claim an address they did not serve before) are then taken oldest
// Service first (creationTimestamp; a manifest without one counts as oldest),
// then by namespace, name and port name; each is served unless one of its
// addresses is already taken, and then it is left out whole. So a working
// Service never loses its address to a newcomer, even an older one, and the
// newcomer takes over when the owner goes away.
func (prev *conflicts) resolve(services []*serviceState) *conflicts {
	n := 0
	for _, ss := range services {
		n += len(ss.ports) // most ports have one address, their ClusterIP
	}
	next := &conflicts{owners: make(map[Claim]PortName, max(n, len(prev.owners)))}
	take := func(p *Port) {
		for c := range p.claims() {
			next.owners[c] = p.Name
		}
	}
	type candidate struct {
		port    *Port
		created time.Time
	}
	var later []candidate
	for _, ss := range services {
		for _, p := range ss.ports {
			if prev.established(p) {
				take(p)
			} else {
				later = append(later, candidate{p, ss.svc.CreationTimestamp.Time})
			}
		}
	}
	slices.SortFunc(later, func(a, b candidate) int {
		return cmp.Or(a.created.Compare(b.created), comparePorts(a.port, b.port))
	})
	for _, c := range later {
		p := c.port
		if conflict := next.conflict(p); conflict != nil {
			if next.leftOut == nil {
				next.leftOut = make(map[PortName]*Conflict)
			}
			next.leftOut[p.Name] = conflict
			next.list = append(next.list, conflict)
			continue
		}
		take(p)
	}
	slices.SortFunc(next.list, func(a, b *Conflict) int { return a.LeftOut.Compare(b.LeftOut) })
	return next
}

// established reports whether p served every address it claims in the Build
// that decided prev.
func (prev *conflicts) established(p *Port) bool {
	for c := range p.claims() {
		if owner, ok := prev.owners[c]; !ok || owner != p.Name {
			return false
		}
	}
	return true
}

// conflict returns the Conflict of p with the first owner of one of its
// addresses, or nil when they are all free (or p's own).
func (next *conflicts) conflict(p *Port) *Conflict {
	for c := range p.claims() {
		owner, ok := next.owners[c]
		if !ok || owner == p.Name {
			continue
		}
		return &Conflict{Claim: c, ServedBy: owner, LeftOut: p.Name}
	}
	return nil
}
