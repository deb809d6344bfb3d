package iptables

import (
	"crypto/sha256"
	"encoding/base32"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	ipt "github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/service"
)

// maxChainName is iptables' limit on chain names (XT_EXTENSION_MAXNAMELEN - 1).
const maxChainName = 28

// names holds the fixed chain names of one prefix and the per-port kinds.
type names struct {
	prefix string
	// nat
	services, nodePorts, postrouting, markMasq string
	// filter
	filterServices, externalServices, forward, firewall string
	// blockLocalnet guards loopback addresses once route_localnet is set.
	blockLocalnet string
	// both tables
	canary ipt.Canary
	// hashLen is how many base32 characters of a hash fit after prefix+"-SVC-".
	hashLen int
}

// Per-port chain kinds, as in kube-proxy: SVC sends to all usable endpoints,
// SVL to this node's, EXT is the entry for external traffic, FW the
// loadBalancerSourceRanges check, SEP one endpoint.
var portKinds = []string{"SVC", "SVL", "EXT", "FW", "SEP"}

func namesOf(prefix string) names {
	return names{
		prefix:           prefix,
		services:         prefix + "-SERVICES",
		nodePorts:        prefix + "-NODEPORTS",
		postrouting:      prefix + "-POSTROUTING",
		markMasq:         prefix + "-MARK-MASQ",
		filterServices:   prefix + "-SERVICES",
		externalServices: prefix + "-EXTERNAL-SERVICES",
		forward:          prefix + "-FORWARD",
		firewall:         prefix + "-PROXY-FIREWALL",
		blockLocalnet:    prefix + "-BLOCK-LOCALNET",
		canary:           ipt.Canary{Chain: prefix + "-PROXY-CANARY", Tables: []string{"nat", "filter"}},
		hashLen:          min(16, maxChainName-len(prefix)-len("-SVC-")),
	}
}

func (n names) natChains() []string {
	return []string{n.services, n.nodePorts, n.postrouting, n.markMasq, n.canary.Chain}
}

// filterChains are declared in every sync of either family, blockLocalnet
// too, empty unless IPv4 NodePorts answer on loopback: a later run without
// them flushes it, and cleanup knows it.
func (n names) filterChains() []string {
	return []string{n.filterServices, n.externalServices, n.forward, n.firewall, n.blockLocalnet, n.canary.Chain}
}

// isPortChain reports whether chain is a per-port chain of this prefix
// (prefix-KIND-hash), the chains stale-chain removal may delete.
func (n names) isPortChain(chain string) bool {
	rest, ok := strings.CutPrefix(chain, n.prefix+"-")
	if !ok {
		return false
	}
	kind, hash, ok := strings.Cut(rest, "-")
	return ok && slices.Contains(portKinds, kind) && len(hash) == n.hashLen && !strings.Contains(hash, "-")
}

// portChain names the chain of kind for one Service port (and endpoint, for SEP):
// a hash of the port name and protocol, so the name is stable across syncs and
// restarts and fits iptables' limit whatever the Service is called.
func (n names) portChain(kind string, name service.PortName, proto service.Protocol, endpoint string) string {
	sum := sha256.Sum256([]byte(name.String() + string(proto) + endpoint))
	enc := base32.StdEncoding.EncodeToString(sum[:])
	return n.prefix + "-" + kind + "-" + enc[:n.hashLen]
}

// jumps lists the rules in built-in chains, each inserted first when missing.
// Each comment begins with ipt.CommentPrefix, which tells uproxy's chains from
// another program's of the same name (ours). The filter jumps carry --ctstate
// NEW: only a connection's first packet can be rejected or dropped for having
// no endpoint.
func (n names) jumps() []ipt.Jump {
	const svc = "kernel-mode service portals"
	newOnly := []string{"-m", "conntrack", "--ctstate", "NEW"}
	jump := func(table, chain string, match []string, text, target string) ipt.Jump {
		return ipt.Jump{Table: table, Chain: chain, Spec: ipt.JumpSpec(match, text, target)}
	}
	return []ipt.Jump{
		jump("nat", "PREROUTING", nil, svc, n.services),
		jump("nat", "OUTPUT", nil, svc, n.services),
		jump("nat", "POSTROUTING", nil, "postrouting rules", n.postrouting),
		jump("filter", "INPUT", newOnly, "externally-visible service portals", n.externalServices),
		jump("filter", "INPUT", newOnly, "load balancer firewall", n.firewall),
		jump("filter", "FORWARD", nil, "forwarding rules", n.forward),
		jump("filter", "FORWARD", newOnly, svc, n.filterServices),
		jump("filter", "FORWARD", newOnly, "externally-visible service portals", n.externalServices),
		jump("filter", "FORWARD", newOnly, "load balancer firewall", n.firewall),
		jump("filter", "OUTPUT", newOnly, svc, n.filterServices),
		jump("filter", "OUTPUT", newOnly, "load balancer firewall", n.firewall),
	}
}

