package rules

import (
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/service"
)

const (
	v4 = 0
	v6 = 1
)

func familyName(f int) string {
	if f == v6 {
		return "IPv6"
	}
	return "IPv4"
}

func familyOf(a netip.Addr) int {
	if a.Unmap().Is4() {
		return v4
	}
	return v6
}

// entry is one validated portal, ready to render.
type entry struct {
	name      service.PortName
	protocol  service.Protocol
	proto     string // "tcp" or "udp", as iptables spells it
	port      int
	proxyPort int
	// extProxyPort is the proxy port of the NodePort, ExternalIPs and
	// LoadBalancer IPs: Portal.ExternalProxyPort, or proxyPort when that is 0.
	extProxyPort int
	nodePort     int
	// ips are the virtual IPs by kind; every address is unmapped and zoneless.
	clusterIPs, externalIPs, lbIPs []netip.Addr
	// families the Service port lives in (both false never happens after validation).
	families [2]bool
	// nodePortHeld is true per family when the NodePort is held open and so may
	// get rules; a NodePort someone else holds gets none.
	nodePortHeld [2]bool
	// refuse is Portal.Refuse: the addresses refused rather than steered.
	refuse Refusal
}

// refused reports whether e's ClusterIPs (external false) or NodePort,
// ExternalIPs and LoadBalancer IPs (external true) of family f are refused.
func (e *entry) refused(f int, external bool) bool {
	if external {
		return e.refuse.External[f]
	}
	return e.refuse.Cluster[f]
}

// refusesAny reports whether e has refused addresses in family f.
func (e *entry) refusesAny(f int) bool { return e.refuse.Cluster[f] || e.refuse.External[f] }

// renderer writes the iptables-restore input of one family.
type renderer struct {
	chains chains
	family int
	nodeIP netip.Addr
	// nodePortDsts are the destination matches of NodePort rules: one empty match
	// when every local address serves NodePorts (the jumps already require a local
	// destination), else one "-d prefix" per NodePortAddresses prefix of the
	// family, and none when the family has no prefix there.
	nodePortDsts []string
	// dialMark, when set, starts the HOST chains with a RETURN for the proxy's own
	// connections (Config.DialMark).
	dialMark uint32
	// onNodeIP: the PREROUTING portals DNAT to the node IP rather than REDIRECT
	// (Config.ProxyPortsOnNodeIP).
	onNodeIP bool
	// clientMark marks transparent dials and their replies in the mangle
	// table (Config.ClientAddressMark) while chains.withClientAddress is set.
	clientMark uint32
}

func newRenderer(c chains, family int, nodeIP netip.Addr, nodePortAddresses []netip.Prefix) renderer {
	r := renderer{chains: c, family: family, nodeIP: nodeIP}
	if len(nodePortAddresses) == 0 {
		r.nodePortDsts = []string{""}
	}
	for _, p := range nodePortAddresses {
		if familyOf(p.Addr()) == family {
			r.nodePortDsts = append(r.nodePortDsts, " -d "+p.Masked().String())
		}
	}
	return r
}

// textSpan is a part of a restore input that entries' rules fill: [start, end),
// in table.
type textSpan struct {
	start, end int
	table      string
}

// render returns the restore input for entries (sorted), and where in it the
// entries' rules are. Every chain is declared, which flushes it, so the text is
// the chain's entire content. It makes one pass per chain appending to a single
// buffer: with 10k portals it runs on every sync.
func (r *renderer) render(entries []entry) ([]byte, []textSpan) {
	parts := make([]ruleParts, len(entries))
	n := 0
	for i := range entries {
		if entries[i].families[r.family] {
			parts[i] = r.ruleParts(&entries[i])
			n++
		}
	}
	// Each rule is about 150 bytes; the estimate saves most of the regrowth.
	// It counts the family's entries only: the text is kept until the next
	// change, and a single-stack cluster's other family writes none.
	out := make([]byte, 0, 1024+n*400)
	out = r.clientAddress(out)
	out = append(out, "*filter\n"...)
	for _, c := range r.chains.filter() {
		out = append(out, ":"+c+" - [0:0]\n"...)
	}
	out = append(out, r.chains.canary.Rule()+"\n"...)
	var spans []textSpan
	each := func(table string, write func([]byte, *entry, *ruleParts) []byte) {
		start := len(out)
		out = r.each(out, entries, parts, write)
		spans = append(spans, textSpan{start, len(out), table})
	}
	out = r.nonLocalGuards(out, entries)
	each("filter", r.nonLocal)
	out = r.ownDials(out, r.chains.noEndpoints)
	each("filter", r.noEndpoints)
	out = append(out, "COMMIT\n*nat\n"...)
	for _, c := range r.chains.nat() {
		out = append(out, ":"+c+" - [0:0]\n"...)
	}
	out = append(out, r.chains.canary.Rule()+"\n"...)
	each("nat", r.portalsContainer)
	out = r.ownDials(out, r.chains.portalsHost)
	each("nat", r.portalsHost)
	each("nat", r.nodePortContainer)
	out = r.ownDials(out, r.chains.nodePortHost)
	each("nat", r.nodePortHost)
	return append(out, "COMMIT\n"...), spans
}

