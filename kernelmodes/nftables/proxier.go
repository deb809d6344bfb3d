// Package nftables is uproxy's nftables kernel mode (--proxy-mode nftables):
// it programs every Service port as elements of maps and sets in one nftables
// table that DNATs straight to an endpoint, so no uproxy process sits on the
// data path.
//
//	p, err := nftables.New(nftables.Config{Common: proxymode.Common{IPv6: true}})
//	...
//	err = p.Sync(snapshot) // from the sync loop, on every change
//
// The table (family inet, named after the chain prefix: "uproxy-kernel") has a
// fixed number of chains, whatever the number of Services: a Service port is a
// few elements (docs/nftables-kernel-mode.md has the measurements behind this
// layout). Per family (4 shown; 6 is the same with ip6):
//
//	map backends4-k     ClusterIP/ExternalIP/LB IP . proto . port . slot -> endpoint, one map per
//	                    endpoint count k in use: "numgen random mod k" splits exactly
//	map local-backends4-k, np-backends4-k, np-local-backends4-k
//	                    the same for this node's endpoints (externalTrafficPolicy Local) and NodePorts
//	set cluster-masq4, external-masq4, np-masq4  keys whose traffic is marked for masquerading
//	set external-local4, np-local4   keys of externalTrafficPolicy Local
//	set firewall4, firewall-allow4   LB keys with loadBalancerSourceRanges, and key . allowed source
//	set reject4, drop4, np-reject4   keys without endpoints (refused) or without local ones (dropped)
//	set hairpin4        endpoint . endpoint, masqueraded in postrouting
//	map affinity4 ...   keys of ClientIP-affinity Service ports -> goto their own chain
//	chain services4     from nat prerouting and output: firewall, marks, Local policy, affinity,
//	                    NodePorts, then one dnat rule per count map
//	chain filter4       from filter input, forward and output, for a connection's first
//	                    packet (ct state new): reject and drop
//
// Only a Service port with ClientIP affinity gets chains of its own (one per
// endpoint set, with a dynamic set of clients per endpoint): affinity needs
// memory per client, which a map lookup cannot give. Such ports are few.
//
// The first sync, and any sync after a failure or after someone flushed or
// deleted the table, writes the whole table in one transaction (deleting the
// old one in it). Later syncs diff each Service port against what was last
// written and send only its changed elements and chains: a changed element is
// deleted and added again, in one transaction the kernel applies atomically.
// The cost of a sync that changes one Service port does not grow with the
// number of Services, and neither does a new connection's.
//
// A map for a new endpoint count is added with its rule when a partial sync
// first needs it; count maps that become empty stay, with their rule (one map
// lookup that misses), until the next whole write.
package nftables

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/go-multierror"
	"k8s.io/klog/v2"
	"sigs.k8s.io/knftables"

	"github.com/uproxy/uproxy/netfilter/conntrack"
	ipt "github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/netfilter/nftables"
	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/service"
)

// DefaultMasqueradeBit is the mark bit meaning "masquerade this", kube-proxy's 14.
const DefaultMasqueradeBit = ipt.DefaultMasqueradeBit

// TableSuffix follows the lower-cased chain prefix in the name of the table:
// the userspace mode's nftables portals use the prefix alone.
const TableSuffix = "-kernel"

// Config configures the nftables mode. The zero value programs IPv4 with
// NodePorts on every local address but loopback.
type Config struct {
	// Common is what every mode takes (prefix, families, NodePort addresses,
	// masquerading); the table is the prefix lower-cased plus TableSuffix.
	// NodeIPs are not used.
	proxymode.Common
	// MasqueradeBit is the mark bit (0-31) for masquerading; 0 means
	// DefaultMasqueradeBit.
	MasqueradeBit int
	// NFTables is the table; nil uses nft and netlink in the calling thread's
	// network namespace (nftables.New).
	NFTables nftables.Kernel
	// Conntrack deletes stale UDP flows; nil uses netlink in the calling
	// thread's network namespace (conntrack.Netlink).
	Conntrack conntrack.Deleter
}