// localnetJumps lead every packet the node receives or sends to
// blockLocalnet, first, as kube-proxy's (and kubelet's) KUBE-FIREWALL: the
// guard must see the packets other rules would accept.
func (n names) localnetJumps() []ipt.Jump {
	return []ipt.Jump{
		{Table: "filter", Chain: "INPUT", Spec: ipt.JumpSpec(nil, "localnet guard", n.blockLocalnet)},
		{Table: "filter", Chain: "OUTPUT", Spec: ipt.JumpSpec(nil, "localnet guard", n.blockLocalnet)},
	}
}

// uncommentedJumps are the localnet jumps as uproxy wrote them before its
// jumps carried ipt.CommentPrefix. A node may still hold them, which is no
// sign of another program's chain; the first sync leaves them beside the new
// ones (the guard is the same), and a cleanup deletes both.
func (n names) uncommentedJumps() []ipt.Jump {
	return []ipt.Jump{
		{Table: "filter", Chain: "INPUT", Spec: []string{"-j", n.blockLocalnet}},
		{Table: "filter", Chain: "OUTPUT", Spec: []string{"-j", n.blockLocalnet}},
	}
}

// ours is everything of the iptables mode's in a family's tables: its fixed
// chains, its per-port chains in nat, and the jumps it once wrote without a
// comment.
func (n names) ours() ipt.Ours {
	fixed := ipt.ChainSet{"nat": n.natChains(), "filter": n.filterChains()}
	return ipt.Ours{
		Chains: func(table, chain string) bool {
			return fixed.Has(table, chain) || table == "nat" && n.isPortChain(chain)
		},
		Uncommented: n.uncommentedJumps(),
	}
}

// renderer writes one family's rules.
type renderer struct {
	n    names
	v6   bool
	mark string // "0x4000", the masquerade bit
	// clusterCIDRs of this family: traffic to a ClusterIP from outside them is
	// masqueraded. masqueradeAll masquerades all of it.
	clusterCIDRs  []netip.Prefix
	masqueradeAll bool
	// nodePortDsts are the destination matches of NodePort rules: the family's
	// NodePortAddresses prefixes, or local addresses except loopback when none.
	nodePortDsts []string
	zone         string // this node's zone for topology hints, from the snapshot
	// localhost: IPv4 NodePorts answer on 127.0.0.0/8 (Config.LocalhostNodePorts);
	// acct, when not empty, is the nfacct object counting them.
	localhost bool
	acct      string
}

// portRules is what one Service port contributes to one family.
type portRules struct {
	key service.PortName
	// proto is the Service protocol (the key within key's name).
	proto service.Protocol
	// chains are its own chains, declared in this order; body declares and
	// fills them and is compared with the last written body to find changes.
	chains []string
	body   []byte
	// declLen is the length of body's declarations, which must precede every
	// rule jumping to the chains.
	declLen int
	// seps maps each SEP chain to its endpoint, for counters.
	seps map[string]netip.AddrPort
	// programmed are the endpoints some chain sends traffic to.
	programmed []netip.AddrPort
	// dsts are the UDP destinations (virtual IP:port) and NodePort, for conntrack.
	vips     []netip.AddrPort
	nodePort int
}

// shared collects the rules every port adds to the shared chains.
type shared struct {
	natServices, natNodePorts   []byte
	filterServices, filterExtra []byte // filterExtra: EXTERNAL-SERVICES
	firewall                    []byte
}

