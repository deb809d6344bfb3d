package nftables

import (
	"crypto/sha256"
	"encoding/base32"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/uproxy/uproxy/netfilter/conntrack"
	"github.com/uproxy/uproxy/service"
)

// elem is one set or map element: a key (with its value, "" in a set) in the
// set or map named set. Keys and values are written as nft prints them
// ("10.96.0.10 . tcp . 80"), so that comparing two is comparing strings.
type elem struct {
	set, key, value string
}

// affSet is the dynamic set of the clients stuck to one endpoint of a
// ClientIP-affinity Service port; each entry lives timeout after its last
// connection.
type affSet struct {
	name    string
	v6      bool
	timeout time.Duration
}

// affChain is the chain of a ClientIP-affinity Service port's endpoints.
type affChain struct {
	name  string
	rules []string
}

// rendered is what one Service port puts in the table: it owns its chains and
// affinity sets alone, and shares elements only with ports that have the same
// (hairpin pairs).
type rendered struct {
	port    *service.Port
	comment string
	elems   []elem
	chains  []affChain
	sets    []affSet
	// udp is the UDP conntrack view of each family (nil: not UDP, or not in
	// that family).
	udp [2]*conntrack.UDPPort
	// programmed are the endpoints some element or chain sends traffic to.
	programmed []netip.AddrPort
}

// equalContent reports whether a and b put the same things in the table.
func (a *rendered) equalContent(b *rendered) bool {
	if !slices.Equal(a.elems, b.elems) || !slices.Equal(a.sets, b.sets) || len(a.chains) != len(b.chains) {
		return false
	}
	for i := range a.chains {
		if a.chains[i].name != b.chains[i].name || !slices.Equal(a.chains[i].rules, b.chains[i].rules) {
			return false
		}
	}
	return true
}

func (f *family) ofFamily(ips []netip.Addr) []netip.Addr { return service.AddrsOfFamily(ips, f.v6) }

func (f *family) endpoints(eps []service.Endpoint) []netip.AddrPort {
	return service.EndpointsOfFamily(eps, f.v6)
}

// hash is a name-safe digest of s, n base32 characters long.
func hash(s string, n int) string {
	sum := sha256.Sum256([]byte(s))
	return strings.ToLower(base32.StdEncoding.EncodeToString(sum[:]))[:n]
}

// affinityTimeout is the timeout of a ClientIP affinity entry: whole seconds,
// at least one.
func affinityTimeout(d time.Duration) time.Duration {
	return max(d, time.Second).Truncate(time.Second)
}

// renderer renders Service ports for a layout.
type renderer struct {
	l    *tableLayout
	zone string
}

// port renders p in every family it belongs to.
func (r *renderer) port(p *service.Port) *rendered {
	out := &rendered{port: p, comment: p.Name.String()}
	programmed := map[netip.AddrPort]bool{}
	for i, f := range r.l.fams {
		if p.InFamily(f.v6) {
			r.family(out, f, i, p, programmed)
		}
	}
	for ep := range programmed {
		out.programmed = append(out.programmed, ep)
	}
	slices.SortFunc(out.programmed, netip.AddrPort.Compare)
	return out
}