// Proxier is the nftables mode. Sync, Cleanup and the readers may be called
// from different goroutines.
type Proxier struct {
	cfg   Config
	table nftables.Table
	l     tableLayout
	r     renderer

	// mu serializes Sync and Cleanup and guards everything below.
	mu sync.Mutex
	// written is what the table holds after the last transaction that
	// succeeded; nil means unknown: the next sync writes the whole table.
	written *state
	// handles are the base chains' rule handles read after the last whole
	// write; other handles mean someone flushed or deleted the table.
	handles map[string][]int
	// udp is the UDP conntrack view of each family after the last sync that
	// cleared stale flows (nil: unknown).
	udp [2]map[portKey]conntrack.UDPPort
	// synced are the ports of the last sync that wrote what it had to, in
	// the Snapshot's order: the ones written holds renderings of (nil:
	// unknown).
	synced []*service.Port
	// last is the last Snapshot synced, for DebugServices.
	last        *service.Snapshot
	lastWasFull bool
}

type portKey struct {
	name  service.PortName
	proto service.Protocol
}

// state is the table's Service content: the fixed layout holds the rest.
type state struct {
	ports map[portKey]*rendered
	// elems counts, per element, the ports that want it (only hairpin pairs are
	// ever shared), with the value written.
	elems map[elemID]*elemRef
	// maps are the count maps the table has.
	maps map[string]bool
}

type elemID struct{ set, key string }

type elemRef struct {
	value   string
	comment string
	refs    int
}

// TableName is the table of the nftables mode for a chain prefix ("" for the
// default): "uproxy-kernel" by default.
func TableName(prefix string) (nftables.Table, error) {
	prefix, err := ipt.ChainPrefix(prefix)
	if err != nil {
		return nftables.Table{}, err
	}
	name, err := nftables.TableName(prefix)
	if err != nil {
		return nftables.Table{}, err
	}
	return nftables.Table{Family: knftables.InetFamily, Name: name + TableSuffix}, nil
}

// New returns the nftables mode for cfg. It changes nothing in the kernel
// until the first Sync; with cfg.NFTables nil it checks that nft runs.
// A table of its name that is not uproxy's is an error (nftables.Claim).
func New(cfg Config) (*Proxier, error) {
	table, err := TableName(cfg.ChainPrefix)
	if err != nil {
		return nil, err
	}
	bit, err := ipt.MasqueradeBit(cfg.MasqueradeBit)
	if err != nil {
		return nil, err
	}
	if cfg.NFTables == nil {
		if cfg.NFTables, err = nftables.New(table); err != nil {
			return nil, err
		}
	}
	if err := nftables.Claim(context.Background(), cfg.NFTables); err != nil {
		return nil, err
	}
	cfg.Conntrack = cmp.Or(cfg.Conntrack, conntrack.Netlink())
	p := &Proxier{cfg: cfg, table: table}
	p.l.mark = fmt.Sprintf("%#x", uint32(1)<<bit)
	p.l.fams = append(p.l.fams, newFamily(false, cfg))
	if cfg.IPv6 {
		p.l.fams = append(p.l.fams, newFamily(true, cfg))
	}
	p.r = renderer{l: &p.l}
	return p, nil
}

// Sync implements syncloop.Mode: it makes the table match s. Service ports with
// an unsupported protocol or an invalid port are skipped and reported; the
// others are programmed regardless.
func (p *Proxier) Sync(s *service.Snapshot) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	ports, errs := service.NetfilterPorts(s.Ports)
	ctx := context.Background()
	if p.written != nil && !p.intact(ctx) {
		klog.InfoS("nftables-mode table was flushed or deleted by someone else; rewriting it", "table", p.table)
		p.written = nil
	}
	// The zone comes with every snapshot: a change of the Node's zone label
	// re-renders every port.
	zoneChanged := s.Zone != p.r.zone
	p.r.zone = s.Zone
	cur, was, touched := p.changes(ports, zoneChanged)
	p.synced = nil
	if err := p.write(ctx, cur, was, touched); err != nil {
		errs = append(errs, err)
	} else {
		p.synced = ports
		if err := p.syncConntrack(was, cur, touched); err != nil {
			errs = append(errs, err)
		}
	}
	p.last = s
	return multierror.Append(nil, errs...).ErrorOrNil()
}