func (r *renderer) family(a netip.Addr) bool { return a.Unmap().Is6() == r.v6 }

func (r *renderer) ofFamily(ips []netip.Addr) []netip.Addr { return service.AddrsOfFamily(ips, r.v6) }

func (r *renderer) epsOfFamily(eps []service.Endpoint) []netip.AddrPort {
	return service.EndpointsOfFamily(eps, r.v6)
}

func (r *renderer) hostMask() string {
	if r.v6 {
		return "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"
	}
	return "255.255.255.255"
}

func cidr(ip netip.Addr) string { return ip.String() + "/" + strconv.Itoa(ip.BitLen()) }

// probability is kube-proxy's formatting of 1/n: ten decimals, enough that
// rounding never starves an endpoint.
func probability(n int) string { return fmt.Sprintf("%0.10f", 1.0/float64(n)) }

// port renders p: its own chains into the returned portRules, its rules in the
// shared chains into sh. It follows kube-proxy's layout: the internal traffic
// chain (SVC, or SVL with internalTrafficPolicy Local) from the ClusterIPs, the
// EXT chain from NodePorts, ExternalIPs and LoadBalancer IPs (through FW when
// loadBalancerSourceRanges are set), SEP chains doing the DNAT.
func (r *renderer) port(p *service.Port, sh *shared) portRules {
	proto := p.Protocol.NetfilterName()
	name := p.Name.String()
	pr := portRules{key: p.Name, proto: p.Protocol, seps: map[string]netip.AddrPort{}, nodePort: p.NodePort}
	svcChain := r.n.portChain("SVC", p.Name, p.Protocol, "")
	svlChain := r.n.portChain("SVL", p.Name, p.Protocol, "")
	extChain := r.n.portChain("EXT", p.Name, p.Protocol, "")
	fwChain := r.n.portChain("FW", p.Name, p.Protocol, "")

	clusterIPs := r.ofFamily(p.ClusterIPs)
	externalIPs := r.ofFamily(p.ExternalIPs)
	lbIPs := r.ofFamily(p.LoadBalancerIPs)
	var sourceRanges []netip.Prefix
	for _, s := range p.LoadBalancerSourceRanges {
		if r.family(s.Addr()) {
			sourceRanges = append(sourceRanges, s.Masked())
		}
	}
	// Ranges of the other family only still mean "not everyone": this family's
	// clients are then all refused.
	firewalled := len(p.LoadBalancerSourceRanges) > 0 && len(lbIPs) > 0
	externallyAccessible := p.NodePort != 0 || len(externalIPs) > 0 || len(lbIPs) > 0

	// The Cluster-policy endpoints are the usable ones after topology; the Local
	// ones this node's.
	clusterView := *p
	clusterView.InternalPolicyLocal = false
	clusterEps := r.epsOfFamily(clusterView.ClusterEndpoints(r.zone))
	localEps := r.epsOfFamily(p.LocalEndpoints())
	anyUsable := len(clusterEps) > 0

	internalChain, internalEps := svcChain, clusterEps
	if p.InternalPolicyLocal {
		internalChain, internalEps = svlChain, localEps
	}
	externalChain, externalEps := svcChain, clusterEps
	if p.ExternalPolicyLocal {
		externalChain, externalEps = svlChain, localEps
	}
	usesSVC := len(clusterEps) > 0 && (!p.InternalPolicyLocal || externallyAccessible)
	usesSVL := len(localEps) > 0 && (p.InternalPolicyLocal || (p.ExternalPolicyLocal && externallyAccessible))
	// The EXT chain exists while the Service has any endpoint: with a Local
	// policy and none on this node, it still sends pods' and the node's own
	// traffic to every endpoint (kube-proxy's short-circuit); the rest is dropped.
	usesEXT := externallyAccessible && anyUsable
	hasExternalEps := len(externalEps) > 0

	// A missing endpoint is a REJECT when the Service has none at all, a DROP when
	// only the policy's (this node's) are missing, as kube-proxy does.
	noEndpoints := func() (string, string) {
		if anyUsable {
			return "DROP", name + " has no local endpoints"
		}
		return "REJECT", name + " has no endpoints"
	}

	portMatch := func(b []byte, port int) []byte {
		b = append(b, " -m "+proto+" --dport "...)
		return strconv.AppendInt(b, int64(port), 10)
	}
	dstRule := func(b []byte, chain string, ip netip.Addr, comment string, port int, target string) []byte {
		b = append(b, "-A "+chain+" -d "+cidr(ip)+" -p "+proto+" -m comment --comment "+ipt.Quote(comment)...)
		b = portMatch(b, port)
		return append(b, " -j "+target+"\n"...)
	}

	// Shared chains.
	for _, ip := range clusterIPs {
		if len(internalEps) > 0 {
			sh.natServices = dstRule(sh.natServices, r.n.services, ip, name+" cluster IP", p.Port, internalChain)
		} else {
			target, comment := noEndpoints()
			sh.filterServices = dstRule(sh.filterServices, r.n.filterServices, ip, comment, p.Port, target)
		}
	}
	for _, ip := range externalIPs {
		if usesEXT {
			sh.natServices = dstRule(sh.natServices, r.n.services, ip, name+" external IP", p.Port, extChain)
		}
		if !hasExternalEps {
			target, comment := noEndpoints()
			sh.filterExtra = dstRule(sh.filterExtra, r.n.externalServices, ip, comment, p.Port, target)
		}
	}
	for _, ip := range lbIPs {
		if usesEXT {
			target := extChain
			if firewalled {
				target = fwChain
			}
			sh.natServices = dstRule(sh.natServices, r.n.services, ip, name+" loadbalancer IP", p.Port, target)
		}
		if !hasExternalEps {
			target, comment := noEndpoints()
			sh.filterExtra = dstRule(sh.filterExtra, r.n.externalServices, ip, comment, p.Port, target)
		}
		if firewalled {
			// Traffic FW let through was DNATed and no longer matches; what is
			// left reached the LB IP from a refused source.
			sh.firewall = dstRule(sh.firewall, r.n.firewall, ip, name+" traffic not accepted by "+fwChain, p.Port, "DROP")
		}
	}
	if p.NodePort != 0 {
		if usesEXT {
			if r.acct != "" {
				// The same jump, first for loopback destinations, to count
				// them (kube-proxy's localhost_nps_accepted_pkts).
				sh.natNodePorts = append(sh.natNodePorts, "-A "+r.n.nodePorts+" -d "+ipv4Loopback.String()+" -p "+proto+" -m comment --comment "+ipt.Quote(name)...)
				sh.natNodePorts = portMatch(sh.natNodePorts, p.NodePort)
				// iptables-save prints two spaces after --nfacct-name; so does
				// this, so that the rule reads back as written (sharedNATDiff).
				sh.natNodePorts = append(sh.natNodePorts, " -m nfacct --nfacct-name  "+r.acct+" -j "+extChain+"\n"...)
			}
			sh.natNodePorts = append(sh.natNodePorts, "-A "+r.n.nodePorts+" -p "+proto+" -m comment --comment "+ipt.Quote(name)...)
			sh.natNodePorts = portMatch(sh.natNodePorts, p.NodePort)
			sh.natNodePorts = append(sh.natNodePorts, " -j "+extChain+"\n"...)
		}
		if !hasExternalEps {
			target, comment := noEndpoints()
			for _, d := range r.nodePortDsts {
				sh.filterExtra = append(sh.filterExtra, "-A "+r.n.externalServices+d+" -p "+proto+" -m comment --comment "+ipt.Quote(comment)...)
				sh.filterExtra = portMatch(sh.filterExtra, p.NodePort)
				sh.filterExtra = append(sh.filterExtra, " -j "+target+"\n"...)
			}
		}
	}

	// Own chains: declared first, then filled.
	var seps []netip.AddrPort
	if usesSVC {
		pr.chains = append(pr.chains, svcChain)
		seps = append(seps, clusterEps...)
	}
	if usesSVL {
		pr.chains = append(pr.chains, svlChain)
		seps = append(seps, localEps...)
	}
	if usesEXT {
		pr.chains = append(pr.chains, extChain)
		if firewalled {
			pr.chains = append(pr.chains, fwChain)
		}
	}
	slices.SortFunc(seps, netip.AddrPort.Compare)
	seps = slices.Compact(seps)
	sepChain := func(ep netip.AddrPort) string { return r.n.portChain("SEP", p.Name, p.Protocol, ep.String()) }
	for _, ep := range seps {
		c := sepChain(ep)
		pr.chains = append(pr.chains, c)
		pr.seps[c] = ep
	}
	pr.programmed = seps

	b := make([]byte, 0, 256*(len(pr.chains)+1))
	for _, c := range pr.chains {
		b = append(b, ":"+c+" - [0:0]\n"...)
	}
	pr.declLen = len(b)
	timeout := strconv.Itoa(int(max(p.AffinityTimeout, 1e9).Seconds()))
	balance := func(chain string, eps []netip.AddrPort) {
		if p.AffinityClientIP {
			// A client seen within the timeout goes back to the endpoint that
			// recorded it; --reap forgets clients idle longer than that.
			for _, ep := range eps {
				c := sepChain(ep)
				b = append(b, "-A "+chain+" -m comment --comment "+ipt.Quote(name+" -> "+ep.String())+
					" -m recent --rcheck --seconds "+timeout+" --reap --name "+c+" --mask "+r.hostMask()+" --rsource -j "+c+"\n"...)
			}
		}
		for i, ep := range eps {
			b = append(b, "-A "+chain+" -m comment --comment "+ipt.Quote(name+" -> "+ep.String())...)
			if i < len(eps)-1 {
				b = append(b, " -m statistic --mode random --probability "+probability(len(eps)-i)...)
			}
			b = append(b, " -j "+sepChain(ep)+"\n"...)
		}
	}
	if usesSVC {
		if !p.InternalPolicyLocal {
			for _, ip := range clusterIPs {
				switch {
				case r.masqueradeAll:
					b = dstRule(b, svcChain, ip, name+" cluster IP", p.Port, r.n.markMasq)
				case len(r.clusterCIDRs) > 0:
					for _, c := range r.clusterCIDRs {
						b = append(b, "-A "+svcChain+" -d "+cidr(ip)+" ! -s "+c.String()+" -p "+proto+" -m comment --comment "+ipt.Quote(name+" cluster IP")...)
						b = portMatch(b, p.Port)
						b = append(b, " -j "+r.n.markMasq+"\n"...)
					}
				}
			}
		}
		balance(svcChain, clusterEps)
	}
	if usesSVL {
		balance(svlChain, localEps)
	}
	if usesEXT {
		if !p.ExternalPolicyLocal {
			// The reply must come back through this node, whichever node the
			// endpoint is on.
			b = append(b, "-A "+extChain+" -m comment --comment "+ipt.Quote("masquerade traffic for "+name+" external destinations")+" -j "+r.n.markMasq+"\n"...)
		} else {
			for _, c := range r.clusterCIDRs {
				// Pods reach external destinations as if from outside the
				// cluster: no policy applies to them.
				b = append(b, "-A "+extChain+" -s "+c.String()+" -m comment --comment "+ipt.Quote("pod traffic for "+name+" external destinations")+" -j "+svcChain+"\n"...)
			}
			// The node's own traffic has a local source address, which the
			// endpoint could not answer: masquerade it and let it use every endpoint.
			b = append(b, "-A "+extChain+" -m comment --comment "+ipt.Quote("masquerade LOCAL traffic for "+name+" external destinations")+" -m addrtype --src-type LOCAL -j "+r.n.markMasq+"\n"...)
			if usesSVC {
				b = append(b, "-A "+extChain+" -m comment --comment "+ipt.Quote("route LOCAL traffic for "+name+" external destinations")+" -m addrtype --src-type LOCAL -j "+svcChain+"\n"...)
			}
		}
		if hasExternalEps {
			b = append(b, "-A "+extChain+" -j "+externalChain+"\n"...)
		}
		if firewalled {
			for _, s := range sourceRanges {
				b = append(b, "-A "+fwChain+" -s "+s.String()+" -m comment --comment "+ipt.Quote(name+" loadbalancer IP")+" -j "+extChain+"\n"...)
			}
			b = append(b, "-A "+fwChain+" -m comment --comment "+ipt.Quote("other traffic to "+name+" will be dropped by "+r.n.firewall)+"\n"...)
		}
	}
	for _, ep := range seps {
		c := sepChain(ep)
		// Hairpin: an endpoint reaching itself through the Service would see its
		// own address as the source; masquerading makes the reply come back here.
		b = append(b, "-A "+c+" -s "+cidr(ep.Addr())+" -m comment --comment "+ipt.Quote(name)+" -j "+r.n.markMasq+"\n"...)
		b = append(b, "-A "+c+" -p "+proto+" -m comment --comment "+ipt.Quote(name)...)
		if p.AffinityClientIP {
			b = append(b, " -m recent --set --name "+c+" --mask "+r.hostMask()+" --rsource"...)
		}
		b = append(b, " -m "+proto+" -j DNAT --to-destination "+ep.String()+"\n"...)
	}
	pr.body = b

	for _, ips := range [][]netip.Addr{clusterIPs, externalIPs, lbIPs} {
		for _, ip := range ips {
			pr.vips = append(pr.vips, netip.AddrPortFrom(ip, uint16(p.Port)))
		}
	}
	return pr
}

