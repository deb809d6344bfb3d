package rules

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/hashicorp/go-multierror"
	"k8s.io/klog/v2"
	"sigs.k8s.io/knftables"

	"github.com/uproxy/uproxy/netfilter/conntrack"
	"github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/netfilter/nftables"
)

// NFTables programs the portals as one nftables table of uproxy's own (family
// inet, named after the chain prefix: "uproxy" by default), where every portal
// is a map element rather than a rule:
//
//	map service-ips4   ClusterIP/LoadBalancer IP . protocol . port : proxy port (and service-ips6)
//	map external-ips4  ExternalIP . protocol . port : proxy port (and external-ips6)
//	map nodeports4     protocol . NodePort : proxy port (and nodeports6)
//	map no-endpoint-service-ips4, no-endpoint-external-ips4, no-endpoint-nodeports4
//	                   the same keys, of the Service ports refused for want of
//	                   endpoints (Portal.Refuse) : goto refuse
//	set nodeport-addresses4  --nodeport-addresses of the family, when given
//	chain prerouting   nat, dstnat-10: one lookup per map, redirect to the proxy port
//	chain output       nat, dstnat-10: the dial mark returns first, then one
//	                   lookup per map, dnat to node IP:proxy port
//	chain filter-input, filter-forward, filter-output
//	                   filter, -110: a connection's first packet (ct state new)
//	                   jumps to no-endpoints
//	chain no-endpoints the dial mark returns first, then one lookup per
//	                   no-endpoint map, as the nat chains look up theirs
//	chain refuse       TCP: reject with tcp reset; anything else: reject (ICMP
//	                   or ICMPv6 port unreachable)
//
// A key is in a steering map or in its no-endpoint map, never both, so a
// Service port that gains its first endpoint or loses its last one is a few
// elements moved from one map to the other in the sync that sees it.
//
// A new connection costs one map lookup per map whatever the number of
// Services, and a sync writes only the elements that changed, in one
// transaction: adding, removing or moving a Service port costs the same with
// ten Services or fifty thousand.
//
// There is no counterpart of the iptables backend's NODEPORT-NON-LOCAL chain:
// an accept in one nftables table does not stop another table (an iptables
// filter table, or a host firewall's own table) from dropping the packet later
// on the same hook, so accepting redirected NodePort traffic here would change
// nothing. A host firewall that drops it must allow it itself (`ct status dnat`
// with `ct original proto-dst` the NodePort).
type NFTables struct {
	cfg    Config
	table  nftables.Table
	layout nftLayout

	// mu serializes Sync and Cleanup and guards everything below.
	mu      sync.Mutex
	enabled [2]bool
	holder  nodePortHolder
	// written are the elements in the kernel after the last transaction that
	// succeeded; nil means the kernel's state is unknown and the next Sync
	// writes the whole table.
	written nftElements
	// handles are the chains' rule handles read after the last whole write;
	// other handles at the start of a sync mean someone flushed or deleted the
	// table, so it is written whole again.
	handles map[string][]int
	// entries and dups are the validated portals of the last sync that wrote
	// and cleared stale flows, and the key conflicts found in them; nil when
	// unknown. While the table is intact, equal entries would make the same
	// elements, so a sync that brings them compares nothing else.
	entries []entry
	dups    []error
	// last is what the last sync was given, when it wrote and cleared
	// everything without an error of a single Service port: the next sync
	// then may write the changed portals alone (syncChanged). nil otherwise.
	last *nftSynced
	udp  [2]staleFlows
	// reply is the policy route of the replies to transparent dials, and
	// repliesOK whether the last Sync left it and the table in place.
	reply     replyRoute
	repliesOK atomic.Bool
}