// changes returns the renderings the table is to hold (cur), the ports
// rendered anew or gone (touched, in name order: all a partial sync needs to
// look at) and what the table held for those before (was; nil when the
// table's content is unknown).
//
// A Snapshot's ports are immutable and a source reuses the unchanged ones,
// so an identical pointer needs no rendering. When the last sync's ports are
// known, one walk beside them in name order finds the others and cur is the
// written state changed in place: a sync that changes one Service port of
// 10k costs one rendering and a few map operations, not a map of 10k.
func (p *Proxier) changes(ports []*service.Port, zoneChanged bool) (cur, was map[portKey]*rendered, touched []portKey) {
	var prev map[portKey]*rendered
	if p.written != nil {
		prev = p.written.ports
	}
	if prev != nil && !zoneChanged && p.synced != nil {
		if keys, now, ok := changedPorts(p.synced, ports); ok {
			was = make(map[portKey]*rendered, len(keys))
			for i, k := range keys {
				was[k] = prev[k]
				if now[i] != nil {
					prev[k] = p.r.port(now[i])
				} else {
					delete(prev, k)
				}
			}
			return prev, was, keys
		}
	}
	cur = make(map[portKey]*rendered, len(ports))
	for _, sp := range ports {
		k := portKey{sp.Name, sp.Protocol}
		if old := prev[k]; old != nil && old.port == sp && !zoneChanged {
			cur[k] = old
			continue
		}
		cur[k] = p.r.port(sp)
		touched = append(touched, k)
	}
	if len(cur)-len(touched) < len(prev) {
		for k := range prev {
			if _, ok := cur[k]; !ok {
				touched = append(touched, k)
			}
		}
	}
	slices.SortFunc(touched, comparePortKeys)
	return cur, prev, touched
}

// changedPorts walks old and now, both in name order (as Build makes a
// Snapshot), and returns the keys of the ports that differ: added, removed,
// or another Port (a pointer other than old's), each with its Port in now
// (nil: removed). ok is false when either is not in strict name order, and
// then nothing can be told from the walk.
func changedPorts(old, now []*service.Port) (keys []portKey, ports []*service.Port, ok bool) {
	key := func(sp *service.Port) portKey { return portKey{sp.Name, sp.Protocol} }
	i, j := 0, 0
	for i < len(old) || j < len(now) {
		if i > 0 && i < len(old) && comparePortKeys(key(old[i-1]), key(old[i])) >= 0 ||
			j > 0 && j < len(now) && comparePortKeys(key(now[j-1]), key(now[j])) >= 0 {
			return nil, nil, false
		}
		var c int
		switch {
		case i == len(old):
			c = 1
		case j == len(now):
			c = -1
		default:
			c = comparePortKeys(key(old[i]), key(now[j]))
		}
		switch {
		case c < 0:
			keys, ports = append(keys, key(old[i])), append(ports, nil)
			i++
		case c > 0:
			keys, ports = append(keys, key(now[j])), append(ports, now[j])
			j++
		default:
			if old[i] != now[j] {
				keys, ports = append(keys, key(now[j])), append(ports, now[j])
			}
			i++
			j++
		}
	}
	return keys, ports, true
}

// write makes the table hold cur: all of it when its state is unknown, else
// the changes since the last write (touched, which held was); nothing when
// nothing changed.
//
// A change that only adds and deletes elements of the sets and maps the table
// has (an endpoint moved, a Service port added or removed) goes to the kernel
// over netlink (nftables.Kernel.WriteElements); anything else, and a change
// too big for one netlink message per set, goes through nft.
func (p *Proxier) write(ctx context.Context, cur, was map[portKey]*rendered, touched []portKey) error {
	k := p.cfg.NFTables
	tx := k.NewTransaction()
	full := p.written == nil
	var next *state
	var elems nftables.ElementChanges
	if full {
		// The whole write deletes the table first: never another program's.
		if err := nftables.Claim(ctx, k); err != nil {
			return err
		}
		next = p.writeAll(tx, cur)
	} else {
		next, elems = p.writeChanges(tx, cur, was, touched)
		if tx.NumOperations() == 0 {
			p.written.ports = cur
			p.lastWasFull = false
			return nil
		}
	}
	p.written = nil
	netlink := elems != nil && len(elems) <= nftables.MaxElementChanges
	var err error
	if netlink {
		err = k.WriteElements(ctx, elems)
	} else {
		err = k.Run(ctx, tx)
	}
	if err != nil {
		return fmt.Errorf("write nftables table %s: %w", p.table, err)
	}
	p.written, p.lastWasFull = next, full
	if full {
		p.handles = p.readHandles(ctx)
	}
	klog.V(3).InfoS("Wrote nftables-mode table", "table", p.table, "full", full, "ports", len(cur), "operations", tx.NumOperations(), "netlink", netlink)
	return nil
}