// sharedText renders the restore input's shared part of table ("filter" or
// "nat"): chain declarations (which flush them) and every rule.
func (r *renderer) sharedFilter(b []byte, sh *shared) []byte {
	for _, c := range r.n.filterChains() {
		b = append(b, ":"+c+" - [0:0]\n"...)
	}
	b = append(b, r.n.canary.Rule()+"\n"...)
	b = append(b, sh.filterServices...)
	b = append(b, sh.filterExtra...)
	b = append(b, "-A "+r.n.forward+` -m comment --comment "uproxy forwarding rules" -m mark --mark `+r.mark+"/"+r.mark+" -j ACCEPT\n"...)
	b = append(b, "-A "+r.n.forward+` -m comment --comment "uproxy forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT`+"\n"...)
	if r.localhost {
		// route_localnet lets packets to 127.0.0.0/8 arrive from other hosts,
		// and leave for them: only replies, and connections to a localhost
		// NodePort (DNATed), may.
		b = append(b, "-A "+r.n.blockLocalnet+" ! -s "+ipv4Loopback.String()+" -d "+ipv4Loopback.String()+
			` -m comment --comment "block incoming localnet connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP`+"\n"...)
	}
	return append(b, sh.firewall...)
}

// sharedNAT writes the nat chains' declarations and rules; the port chains to
// declare come right after the shared declarations, so callers add theirs
// before calling sharedNATRules.
func (r *renderer) sharedNATDecl(b []byte) []byte {
	for _, c := range r.n.natChains() {
		b = append(b, ":"+c+" - [0:0]\n"...)
	}
	return b
}