// clientAddress appends the mangle table's chain of transparent dials and
// their replies (see clientaddress.go), when the portals have one.
func (r *renderer) clientAddress(out []byte) []byte {
	if !r.chains.withClientAddress {
		return out
	}
	c, m, d := r.chains.clientAddress, markHex(r.clientMark), markHex(r.dialMark)
	out = append(out, "*mangle\n"...)
	for _, ch := range r.chains.mangle() {
		out = append(out, ":"+ch+" - [0:0]\n"...)
	}
	out = append(out, r.chains.canary.Rule()+"\n"...)
	// Every packet the node sends or receives passes this chain, so each rule
	// tests its mark first, which rules out most packets at once: the dial
	// mark (a native nft expression under iptables-nft), the conntrack mark.
	// The conntrack state and direction, matches of the xtables compatibility
	// layer, come after (record 20 of docs/data-path.md prices the order).
	out = append(out, "-A "+c+" -m mark --mark "+d+"/"+d+" -m conntrack --ctstate NEW -m addrtype ! --src-type LOCAL"+
		` -m comment --comment "a dial from a client's address" -j CONNMARK --or-mark `+m+"\n"...)
	out = append(out, "-A "+c+" -m connmark --mark "+m+"/"+m+" -m conntrack --ctdir REPLY"+
		` -m comment --comment "its replies" -j MARK --or-mark `+m+"\n"...)
	out = append(out, "-A "+r.chains.dialMark+" -m mark --mark "+d+"/"+d+" ! -o lo"+
		` -m comment --comment "no later rule sees uproxy's dial mark" -j MARK --and-mark `+markHex(^r.dialMark)+"\n"...)
	return append(out, "COMMIT\n"...)
}

// maxPortalDeletes bounds the rules a sync deletes in place; beyond it the
// chains are rewritten. With 10k portals, iptables-restore took 0.01 s to
// append two rules, 0.14 s to delete one and 0.16 s to delete eight, and 0.63 s
// to rewrite the chains.
const maxPortalDeletes = 64

// portalEdit returns the restore input that turns the portals written as old
// (its entries' rules at oldSpans) into new: a deletion of each rule gone and
// an appending of each rule new. ok is false when anything else differs (the
// chains' fixed rules: the canary, the own-dial RETURNs, the NodePort guards)
// or more than maxPortalDeletes rules go; the chains must then be rewritten.
// A portal's rules match its own addresses and ports, so their order within a
// chain does not matter, and appending keeps each chain's fixed rules first.
func portalEdit(old []byte, oldSpans []textSpan, new []byte, newSpans []textSpan) ([]byte, bool) {
	oldFixed, oldRules := splitPortalText(old, oldSpans)
	newFixed, newRules := splitPortalText(new, newSpans)
	if oldFixed != newFixed {
		return nil, false
	}
	gone, added := map[string][]string{}, map[string][]string{}
	deletes := 0
	for k, n := range oldRules {
		for range n - newRules[k] {
			gone[k.table] = append(gone[k.table], "-D "+k.rule[len("-A "):])
			deletes++
		}
	}
	for k, n := range newRules {
		for range n - oldRules[k] {
			added[k.table] = append(added[k.table], k.rule)
		}
	}
	if deletes > maxPortalDeletes {
		return nil, false
	}
	var b []byte
	for _, table := range []string{"filter", "nat"} {
		if len(gone[table])+len(added[table]) == 0 {
			continue
		}
		slices.Sort(gone[table])
		slices.Sort(added[table])
		b = append(b, "*"+table+"\n"...)
		for _, line := range slices.Concat(gone[table], added[table]) {
			b = append(b, line+"\n"...)
		}
		b = append(b, "COMMIT\n"...)
	}
	return b, true
}