// NewNFTables returns the nftables Portals for cfg. It changes nothing in the
// kernel until the first Sync; with cfg.NFTables nil it checks that nft runs.
// A table of its name that is not uproxy's is an error (nftables.Claim).
func NewNFTables(cfg Config) (*NFTables, error) {
	prefix, err := iptables.ChainPrefix(cfg.ChainPrefix)
	if err != nil {
		return nil, err
	}
	name, err := nftables.TableName(prefix)
	if err != nil {
		return nil, err
	}
	p := &NFTables{table: nftables.Table{Family: knftables.InetFamily, Name: name}}
	p.layout.dialMark = cfg.DialMark
	p.layout.onNodeIP = cfg.ProxyPortsOnNodeIP
	if cfg.DialMark != 0 {
		p.layout.clientMark = cfg.ClientAddressMark
	}
	nodeIPs, err := cfg.familyNodeIPs()
	if err != nil {
		return nil, err
	}
	for f, nodeIP := range nodeIPs {
		if !nodeIP.IsValid() {
			continue
		}
		p.enabled[f] = true
		p.reply.enabled[f] = true
		p.layout.fams = append(p.layout.fams, newNFTFamily(f, nodeIP, cfg.NodePortAddresses))
	}
	if cfg.NFTables == nil {
		if cfg.NFTables, err = nftables.New(p.table); err != nil {
			return nil, err
		}
	}
	if err := nftables.Claim(context.Background(), cfg.NFTables); err != nil {
		return nil, err
	}
	cfg.Conntrack = cmp.Or(cfg.Conntrack, conntrack.Netlink())
	p.cfg = cfg
	p.holder = nodePortHolder{listen: p.cfg.listen, prefixes: cfg.NodePortAddresses, held: map[holdKey]*hold{}}
	p.reply.mark, p.reply.prefix = p.layout.clientMark, prefix
	return p, nil
}

// Sync implements Portals.
func (p *NFTables) Sync(portals []Portal) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	ctx := context.Background()
	if p.written != nil && !p.intact(ctx) {
		klog.InfoS("Portal table was flushed or deleted by someone else; rewriting it", "table", p.table)
		p.written, p.entries, p.last = nil, nil, nil
	}
	replyErr := p.reply.ensure()
	defer func() { p.repliesOK.Store(p.reply.mark != 0 && p.written != nil && replyErr == nil) }()
	if done, err := p.syncChanged(ctx, portals); done {
		return multierror.Append(nil, replyErr, err).ErrorOrNil()
	}
	p.last = nil
	entries, errs := entriesOf(portals, p.enabled)
	errs = append(errs, p.holder.sync(entries, p.enabled)...)
	clean := len(errs) == 0
	if replyErr != nil {
		errs = append(errs, replyErr)
	}
	if p.written != nil && p.entries != nil && equalEntries(p.entries, entries) {
		if clean && len(p.dups) == 0 {
			p.last = syncedOf(portals, p.entries)
		}
		return multierror.Append(nil, append(errs, p.dups...)...).ErrorOrNil()
	}
	p.entries = nil
	want, dups := p.layout.elements(entries)
	errs = append(errs, dups...)
	if err := p.write(ctx, want); err != nil {
		return multierror.Append(nil, append(errs, err)...)
	}
	cleared := true
	for _, fam := range p.layout.fams {
		if err := p.udp[fam.f].sync(p.cfg.Conntrack, entries, fam.f); err != nil {
			errs = append(errs, err)
			cleared = false
		}
	}
	if cleared {
		p.entries, p.dups = entries, dups
		if clean && len(dups) == 0 {
			p.last = syncedOf(portals, entries)
		}
	}
	return multierror.Append(nil, errs...).ErrorOrNil()
}

