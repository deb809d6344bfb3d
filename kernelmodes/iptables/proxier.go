// Package iptables is uproxy's iptables kernel mode (--proxy-mode iptables): it
// programs every Service port as nat rules that DNAT straight to an endpoint,
// so no uproxy process sits on the data path.
//
//	p, err := iptables.New(iptables.Config{Common: proxymode.Common{IPv6: true}})
//	...
//	err = p.Sync(snapshot) // from the sync loop, on every change
//
// Chains (prefix P, "UPROXY" by default), the layout of kube-proxy's iptables mode:
//
//	nat    P-SERVICES       from PREROUTING and OUTPUT: VIP:port -> SVC/SVL, EXT or FW; last, NodePorts
//	nat    P-NODEPORTS      NodePort -> EXT
//	nat    P-SVC-<hash>     all usable endpoints: recent (ClientIP affinity), statistic -> SEP
//	nat    P-SVL-<hash>     this node's endpoints (traffic policy Local)
//	nat    P-EXT-<hash>     external traffic: masquerade mark (policy Cluster) -> SVC/SVL
//	nat    P-FW-<hash>      loadBalancerSourceRanges -> EXT
//	nat    P-SEP-<hash>     one endpoint: hairpin masquerade mark, DNAT
//	nat    P-MARK-MASQ, P-POSTROUTING  the masquerade mark and the MASQUERADE it leads to
//	filter P-SERVICES, P-EXTERNAL-SERVICES  REJECT (no endpoints) or DROP (no local endpoints)
//	filter P-PROXY-FIREWALL  DROP what FW did not accept
//	filter P-FORWARD        ACCEPT marked and established traffic
//	both   P-PROXY-CANARY   one rule; its loss means someone flushed the table
//
// Per-port chain names hash the port name, protocol and endpoint (sha256,
// base32), so they fit iptables' 28 characters. The first sync, and any sync
// after a failure or a flush, writes everything with iptables-restore
// --noflush and deletes leftover per-port chains; later syncs write only the
// per-port chains whose text changed, and a table's shared chains when their
// text changed: when only Service ports' jumps come and go (at most 64 of them
// going), by inserting and deleting those jumps in place (sharedNATDiff). A
// sync writes in one
// restore per family unless it changes more than 500 ports or deletes more than
// 1500 chains: such chains are written before the shared chains that lead to
// them, 500 ports a restore, and deleted after, 1500 chains a restore; each
// restore of 500 ports also inserts its new ports' jumps. When the kernel holds
// no port chain of ours yet (the first sync on a node), the shared chains go
// first, and every jump with its port's chains. A whole sync over our own rules
// (a restart) edits P-SERVICES and P-NODEPORTS against the jumps the kernel
// holds, as a partial sync does against those it wrote.
package iptables

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"

	"github.com/hashicorp/go-multierror"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/netfilter/conntrack"
	ipt "github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/netfilter/nfacct"
	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/service"
)

// DefaultMasqueradeBit is the mark bit meaning "masquerade this", kube-proxy's 14.
const DefaultMasqueradeBit = ipt.DefaultMasqueradeBit

// Config configures the iptables mode. The zero value programs IPv4 with
// NodePorts on every local address.
type Config struct {
	// Common is what every mode takes (prefix, families, NodePort addresses,
	// masquerading); NodeIPs are not used.
	proxymode.Common
	// MasqueradeBit is the mark bit (0-31) for masquerading; 0 means
	// DefaultMasqueradeBit.
	MasqueradeBit int
	// LocalhostNodePorts also serves IPv4 NodePorts on 127.0.0.0/8, as
	// kube-proxy's iptables mode does by default (its
	// --iptables-localhost-nodeports), when NodePortAddresses is empty or one
	// of its prefixes holds 127.0.0.1. The kernel drops DNATed loopback
	// traffic unless net.ipv4.conf.all.route_localnet is 1, so the first
	// sync sets it; and since route_localnet also lets other hosts reach the
	// node's loopback addresses, the filter chain P-BLOCK-LOCALNET (from
	// INPUT and OUTPUT) drops packets to 127.0.0.0/8 from a source outside it
	// that belong to no connection the node made and no DNAT (CVE-2020-8558).
	// Each such connection's first packet is counted in the nfacct object
	// LocalhostNodePortsCounter. IPv6 has no route_localnet: NodePorts are
	// never served on ::1, as in kube-proxy.
	LocalhostNodePorts bool
	// Accounting holds the nfacct object of the localhost NodePort count; nil
	// opens nfnetlink_acct in the namespace of the first sync that needs it.
	// Without it the packets are served, not counted, as in kube-proxy.
	Accounting Accounting
	// Sysctl sets a sysctl where its value differs and returns the change;
	// nil: conntrack.SetSysctl, in the calling thread's namespace.
	Sysctl func(key string, value int) (*conntrack.Change, error)
	// IPTables is iptables and ip6tables; nil runs the commands
	// (iptables.Commands) in the calling thread's network namespace.
	IPTables ipt.Kernel
	// Conntrack deletes stale UDP flows; nil uses netlink in the calling
	// thread's network namespace (conntrack.Netlink).
	Conntrack conntrack.Deleter
}