// portalRule is one entry's rule and its table.
type portalRule struct{ table, rule string }

// splitPortalText returns text without its entries' rules, and those rules
// counted.
func splitPortalText(text []byte, spans []textSpan) (string, map[portalRule]int) {
	var fixed strings.Builder
	rules := map[portalRule]int{}
	at := 0
	for _, sp := range spans {
		fixed.Write(text[at:sp.start])
		for line := range strings.Lines(string(text[sp.start:sp.end])) {
			rules[portalRule{sp.table, strings.TrimSuffix(line, "\n")}]++
		}
		at = sp.end
	}
	fixed.Write(text[at:])
	return fixed.String(), rules
}

// ownDials appends chain's first rule: the proxy's own connections to endpoints
// skip the portals.
func (r *renderer) ownDials(out []byte, chain string) []byte {
	if r.dialMark == 0 {
		return out
	}
	m := markHex(r.dialMark)
	return append(out, "-A "+chain+" -m mark --mark "+m+"/"+m+` -m comment --comment "uproxy dials to endpoints skip the portals" -j RETURN`+"\n"...)
}

// each appends what write renders for every entry of the family.
func (r *renderer) each(out []byte, entries []entry, parts []ruleParts, write func([]byte, *entry, *ruleParts) []byte) []byte {
	for i := range entries {
		if entries[i].families[r.family] {
			out = write(out, &entries[i], &parts[i])
		}
	}
	return out
}

// proxyPortOf returns the proxy port of e's external addresses (NodePort,
// ExternalIPs, LoadBalancer IPs) when external is true, else of its ClusterIPs.
func (e *entry) proxyPortOf(external bool) int {
	if external {
		return e.extProxyPort
	}
	return e.proxyPort
}

// ruleParts are the pieces of text shared by every rule of one entry.
type ruleParts struct {
	match    string // " -p tcp -m comment --comment \"ns/name:port\" -m tcp --dport "
	port     string // the Service port
	redirect string // " -j REDIRECT --to-ports N\n"
	dnat     string // " -j DNAT --to-destination nodeIP:N\n"
	// extRedirect and extDnat are redirect and dnat to the external proxy port.
	extRedirect, extDnat string
	// refuseMatch is match with the comment "ns/name:port has no endpoints",
	// and reject the target refusing the protocol; both are set only for an
	// entry with refused addresses in the family.
	refuseMatch, reject string
}

// rejects are the REJECT targets of the NO-ENDPOINTS rules by family and
// protocol: for TCP a reset, which fails a connect at once (a client on the
// node holds its socket locked while connecting and would drop an ICMP error,
// retrying the SYN a second later), for UDP ICMP port unreachable, which a
// connected UDP socket reports as ECONNREFUSED.
var rejects = [2]map[string]string{
	v4: {"tcp": " -j REJECT --reject-with tcp-reset\n", "udp": " -j REJECT --reject-with icmp-port-unreachable\n"},
	v6: {"tcp": " -j REJECT --reject-with tcp-reset\n", "udp": " -j REJECT --reject-with icmp6-port-unreachable\n"},
}

// ruleParts orders protocol, comment and destination port as iptables-save
// prints them, so the written rules read back identically.
func (r *renderer) ruleParts(e *entry) ruleParts {
	redirect := func(pp int) string { return " -j REDIRECT --to-ports " + strconv.Itoa(pp) + "\n" }
	dnat := func(pp int) string {
		return " -j DNAT --to-destination " + netip.AddrPortFrom(r.nodeIP, uint16(pp)).String() + "\n"
	}
	p := ruleParts{
		match:    " -p " + e.proto + " -m comment --comment " + iptables.Quote(e.name.String()) + " -m " + e.proto + " --dport ",
		port:     strconv.Itoa(e.port),
		redirect: redirect(e.proxyPort),
		dnat:     dnat(e.proxyPort),
	}
	p.extRedirect, p.extDnat = p.redirect, p.dnat
	if e.extProxyPort != e.proxyPort {
		p.extRedirect, p.extDnat = redirect(e.extProxyPort), dnat(e.extProxyPort)
	}
	if r.onNodeIP {
		p.redirect, p.extRedirect = p.dnat, p.extDnat
	}
	if e.refusesAny(r.family) {
		p.refuseMatch = " -p " + e.proto + " -m comment --comment " + iptables.Quote(e.name.String()+" has no endpoints") + " -m " + e.proto + " --dport "
		p.reject = rejects[r.family][e.proto]
	}
	return p
}

