package nftables

import (
	"net/netip"
	"strconv"
	"strings"

	"sigs.k8s.io/knftables"

	"github.com/uproxy/uproxy/netfilter/nftables"
)

// Base chains. The nat chains hook at dstnat (-100) and srcnat (100), as
// kube-proxy's and iptables' nat tables do; Service keys are disjoint from
// theirs (a Service handled here is skipped by kube-proxy). The filter chains
// run just before the filter tables (-1), on the packets the nat chains left
// untranslated: a Service key seen there had no endpoint to go to.
const (
	chainNATPrerouting  = "nat-prerouting"
	chainNATOutput      = "nat-output"
	chainNATPostrouting = "nat-postrouting"
	chainFilterInput    = "filter-input"
	chainFilterForward  = "filter-forward"
	chainFilterOutput   = "filter-output"
)

// baseChains are the chains with a hook, in the order they are written; their
// rules never change after a whole write, so their rule handles tell whether
// anyone flushed or deleted the table.
var baseChains = []struct {
	name, typ, hook, priority string
}{
	{chainNATPrerouting, string(knftables.NATType), string(knftables.PreroutingHook), "-100"},
	{chainNATOutput, string(knftables.NATType), string(knftables.OutputHook), "-100"},
	{chainNATPostrouting, string(knftables.NATType), string(knftables.PostroutingHook), "100"},
	{chainFilterInput, string(knftables.FilterType), string(knftables.InputHook), "-1"},
	{chainFilterForward, string(knftables.FilterType), string(knftables.ForwardHook), "-1"},
	{chainFilterOutput, string(knftables.FilterType), string(knftables.OutputHook), "-1"},
}

// l4 matches the protocols whose destination port th dport reads; nft takes a
// port in dnat only after such a match.
const l4 = "meta l4proto { tcp, udp, sctp }"

// pick is one way of choosing an endpoint, with its own count maps: for the
// destination address (ClusterIPs, ExternalIPs, LoadBalancer IPs) or for a
// NodePort (protocol and port alone), among all usable endpoints or among this
// node's (external traffic with externalTrafficPolicy Local).
type pick int

const (
	pickCluster pick = iota
	pickLocal
	pickNPCluster
	pickNPLocal
	numPicks
)

// picks names, by pick, the count maps ("backends4-2"), the chain their rules
// go in (appended: nothing follows them), and the verdict map that sends a
// ClientIP-affinity Service port to its own chain instead.
var picks = [numPicks]struct {
	maps, chain, affinity string
	nodePort              bool
}{
	pickCluster:   {"backends", "services", "affinity", false},
	pickLocal:     {"local-backends", "local-pick", "local-affinity", false},
	pickNPCluster: {"np-backends", "nodeports", "np-affinity", true},
	pickNPLocal:   {"np-local-backends", "np-local-pick", "np-local-affinity", true},
}

// family is what the layout needs of one address family. Every set, map and
// regular chain of the family ends in 4 or 6.
type family struct {
	v6       bool
	n        string // "4" or "6"
	ip       string // "ip" or "ip6"
	nfproto  string // "ipv4" or "ipv6"
	addrType string // "ipv4_addr" or "ipv6_addr"
	loopback string
	// nodePorts is whether the family serves NodePorts: always without
	// --nodeport-addresses, else only when one of them is of this family.
	nodePorts        bool
	nodePortPrefixes []netip.Prefix
	// clusterCIDRs of this family: ClusterIP traffic from outside them is
	// masqueraded, and traffic from inside them to an external destination of
	// a Local-policy Service goes to any endpoint.
	clusterCIDRs  []netip.Prefix
	masqueradeAll bool
}

func newFamily(v6 bool, cfg Config) *family {
	f := &family{v6: v6, n: "4", ip: "ip", nfproto: "ipv4", addrType: "ipv4_addr", loopback: "127.0.0.0/8", masqueradeAll: cfg.MasqueradeAll}
	if v6 {
		f.n, f.ip, f.nfproto, f.addrType, f.loopback = "6", "ip6", "ipv6", "ipv6_addr", "::1"
	}
	for _, p := range cfg.NodePortAddresses {
		if f.has(p.Addr()) {
			f.nodePortPrefixes = append(f.nodePortPrefixes, p.Masked())
		}
	}
	f.nodePorts = len(cfg.NodePortAddresses) == 0 || len(f.nodePortPrefixes) > 0
	for _, c := range cfg.ClusterCIDRs {
		if f.has(c.Addr()) {
			f.clusterCIDRs = append(f.clusterCIDRs, c.Masked())
		}
	}
	return f
}

func (f *family) has(a netip.Addr) bool { return a.Unmap().Is6() == f.v6 }

