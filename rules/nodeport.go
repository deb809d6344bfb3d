package rules

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"

	"github.com/uproxy/uproxy/nodeaddr"
	"github.com/uproxy/uproxy/service"
)

// holdKey is one socket holding a NodePort: network (tcp4, udp6, ...) and address.
type holdKey struct {
	network string
	address string
}

type hold struct {
	socket io.Closer
	owner  service.PortName
}

// nodePortHolder keeps a socket bound on every NodePort in use, as kube-proxy
// does, so no other process on the node takes a port whose traffic the rules
// steer away from it, and a port already taken is reported instead of hijacked.
type nodePortHolder struct {
	listen func(network, address string) (io.Closer, error)
	// prefixes are Config.NodePortAddresses; empty means the wildcard address.
	prefixes []netip.Prefix
	held     map[holdKey]*hold
}

// sync holds the NodePorts of entries (sorted, so the first claimant of a port
// wins deterministically) and releases the others. It sets nodePortHeld for every
// family whose sockets are all held; the errors name the Service and the port.
func (h *nodePortHolder) sync(entries []entry, enabled [2]bool) []error {
	var errs []error
	var local [2][]netip.Addr
	if len(h.prefixes) > 0 {
		var err error
		if local, err = h.localAddresses(); err != nil {
			// Holding nothing would let the rules steer ports someone else owns.
			return []error{fmt.Errorf("list node addresses for NodePorts: %w", err)}
		}
	}

	type claim struct {
		entry  *entry
		family int
	}
	want := make(map[holdKey]claim)
	var order []holdKey // want's keys in entry order, so errors come out in a stable order
	failed := make(map[*entry]*[2]bool)
	for i := range entries {
		e := &entries[i]
		if e.nodePort == 0 {
			continue
		}
		failed[e] = new([2]bool)
		for f := v4; f <= v6; f++ {
			if !e.families[f] || !enabled[f] {
				continue
			}
			for _, k := range h.keys(e, f, local[f]) {
				if c, ok := want[k]; ok {
					errs = append(errs, &PortalError{Service: e.name, Protocol: e.protocol, Port: e.nodePort,
						Err: fmt.Errorf("NodePort already used by %s", c.entry.name)})
					failed[e][f] = true
					continue
				}
				want[k] = claim{e, f}
				order = append(order, k)
			}
		}
	}

	for k, hd := range h.held {
		if _, ok := want[k]; !ok {
			hd.socket.Close()
			delete(h.held, k)
		}
	}
	for _, k := range order {
		c := want[k]
		if hd, ok := h.held[k]; ok {
			hd.owner = c.entry.name // a port handed from one Service to another stays held
			continue
		}
		s, err := h.listen(k.network, k.address)
		if err != nil {
			errs = append(errs, &PortalError{Service: c.entry.name, Protocol: c.entry.protocol, Port: c.entry.nodePort,
				Err: fmt.Errorf("NodePort not served, the Service's other addresses are: %w", err)})
			failed[c.entry][c.family] = true
			continue
		}
		h.held[k] = &hold{socket: s, owner: c.entry.name}
	}
	for e, f := range failed {
		for fam := v4; fam <= v6; fam++ {
			e.nodePortHeld[fam] = e.families[fam] && enabled[fam] && !f[fam] && h.family(fam)
		}
	}
	return errs
}

// family reports whether NodePorts exist at all in family f.
func (h *nodePortHolder) family(f int) bool {
	if len(h.prefixes) == 0 {
		return true
	}
	for _, p := range h.prefixes {
		if familyOf(p.Addr()) == f {
			return true
		}
	}
	return false
}

// keys returns the sockets that hold e's NodePort in family f.
func (h *nodePortHolder) keys(e *entry, f int, local []netip.Addr) []holdKey {
	network := e.proto + "4"
	wildcard := "0.0.0.0"
	if f == v6 {
		network = e.proto + "6"
		wildcard = "::"
	}
	port := strconv.Itoa(e.nodePort)
	if len(h.prefixes) == 0 {
		return []holdKey{{network, net.JoinHostPort(wildcard, port)}}
	}
	var keys []holdKey
	for _, a := range local {
		for _, p := range h.prefixes {
			if p.Contains(a) {
				keys = append(keys, holdKey{network, net.JoinHostPort(a.String(), port)})
				break
			}
		}
	}
	return keys
}

// localAddresses lists the node's addresses by family. IPv6 link-local addresses
// are left out: binding them needs a zone and NodePorts are not served there.
func (h *nodePortHolder) localAddresses() ([2][]netip.Addr, error) {
	var out [2][]netip.Addr
	addrs, err := nodeaddr.List()
	if err != nil {
		return out, err
	}
	for _, ip := range addrs {
		if ip.Is6() && ip.IsLinkLocalUnicast() {
			continue
		}
		f := familyOf(ip)
		out[f] = append(out[f], ip)
	}
	return out, nil
}

// close releases every held port.
func (h *nodePortHolder) close() {
	for k, hd := range h.held {
		hd.socket.Close()
		delete(h.held, k)
	}
}