// Accounting is the nfacct objects, as nfacct.Client reaches them.
type Accounting interface {
	// Ensure creates the object name unless it exists.
	Ensure(name string) error
	// Get reads the object name (nfacct.ErrNotFound when there is none).
	Get(name string) (nfacct.Counter, error)
	// Delete removes the object name (nfacct.ErrNotFound when there is none).
	Delete(name string) error
}

// routeLocalnet is the sysctl that lets the kernel route DNATed loopback
// traffic off the loopback device, which localhost NodePorts need.
const routeLocalnet = "net.ipv4.conf.all.route_localnet"

// LocalhostNodePortsCounter names the nfacct object counting the packets the
// mode accepts on localhost NodePorts of chain prefix prefix. kube-proxy's is
// localhost_nps_accepted_pkts; uproxy's own name keeps the two proxies' counts
// apart when both run on a node.
func LocalhostNodePortsCounter(prefix string) string {
	return strings.ToLower(prefix) + "_localhost_nps_pkts"
}

// Proxier is the iptables mode. Sync, Cleanup and the readers may be called
// from different goroutines.
type Proxier struct {
	cfg Config
	n   names
	// localhost says IPv4 NodePorts are served on loopback (Config.LocalhostNodePorts
	// where NodePortAddresses allow it); acctName is LocalhostNodePortsCounter's.
	localhost bool
	acctName  string
	// portsPerRestore bounds the ports one restore writes the chains of
	// (defaultPortsPerRestore; tests make it small).
	portsPerRestore int

	// mu serializes Sync and Cleanup and guards everything below.
	mu   sync.Mutex
	fams []*family
	// last is the last Snapshot synced without error, for DebugServices.
	last       *service.Snapshot
	programmed map[service.PortName]map[netip.AddrPort]bool
	// acct is where the localhost count is kept once its object exists (nil
	// before, or while nfnetlink_acct is unavailable); acctErr is the last
	// reason it is not, logged when it changes. localnetSet says route_localnet
	// was found or made 1.
	acct        Accounting
	acctErr     string
	localnetSet bool
	// client is the nfacct client the mode opened (accounting), kept for
	// the process's life.
	client *nfacct.Client
}

// family is the state of one address family.
type family struct {
	v6     bool
	r      renderer
	tables ipt.Tables
	// written holds each port's body as last written successfully; nil means the
	// kernel state is unknown: the next sync is a full one.
	written map[portKey]*portRules
	// udp is the UDP conntrack view after the last sync (nil: unknown).
	udp map[portKey]conntrack.UDPPort
	// lastFull, lastPartial describe the most recent write, for tests and logs.
	lastWasFull bool
	// sharedFilter and sharedNAT are the shared chains' text of each table as
	// last written (valid with written); a sync rewrites a table's shared
	// chains only when their text changed.
	sharedFilter, sharedNAT []byte
	// noEdit says the last write failed while editing the shared chains in
	// place: the next sync rewrites them whole.
	noEdit bool
}

type portKey struct {
	name  service.PortName
	proto service.Protocol
}