// write makes the table hold want: the whole table when its state is unknown
// (first sync, failed write, external flush), else only the elements that
// changed; nothing at all when none did. Changes of the steering maps alone
// (a Service port added or removed, a proxy port moved) go over netlink
// (nftables.Kernel.WriteElements); the others, and a whole write, through nft.
func (p *NFTables) write(ctx context.Context, want nftElements) error {
	k := p.cfg.NFTables
	tx := k.NewTransaction()
	whole := p.written == nil
	if whole {
		// The whole write deletes the table first: never another program's.
		if err := nftables.Claim(ctx, k); err != nil {
			return err
		}
		p.layout.write(tx)
		want.addAll(tx)
	} else {
		if err := p.writeChanges(ctx, p.written.diff(want)); err != nil {
			return err
		}
		p.written = want
		return nil
	}
	p.written = nil
	if err := k.Run(ctx, tx); err != nil {
		return fmt.Errorf("write nftables table %s: %w", p.table, err)
	}
	p.written = want
	if whole {
		p.handles = p.readHandles(ctx)
	}
	return nil
}

// readHandles reads the rule handles of every chain; nil when they cannot be
// read, which costs a whole write at the next sync.
func (p *NFTables) readHandles(ctx context.Context) map[string][]int {
	handles := map[string][]int{}
	for _, c := range p.layout.chains() {
		h, err := p.cfg.NFTables.RuleHandles(ctx, c)
		if err != nil {
			klog.ErrorS(err, "Reading the portal table's rules", "table", p.table)
			return nil
		}
		handles[c] = h
	}
	return handles
}

// RepliesToClientAddress implements Portals.
func (p *NFTables) RepliesToClientAddress() bool { return p.repliesOK.Load() }

// Intact implements Portals: the table written, and its chains' rules as written.
func (p *NFTables) Intact() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.written != nil && p.intact(context.Background()) && (p.reply.mark == 0 || p.reply.present())
}

// intact reports whether every chain still holds the rules of the last whole
// write: a deleted table (`nft delete table`, `nft flush ruleset`), flushed
// chains (`nft flush table`) or an edited chain all change the handles.
func (p *NFTables) intact(ctx context.Context) bool {
	now := p.readHandles(ctx)
	if now == nil || p.handles == nil {
		return false
	}
	for c, h := range p.handles {
		if !slices.Equal(now[c], h) {
			return false
		}
	}
	return true
}

// Cleanup implements Portals: it releases the held NodePorts and deletes the
// table, which holds both families. It never touches iptables or another
// table (kube-proxy's among them).
func (p *NFTables) Cleanup() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.holder.close()
	p.written, p.handles, p.entries, p.last = nil, nil, nil, nil
	p.repliesOK.Store(false)
	for f := range p.udp {
		p.udp[f].forget()
	}
	var errs []error
	if err := nftables.DeleteTable(context.Background(), p.cfg.NFTables); err != nil {
		errs = append(errs, fmt.Errorf("delete nftables table %s: %w", p.table, err))
	}
	if p.reply.mark != 0 {
		p.reply.release()
		errs = append(errs, removeReplyRoutes(p.reply.prefix))
	}
	return errors.Join(errs...)
}

// ProbeNFTables reports why this namespace's nftables cannot hold the portals
// of chain prefix prefix (nil when it can): it checks the whole layout, both
// families, the dial mark and --nodeport-addresses included, with nft --check,
// which changes nothing.
func ProbeNFTables(prefix string) error {
	prefix, err := iptables.ChainPrefix(prefix)
	if err != nil {
		return err
	}
	name, err := nftables.TableName(prefix)
	if err != nil {
		return err
	}
	// Documentation addresses stand in for the node's: only the syntax and
	// the kernel's support are checked.
	l := nftLayout{dialMark: 1, fams: []nftFamily{
		newNFTFamily(v4, netip.MustParseAddr("192.0.2.1"), []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24"), netip.MustParsePrefix("2001:db8::/64")}),
		newNFTFamily(v6, netip.MustParseAddr("2001:db8::1"), []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24"), netip.MustParsePrefix("2001:db8::/64")}),
	}}
	return nftables.Probe(nftables.Table{Family: knftables.InetFamily, Name: name}, l.write)
}

// ReleaseReplyRoute stops saying that these portals use the reply route
// (replyRoute), and leaves the route and the rules in place: for a
// successor of the same prefix, which says it from its first write.
func (p *NFTables) ReleaseReplyRoute() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.reply.release()
}