// markMasqRule is the masquerade-mark chain's one rule.
func (r *renderer) markMasqRule(b []byte) []byte {
	return append(b, "-A "+r.n.markMasq+" -j MARK --or-mark "+r.mark+"\n"...)
}

// jumpSpan is where one port's rules are in a shared's natServices and
// natNodePorts: [services, servicesEnd) and [nodePorts, nodePortsEnd).
type jumpSpan struct {
	services, servicesEnd, nodePorts, nodePortsEnd int
}

// maxNATDeletes bounds the rules an edit of the nat table's shared chains
// deletes; beyond it they are rewritten whole. Inserting a rule into a chain of
// 50000 took iptables-restore 0.05 s where rewriting the chain took 10 s; a
// deletion makes it read every chain of the table (about 4 s with 50000), and
// each further one costs more.
const maxNATDeletes = 64

// sharedNATDiff compares the shared nat chains written as old with new. ok says
// that only rules of Service ports differ (jumps from P-SERVICES or
// P-NODEPORTS, whose order does not matter), at most maxNATDeletes of them
// gone: gone and added are those rules, and the chains can be edited in place.
func (r *renderer) sharedNATDiff(old, new []byte) (gone []string, added map[string]bool, ok bool) {
	was := map[string]bool{}
	for line := range strings.SplitSeq(string(old), "\n") {
		was[line] = true
	}
	added = map[string]bool{}
	for line := range strings.SplitSeq(string(new), "\n") {
		if !was[line] {
			if !r.portRule(line) {
				return nil, nil, false
			}
			added[line] = true
		}
		delete(was, line)
	}
	if len(was) > maxNATDeletes {
		return nil, nil, false
	}
	for line := range was {
		if !r.portRule(line) {
			return nil, nil, false
		}
	}
	return slices.Sorted(maps.Keys(was)), added, true
}