// portalsContainer writes the PREROUTING rules of e's virtual IPs: REDIRECT to
// the proxy port.
//
// ExternalIPs follow the legacy userspace proxy, which captured them in PREROUTING
// only for traffic "from off the machine" (`-m physdev ! --physdev-is-in` plus
// `-m addrtype ! --src-type LOCAL`) and in OUTPUT only when the node owns the IP.
// physdev is not available here, and only ever identified pods behind a bridge:
// with routed pod interfaces (veth per pod) it matched pods too. The rule keeps the
// half that is expressible everywhere, "source is not a node address", and drops
// the bridge test: traffic to an ExternalIP routed through the node, from another
// host or from a local pod, reaches the Service, as in kube-proxy's kernel modes
// today, so A/B comparisons see the same semantics. A node process reaching an
// ExternalIP the node does not own goes to the real address, as in legacy.
func (r *renderer) portalsContainer(b []byte, e *entry, s *ruleParts) []byte {
	return r.portals(b, e, s, r.chains.portalsContainer, " -m addrtype ! --src-type LOCAL", s.redirect, s.extRedirect)
}

// portalsHost writes the OUTPUT rules of e's virtual IPs: DNAT to nodeIP:proxy port.
func (r *renderer) portalsHost(b []byte, e *entry, s *ruleParts) []byte {
	return r.portals(b, e, s, r.chains.portalsHost, " -m addrtype --dst-type LOCAL", s.dnat, s.extDnat)
}

// portals writes the rules of e's virtual IPs in chain: ClusterIPs to target,
// LoadBalancer IPs and ExternalIPs (these only when externalMatch holds too)
// to extTarget, the external proxy port. Refused addresses get none: their
// packets go on untouched to the NO-ENDPOINTS chain.
func (r *renderer) portals(b []byte, e *entry, s *ruleParts, chain, externalMatch, target, extTarget string) []byte {
	for kind, ips := range [...][]netip.Addr{e.clusterIPs, e.lbIPs, e.externalIPs} {
		external := kind == 2
		t := target
		if kind != 0 {
			t = extTarget
		}
		if e.refused(r.family, kind != 0) {
			continue
		}
		for _, ip := range ips {
			if familyOf(ip) != r.family {
				continue
			}
			b = append(b, "-A "...)
			b = append(b, chain...)
			b = append(b, " -d "...)
			b = ip.AppendTo(b)
			b = append(b, '/')
			b = strconv.AppendInt(b, int64(ip.BitLen()), 10)
			b = append(b, s.match...)
			b = append(b, s.port...)
			if external {
				b = append(b, externalMatch...)
			}
			b = append(b, t...)
		}
	}
	return b
}

func (r *renderer) hasNodePort(e *entry) bool { return e.nodePort != 0 && e.nodePortHeld[r.family] }

// steersNodePort reports whether e has NodePort rules in the nat table: a
// NodePort held and not refused.
func (r *renderer) steersNodePort(e *entry) bool {
	return r.hasNodePort(e) && !e.refused(r.family, true)
}

// acceptsNonLocal reports whether e has a NON-LOCAL rule: a NodePort that some
// address of the family serves.
func (r *renderer) acceptsNonLocal(e *entry) bool { return r.hasNodePort(e) && len(r.nodePortDsts) > 0 }

// nodePortContainer writes e's PREROUTING NodePort rules: REDIRECT.
func (r *renderer) nodePortContainer(b []byte, e *entry, s *ruleParts) []byte {
	if !r.steersNodePort(e) {
		return b
	}
	for _, d := range r.nodePortDsts {
		b = append(b, "-A "+r.chains.nodePortContainer+d+s.match+strconv.Itoa(e.nodePort)+s.extRedirect...)
	}
	return b
}