// writeAll adds the whole table holding cur to tx.
func (p *Proxier) writeAll(tx *knftables.Transaction, cur map[portKey]*rendered) *state {
	p.l.write(tx)
	next := &state{ports: cur, elems: map[elemID]*elemRef{}, maps: map[string]bool{}}
	keys := sortedPorts(cur)
	var chains []affChain
	for _, k := range keys {
		r := cur[k]
		for _, s := range r.sets {
			tx.Add(setObject(s))
		}
		for _, c := range r.chains {
			tx.Add(&knftables.Chain{Name: c.name})
			chains = append(chains, c)
		}
	}
	for _, c := range chains {
		for _, rule := range c.rules {
			tx.Add(&knftables.Rule{Chain: c.name, Rule: rule})
		}
	}
	var adds []elemID
	for _, k := range keys {
		r := cur[k]
		for _, e := range r.elems {
			id := elemID{e.set, e.key}
			if ref := next.elems[id]; ref != nil {
				ref.refs++
				continue
			}
			next.elems[id] = &elemRef{value: e.value, comment: r.comment, refs: 1}
			adds = append(adds, id)
		}
	}
	p.addCountMaps(tx, next, adds)
	for _, id := range adds {
		tx.Add(next.elems[id].object(id))
	}
	return next
}