// family renders p in family f (index fi): the layout of the package doc.
func (r *renderer) family(out *rendered, f *family, fi int, p *service.Port, programmed map[netip.AddrPort]bool) {
	proto := p.Protocol.NetfilterName()
	port := strconv.Itoa(p.Port)
	clusterIPs := f.ofFamily(p.ClusterIPs)
	externalIPs := f.ofFamily(p.ExternalIPs)
	lbIPs := f.ofFamily(p.LoadBalancerIPs)

	// Endpoints: all usable ones after topology (policy Cluster), this node's
	// (policy Local), and those of ClusterIP traffic (either).
	clusterView := *p
	clusterView.InternalPolicyLocal = false
	clusterEps := f.endpoints(clusterView.ClusterEndpoints(r.zone))
	localEps := f.endpoints(p.LocalEndpoints())
	internalEps, internalLabel := clusterEps, "all"
	if p.InternalPolicyLocal {
		internalEps, internalLabel = localEps, "local"
	}
	anyUsable := len(clusterEps) > 0

	add := func(set, key, value string) { out.elems = append(out.elems, elem{set, key, value}) }
	svcHash := hash(p.Name.String()+"/"+string(p.Protocol), 16)
	chains := map[string]bool{}
	// choose puts key (of pick k) on its way to eps.
	choose := func(k pick, key string, eps []netip.AddrPort, label string) {
		for _, ep := range eps {
			programmed[ep] = true
		}
		if p.AffinityClientIP {
			name := "aff" + f.n + "-" + svcHash + "-" + label
			add(f.name(picks[k].affinity), key, "goto "+name)
			if !chains[name] {
				chains[name] = true
				out.chains = append(out.chains, r.affinityChain(f, p, name, svcHash, eps, &out.sets))
			}
			return
		}
		m := f.countMap(k, len(eps))
		for i, ep := range eps {
			add(m, key+" . "+strconv.Itoa(i), ep.Addr().String()+" . "+strconv.Itoa(int(ep.Port())))
		}
	}

	for _, ip := range clusterIPs {
		key := ip.String() + " . " + proto + " . " + port
		switch {
		case len(internalEps) > 0:
			if !p.InternalPolicyLocal && (f.masqueradeAll || len(f.clusterCIDRs) > 0) {
				add(f.name("cluster-masq"), key, "")
			}
			choose(pickCluster, key, internalEps, internalLabel)
		case anyUsable:
			// internalTrafficPolicy Local and none here: dropped, as
			// kube-proxy does, rather than refused.
			add(f.name("drop"), key, "")
		default:
			add(f.name("reject"), key, "")
		}
	}
	external := func(key string, masq, local string, kCluster, kLocal pick, reject string) {
		if !anyUsable {
			add(reject, key, "")
			return
		}
		if !p.ExternalPolicyLocal {
			add(masq, key, "")
			choose(kCluster, key, clusterEps, "all")
			return
		}
		// Local policy: from outside, this node's endpoints or a drop (the
		// local chain ends in one); from the node and the pods, any.
		add(local, key, "")
		choose(kCluster, key, clusterEps, "all")
		if len(localEps) > 0 {
			choose(kLocal, key, localEps, "local")
		}
	}
	var allowed []netip.Prefix
	for _, s := range p.LoadBalancerSourceRanges {
		if f.has(s.Addr()) {
			allowed = append(allowed, s.Masked())
		}
	}
	allowed = outermost(allowed)
	for i, ip := range slices.Concat(externalIPs, lbIPs) {
		key := ip.String() + " . " + proto + " . " + port
		if i >= len(externalIPs) && len(p.LoadBalancerSourceRanges) > 0 {
			// Ranges of the other family only still mean "not everyone":
			// this family's clients are all refused.
			add(f.name("firewall"), key, "")
			for _, s := range allowed {
				add(f.name("firewall-allow"), key+" . "+s.String(), "")
			}
		}
		external(key, f.name("external-masq"), f.name("external-local"), pickCluster, pickLocal, f.name("reject"))
	}
	if p.NodePort != 0 && f.nodePorts {
		external(proto+" . "+strconv.Itoa(p.NodePort), f.name("np-masq"), f.name("np-local"), pickNPCluster, pickNPLocal, f.name("np-reject"))
	}
	var eps []netip.AddrPort
	for ep := range programmed {
		if f.has(ep.Addr()) {
			eps = append(eps, ep)
		}
	}
	slices.SortFunc(eps, netip.AddrPort.Compare)
	// Hairpin pairs, one per endpoint address (shared by the Service ports
	// with the same address). Every endpoint gets one, not only those known
	// to be on this node: Endpoint.Local needs the node's name, which a
	// source may not know, and a missing pair breaks the Service for the pod
	// behind it.
	for i, ep := range eps {
		if i == 0 || eps[i-1].Addr() != ep.Addr() {
			a := ep.Addr().String()
			add(f.name("hairpin"), a+" . "+a, "")
		}
	}

	if p.Protocol == service.UDP {
		st := &conntrack.UDPPort{Endpoints: map[netip.AddrPort]bool{}}
		for _, ip := range slices.Concat(clusterIPs, externalIPs, lbIPs) {
			st.VIPs = append(st.VIPs, netip.AddrPortFrom(ip, uint16(p.Port)))
		}
		if f.nodePorts {
			st.NodePort = p.NodePort
		}
		for _, ep := range eps {
			st.Endpoints[ep] = true
		}
		out.udp[fi] = st
	}
}

// affinityChain renders the chain of a ClientIP-affinity Service port's
// endpoints eps: a client found in an endpoint's set goes back to it (and
// refreshes its entry); a new client gets endpoint i with probability
// 1/(k-i) after passing the ones before, an even split, and is recorded.
// numgen runs anew in every rule, hence the decreasing divisors.
func (r *renderer) affinityChain(f *family, p *service.Port, name, svcHash string, eps []netip.AddrPort, sets *[]affSet) affChain {
	timeout := affinityTimeout(p.AffinityTimeout)
	proto := p.Protocol.NetfilterName()
	setOf := func(ep netip.AddrPort) string {
		return "aff" + f.n + "-" + svcHash + "-" + hash(ep.String(), 8) + "-" + strconv.Itoa(int(timeout.Seconds()))
	}
	to := func(ep netip.AddrPort) string {
		return "meta l4proto " + proto + " dnat " + f.ip + " to " + ep.String()
	}
	c := affChain{name: name}
	for _, ep := range eps {
		s := setOf(ep)
		if !slices.ContainsFunc(*sets, func(a affSet) bool { return a.name == s }) {
			*sets = append(*sets, affSet{name: s, v6: f.v6, timeout: timeout})
		}
		c.rules = append(c.rules, f.ip+" saddr @"+s+" update @"+s+" { "+f.ip+" saddr } "+to(ep))
	}
	for i, ep := range eps {
		s := setOf(ep)
		rule := "update @" + s + " { " + f.ip + " saddr } " + to(ep)
		if i < len(eps)-1 {
			rule = "numgen random mod " + strconv.Itoa(len(eps)-i) + " 0 " + rule
		}
		c.rules = append(c.rules, rule)
	}
	return c
}

// outermost drops the prefixes another one contains: an interval set refuses
// overlapping elements.
func outermost(ps []netip.Prefix) []netip.Prefix {
	slices.SortFunc(ps, func(a, b netip.Prefix) int {
		if c := a.Addr().Compare(b.Addr()); c != 0 {
			return c
		}
		return a.Bits() - b.Bits()
	})
	var out []netip.Prefix
	for _, p := range ps {
		if len(out) > 0 && out[len(out)-1].Contains(p.Addr()) && out[len(out)-1].Bits() <= p.Bits() {
			continue
		}
		out = append(out, p)
	}
	return out
}