// nodePortHost writes e's OUTPUT NodePort rules: DNAT.
func (r *renderer) nodePortHost(b []byte, e *entry, s *ruleParts) []byte {
	if !r.steersNodePort(e) {
		return b
	}
	for _, d := range r.nodePortDsts {
		b = append(b, "-A "+r.chains.nodePortHost+d+s.match+strconv.Itoa(e.nodePort)+s.extDnat...)
	}
	return b
}

// noEndpoints writes e's NO-ENDPOINTS rules: a REJECT for each refused address,
// matching exactly the packets the nat rules would have steered had it been
// steered. The chain is reached from INPUT, FORWARD and OUTPUT, so each rule
// holds in every hook: a ClusterIP or LoadBalancer IP whoever the client; an
// ExternalIP the node owns (the node's own connections are steered only then),
// or from a client that is not the node (two rules, for iptables has no "or");
// a NodePort on a local address inside --nodeport-addresses.
func (r *renderer) noEndpoints(b []byte, e *entry, s *ruleParts) []byte {
	if !e.refusesAny(r.family) {
		return b
	}
	chain := "-A " + r.chains.noEndpoints
	for kind, ips := range [...][]netip.Addr{e.clusterIPs, e.lbIPs, e.externalIPs} {
		if !e.refused(r.family, kind != 0) {
			continue
		}
		matches := []string{""}
		if kind == 2 {
			matches = []string{" -m addrtype --dst-type LOCAL", " -m addrtype ! --src-type LOCAL"}
		}
		for _, ip := range ips {
			if familyOf(ip) != r.family {
				continue
			}
			for _, m := range matches {
				b = append(b, chain+" -d "...)
				b = ip.AppendTo(b)
				b = append(b, '/')
				b = strconv.AppendInt(b, int64(ip.BitLen()), 10)
				b = append(b, s.refuseMatch+s.port+m+s.reject...)
			}
		}
	}
	if r.hasNodePort(e) && e.refused(r.family, true) {
		for _, d := range r.nodePortDsts {
			b = append(b, chain+d+s.refuseMatch+strconv.Itoa(e.nodePort)+" -m addrtype --dst-type LOCAL"+s.reject...)
		}
	}
	return b
}

// nonLocal writes e's INPUT accept rule. It accepts only what a NodePort rule
// redirected (REDIRECT counts as DNAT for conntrack), so the proxy port itself
// is not opened to the network.
func (r *renderer) nonLocal(b []byte, e *entry, s *ruleParts) []byte {
	if !r.acceptsNonLocal(e) {
		return b
	}
	return append(b, "-A "+r.chains.nodePortNonLocal+s.match+strconv.Itoa(e.extProxyPort)+
		" -m conntrack --ctstate DNAT --ctorigdstport "+strconv.Itoa(e.nodePort)+" -j ACCEPT\n"...)
}

// nonLocalGuards starts the NON-LOCAL chain, when it has rules, with two RETURNs
// that let every packet no rule could accept leave at once, rather than trying one
// rule per NodePort: packets that were not redirected (replies to the proxy's
// dials, all other traffic to the node) and redirected packets whose original
// port lies outside the NodePorts' span (ClusterIP traffic to the proxy ports).
func (r *renderer) nonLocalGuards(out []byte, entries []entry) []byte {
	lo, hi := 0, 0
	for i := range entries {
		e := &entries[i]
		if !e.families[r.family] || !r.acceptsNonLocal(e) {
			continue
		}
		if lo == 0 || e.nodePort < lo {
			lo = e.nodePort
		}
		hi = max(hi, e.nodePort)
	}
	if lo == 0 {
		return out
	}
	span := strconv.Itoa(lo)
	if hi > lo {
		span += ":" + strconv.Itoa(hi)
	}
	chain := "-A " + r.chains.nodePortNonLocal
	out = append(out, chain+` -m conntrack ! --ctstate DNAT -m comment --comment "uproxy NodePorts: not redirected" -j RETURN`+"\n"...)
	return append(out, chain+" -m conntrack ! --ctorigdstport "+span+` -m comment --comment "uproxy NodePorts: not to a NodePort" -j RETURN`+"\n"...)
}
