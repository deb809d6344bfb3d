package rules

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/hashicorp/go-multierror"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/netfilter/conntrack"
	"github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/service"
)

// IPTables programs the portals with iptables (and ip6tables), as the legacy
// userspace proxy did.
type IPTables struct {
	cfg    Config
	chains chains

	// mu serializes Sync and Cleanup and guards everything below.
	mu     sync.Mutex
	fams   []*family // IPv4 first, then IPv6 when enabled
	holder nodePortHolder
	// reply is the policy route of the replies to transparent dials, and
	// repliesOK whether the last Sync left it and the chains in place.
	reply     replyRoute
	repliesOK atomic.Bool
}

// family is the state of one address family.
type family struct {
	f        int
	tables   iptables.Tables
	renderer renderer
	// written is the last restore input that succeeded, with the jumps in place;
	// nil means the kernel's state is unknown and the next Sync rewrites everything
	// and re-checks the jumps.
	written []byte
	// spans are where written's entries' rules are.
	spans []textSpan
	// entries are the portals (after validation and NodePort holding) that
	// written and udp were made from; nil when unknown. While the canary holds,
	// equal entries would render the same text and find no stale flows, so a
	// sync that brings equal entries does neither.
	entries []entry
	// udp deletes the UDP flows each sync leaves going the wrong way.
	udp staleFlows
}

// NewIPTables returns the iptables Portals for cfg. It changes nothing in the
// kernel until the first Sync.
func NewIPTables(cfg Config) (*IPTables, error) {
	prefix, err := iptables.ChainPrefix(cfg.ChainPrefix)
	if err != nil {
		return nil, err
	}
	// Unset kernel parts are the real ones.
	cfg.IPTables = cmp.Or[iptables.Kernel](cfg.IPTables, iptables.Commands{})
	cfg.Conntrack = cmp.Or(cfg.Conntrack, conntrack.Netlink())
	p := &IPTables{cfg: cfg, chains: chainNames(prefix)}
	p.reply.prefix = prefix
	if cfg.ClientAddressMark != 0 && cfg.DialMark != 0 {
		p.chains = p.chains.withClientAddressChain()
		p.reply.mark = cfg.ClientAddressMark
	}
	p.holder = nodePortHolder{listen: p.cfg.listen, prefixes: cfg.NodePortAddresses, held: map[holdKey]*hold{}}
	nodeIPs, err := cfg.familyNodeIPs()
	if err != nil {
		return nil, err
	}
	for f, nodeIP := range nodeIPs {
		if !nodeIP.IsValid() {
			continue
		}
		t, err := p.cfg.IPTables.Tables(f == v6)
		if err != nil {
			return nil, err
		}
		r := newRenderer(p.chains, f, nodeIP, cfg.NodePortAddresses)
		r.dialMark = cfg.DialMark
		r.onNodeIP = cfg.ProxyPortsOnNodeIP
		r.clientMark = p.reply.mark
		p.reply.enabled[f] = true
		p.fams = append(p.fams, &family{f: f, tables: t, renderer: r})
	}
	return p, nil
}

// Sync implements Portals.
func (p *IPTables) Sync(portals []Portal) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var enabled [2]bool
	for _, fam := range p.fams {
		enabled[fam.f] = true
	}
	entries, errs := entriesOf(portals, enabled)
	errs = append(errs, p.holder.sync(entries, enabled)...)
	ok := p.reply.mark != 0
	if err := p.reply.ensure(); err != nil {
		errs = append(errs, err)
		ok = false
	}
	for _, fam := range p.fams {
		if err := p.syncFamily(fam, entries); err != nil {
			errs = append(errs, err)
		}
		ok = ok && fam.written != nil
	}
	p.repliesOK.Store(ok)
	return multierror.Append(nil, errs...).ErrorOrNil()
}

func (p *IPTables) syncFamily(fam *family, entries []entry) error {
	if fam.written != nil && !p.chains.canary.Holds(fam.tables, familyName(fam.f)) {
		klog.InfoS("Portal rules were flushed or deleted by someone else; rewriting them", "family", familyName(fam.f))
		fam.written = nil
	}
	if fam.written != nil && fam.udp.known() && fam.entries != nil && equalEntries(fam.entries, entries) {
		return nil
	}
	fam.entries = nil
	text, spans := fam.renderer.render(entries)
	if !bytes.Equal(text, fam.written) {
		newJumps := fam.written == nil
		// Portals that come and go are appended and deleted in place: a
		// rewrite of the chains takes iptables-restore time growing with
		// every portal.
		input := text
		if !newJumps {
			if edit, ok := portalEdit(fam.written, fam.spans, text, spans); ok {
				input = edit
			}
		}
		fam.written = nil
		if err := p.cfg.IPTables.Restore(fam.f == v6, input); err != nil {
			return fmt.Errorf("write %s portals: %w", familyName(fam.f), err)
		}
		// Jumps go in after the restore: a jump to a chain that does not exist
		// yet is refused.
		if newJumps {
			if err := iptables.EnsureJumps(fam.tables, fam.f == v6, p.chains.jumps()); err != nil {
				return err
			}
		}
		// Kept until the next change: without the estimate's spare room.
		fam.written, fam.spans = bytes.Clone(text), spans
	}

	if err := fam.udp.sync(p.cfg.Conntrack, entries, fam.f); err != nil {
		return err
	}
	fam.entries = entries
	return nil
}