// portRule says whether line is a Service port's rule in a shared nat chain.
func (r *renderer) portRule(line string) bool {
	return strings.HasPrefix(line, "-A "+r.n.nodePorts+" ") ||
		strings.HasPrefix(line, "-A "+r.n.services+" ") && !strings.HasSuffix(line, " -j "+r.n.nodePorts)
}

// placeJumps turns a diff of the shared nat chains into restore lines: edit
// deletes the gone rules and adds the added ones that no chunk does; with
// chunked, jumps[i] adds those of the port whose rules are in sh at
// spans[at[i]], for the chunk holding its chains. A rule is added at the top of
// P-SERVICES, so the NodePorts rule stays last, or at the end of P-NODEPORTS.
func (r *renderer) placeJumps(gone []string, added map[string]bool, sh *shared, spans []jumpSpan, at []int, chunked bool) (edit []byte, jumps [][]byte) {
	for _, line := range gone {
		edit = append(edit, "-D "+line[len("-A "):]+"\n"...)
	}
	add := func(b []byte, line string) []byte {
		if rest, ok := strings.CutPrefix(line, "-A "+r.n.services+" "); ok {
			return append(b, "-I "+r.n.services+" 1 "+rest+"\n"...)
		}
		return append(b, line+"\n"...)
	}
	if chunked {
		jumps = make([][]byte, len(at))
		for i, o := range at {
			sp := spans[o]
			for _, text := range []string{string(sh.natServices[sp.services:sp.servicesEnd]), string(sh.natNodePorts[sp.nodePorts:sp.nodePortsEnd])} {
				for line := range strings.SplitSeq(strings.TrimSuffix(text, "\n"), "\n") {
					if added[line] {
						jumps[i] = add(jumps[i], line)
						delete(added, line)
					}
				}
			}
		}
	}
	for _, line := range slices.Sorted(maps.Keys(added)) {
		edit = add(edit, line)
	}
	return edit, jumps
}