// writeChanges adds to tx what turns the written table into cur, and returns
// the state after it. The order keeps every step valid: new maps, sets and
// chains first; then the element deletions (a verdict map's element before
// the chain it jumps to); chains rewritten, then stale ones and their sets
// deleted; the element additions last. When tx holds nothing but element
// changes of sets and maps with an elementType, they are returned too, in
// tx's order, for WriteElements; else elems is nil.
func (p *Proxier) writeChanges(tx *knftables.Transaction, cur, was map[portKey]*rendered, touched []portKey) (next *state, elems nftables.ElementChanges) {
	old := p.written
	next = &state{ports: cur, elems: old.elems, maps: old.maps}
	type change struct{ was, now *rendered }
	// touched is in name order, so the transaction is the same for the same change.
	var changes []change
	for _, k := range touched {
		was, now := was[k], cur[k]
		if was != nil && now != nil && was.equalContent(now) {
			continue
		}
		changes = append(changes, change{was, now})
	}
	if len(changes) == 0 {
		return next, nil
	}

	// Elements: drop every reference of the old renderings, then take those of
	// the new; an element whose count fell to zero and came back with the
	// same value is left alone.
	deleted := map[elemID]*elemRef{}
	var dels []elemID
	for _, c := range changes {
		if c.was == nil {
			continue
		}
		for _, e := range c.was.elems {
			id := elemID{e.set, e.key}
			ref := next.elems[id]
			if ref == nil {
				continue
			}
			if ref.refs--; ref.refs == 0 {
				delete(next.elems, id)
				deleted[id] = ref
				dels = append(dels, id)
			}
		}
	}
	var adds []elemID
	for _, c := range changes {
		if c.now == nil {
			continue
		}
		for _, e := range c.now.elems {
			id := elemID{e.set, e.key}
			if ref := next.elems[id]; ref != nil {
				ref.refs++
				continue
			}
			ref := &elemRef{value: e.value, comment: c.now.comment, refs: 1}
			next.elems[id] = ref
			if d, ok := deleted[id]; ok && d.value == e.value {
				delete(deleted, id)
				continue
			}
			adds = append(adds, id)
		}
	}

	// Chains and affinity sets, which each belong to one port.
	var newSets, staleSets []affSet
	var newChains, rewritten []affChain
	var staleChains []string
	for _, c := range changes {
		var wasChains, nowChains []affChain
		var wasSets, nowSets []affSet
		if c.was != nil {
			wasChains, wasSets = c.was.chains, c.was.sets
		}
		if c.now != nil {
			nowChains, nowSets = c.now.chains, c.now.sets
		}
		for _, s := range nowSets {
			if !slices.Contains(wasSets, s) {
				newSets = append(newSets, s)
			}
		}
		for _, s := range wasSets {
			if !slices.Contains(nowSets, s) {
				staleSets = append(staleSets, s)
			}
		}
		for _, ch := range nowChains {
			i := slices.IndexFunc(wasChains, func(w affChain) bool { return w.name == ch.name })
			switch {
			case i < 0:
				newChains = append(newChains, ch)
			case !slices.Equal(wasChains[i].rules, ch.rules):
				rewritten = append(rewritten, ch)
			}
		}
		for _, ch := range wasChains {
			if !slices.ContainsFunc(nowChains, func(n affChain) bool { return n.name == ch.name }) {
				staleChains = append(staleChains, ch.name)
			}
		}
	}

	onlyElements := p.addCountMaps(tx, next, adds) == 0 && len(newSets)+len(newChains)+len(rewritten)+len(staleChains)+len(staleSets) == 0
	for _, s := range newSets {
		tx.Add(setObject(s))
	}
	for _, c := range newChains {
		tx.Add(&knftables.Chain{Name: c.name})
	}
	for _, id := range dels {
		if _, ok := deleted[id]; ok {
			e := element(id, deleted[id].value)
			e.Value = nil
			tx.Delete(e)
			elems = p.appendChange(elems, &onlyElements, id, nil)
		}
	}
	for _, c := range rewritten {
		tx.Flush(&knftables.Chain{Name: c.name})
	}
	for _, c := range slices.Concat(rewritten, newChains) {
		for _, rule := range c.rules {
			tx.Add(&knftables.Rule{Chain: c.name, Rule: rule})
		}
	}
	for _, name := range staleChains {
		tx.Flush(&knftables.Chain{Name: name})
		tx.Delete(&knftables.Chain{Name: name})
	}
	for _, s := range staleSets {
		tx.Delete(&knftables.Set{Name: s.name})
	}
	for _, id := range adds {
		tx.Add(next.elems[id].object(id))
		elems = p.appendChange(elems, &onlyElements, id, next.elems[id])
	}
	if !onlyElements {
		return next, nil
	}
	return next, elems
}

// appendChange appends to elems the deletion of element id (ref nil) or its
// addition with ref's value; ok turns false, and stays so, when id's set has
// no elementType.
func (p *Proxier) appendChange(elems nftables.ElementChanges, ok *bool, id elemID, ref *elemRef) nftables.ElementChanges {
	if !*ok {
		return nil
	}
	typ, known := p.l.elementType(id.set)
	if !known {
		*ok = false
		return nil
	}
	c := nftables.ElementChange{Delete: ref == nil, Set: id.set, Type: typ, Key: id.key}
	if ref != nil {
		e := ref.object(id)
		c.Value = ref.value
		if e.Comment != nil {
			c.Comment = *e.Comment
		}
	}
	return append(elems, c)
}

// addCountMaps declares the count maps that elements ids need and the table
// lacks, each with its rule, and returns how many.
func (p *Proxier) addCountMaps(tx *knftables.Transaction, st *state, ids []elemID) int {
	var added []string
	for _, id := range ids {
		if _, _, _, ok := p.l.parseCountMap(id.set); !ok || st.maps[id.set] {
			continue
		}
		st.maps[id.set] = true
		added = append(added, id.set)
	}
	slices.Sort(added)
	for _, name := range added {
		f, k, n, _ := p.l.parseCountMap(name)
		tx.Add(f.countMapObject(k, n))
		tx.Add(f.countRule(k, n))
	}
	return len(added)
}

// element is the element id of a set or, with a value, of a map.
func element(id elemID, value string) *knftables.Element {
	if value == "" {
		return &knftables.Element{Set: id.set, Key: []string{id.key}}
	}
	return &knftables.Element{Map: id.set, Key: []string{id.key}, Value: []string{value}}
}