// New returns the iptables mode for cfg. It changes nothing in the kernel
// until the first Sync.
func New(cfg Config) (*Proxier, error) {
	prefix, err := ipt.ChainPrefix(cfg.ChainPrefix)
	if err != nil {
		return nil, err
	}
	bit, err := ipt.MasqueradeBit(cfg.MasqueradeBit)
	if err != nil {
		return nil, err
	}
	// Unset kernel parts are the real ones.
	cfg.IPTables = cmp.Or[ipt.Kernel](cfg.IPTables, ipt.Commands{})
	cfg.Conntrack = cmp.Or(cfg.Conntrack, conntrack.Netlink())
	if cfg.Sysctl == nil {
		cfg.Sysctl = conntrack.SetSysctl
	}
	p := &Proxier{cfg: cfg, n: namesOf(prefix), portsPerRestore: defaultPortsPerRestore, acctName: LocalhostNodePortsCounter(prefix)}
	p.localhost = cfg.LocalhostNodePorts && len(cfg.NodePortAddresses) == 0
	for _, pr := range cfg.NodePortAddresses {
		p.localhost = p.localhost || cfg.LocalhostNodePorts && pr.Overlaps(ipv4Loopback)
	}
	for _, v6 := range []bool{false, true} {
		if v6 && !cfg.IPv6 {
			continue
		}
		r := renderer{n: p.n, v6: v6, mark: fmt.Sprintf("%#x", uint32(1)<<bit), masqueradeAll: cfg.MasqueradeAll, localhost: p.localhost && !v6}
		for _, c := range cfg.ClusterCIDRs {
			if r.family(c.Addr()) {
				r.clusterCIDRs = append(r.clusterCIDRs, c.Masked())
			}
		}
		if len(cfg.NodePortAddresses) == 0 {
			// Every local address; loopback ones only with route_localnet,
			// which IPv6 does not have.
			dst := " ! -d " + ipv4Loopback.String()
			switch {
			case v6:
				dst = " ! -d ::1/128"
			case r.localhost:
				dst = ""
			}
			r.nodePortDsts = []string{dst + " -m addrtype --dst-type LOCAL"}
		}
		for _, pr := range cfg.NodePortAddresses {
			if !r.family(pr.Addr()) {
				continue
			}
			// Inside 127.0.0.0/8 or ::1/128: nothing but loopback.
			onlyLoopback := pr.Addr().IsLoopback() && (pr.Bits() >= ipv4Loopback.Bits() || pr.Addr().Is6())
			if pr = pr.Masked(); onlyLoopback && !r.localhost {
				// Loopback alone could only be served with route_localnet: as
				// kube-proxy, such a prefix serves nothing.
				klog.InfoS("NodePorts are not served on loopback without localhost NodePorts (IPv4 only, --iptables-localhost-nodeports)", "nodePortAddress", pr)
				continue
			}
			r.nodePortDsts = append(r.nodePortDsts, " -d "+pr.String())
		}
		t, err := p.cfg.IPTables.Tables(v6)
		if err != nil {
			return nil, err
		}
		p.fams = append(p.fams, &family{v6: v6, r: r, tables: t})
	}
	return p, nil
}

// ipv4Loopback is where localhost NodePorts answer.
var ipv4Loopback = netip.MustParsePrefix("127.0.0.0/8")

// Sync implements syncloop.Mode: it makes the rules of every family match s.
// Services with an unsupported protocol are skipped and reported; the others
// are programmed regardless.
func (p *Proxier) Sync(s *service.Snapshot) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	ports, errs := service.NetfilterPorts(s.Ports)
	programmed := map[service.PortName]map[netip.AddrPort]bool{}
	for _, fam := range p.fams {
		// The zone comes with every snapshot: a change of the Node's zone
		// label re-renders every port, whose text is compared as usual.
		fam.r.zone = s.Zone
		if fam.r.localhost {
			if err := p.prepareLocalhost(fam); err != nil {
				errs = append(errs, err)
			}
		}
		if err := p.syncFamily(fam, ports, programmed); err != nil {
			errs = append(errs, err)
		}
	}
	p.last, p.programmed = s, programmed
	return multierror.Append(nil, errs...).ErrorOrNil()
}

