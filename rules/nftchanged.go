package rules

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/hashicorp/go-multierror"

	"github.com/uproxy/uproxy/service"
)

// nftSynced is what a clean sync of the nftables portals was given and made:
// the portals in order, and for each the index of its entry in
// NFTables.entries (-1: none, its addresses of no family programmed).
type nftSynced struct {
	portals []Portal
	entry   []int32
}

// maxChangedPortals bounds the Service ports a sync may change and still take
// the short way (syncChanged); more go the whole way, which costs the same
// whatever changed.
const maxChangedPortals = 256

// syncChanged is the short way of Sync, for a change of a few Service ports
// after a sync that left nothing to retry: it walks portals beside the last
// sync's (both sorted by name), keeps the entry of every portal that is the
// same (same Port pointer, proxy ports and refusal), and writes the elements
// of the changed ones alone, so one new Service costs about what one Service
// port costs. Its result is what the whole way would write; when it cannot
// tell cheaply that it is (a changed NodePort, a key another Service port
// holds, more than maxChangedPortals changed, portals out of order) it
// reports false having changed nothing, and the whole way runs.
func (p *NFTables) syncChanged(ctx context.Context, portals []Portal) (bool, error) {
	last := p.last
	if last == nil || p.written == nil || p.entries == nil || len(p.holder.prefixes) > 0 {
		return false, nil
	}
	entries := make([]entry, 0, len(p.entries)+1)
	index := make([]int32, len(portals))
	var gone, added []entry // the entries of the changed portals, before and after
	changed := 0
	j := 0
	// keep appends the entry (of the last sync) of old portal j to entries.
	keep := func(i, j int) {
		index[i] = -1
		if k := last.entry[j]; k >= 0 {
			index[i] = int32(len(entries))
			entries = append(entries, p.entries[k])
		}
	}
	drop := func(j int) {
		changed++
		if k := last.entry[j]; k >= 0 {
			gone = append(gone, p.entries[k])
		}
	}
	for i := range portals {
		pt := &portals[i]
		if pt.Port == nil || i > 0 && !portals[i-1].Port.Name.Less(pt.Port.Name) {
			return false, nil
		}
		for j < len(last.portals) && last.portals[j].Port.Name.Less(pt.Port.Name) {
			drop(j)
			j++
		}
		if j < len(last.portals) && last.portals[j] == *pt {
			keep(i, j)
			j++
			continue
		}
		changed++
		if changed > maxChangedPortals {
			return false, nil
		}
		es, errs := entriesOf(portals[i:i+1], p.enabled)
		if len(errs) > 0 {
			return false, nil
		}
		var was *entry
		if j < len(last.portals) && last.portals[j].Port.Name == pt.Port.Name {
			if k := last.entry[j]; k >= 0 {
				was = &p.entries[k]
			}
			j++
		}
		index[i] = -1
		if len(es) == 1 {
			e := es[0]
			if e.nodePort != 0 || was != nil && was.nodePort != 0 {
				// Held NodePorts are the holder's, which walks them all.
				return false, nil
			}
			index[i] = int32(len(entries))
			entries = append(entries, e)
			added = append(added, e)
		}
		if was != nil {
			gone = append(gone, *was)
		}
	}
	for ; j < len(last.portals); j++ {
		drop(j)
	}
	if changed > maxChangedPortals {
		return false, nil
	}
	for _, e := range gone {
		if e.nodePort != 0 {
			return false, nil
		}
	}
	changes, ok := p.layout.changesOf(p.written, gone, added)
	if !ok {
		return false, nil
	}
	if err := p.writeChanges(ctx, changes); err != nil {
		p.entries, p.last = nil, nil
		return true, err
	}
	p.entries, p.last = nil, nil
	// UDP flows change only with a UDP Service port; their check walks
	// every UDP portal.
	if anyUDP(gone) || anyUDP(added) {
		var errs error
		for _, fam := range p.layout.fams {
			if err := p.udp[fam.f].sync(p.cfg.Conntrack, entries, fam.f); err != nil {
				errs = multierror.Append(errs, err)
			}
		}
		if errs != nil {
			return true, errs
		}
	}
	p.entries = entries
	p.last = &nftSynced{portals: slices.Clone(portals), entry: index}
	return true, nil
}

func anyUDP(entries []entry) bool {
	for i := range entries {
		if entries[i].protocol == service.UDP {
			return true
		}
	}
	return false
}

// elementsOf calls add with every element of e, in the order elements
// adds them: the steering map of the key, its no-endpoint counterpart,
// whether the key goes to the latter, the Service's port, the key and the
// proxy port.
func (l *nftLayout) elementsOf(e *entry, add func(fam nftFamily, steer string, port int, k nftKey, proxyPort int, refused bool)) {
	for _, fam := range l.fams {
		if !e.families[fam.f] {
			continue
		}
		for kind, ips := range [...][]netip.Addr{e.clusterIPs, e.lbIPs, e.externalIPs} {
			name := fam.serviceIPs
			if kind == 2 {
				name = fam.externalIPs
			}
			refused := e.refused(fam.f, kind != 0)
			for _, ip := range ips {
				if familyOf(ip) == fam.f {
					add(fam, name, e.port, nftKey{ip, e.proto, e.port}, e.proxyPortOf(kind != 0), refused)
				}
			}
		}
		if e.nodePort != 0 && e.nodePortHeld[fam.f] && fam.nodePorts {
			add(fam, fam.nodePortMap, e.nodePort, nftKey{proto: e.proto, port: e.nodePort}, e.extProxyPort, e.refused(fam.f, true))
		}
	}
}