// equalEntries reports whether a and b hold the same portals, field by field.
func equalEntries(a, b []entry) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		x, y := &a[i], &b[i]
		if x.name != y.name || x.protocol != y.protocol || x.proto != y.proto || x.port != y.port ||
			x.proxyPort != y.proxyPort || x.extProxyPort != y.extProxyPort || x.nodePort != y.nodePort ||
			x.families != y.families || x.nodePortHeld != y.nodePortHeld || x.refuse != y.refuse ||
			!slices.Equal(x.clusterIPs, y.clusterIPs) || !slices.Equal(x.externalIPs, y.externalIPs) ||
			!slices.Equal(x.lbIPs, y.lbIPs) {
			return false
		}
	}
	return true
}

// Intact implements Portals: every family written, and its canary in place.
func (p *IPTables) Intact() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, fam := range p.fams {
		if fam.written == nil || !p.chains.canary.Holds(fam.tables, familyName(fam.f)) {
			return false
		}
	}
	return p.reply.mark == 0 || p.reply.present()
}

// Cleanup implements Portals: it releases the held NodePorts and removes the
// chains and jumps of both families, whatever Config.IPv6 says.
func (p *IPTables) Cleanup() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.holder.close()
	p.repliesOK.Store(false)
	for _, fam := range p.fams {
		fam.written = nil
		fam.udp.forget()
		fam.entries = nil
	}
	err := cleanup(p.cfg.IPTables, p.chains)
	if p.reply.mark != 0 {
		p.reply.release()
		err = errors.Join(err, removeReplyRoutes(p.reply.prefix))
	}
	return err
}

// RepliesToClientAddress implements Portals.
func (p *IPTables) RepliesToClientAddress() bool { return p.repliesOK.Load() }

// entriesOf validates portals and returns them sorted by name and protocol, with
// an error for each one left out.
func entriesOf(portals []Portal, enabled [2]bool) ([]entry, []error) {
	var errs []error
	entries := make([]entry, 0, len(portals))
	for i, pt := range portals {
		sp := pt.Port
		if sp == nil {
			errs = append(errs, fmt.Errorf("portal %d: no Service port", i))
			continue
		}
		e := entry{name: sp.Name, protocol: sp.Protocol, port: sp.Port, proxyPort: pt.ProxyPort, extProxyPort: pt.ProxyPort, nodePort: sp.NodePort, refuse: pt.Refuse}
		if pt.ExternalProxyPort != 0 {
			e.extProxyPort = pt.ExternalProxyPort
		}
		fail := func(port int, err error) {
			errs = append(errs, &PortalError{Service: sp.Name, Protocol: sp.Protocol, Port: port, Err: err})
		}
		switch sp.Protocol {
		case service.TCP:
			e.proto = "tcp"
		case service.UDP:
			e.proto = "udp"
		default:
			// SCTP would need an SCTP proxy socket, which the userspace mode lacks.
			fail(sp.Port, ErrUnsupportedProtocol)
			continue
		}
		if !validPort(sp.Port) {
			fail(sp.Port, fmt.Errorf("invalid port"))
			continue
		}
		if !validPort(pt.ProxyPort) {
			fail(sp.Port, fmt.Errorf("invalid proxy port %d", pt.ProxyPort))
			continue
		}
		if !validPort(e.extProxyPort) {
			fail(sp.Port, fmt.Errorf("invalid external proxy port %d", pt.ExternalProxyPort))
			continue
		}
		if sp.NodePort != 0 && !validPort(sp.NodePort) {
			fail(sp.NodePort, fmt.Errorf("invalid NodePort"))
			continue
		}
		e.clusterIPs = cleanIPs(sp.ClusterIPs)
		e.externalIPs = cleanIPs(sp.ExternalIPs)
		e.lbIPs = cleanIPs(sp.LoadBalancerIPs)
		e.families = familiesOf(&e, enabled)
		if !e.families[v4] && !e.families[v6] {
			// Only addresses of a family this proxy does not program, as a
			// single-stack kube-proxy ignores the other family's Services.
			continue
		}
		entries = append(entries, e)
	}
	slices.SortStableFunc(entries, func(a, b entry) int {
		if a.name != b.name {
			if a.name.Less(b.name) {
				return -1
			}
			return 1
		}
		return cmp.Compare(a.protocol, b.protocol)
	})
	return entries, errs
}

// familiesOf returns the enabled families the Service port lives in: those of its
// ClusterIPs, else of its other IPs, else (a bare NodePort) every enabled family.
func familiesOf(e *entry, enabled [2]bool) [2]bool {
	var fams [2]bool
	for _, ips := range [][]netip.Addr{e.clusterIPs, slices.Concat(e.externalIPs, e.lbIPs)} {
		for _, ip := range ips {
			fams[familyOf(ip)] = true
		}
		if fams[v4] || fams[v6] {
			break
		}
	}
	if !fams[v4] && !fams[v6] {
		fams = [2]bool{true, true}
	}
	return [2]bool{fams[v4] && enabled[v4], fams[v6] && enabled[v6]}
}

// cleanIPs returns the usable addresses of ips, unmapped and zoneless. It returns
// ips itself when it is already clean (the common case, which saves a copy per
// Service on every sync); entries never modify their addresses.
func cleanIPs(ips []netip.Addr) []netip.Addr {
	if !slices.ContainsFunc(ips, func(ip netip.Addr) bool {
		return !ip.IsValid() || ip.IsUnspecified() || ip.Is4In6() || ip.Zone() != ""
	}) {
		return ips
	}
	out := make([]netip.Addr, 0, len(ips))
	for _, ip := range ips {
		if ip.IsValid() && !ip.IsUnspecified() {
			out = append(out, ip.Unmap().WithZone(""))
		}
	}
	return out
}

func validPort(p int) bool { return p > 0 && p < 65536 }

// ReleaseReplyRoute stops saying that these portals use the reply route
// (replyRoute), and leaves the route and the rules in place: for a
// successor of the same prefix, which says it from its first write.
func (p *IPTables) ReleaseReplyRoute() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.reply.release()
}