// prepareLocalhost readies the kernel for the IPv4 family's localhost
// NodePorts: route_localnet, until it is set, and the nfacct object its
// counting rules name, whenever the rules may be written whole (the object
// may have gone with them) or while it is missing. A failure of either is
// returned and leaves the rules to be written all the same: without the
// object they count nothing, without route_localnet localhost NodePorts do
// not answer, and every other rule serves.
func (p *Proxier) prepareLocalhost(fam *family) error {
	var errs []error
	if !p.localnetSet {
		c, err := p.cfg.Sysctl(routeLocalnet, 1)
		if err != nil {
			errs = append(errs, fmt.Errorf("localhost NodePorts: %w", err))
		} else {
			p.localnetSet = true
			if c != nil {
				klog.InfoS("Set route_localnet, so that NodePorts answer on 127.0.0.0/8 as with kube-proxy's iptables mode; --iptables-localhost-nodeports=false or --nodeport-addresses without loopback leaves it alone",
					"sysctl", c.Key, "from", c.From, "to", c.To)
			}
		}
	}
	if fam.written != nil && p.acct != nil {
		return errors.Join(errs...)
	}
	acct, err := p.accounting()
	if err == nil {
		err = acct.Ensure(p.acctName)
	}
	if err != nil {
		p.acct, fam.r.acct = nil, ""
		if msg := err.Error(); msg != p.acctErr {
			p.acctErr = msg
			klog.ErrorS(err, "Localhost NodePorts are served but not counted (kubeproxy_iptables_localhost_nodeports_accepted_packets_total)", "counter", p.acctName)
		}
		return errors.Join(errs...)
	}
	p.acct, p.acctErr, fam.r.acct = acct, "", p.acctName
	return errors.Join(errs...)
}

// accounting returns Config.Accounting, or else the mode's own nfacct client,
// opened at the first call: the mode's syncs run on the thread (and in the
// network namespace) that programs the rules, and the counts are read from
// there ever after, whichever goroutine asks.
func (p *Proxier) accounting() (Accounting, error) {
	if p.cfg.Accounting != nil {
		return p.cfg.Accounting, nil
	}
	if p.client == nil {
		c, err := nfacct.Open()
		if err != nil {
			return nil, err
		}
		p.client = c
	}
	return p.client, nil
}

// LocalhostNodePortPackets reads how many packets the mode accepted on
// localhost NodePorts, the first of each connection (kube-proxy's
// kubeproxy_iptables_localhost_nodeports_accepted_packets_total). counting is
// false, and the rest zero, when the mode counts none: localhost NodePorts
// off, or no nfacct object yet.
func (p *Proxier) LocalhostNodePortPackets() (packets uint64, counting bool, err error) {
	p.mu.Lock()
	acct := p.acct
	p.mu.Unlock()
	if acct == nil {
		return 0, false, nil
	}
	c, err := acct.Get(p.acctName)
	if err != nil {
		return 0, true, err
	}
	return c.Packets, true, nil
}