func (ref *elemRef) object(id elemID) *knftables.Element {
	e := element(id, ref.value)
	if !isHairpin(id.set) {
		// Shared hairpin pairs have no one owner to name.
		comment := nftables.Comment(ref.comment)
		e.Comment = &comment
	}
	return e
}

func setObject(s affSet) *knftables.Set {
	typ := "ipv4_addr"
	if s.v6 {
		typ = "ipv6_addr"
	}
	return &knftables.Set{Name: s.name, Type: typ, Flags: []knftables.SetFlag{knftables.DynamicFlag, knftables.TimeoutFlag},
		Timeout: knftables.PtrTo(s.timeout)}
}

func sortedPorts(m map[portKey]*rendered) []portKey {
	keys := make([]portKey, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, comparePortKeys)
	return keys
}

func comparePortKeys(a, b portKey) int {
	return cmp.Or(a.name.Compare(b.name), cmp.Compare(a.proto, b.proto))
}

// syncConntrack deletes the UDP flows the sync made stale, per family. prev
// are the renderings the table held before, of the touched ports at least
// (nil: unknown); only the touched ports (rendered anew, or gone) are
// compared, so an unchanged Service costs nothing.
func (p *Proxier) syncConntrack(prev, cur map[portKey]*rendered, touched []portKey) error {
	var errs []error
	for fi, f := range p.l.fams {
		old, now := p.udp[fi], map[portKey]conntrack.UDPPort{}
		if old == nil || prev == nil {
			old = nil
			for k, r := range cur {
				if r.udp[fi] != nil {
					now[k] = *r.udp[fi]
				}
			}
		} else {
			// The changed ports' views, before and after.
			was := map[portKey]conntrack.UDPPort{}
			note := func(k portKey) {
				if v, ok := old[k]; ok {
					was[k] = v
				}
				if r := cur[k]; r != nil && r.udp[fi] != nil {
					now[k] = *r.udp[fi]
				}
			}
			for _, k := range touched {
				note(k)
			}
			stale := conntrack.StaleUDPOf(was, now)
			if !stale.Empty() {
				if err := stale.Delete(p.cfg.Conntrack, f.v6); err != nil {
					// Unknown from now on: the next sync checks every port.
					p.udp[fi] = nil
					errs = append(errs, err)
					continue
				}
			}
			for k := range was {
				delete(old, k)
			}
			maps.Copy(old, now)
			continue
		}
		if stale := conntrack.StaleUDPOf(old, now); !stale.Empty() {
			if err := stale.Delete(p.cfg.Conntrack, f.v6); err != nil {
				p.udp[fi] = nil
				errs = append(errs, err)
				continue
			}
		}
		p.udp[fi] = now
	}
	return multierror.Append(nil, errs...).ErrorOrNil()
}

// readHandles reads the rule handles of the base chains; nil when they cannot
// be read, which costs a whole write at the next sync.
func (p *Proxier) readHandles(ctx context.Context) map[string][]int {
	handles := map[string][]int{}
	for _, c := range baseChains {
		h, err := p.cfg.NFTables.RuleHandles(ctx, c.name)
		if err != nil {
			klog.ErrorS(err, "Reading the nftables-mode table's rules", "table", p.table)
			return nil
		}
		handles[c.name] = h
	}
	return handles
}

// Intact reports whether the table was written and its base chains hold the
// rules of the last whole write: the sync loop polls it to repair an external
// flush (`nft flush ruleset`, `nft flush table`, a deleted table) promptly.
func (p *Proxier) Intact() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.written != nil && p.intact(context.Background())
}

func (p *Proxier) intact(ctx context.Context) bool {
	now := p.readHandles(ctx)
	if now == nil || p.handles == nil {
		return false
	}
	for c, h := range p.handles {
		if len(h) == 0 || !slices.Equal(now[c], h) {
			return false
		}
	}
	return true
}

// Cleanup deletes the table; the next Sync starts from scratch. It never
// touches another table (kube-proxy's or the portals') or iptables.
func (p *Proxier) Cleanup() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.written, p.handles, p.last, p.synced = nil, nil, nil, nil
	p.udp = [2]map[portKey]conntrack.UDPPort{}
	if err := nftables.DeleteTable(context.Background(), p.cfg.NFTables); err != nil {
		return fmt.Errorf("delete nftables table %s: %w", p.table, err)
	}
	return nil
}