// name is a family's object: base plus 4 or 6.
func (f *family) name(base string) string { return base + f.n }

// countMap names the map of pick k holding Service ports with n endpoints.
func (f *family) countMap(k pick, n int) string {
	return picks[k].maps + f.n + "-" + strconv.Itoa(n)
}

// parseCountMap is countMap backwards, for reading the table: the pick and
// endpoint count of a count map of the family fam ("4" or "6").
func parseCountMap(name, fam string) (k pick, n int, ok bool) {
	i := strings.LastIndexByte(name, '-')
	if i < 0 {
		return 0, 0, false
	}
	n, err := strconv.Atoi(name[i+1:])
	if err != nil || n <= 0 {
		return 0, 0, false
	}
	for k := range numPicks {
		if name[:i] == picks[k].maps+fam {
			return k, n, true
		}
	}
	return 0, 0, false
}

// addrKey and npKey are the lookup expressions of the two kinds of key.
func (f *family) addrKey() string { return f.ip + " daddr . meta l4proto . th dport" }

const npKey = "meta l4proto . th dport"

func (f *family) key(k pick) string {
	if picks[k].nodePort {
		return npKey
	}
	return f.addrKey()
}

// keyType is the type of a key of pick k's lookups.
func (f *family) keyType(nodePort bool) string {
	if nodePort {
		return "inet_proto . inet_service"
	}
	return f.addrType + " . inet_proto . inet_service"
}

// countMapObject declares the map of pick k for n endpoints: the key is the
// Service port's key and a slot 0..n-1, the value the endpoint.
func (f *family) countMapObject(k pick, n int) *knftables.Map {
	mod := " . numgen random mod " + strconv.Itoa(n)
	return &knftables.Map{
		Name:   f.countMap(k, n),
		TypeOf: f.key(k) + mod + " : " + f.ip + " daddr . th dport",
	}
}

// countRule picks one of n endpoints for the keys in the map: numgen random
// mod n splits exactly. A key not in the map leaves the rule unmatched.
func (f *family) countRule(k pick, n int) *knftables.Rule {
	r := []string{l4, "dnat", f.ip, "to", f.key(k), ". numgen random mod", strconv.Itoa(n), "map @" + f.countMap(k, n)}
	if picks[k].nodePort {
		// The key has no address to imply the family.
		r = append([]string{"meta nfproto", f.nfproto}, r...)
	}
	return &knftables.Rule{Chain: f.name(picks[k].chain), Rule: knftables.Concat(r)}
}

// nodePortDst matches a destination that serves NodePorts: a local address
// (inside --nodeport-addresses when given) but loopback, whatever the prefixes
// hold. A DNATed loopback packet could leave the node only with route_localnet,
// which this mode never sets, as kube-proxy's nftables mode does not: loopback
// NodePorts, where served, are the userspace relay's (package localnodeports),
// which these rules must leave alone.
func (f *family) nodePortDst() string {
	dst := "fib daddr type local " + f.ip + " daddr != " + f.loopback
	if len(f.nodePortPrefixes) > 0 {
		dst += " " + f.ip + " daddr @" + f.name("nodeport-addresses")
	}
	return dst
}

// externalSource matches traffic from outside the node and the pod networks:
// what externalTrafficPolicy Local keeps on this node's endpoints. The node's
// own traffic and pods' (with cluster CIDRs known) go to any endpoint.
func (f *family) externalSource() string {
	s := "fib saddr type != local"
	if len(f.clusterCIDRs) > 0 {
		s += " " + f.ip + " saddr != " + cidrSet(f.clusterCIDRs)
	}
	return s
}

func cidrSet(ps []netip.Prefix) string {
	ss := make([]string, len(ps))
	for i, p := range ps {
		ss[i] = p.String()
	}
	return "{ " + strings.Join(ss, ", ") + " }"
}

// tableLayout is the table without the Service ports' elements and chains; it is
// fixed for the life of a Proxier.
type tableLayout struct {
	fams []*family
	mark string // the masquerade bit, "0x4000"
}