func (p *Proxier) syncFamily(fam *family, ports []*service.Port, programmed map[service.PortName]map[netip.AddrPort]bool) error {
	var sh shared
	cur := make(map[portKey]*portRules, len(ports))
	order := make([]*portRules, 0, len(ports))
	// spans[i] is where order[i]'s jumps are in sh's nat rules.
	spans := make([]jumpSpan, 0, len(ports))
	for _, sp := range ports {
		if !sp.InFamily(fam.v6) {
			continue
		}
		span := jumpSpan{services: len(sh.natServices), nodePorts: len(sh.natNodePorts)}
		pr := fam.r.port(sp, &sh)
		span.servicesEnd, span.nodePortsEnd = len(sh.natServices), len(sh.natNodePorts)
		spans = append(spans, span)
		k := portKey{sp.Name, sp.Protocol}
		cur[k] = &pr
		order = append(order, &pr)
		if programmed[sp.Name] == nil {
			programmed[sp.Name] = map[netip.AddrPort]bool{}
		}
		for _, ep := range pr.programmed {
			programmed[sp.Name][ep] = true
		}
	}

	full := fam.written == nil
	if !full && !p.n.canary.Holds(fam.tables, ipt.FamilyName(fam.v6)) {
		klog.InfoS("iptables-mode rules were flushed or deleted by someone else; rewriting them all", "family", ipt.FamilyName(fam.v6))
		full = true
	}

	// Chains to delete: in a full sync, every per-port chain the kernel holds
	// that is not wanted (left by a previous run or process); in a partial one,
	// the chains last written that are no longer wanted.
	wanted := map[string]bool{}
	for _, pr := range order {
		for _, c := range pr.chains {
			wanted[c] = true
		}
	}
	var stale []string
	// fresh says the kernel holds no port chain of ours, so no rule leads to one;
	// kernelJumps are the rules of P-SERVICES and P-NODEPORTS in the kernel.
	fresh := false
	var kernelJumps []byte
	if full {
		existing, jumps, err := p.existingPortChains(fam.v6)
		if err != nil {
			return err
		}
		fresh, kernelJumps = len(existing) == 0, jumps
		for _, c := range existing {
			if !wanted[c] {
				stale = append(stale, c)
			}
		}
	} else {
		for _, pr := range fam.written {
			for _, c := range pr.chains {
				if !wanted[c] {
					stale = append(stale, c)
				}
			}
		}
		slices.Sort(stale)
	}

	sharedFilter := fam.r.sharedFilter(nil, &sh)
	sharedNAT := fam.r.sharedNATRules(nil, &sh)
	var changed []*portRules
	var changedAt []int // changed[i] is order[changedAt[i]]
	for i, pr := range order {
		if old, ok := fam.written[portKey{pr.key, pr.proto}]; full || !ok || !bytes.Equal(old.body, pr.body) {
			changed = append(changed, pr)
			changedAt = append(changedAt, i)
		}
	}
	// Many ports' chains, or many chains to delete, go in restores of their
	// own (chunks, see defaultPortsPerRestore), the others inline.
	inline, inlineStale := changed, stale
	if len(changed) > p.portsPerRestore {
		inline = nil
	}
	if len(stale) > p.chainsPerRestore() {
		inlineStale = nil
	}

	// A table's shared chains are rewritten only when their text changed: the
	// nat table's hold a rule per Service port, and rewriting them takes
	// iptables-restore seconds at tens of thousands of ports. When only Service
	// ports' jumps come and go, they are inserted and deleted in place instead,
	// a new port's jumps beside its chains, in its chunk. So are the first
	// sync's, when no port chain of ours is in the kernel yet (fresh): the
	// shared chains are then written first, without them (sharedFirst); and a
	// whole sync's over our own rules (after a restart), against the jumps the
	// kernel holds: the other shared chains are then rewritten alone
	// (fixedOnly). No restore then jumps to many existing chains, which would
	// make iptables-restore read the whole table (see defaultPortsPerRestore).
	writeFilter := full || !bytes.Equal(sharedFilter, fam.sharedFilter)
	writeNAT := full || !bytes.Equal(sharedNAT, fam.sharedNAT)
	natText := sharedNAT
	var natEdit []byte
	var chunkJumps [][]byte
	sharedFirst, fixedOnly := false, false
	if writeNAT && !fam.noEdit {
		var old []byte
		switch {
		case !full:
			old = fam.sharedNAT
		case fresh && inline == nil:
			old = fam.r.sharedNATRules(nil, &shared{})
		case !fresh && kernelJumps != nil:
			old = append(fam.r.sharedNATFixed(nil), kernelJumps...)
		}
		if old != nil {
			if gone, added, ok := fam.r.sharedNATDiff(old, sharedNAT); ok {
				switch {
				case !full:
					writeNAT = false
				case fresh:
					natText, sharedFirst = old, true
				default:
					natText, fixedOnly = fam.r.sharedNATFixed(nil), true
				}
				natEdit, chunkJumps = fam.r.placeJumps(gone, added, &sh, spans, changedAt, inline == nil)
			}
		}
	}
	b := make([]byte, 0, 4096+len(order)*600)
	if writeFilter {
		b = append(b, "*filter\n"...)
		b = append(b, sharedFilter...)
		b = append(b, "COMMIT\n"...)
	}
	natStart := len(b)
	b = append(b, "*nat\n"...)
	switch {
	case fixedOnly:
		for _, c := range p.n.fixedNATChains() {
			b = append(b, ":"+c+" - [0:0]\n"...)
		}
	case writeNAT:
		b = fam.r.sharedNATDecl(b)
	}
	// Declaring a stale chain flushes it, so its jumps to other stale chains are
	// gone by the time -X runs.
	for _, c := range inlineStale {
		b = append(b, ":"+c+" - [0:0]\n"...)
	}
	for _, pr := range inline {
		b = append(b, pr.body[:pr.declLen]...)
	}
	if writeNAT {
		b = append(b, natText...)
	}
	b = append(b, natEdit...)
	for _, pr := range inline {
		b = append(b, pr.body[pr.declLen:]...)
	}
	for _, c := range inlineStale {
		b = append(b, "-X "+c+"\n"...)
	}
	if writeNAT || len(natEdit) > 0 || len(inline) > 0 || len(inlineStale) > 0 {
		b = append(b, "COMMIT\n"...)
	} else {
		b = b[:natStart]
	}
	if !full && len(changed) == 0 && len(stale) == 0 && !writeFilter && !writeNAT && len(natEdit) == 0 {
		// Nothing to write: the canary says the kernel still has it all.
		fam.lastWasFull = false
		fam.written = cur
		return p.syncConntrack(fam, order)
	}

	fam.written = nil
	err := func() error {
		if inline != nil || sharedFirst {
			if err := p.restoreMain(fam, b); err != nil {
				return err
			}
		}
		if inline == nil {
			// Many ports' chains go in first and the shared chains that may
			// lead to them after; or after the shared chains, with their jumps.
			if err := p.writePortChunks(fam, changed, chunkJumps); err != nil {
				return err
			}
			if !sharedFirst {
				if err := p.restoreMain(fam, b); err != nil {
					return err
				}
			}
		}
		if inlineStale == nil {
			// Nothing but other stale chains jumps to them now.
			return p.deleteChainChunks(fam, stale)
		}
		return nil
	}()
	if err != nil {
		// After a failed write that edited the shared chains in place, the
		// next sync rewrites them whole, in case the edit was what failed.
		fam.noEdit = fam.noEdit || len(natEdit) > 0 || chunkJumps != nil || sharedFirst || fixedOnly
		return err
	}
	fam.noEdit = false
	fam.lastWasFull = full
	if full {
		// Jumps go in after the chains exist: a jump to a missing chain is refused.
		jumps := p.n.jumps()
		if fam.r.localhost {
			jumps = append(jumps, p.n.localnetJumps()...)
		}
		if err := ipt.EnsureJumps(fam.tables, fam.v6, jumps); err != nil {
			return err
		}
	}
	fam.written, fam.sharedFilter, fam.sharedNAT = cur, sharedFilter, sharedNAT
	klog.V(3).InfoS("Wrote iptables-mode rules", "family", ipt.FamilyName(fam.v6), "full", full, "ports", len(order), "changedPorts", len(changed), "deletedChains", len(stale), "bytes", len(b))

	return p.syncConntrack(fam, order)
}