// Cleanup deletes the nftables mode's table for this chain prefix ("" for the
// default) in the calling thread's namespace. A missing table or nft command
// is not an error; no other table is touched.
func Cleanup(prefix string) error {
	t, err := TableName(prefix)
	if err != nil {
		return err
	}
	return nftables.Delete(t)
}

// DebugServices implements observe.ServicesView: every Service port of the last
// sync with the endpoints some element or chain sends traffic to marked usable.
// The mode keeps no per-endpoint counters.
func (p *Proxier) DebugServices() []observe.ServiceState {
	p.mu.Lock()
	s := p.last
	var ports map[portKey]*rendered
	if p.written != nil {
		ports = p.written.ports
	}
	p.mu.Unlock()
	if s == nil {
		return nil
	}
	out := make([]observe.ServiceState, 0, len(s.Ports))
	for _, sp := range s.Ports {
		st := observe.PortState(sp, "random")
		r := ports[portKey{sp.Name, sp.Protocol}]
		for _, e := range sp.Endpoints {
			ep := netip.AddrPortFrom(e.Addr.Addr().Unmap(), e.Addr.Port())
			st.Endpoints = append(st.Endpoints, observe.EndpointState{
				Address:     e.Addr.String(),
				Ready:       e.Ready,
				Serving:     e.Serving,
				Terminating: e.Terminating,
				Usable:      r != nil && r.port == sp && slices.Contains(r.programmed, ep),
			})
		}
		out = append(out, st)
	}
	return out
}

// Probe reports why this namespace's nftables cannot run the mode (nil when it
// can): no nft command, one too old, no permission, or a kernel without what
// the table uses (NAT, fib, numgen, concatenated and interval keys, dynamic
// sets). It checks the whole table of both families, with an element and an
// affinity chain of each kind, through nft --check: the kernel validates the
// transaction and discards it, so nothing changes.
func Probe() error {
	t, err := TableName("")
	if err != nil {
		return err
	}
	cidr := []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16"), netip.MustParsePrefix("fd00:244::/48")}
	p := &Proxier{}
	p.l.mark = "0x4000"
	for _, c := range []proxymode.Common{{ClusterCIDRs: cidr}, {ClusterCIDRs: cidr, NodePortAddresses: cidr}} {
		cfg := Config{Common: c}
		p.l.fams = []*family{newFamily(false, cfg), newFamily(true, cfg)}
		p.r = renderer{l: &p.l}
		// Documentation addresses: only the syntax and the kernel's support count.
		web := &service.Port{Name: service.PortName{Namespace: "probe", Name: "web"}, Protocol: service.TCP, Port: 80,
			ClusterIPs: []netip.Addr{netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("2001:db8::1")}, NodePort: 30000,
			LoadBalancerIPs:          []netip.Addr{netip.MustParseAddr("192.0.2.2"), netip.MustParseAddr("2001:db8::2")},
			LoadBalancerSourceRanges: []netip.Prefix{netip.MustParsePrefix("198.51.100.0/24"), netip.MustParsePrefix("2001:db8:1::/48")},
			ExternalPolicyLocal:      true,
			Endpoints: []service.Endpoint{
				{Addr: netip.MustParseAddrPort("198.51.100.1:8080"), Ready: true, Local: true},
				{Addr: netip.MustParseAddrPort("[2001:db8:1::1]:8080"), Ready: true, Local: true},
			}}
		sticky := *web
		sticky.Name.Name, sticky.Protocol, sticky.AffinityClientIP, sticky.AffinityTimeout = "sticky", service.UDP, true, time.Minute
		cur := map[portKey]*rendered{}
		for _, sp := range []*service.Port{web, &sticky} {
			cur[portKey{sp.Name, sp.Protocol}] = p.r.port(sp)
		}
		if err := nftables.Probe(t, func(tx *knftables.Transaction) { p.writeAll(tx, cur) }); err != nil {
			return err
		}
	}
	return nil
}