// write adds the whole fixed table to tx, deleting whatever the table held
// before in the same transaction, which the kernel applies atomically.
func (l *tableLayout) write(tx *knftables.Transaction) {
	tx.Add(&knftables.Table{})
	tx.Delete(&knftables.Table{})
	tx.Add(&knftables.Table{Comment: knftables.PtrTo(nftables.CommentPrefix + "nftables kernel mode: Service IPs and NodePorts DNATed to endpoints")})
	for _, c := range baseChains {
		tx.Add(&knftables.Chain{
			Name:     c.name,
			Type:     knftables.PtrTo(knftables.BaseChainType(c.typ)),
			Hook:     knftables.PtrTo(knftables.BaseChainHook(c.hook)),
			Priority: knftables.PtrTo(knftables.BaseChainPriority(c.priority)),
		})
	}
	for _, f := range l.fams {
		f.objects(tx)
	}
	rule := func(chain string, r ...any) {
		tx.Add(&knftables.Rule{Chain: chain, Rule: knftables.Concat(r...)})
	}
	setMark := "meta mark set meta mark | " + l.mark
	for _, f := range l.fams {
		for _, c := range []string{chainNATPrerouting, chainNATOutput} {
			rule(c, "meta nfproto", f.nfproto, "jump", f.name("services"))
		}
		// Only a connection's first packet can be refused: the rest of its
		// packets skip the lookups (a node's own connections pass both the
		// output and the input hook, every packet).
		for _, c := range []string{chainFilterInput, chainFilterForward, chainFilterOutput} {
			rule(c, "meta nfproto", f.nfproto, "ct state new jump", f.name("filter"))
		}
	}
	// Clear the bit, so that a packet coming back (tunnels, IPsec) is not
	// masqueraded twice.
	rule(chainNATPostrouting, "meta mark &", l.mark, "!= 0 meta mark set meta mark ^", l.mark, "masquerade fully-random")
	for _, f := range l.fams {
		// Hairpin: an endpoint reaching itself through a Service sees its own
		// address as the source unless the node takes its place.
		rule(chainNATPostrouting, "ct status dnat", f.ip, "saddr .", f.ip, "daddr @"+f.name("hairpin"), "masquerade")

		addr := f.addrKey()
		svc := f.name("services")
		rule(svc, addr, "@"+f.name("firewall"), addr, ".", f.ip, "saddr != @"+f.name("firewall-allow"), "drop")
		switch {
		case f.masqueradeAll:
			rule(svc, addr, "@"+f.name("cluster-masq"), setMark)
		case len(f.clusterCIDRs) > 0:
			rule(svc, f.ip, "saddr !=", cidrSet(f.clusterCIDRs), addr, "@"+f.name("cluster-masq"), setMark)
		}
		rule(svc, addr, "@"+f.name("external-masq"), setMark)
		rule(svc, "fib saddr type local", addr, "@"+f.name("external-local"), setMark)
		rule(svc, f.externalSource(), addr, "@"+f.name("external-local"), "goto", f.name("local"))
		rule(svc, addr, "vmap @"+f.name(picks[pickCluster].affinity))
		local := f.name("local")
		rule(local, addr, "vmap @"+f.name(picks[pickLocal].affinity))
		rule(local, "jump", f.name(picks[pickLocal].chain))
		rule(local, "drop")

		// A TCP reset rather than ICMP for TCP: the client's stack queues a
		// reset for a socket it holds locked (a connect in progress on this
		// node), where it would drop the ICMP error and retry the SYN a
		// second later.
		filter := f.name("filter")
		rule(filter, addr, "@"+f.name("reject"), "meta l4proto tcp reject with tcp reset")
		rule(filter, addr, "@"+f.name("reject"), "reject")
		rule(filter, addr, "@"+f.name("drop"), "drop")
		if !f.nodePorts {
			continue
		}
		rule(svc, f.nodePortDst(), "jump", f.name("nodeports"))
		np := f.name("nodeports")
		rule(np, npKey, "@"+f.name("np-masq"), setMark)
		rule(np, "fib saddr type local", npKey, "@"+f.name("np-local"), setMark)
		rule(np, f.externalSource(), npKey, "@"+f.name("np-local"), "goto", f.name("np-local"))
		rule(np, npKey, "vmap @"+f.name(picks[pickNPCluster].affinity))
		npLocal := f.name("np-local")
		rule(npLocal, npKey, "vmap @"+f.name(picks[pickNPLocal].affinity))
		rule(npLocal, "jump", f.name(picks[pickNPLocal].chain))
		rule(npLocal, "drop")
		rule(filter, f.nodePortDst(), npKey, "@"+f.name("np-reject"), "meta l4proto tcp reject with tcp reset")
		rule(filter, f.nodePortDst(), npKey, "@"+f.name("np-reject"), "reject")
	}
}

// sets lists a family's sets of keys: name, whether the key is a NodePort's,
// and what it holds.
var keySets = []struct {
	name     string
	nodePort bool
	comment  string
}{
	{"cluster-masq", false, "ClusterIPs masqueraded from outside the pod networks"},
	{"external-masq", false, "ExternalIPs and LoadBalancer IPs of externalTrafficPolicy Cluster: masqueraded"},
	{"external-local", false, "ExternalIPs and LoadBalancer IPs of externalTrafficPolicy Local"},
	{"firewall", false, "LoadBalancer IPs with loadBalancerSourceRanges"},
	{"reject", false, "Service IPs without endpoints"},
	{"drop", false, "ClusterIPs of internalTrafficPolicy Local without endpoints on this node"},
	{"np-masq", true, "NodePorts of externalTrafficPolicy Cluster: masqueraded"},
	{"np-local", true, "NodePorts of externalTrafficPolicy Local"},
	{"np-reject", true, "NodePorts without endpoints"},
}