// defaultPortsPerRestore bounds the ports whose chains one restore writes. The
// nf_tables variant of iptables-restore (1.8.9 measured) keeps the chains it
// knows in a sorted list and walks it to add each one (a strcmp loop in the
// profile), so one restore's time grows with the square of the chains it
// creates: 10000 ports (about 31000 chains) took 189 s in one restore, and
// 7.7 s in chunks of this many ports (BenchmarkSync/ports=10000/full); chunks
// of 200 or 2000 took longer. The same walk makes a restore that jumps to many
// existing chains, which reads them all, grow with the square of the table's
// chains: the shared chains' rewrite of a whole sync at 30000 ports took 14.8 s.
const defaultPortsPerRestore = 500

// chainsPerRestore bounds the chains one restore deletes: as many as
// p.portsPerRestore ports have, at about three chains a port.
func (p *Proxier) chainsPerRestore() int { return 3 * p.portsPerRestore }

// deleteChainChunks deletes chains in restores of p.chainsPerRestore chains,
// flushed first, then deleted (iptables.ChainDeletion).
func (p *Proxier) deleteChainChunks(fam *family, chains []string) error {
	flushes, deletes := ipt.ChainDeletion("nat", chains, p.chainsPerRestore(), nil)
	for _, in := range slices.Concat(flushes, deletes) {
		if err := p.cfg.IPTables.Restore(fam.v6, in); err != nil {
			return fmt.Errorf("delete %d stale %s iptables-mode chains: %w", len(chains), ipt.FamilyName(fam.v6), err)
		}
	}
	return nil
}

