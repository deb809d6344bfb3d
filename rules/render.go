package rules

import (
	"net/netip"
	"strconv"
	"strings"

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
	nodePort  int
	// ips are the virtual IPs by kind; every address is unmapped and zoneless.
	clusterIPs, externalIPs, lbIPs []netip.Addr
	// families the Service port lives in (both false never happens after validation).
	families [2]bool
	// nodePortHeld is true per family when the NodePort is held open and so may
	// get rules; a NodePort someone else holds gets none.
	nodePortHeld [2]bool
}

// renderer writes the iptables-restore input of one family.
type renderer struct {
	chains            chains
	family            int
	nodeIP            netip.Addr
	nodePortAddresses []netip.Prefix // of this family only; nil = every local address
	// allNodePortAddresses is true when Config.NodePortAddresses was empty.
	allNodePortAddresses bool
}

// render returns the restore input for entries (sorted). Every chain is declared,
// which flushes it, so the text is the chain's entire content.
func (r *renderer) render(entries []entry) []byte {
	var container, host, npContainer, npHost, nonLocal strings.Builder
	for i := range entries {
		e := &entries[i]
		if !e.families[r.family] {
			continue
		}
		for _, ip := range e.clusterIPs {
			r.portal(&container, &host, e, ip, false)
		}
		for _, ip := range e.lbIPs {
			r.portal(&container, &host, e, ip, false)
		}
		for _, ip := range e.externalIPs {
			r.portal(&container, &host, e, ip, true)
		}
		if e.nodePort != 0 && e.nodePortHeld[r.family] {
			r.nodePort(&npContainer, &npHost, &nonLocal, e)
		}
	}

	var b strings.Builder
	b.Grow(256 + container.Len() + host.Len() + npContainer.Len() + npHost.Len() + nonLocal.Len())
	b.WriteString("*filter\n")
	for _, c := range r.chains.filter() {
		b.WriteString(":" + c + " - [0:0]\n")
	}
	b.WriteString(nonLocal.String())
	b.WriteString("COMMIT\n*nat\n")
	for _, c := range r.chains.nat() {
		b.WriteString(":" + c + " - [0:0]\n")
	}
	b.WriteString(canaryRule(r.chains) + "\n")
	b.WriteString(container.String())
	b.WriteString(host.String())
	b.WriteString(npContainer.String())
	b.WriteString(npHost.String())
	b.WriteString("COMMIT\n")
	return []byte(b.String())
}

// canaryRule is the one rule of the canary chain, as iptables -S prints it.
func canaryRule(c chains) string {
	return "-A " + c.canary + ` -m comment --comment "uproxy canary: gone means the table was flushed" -j RETURN`
}

// portal writes the rules capturing ip:port.
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
func (r *renderer) portal(container, host *strings.Builder, e *entry, ip netip.Addr, external bool) {
	if familyOf(ip) != r.family {
		return
	}
	dst := "-d " + hostPrefix(ip)
	container.WriteString("-A " + r.chains.portalsContainer + " " + dst)
	r.match(container, e, e.port)
	if external {
		container.WriteString(" -m addrtype ! --src-type LOCAL")
	}
	r.redirect(container, e)

	host.WriteString("-A " + r.chains.portalsHost + " " + dst)
	r.match(host, e, e.port)
	if external {
		host.WriteString(" -m addrtype --dst-type LOCAL")
	}
	r.dnat(host, e)
}

// nodePort writes the NodePort rules of e. The jumps to the NODEPORT chains
// already require a local destination; -d narrows that to NodePortAddresses.
func (r *renderer) nodePort(container, host, nonLocal *strings.Builder, e *entry) {
	dsts := []string{""}
	if !r.allNodePortAddresses {
		dsts = dsts[:0]
		for _, p := range r.nodePortAddresses {
			dsts = append(dsts, " -d "+p.Masked().String())
		}
	}
	for _, d := range dsts {
		container.WriteString("-A " + r.chains.nodePortContainer + d)
		r.match(container, e, e.nodePort)
		r.redirect(container, e)
		host.WriteString("-A " + r.chains.nodePortHost + d)
		r.match(host, e, e.nodePort)
		r.dnat(host, e)
	}
	if len(dsts) == 0 {
		return
	}
	// Accept only what a NodePort rule redirected (REDIRECT counts as DNAT for
	// conntrack), so the proxy port itself is not opened to the network.
	nonLocal.WriteString("-A " + r.chains.nodePortNonLocal)
	r.match(nonLocal, e, e.proxyPort)
	nonLocal.WriteString(" -m conntrack --ctstate DNAT --ctorigdstport " + strconv.Itoa(e.nodePort) + " -j ACCEPT\n")
}

// match writes protocol, comment and destination port in the order iptables-save
// prints them, so the written rules read back identically.
func (r *renderer) match(b *strings.Builder, e *entry, port int) {
	b.WriteString(" -p " + e.proto + " -m comment --comment " + quote(e.name.String()) +
		" -m " + e.proto + " --dport " + strconv.Itoa(port))
}

func (r *renderer) redirect(b *strings.Builder, e *entry) {
	b.WriteString(" -j REDIRECT --to-ports " + strconv.Itoa(e.proxyPort) + "\n")
}

func (r *renderer) dnat(b *strings.Builder, e *entry) {
	b.WriteString(" -j DNAT --to-destination " + netip.AddrPortFrom(r.nodeIP, uint16(e.proxyPort)).String() + "\n")
}

func hostPrefix(ip netip.Addr) string {
	return netip.PrefixFrom(ip, ip.BitLen()).String()
}

// quote double-quotes s for iptables-restore, which understands backslash escapes
// inside quotes.
func quote(s string) string {
	if !strings.ContainsAny(s, `"\`) {
		return `"` + s + `"`
	}
	r := strings.NewReplacer(`\`, `\\`, `"`, `\"`)
	return `"` + r.Replace(s) + `"`
}