func (r *renderer) sharedNATRules(b []byte, sh *shared) []byte {
	return r.sharedNATJumps(r.sharedNATFixed(b), sh)
}

// fixedNATChains are the shared nat chains that hold no Service port's rule.
func (n names) fixedNATChains() []string {
	return []string{n.postrouting, n.markMasq, n.canary.Chain}
}

// sharedNATFixed writes the rules of fixedNATChains.
func (r *renderer) sharedNATFixed(b []byte) []byte {
	b = append(b, r.n.canary.Rule()+"\n"...)
	b = append(b, "-A "+r.n.postrouting+" -m mark ! --mark "+r.mark+"/"+r.mark+" -j RETURN\n"...)
	// Clear the bit so a packet re-entering (IPsec, tunnels) is not masqueraded twice.
	b = append(b, "-A "+r.n.postrouting+" -j MARK --xor-mark "+r.mark+"\n"...)
	b = append(b, "-A "+r.n.postrouting+` -m comment --comment "uproxy service traffic requiring SNAT" -j MASQUERADE --random-fully`+"\n"...)
	return r.markMasqRule(b)
}

// sharedNATJumps writes the rules of P-SERVICES and P-NODEPORTS: the Service
// ports' jumps, and last the NodePorts rule.
func (r *renderer) sharedNATJumps(b []byte, sh *shared) []byte {
	b = append(b, sh.natServices...)
	b = append(b, sh.natNodePorts...)
	// NodePorts last: they match by port on any local address.
	for _, d := range r.nodePortDsts {
		b = append(b, "-A "+r.n.services+d+` -m comment --comment "uproxy service nodeports; NOTE: this must be the last rule in this chain" -j `+r.n.nodePorts+"\n"...)
	}
	return b
}