// writePortChunks writes the chains of ports in restores of p.portsPerRestore
// ports. Each restore holds whole ports, so a port's chains change at once,
// and also rewrites the masquerade-mark chain they jump to (its one rule never
// changes), which the first sync has not created yet. With jumps (one entry
// per port), each restore also adds its ports' jumps to the shared chains.
func (p *Proxier) writePortChunks(fam *family, ports []*portRules, jumps [][]byte) error {
	for i := 0; i < len(ports); i += p.portsPerRestore {
		chunk := ports[i:min(i+p.portsPerRestore, len(ports))]
		b := make([]byte, 0, 256+len(chunk)*800)
		b = append(b, "*nat\n:"+p.n.markMasq+" - [0:0]\n"...)
		for _, pr := range chunk {
			b = append(b, pr.body[:pr.declLen]...)
		}
		b = fam.r.markMasqRule(b)
		for j, pr := range chunk {
			b = append(b, pr.body[pr.declLen:]...)
			if jumps != nil {
				b = append(b, jumps[i+j]...)
			}
		}
		b = append(b, "COMMIT\n"...)
		if err := p.cfg.IPTables.Restore(fam.v6, b); err != nil {
			return fmt.Errorf("write %s iptables-mode rules of %d Service ports: %w", ipt.FamilyName(fam.v6), len(chunk), err)
		}
	}
	return nil
}

// restoreMain writes a sync's restore of shared chains and inline ports.
func (p *Proxier) restoreMain(fam *family, b []byte) error {
	if len(b) == 0 {
		return nil
	}
	if err := p.cfg.IPTables.Restore(fam.v6, b); err != nil {
		return fmt.Errorf("write %s iptables-mode rules: %w", ipt.FamilyName(fam.v6), err)
	}
	return nil
}

// syncConntrack deletes the UDP flows the sync made stale.
func (p *Proxier) syncConntrack(fam *family, order []*portRules) error {
	udp := udpStateOf(order)
	if stale := conntrack.StaleUDPOf(fam.udp, udp); !stale.Empty() {
		// On failure fam.udp keeps the old view, so the next sync tries again.
		if err := stale.Delete(p.cfg.Conntrack, fam.v6); err != nil {
			return err
		}
	}
	fam.udp = udp
	return nil
}

// Intact reports whether every family's rules were written and its canaries
// are in place: the sync loop polls it to repair an external flush promptly.
func (p *Proxier) Intact() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, fam := range p.fams {
		if fam.written == nil || !p.n.canary.Holds(fam.tables, ipt.FamilyName(fam.v6)) {
			return false
		}
	}
	return true
}

// existingPortChains returns the per-port chains of our prefix in the nat
// table, and the rules of P-SERVICES and P-NODEPORTS as iptables-save prints
// them (nil when P-SERVICES is missing). A chain of the mode's names that is
// another program's is an error (*ipt.NotOursError): a whole sync declares
// every chain it writes, which would flush it.
func (p *Proxier) existingPortChains(v6 bool) ([]string, []byte, error) {
	saved, err := p.cfg.IPTables.Save(v6)
	if err != nil {
		return nil, nil, fmt.Errorf("read %s rules: %w", ipt.FamilyName(v6), err)
	}
	rs := ipt.Parse(saved)
	if err := rs.NotOurs(v6, p.n.ours()); err != nil {
		return nil, nil, err
	}
	nat := rs.Table("nat")
	var out []string
	if nat != nil {
		for _, c := range nat.Chains {
			if p.n.isPortChain(c.Name) {
				out = append(out, c.Name)
			}
		}
	}
	var jumps []byte
	if services := nat.Chain(p.n.services); services != nil && services.Policy != "" {
		jumps = []byte{}
		for _, name := range []string{p.n.services, p.n.nodePorts} {
			if c := nat.Chain(name); c != nil {
				for _, r := range c.Rules {
					jumps = append(jumps, r.Text+"\n"...)
				}
			}
		}
	}
	return out, jumps, nil
}

// Cleanup removes every chain and jump rule of this prefix in both families,
// whatever Config.IPv6 says, and with localhost NodePorts their counter; the
// next Sync starts from scratch.
func (p *Proxier) Cleanup() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, fam := range p.fams {
		fam.written, fam.udp = nil, nil
	}
	p.last, p.programmed = nil, nil
	err := cleanup(p.cfg.IPTables, p.n)
	if !removedOurs(err) {
		return err
	}
	p.acct = nil
	for _, fam := range p.fams {
		fam.r.acct = ""
	}
	if !p.localhost {
		// No counter of this mode's; one a run with localhost NodePorts
		// left is `uproxy cleanup`'s (Cleanup).
		return err
	}
	acct, _ := p.accounting() // nil when nfacct is missing: deleteCounter finds none
	return errors.Join(err, deleteCounter(acct, p.acctName))
}