// objects adds a family's regular chains, sets and maps (without elements,
// but for --nodeport-addresses).
func (f *family) objects(tx *knftables.Transaction) {
	for _, c := range []string{"services", "local", "local-pick", "filter"} {
		tx.Add(&knftables.Chain{Name: f.name(c)})
	}
	if f.nodePorts {
		for _, c := range []string{"nodeports", "np-local", "np-local-pick"} {
			tx.Add(&knftables.Chain{Name: f.name(c)})
		}
	}
	for _, s := range keySets {
		if s.nodePort && !f.nodePorts {
			continue
		}
		tx.Add(&knftables.Set{Name: f.name(s.name), Type: f.keyType(s.nodePort), Comment: knftables.PtrTo(s.comment)})
	}
	tx.Add(&knftables.Set{Name: f.name("firewall-allow"), Type: f.keyType(false) + " . " + f.addrType,
		Flags: []knftables.SetFlag{knftables.IntervalFlag}, Comment: knftables.PtrTo("loadBalancerSourceRanges: LoadBalancer IP . protocol . port . source")})
	tx.Add(&knftables.Set{Name: f.name("hairpin"), Type: f.addrType + " . " + f.addrType, Comment: knftables.PtrTo("endpoint . endpoint: an endpoint reaching itself")})
	for k := range numPicks {
		if picks[k].nodePort && !f.nodePorts {
			continue
		}
		tx.Add(&knftables.Map{Name: f.name(picks[k].affinity), Type: f.keyType(picks[k].nodePort) + " : verdict",
			Comment: knftables.PtrTo("Service ports with ClientIP affinity: their chains")})
	}
	if len(f.nodePortPrefixes) > 0 {
		tx.Add(&knftables.Set{Name: f.name("nodeport-addresses"), Type: f.addrType,
			Flags: []knftables.SetFlag{knftables.IntervalFlag}, AutoMerge: knftables.PtrTo(true),
			Comment: knftables.PtrTo("--nodeport-addresses")})
		for _, p := range f.nodePortPrefixes {
			tx.Add(&knftables.Element{Set: f.name("nodeport-addresses"), Key: []string{p.String()}})
		}
	}
}

// parseCountMap reads a count map's name back: its family, pick and count;
// ok is false for any other name.
func (l *tableLayout) parseCountMap(name string) (f *family, k pick, n int, ok bool) {
	i := strings.LastIndexByte(name, '-')
	if i < 1 {
		return nil, 0, 0, false
	}
	n, err := strconv.Atoi(name[i+1:])
	if err != nil || n < 1 {
		return nil, 0, 0, false
	}
	base, fam := name[:i-1], name[i-1:i]
	for _, f := range l.fams {
		if f.n != fam {
			continue
		}
		for k := range numPicks {
			if picks[k].maps == base {
				return f, k, n, true
			}
		}
	}
	return nil, 0, 0, false
}

func isHairpin(set string) bool { return set == "hairpin4" || set == "hairpin6" }

// elementType is the type of the elements of set, for writing them over
// netlink; false for the sets and maps whose elements go through nft only
// (intervals, verdicts), and for names the layout does not have.
func (l *tableLayout) elementType(set string) (nftables.ElementType, bool) {
	if f, k, _, ok := l.parseCountMap(set); ok {
		key := []nftables.Field{nftables.InetProto, nftables.InetService, nftables.Integer}
		if !picks[k].nodePort {
			key = append([]nftables.Field{f.addrField()}, key...)
		}
		return nftables.ElementType{Key: key, Value: []nftables.Field{f.addrField(), nftables.InetService}}, true
	}
	for _, f := range l.fams {
		if set == f.name("hairpin") {
			return nftables.ElementType{Key: []nftables.Field{f.addrField(), f.addrField()}}, true
		}
		for _, s := range keySets {
			if set != f.name(s.name) {
				continue
			}
			if s.nodePort {
				return nftables.ElementType{Key: []nftables.Field{nftables.InetProto, nftables.InetService}}, true
			}
			return nftables.ElementType{Key: []nftables.Field{f.addrField(), nftables.InetProto, nftables.InetService}}, true
		}
	}
	return nftables.ElementType{}, false
}

// addrField is the type of the family's addresses in a key or value.
func (f *family) addrField() nftables.Field {
	if f.v6 {
		return nftables.IPv6Addr
	}
	return nftables.IPv4Addr
}