// changesOf returns what turns written, the elements of a sync without key
// conflicts, into the elements of the same sync with the entries gone
// replaced by added, in diff's order; false when an added key is taken by a
// Service port that stays (or twice among added), where the whole way
// decides who wins.
func (l *nftLayout) changesOf(written nftElements, gone, added []entry) ([]elementChange, bool) {
	type mapKey struct {
		m string
		k nftKey
	}
	leaving := make(map[service.PortName]bool, len(gone))
	dels := make(map[mapKey]nftElement)
	for i := range gone {
		e := &gone[i]
		leaving[e.name] = true
		l.elementsOf(e, func(fam nftFamily, steer string, port int, k nftKey, proxyPort int, refused bool) {
			m := steer
			el := nftElement{proxyPort: proxyPort, owner: e.name}
			if refused {
				m, el = fam.refuseMap(steer), nftElement{owner: e.name}
			}
			if written[m][k] == el {
				dels[mapKey{m, k}] = el
			}
		})
	}
	adds := make(map[mapKey]nftElement)
	ok := true
	for i := range added {
		e := &added[i]
		l.elementsOf(e, func(fam nftFamily, steer string, port int, k nftKey, proxyPort int, refused bool) {
			refuse := fam.refuseMap(steer)
			for _, m := range [...]string{steer, refuse} {
				if old, taken := adds[mapKey{m, k}]; taken {
					ok = ok && old.owner == e.name
					return
				}
				if old, taken := written[m][k]; taken && !leaving[old.owner] {
					ok = false
					return
				}
			}
			if refused {
				adds[mapKey{refuse, k}] = nftElement{owner: e.name}
			} else {
				adds[mapKey{steer, k}] = nftElement{proxyPort: proxyPort, owner: e.name}
			}
		})
	}
	if !ok {
		return nil, false
	}
	var changes []elementChange
	for mk, el := range dels {
		if adds[mk] != el {
			changes = append(changes, elementChange{delete: true, m: mk.m, k: mk.k})
		}
	}
	for mk, el := range adds {
		if old, in := dels[mk]; !in || old != el {
			changes = append(changes, elementChange{m: mk.m, k: mk.k, e: el})
		}
	}
	slices.SortFunc(changes, func(a, b elementChange) int {
		if a.delete != b.delete {
			if a.delete {
				return -1
			}
			return 1
		}
		if a.m != b.m {
			return strings.Compare(a.m, b.m)
		}
		return compareKeys(a.k, b.k)
	})
	return changes, true
}

// apply makes els hold what changes (of diff or changesOf) turn it into.
func (els nftElements) apply(changes []elementChange) {
	for _, c := range changes {
		if c.delete {
			delete(els[c.m], c.k)
		} else {
			els[c.m][c.k] = c.e
		}
	}
}

// writeChanges writes changes (none: nothing) and, once they are in, applies
// them to p.written. Changes of the steering maps alone go over netlink
// (nftables.Kernel.WriteElements); the others through nft, in one
// transaction. While it writes, and after a failure, p.written is nil: the
// kernel's state is unknown and the next Sync writes the whole table.
func (p *NFTables) writeChanges(ctx context.Context, changes []elementChange) error {
	if len(changes) == 0 {
		return nil
	}
	w := p.written
	p.written = nil
	k := p.cfg.NFTables
	if elems, ok := p.layout.netlinkChanges(changes); ok {
		if err := k.WriteElements(ctx, elems); err != nil {
			return fmt.Errorf("write nftables table %s: %w", p.table, err)
		}
	} else {
		tx := k.NewTransaction()
		addChanges(tx, changes)
		if err := k.Run(ctx, tx); err != nil {
			return fmt.Errorf("write nftables table %s: %w", p.table, err)
		}
	}
	w.apply(changes)
	p.written = w
	return nil
}

// syncedOf returns the nftSynced of a clean sync of portals into entries;
// nil unless portals are sorted by name, as entries are, each with its
// entry or none.
func syncedOf(portals []Portal, entries []entry) *nftSynced {
	s := &nftSynced{portals: slices.Clone(portals), entry: make([]int32, len(portals))}
	j := 0
	for i, pt := range portals {
		if pt.Port == nil || i > 0 && !portals[i-1].Port.Name.Less(pt.Port.Name) {
			return nil
		}
		s.entry[i] = -1
		if j < len(entries) && entries[j].name == pt.Port.Name {
			s.entry[i] = int32(j)
			j++
		}
	}
	if j != len(entries) {
		return nil
	}
	return s
}