// DebugServices implements observe.ServicesView: every Service port of the last
// sync with the endpoints some rule sends traffic to marked usable, and each
// endpoint's DNAT counters (one iptables-save -c per family per call; the
// counters of a family that cannot be read are left zero and logged).
func (p *Proxier) DebugServices() []observe.ServiceState {
	p.mu.Lock()
	s, programmed := p.last, p.programmed
	p.mu.Unlock()
	if s == nil {
		return nil
	}
	type counted struct {
		key portKey
		ep  netip.AddrPort
	}
	cs, err := p.Counters()
	if err != nil {
		klog.V(2).InfoS("Reading the DNAT counters for /debug/services", "err", err)
	}
	counters := make(map[counted]EndpointCounters, len(cs))
	for _, c := range cs {
		counters[counted{portKey{c.Service, c.Protocol}, c.Endpoint}] = c
	}
	out := make([]observe.ServiceState, 0, len(s.Ports))
	for _, sp := range s.Ports {
		st := observe.PortState(sp, "random")
		for _, e := range sp.Endpoints {
			ep := netip.AddrPortFrom(e.Addr.Addr().Unmap(), e.Addr.Port())
			c := counters[counted{portKey{sp.Name, sp.Protocol}, ep}]
			st.Endpoints = append(st.Endpoints, observe.EndpointState{
				Address:     e.Addr.String(),
				Ready:       e.Ready,
				Serving:     e.Serving,
				Terminating: e.Terminating,
				Usable:      programmed[sp.Name][ep],
				Packets:     c.Packets,
				Bytes:       c.Bytes,
			})
		}
		out = append(out, st)
	}
	return out
}

// EndpointCounters are the kernel's counters of one endpoint's DNAT rule. Only a
// connection's first packet traverses the nat table, so Packets counts the
// connections (UDP flows) sent to the endpoint and Bytes their first packets.
type EndpointCounters struct {
	Service  service.PortName
	Protocol service.Protocol
	Endpoint netip.AddrPort
	Packets  uint64
	Bytes    uint64
}

// Counters reads the DNAT counters of every programmed endpoint (one
// iptables-save -c per family), summed over the SEP chains' DNAT rules.
func (p *Proxier) Counters() ([]EndpointCounters, error) {
	p.mu.Lock()
	type sep struct {
		key portKey
		ep  netip.AddrPort
	}
	type famSeps struct {
		v6   bool
		seps map[string]sep
	}
	var fams []famSeps
	for _, fam := range p.fams {
		fs := famSeps{v6: fam.v6, seps: map[string]sep{}}
		for k, pr := range fam.written {
			for c, ep := range pr.seps {
				fs.seps[c] = sep{k, ep}
			}
		}
		fams = append(fams, fs)
	}
	p.mu.Unlock()

	var out []EndpointCounters
	var errs []error
	for _, fs := range fams {
		saved, err := p.cfg.IPTables.SaveCounters(fs.v6, "nat")
		if err != nil {
			errs = append(errs, err)
			continue
		}
		got := map[string]*EndpointCounters{}
		for _, c := range ipt.Parse(saved).Chains("nat") {
			s, ok := fs.seps[c.Name]
			if !ok {
				continue
			}
			for _, r := range c.Rules {
				if r.Target() != "DNAT" {
					continue
				}
				ec := got[c.Name]
				if ec == nil {
					ec = &EndpointCounters{Service: s.key.name, Protocol: s.key.proto, Endpoint: s.ep}
					got[c.Name] = ec
				}
				ec.Packets += r.Packets
				ec.Bytes += r.Bytes
			}
		}
		for _, c := range got {
			out = append(out, *c)
		}
	}
	slices.SortFunc(out, func(a, b EndpointCounters) int {
		if a.Service != b.Service {
			if a.Service.Less(b.Service) {
				return -1
			}
			return 1
		}
		if c := strings.Compare(string(a.Protocol), string(b.Protocol)); c != 0 {
			return c
		}
		return a.Endpoint.Compare(b.Endpoint)
	})
	return out, multierror.Append(nil, errs...).ErrorOrNil()
}
