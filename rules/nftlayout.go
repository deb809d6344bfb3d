package rules

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"sigs.k8s.io/knftables"

	"github.com/uproxy/uproxy/netfilter/nftables"
	"github.com/uproxy/uproxy/service"
)

// The base chains of the nftables table. Both are nat chains at priority
// dstnat-10 (-110): kube-proxy's nftables mode hooks its nat chains at dstnat
// (-100) and iptables' nat table (legacy or nft) sits at -100 too. The kernel
// runs a new connection through the nat chains of a hook in priority order and
// stops at the first that sets up a NAT binding, so a Service port uproxy
// serves is redirected here and never reaches theirs, while everything else
// passes on to them untouched. The portals only ever see a connection's first
// packet: later ones follow the binding.
const (
	nftPrerouting = "prerouting"
	nftOutput     = "output"
	nftPriority   = knftables.DNATPriority + "-10"
)

// The chains that refuse Service ports without endpoints. The three base
// chains are filter chains at priority -110, as kube-proxy's nftables mode
// hooks its no-endpoint checks (nft names no "dstnat" on these hooks): on
// output this is before any DNAT at -100, so the check sees the destination
// the node's own connection asked for; on input and forward the packet is
// past prerouting, and only the portals' untouched packets still carry a
// virtual IP. Each jumps, for a connection's first packet, to nftNoEndpoints,
// whose lookups send a refused destination to nftRefuse.
const (
	nftFilterInput   = "filter-input"
	nftFilterForward = "filter-forward"
	nftFilterOutput  = "filter-output"
	nftNoEndpoints   = "no-endpoints"
	nftRefuse        = "refuse"
	nftFilterPrio    = "-110"
	// nftRefuseVerdict is the value of every element of a no-endpoint map.
	nftRefuseVerdict = "goto " + nftRefuse
)

// chains are the chains whose rules a whole write adds and nothing else
// changes: their rule handles tell whether someone flushed or edited the table.
func (l *nftLayout) chains() []string {
	c := []string{nftPrerouting, nftOutput, nftFilterInput, nftFilterForward, nftFilterOutput, nftNoEndpoints, nftRefuse}
	if l.clientMark != 0 && l.dialMark != 0 {
		c = append(c, nftClientOutput, nftClientPrerouting, nftClientPostrouting)
	}
	return c
}

// nftLayout is the nftables table of the portals without the map elements,
// which change with the Services; it is fixed for the life of an NFTables.
type nftLayout struct {
	fams     []nftFamily // IPv4 first, then IPv6 when enabled
	dialMark uint32
	// clientMark marks transparent dials and their replies
	// (Config.ClientAddressMark); 0: no such chains.
	clientMark uint32
	// onNodeIP: the prerouting portals dnat to the node IP rather than redirect
	// (Config.ProxyPortsOnNodeIP).
	onNodeIP bool
}

// nftFamily is what the layout needs of one address family.
type nftFamily struct {
	f        int
	ip       string // "ip" or "ip6": address matches and dnat
	nfproto  string // "ipv4" or "ipv6"
	addrType string // the key type of an address
	nodeIP   netip.Addr
	// nodePorts is whether the family serves NodePorts: always without
	// NodePortAddresses, else only when one of them is of this family.
	nodePorts bool
	// nodePortPrefixes are the NodePortAddresses of the family; empty with
	// nodePorts means every local address.
	nodePortPrefixes []netip.Prefix
	// The names of the family's maps and set: they end in 4 or 6, since a
	// map's key type names the address family. serviceIPs maps ClusterIP or
	// LoadBalancer IP . protocol . port to the proxy port; externalIPs does
	// the same for ExternalIPs, which are captured under narrower conditions;
	// nodePortMap maps protocol . NodePort to the proxy port.
	serviceIPs, externalIPs, nodePortMap, nodePortAddresses string
	// The no-endpoint maps hold the same keys as serviceIPs, externalIPs
	// and nodePortMap for the Service ports refused (Portal.Refuse), each
	// mapped to the verdict nftRefuseVerdict. A key is in one map of a pair,
	// never both.
	noEndpointServiceIPs, noEndpointExternalIPs, noEndpointNodePorts string
}

// refuseMap returns the no-endpoint counterpart of the family's map steer.
func (fam nftFamily) refuseMap(steer string) string {
	switch steer {
	case fam.serviceIPs:
		return fam.noEndpointServiceIPs
	case fam.externalIPs:
		return fam.noEndpointExternalIPs
	}
	return fam.noEndpointNodePorts
}

func newNFTFamily(f int, nodeIP netip.Addr, nodePortAddresses []netip.Prefix) nftFamily {
	fam := nftFamily{f: f, ip: "ip", nfproto: "ipv4", addrType: "ipv4_addr", nodeIP: nodeIP}
	if f == v6 {
		fam.ip, fam.nfproto, fam.addrType = "ip6", "ipv6", "ipv6_addr"
	}
	for _, p := range nodePortAddresses {
		if familyOf(p.Addr()) == f {
			fam.nodePortPrefixes = append(fam.nodePortPrefixes, p.Masked())
		}
	}
	fam.nodePorts = len(nodePortAddresses) == 0 || len(fam.nodePortPrefixes) > 0
	n := "4"
	if f == v6 {
		n = "6"
	}
	fam.serviceIPs, fam.externalIPs, fam.nodePortMap, fam.nodePortAddresses =
		"service-ips"+n, "external-ips"+n, "nodeports"+n, "nodeport-addresses"+n
	fam.noEndpointServiceIPs, fam.noEndpointExternalIPs, fam.noEndpointNodePorts =
		"no-endpoint-"+fam.serviceIPs, "no-endpoint-"+fam.externalIPs, "no-endpoint-"+fam.nodePortMap
	return fam
}

// write adds the whole table except the map elements to tx. The table is
// deleted and created again in the same transaction, which the kernel applies
// atomically: whatever another program or an older uproxy left in it (rules,
// maps of another type) is gone, and there is no moment without portals.
func (l *nftLayout) write(tx *knftables.Transaction) {
	tx.Add(&knftables.Table{})
	tx.Delete(&knftables.Table{})
	tx.Add(&knftables.Table{Comment: knftables.PtrTo(nftables.CommentPrefix + "userspace-mode portals: Service IPs and NodePorts to proxy ports")})
	for _, c := range []struct {
		name string
		typ  knftables.BaseChainType
		hook knftables.BaseChainHook
		prio knftables.BaseChainPriority
	}{
		{nftPrerouting, knftables.NATType, knftables.PreroutingHook, nftPriority},
		{nftOutput, knftables.NATType, knftables.OutputHook, nftPriority},
		{nftFilterInput, knftables.FilterType, knftables.InputHook, nftFilterPrio},
		{nftFilterForward, knftables.FilterType, knftables.ForwardHook, nftFilterPrio},
		{nftFilterOutput, knftables.FilterType, knftables.OutputHook, nftFilterPrio},
	} {
		tx.Add(&knftables.Chain{Name: c.name, Type: &c.typ, Hook: &c.hook, Priority: &c.prio})
	}
	tx.Add(&knftables.Chain{Name: nftNoEndpoints, Comment: knftables.PtrTo("Service ports without endpoints: refused")})
	tx.Add(&knftables.Chain{Name: nftRefuse})
	for _, fam := range l.fams {
		vip := fam.addrType + " . inet_proto . inet_service"
		tx.Add(&knftables.Map{Name: fam.serviceIPs, Type: vip + " : inet_service", Comment: knftables.PtrTo("ClusterIPs and LoadBalancer IPs")})
		tx.Add(&knftables.Map{Name: fam.externalIPs, Type: vip + " : inet_service", Comment: knftables.PtrTo("ExternalIPs")})
		tx.Add(&knftables.Map{Name: fam.noEndpointServiceIPs, Type: vip + " : verdict", Comment: knftables.PtrTo("ClusterIPs and LoadBalancer IPs without endpoints")})
		tx.Add(&knftables.Map{Name: fam.noEndpointExternalIPs, Type: vip + " : verdict", Comment: knftables.PtrTo("ExternalIPs without endpoints")})
		if fam.nodePorts {
			tx.Add(&knftables.Map{Name: fam.nodePortMap, Type: "inet_proto . inet_service : inet_service", Comment: knftables.PtrTo("NodePorts")})
			tx.Add(&knftables.Map{Name: fam.noEndpointNodePorts, Type: "inet_proto . inet_service : verdict", Comment: knftables.PtrTo("NodePorts without endpoints")})
		}
		if len(fam.nodePortPrefixes) > 0 {
			// auto-merge lets overlapping --nodeport-addresses in, as iptables takes them.
			tx.Add(&knftables.Set{Name: fam.nodePortAddresses, Type: fam.addrType,
				Flags: []knftables.SetFlag{knftables.IntervalFlag}, AutoMerge: knftables.PtrTo(true),
				Comment: knftables.PtrTo("--nodeport-addresses")})
			for _, p := range fam.nodePortPrefixes {
				tx.Add(&knftables.Element{Set: fam.nodePortAddresses, Key: []string{p.String()}})
			}
		}
	}
	l.rules(tx)
	clientAddressChains(tx, l.clientMark, l.dialMark)
}

// rules adds the rules of both chains. Every rule is one map lookup: a packet
// whose key is not in the map leaves the rule unmatched, so the cost of a new
// connection does not grow with the number of Services.
func (l *nftLayout) rules(tx *knftables.Transaction) {
	// nft accepts a port mapping only after a transport protocol match.
	const l4 = "meta l4proto { tcp, udp }"
	add := func(chain, comment string, rule ...any) {
		tx.Add(&knftables.Rule{Chain: chain, Rule: knftables.Concat(rule...), Comment: knftables.PtrTo(comment)})
	}
	if l.dialMark != 0 {
		m := markHex(l.dialMark)
		add(nftOutput, "uproxy dials to endpoints skip the portals", "meta mark &", m, "!= 0 return")
	}
	for _, fam := range l.fams {
		vip := fam.ip + " daddr . meta l4proto . th dport map @"
		redirect := "redirect to :"
		dnat := "dnat " + fam.ip + " to " + fam.nodeAddress() + ":"
		if l.onNodeIP {
			redirect = dnat
		}
		// ExternalIPs as in the iptables backend (see renderer.portalsContainer):
		// from outside only when the source is not a node address, from the node
		// only when the node owns the address.
		add(nftPrerouting, "Service IPs", l4, redirect, vip+fam.serviceIPs)
		add(nftPrerouting, "ExternalIPs from outside the node", "fib saddr type != local", l4, redirect, vip+fam.externalIPs)
		add(nftOutput, "Service IPs", l4, dnat, vip+fam.serviceIPs)
		add(nftOutput, "ExternalIPs the node owns", "fib daddr type local", l4, dnat, vip+fam.externalIPs)
		if !fam.nodePorts {
			continue
		}
		// A NodePort answers on the node's own addresses (inside
		// --nodeport-addresses when given); the map key has no address, so the
		// family is matched explicitly.
		dst := []string{"fib daddr type local"}
		if len(fam.nodePortPrefixes) > 0 {
			dst = append(dst, fam.ip+" daddr @"+fam.nodePortAddresses)
		}
		np := "meta l4proto . th dport map @" + fam.nodePortMap
		add(nftPrerouting, "NodePorts", dst, "meta nfproto", fam.nfproto, l4, redirect, np)
		add(nftOutput, "NodePorts", dst, "meta nfproto", fam.nfproto, l4, dnat, np)
	}
	l.refuseRules(add)
}

// refuseRules adds the rules that refuse the keys of the no-endpoint maps. A
// refused key gets no nat element, so its packets reach the filter hooks
// with their destination untouched; the lookups in nftNoEndpoints match
// exactly the packets the nat rules would have steered, in whichever hook
// they arrive (the chain is reached from input, forward and output alike).
func (l *nftLayout) refuseRules(add func(chain, comment string, rule ...any)) {
	for _, c := range []string{nftFilterInput, nftFilterForward, nftFilterOutput} {
		add(c, "a connection's first packet: refused when its Service port has no endpoints", "ct state new jump", nftNoEndpoints)
	}
	if l.dialMark != 0 {
		m := markHex(l.dialMark)
		add(nftNoEndpoints, "uproxy dials to endpoints skip the portals", "meta mark &", m, "!= 0 return")
	}
	for _, fam := range l.fams {
		vip := fam.ip + " daddr . meta l4proto . th dport vmap @"
		add(nftNoEndpoints, "Service IPs without endpoints", vip+fam.noEndpointServiceIPs)
		// ExternalIPs: steered from outside the node, and from the node
		// when it owns the address; nft has no "or" across two fib lookups.
		add(nftNoEndpoints, "ExternalIPs the node owns, without endpoints", "fib daddr type local", vip+fam.noEndpointExternalIPs)
		add(nftNoEndpoints, "ExternalIPs from outside the node, without endpoints", "fib saddr type != local", vip+fam.noEndpointExternalIPs)
		if !fam.nodePorts {
			continue
		}
		dst := []string{"fib daddr type local"}
		if len(fam.nodePortPrefixes) > 0 {
			dst = append(dst, fam.ip+" daddr @"+fam.nodePortAddresses)
		}
		add(nftNoEndpoints, "NodePorts without endpoints", dst, "meta nfproto", fam.nfproto, "meta l4proto . th dport vmap @"+fam.noEndpointNodePorts)
	}
	// For TCP a reset, which fails a connect at once: a client on the node
	// holds its socket locked while connecting and would drop an ICMP error,
	// retrying the SYN a second later. Anything else (UDP) gets ICMP or ICMPv6
	// port unreachable, which a connected UDP socket reports as ECONNREFUSED.
	add(nftRefuse, "TCP: reset", "meta l4proto tcp reject with tcp reset")
	add(nftRefuse, "UDP: port unreachable", "reject")
}

// nodeAddress is the node IP as a dnat target: IPv6 in brackets, since a port follows.
func (fam nftFamily) nodeAddress() string {
	if fam.f == v6 {
		return "[" + fam.nodeIP.String() + "]"
	}
	return fam.nodeIP.String()
}

// nftKey is a map element's key: address . protocol . port, or for a NodePort
// (addr not valid) protocol . port. Keys stay structs until they are written,
// so a sync that changes little allocates little.
type nftKey struct {
	addr  netip.Addr
	proto string
	port  int
}

func (k nftKey) strings() []string {
	if !k.addr.IsValid() {
		return []string{k.proto, strconv.Itoa(k.port)}
	}
	return []string{k.addr.String(), k.proto, strconv.Itoa(k.port)}
}

func (k nftKey) String() string { return strings.Join(k.strings(), " . ") }

func compareKeys(a, b nftKey) int {
	if c := a.addr.Compare(b.addr); c != 0 {
		return c
	}
	if c := strings.Compare(a.proto, b.proto); c != 0 {
		return c
	}
	return a.port - b.port
}

// nftElement is where a key leads: the proxy port (0 in a no-endpoint map,
// whose value is always nftRefuseVerdict), and the Service port it belongs
// to, which is also the element's comment.
type nftElement struct {
	proxyPort int
	owner     service.PortName
}

// nftElements are the elements of every map, by map name, then by key.
type nftElements map[string]map[nftKey]nftElement

// elements returns the map elements of entries, with an error for each key
// already taken by an earlier entry (entries are sorted, so the first claimant
// wins deterministically, as the first matching iptables rule would): a
// transaction that added one key twice would fail as a whole.
func (l *nftLayout) elements(entries []entry) (nftElements, []error) {
	els := nftElements{}
	for _, fam := range l.fams {
		for _, m := range []string{fam.serviceIPs, fam.externalIPs, fam.noEndpointServiceIPs, fam.noEndpointExternalIPs} {
			els[m] = map[nftKey]nftElement{}
		}
		if fam.nodePorts {
			els[fam.nodePortMap] = map[nftKey]nftElement{}
			els[fam.noEndpointNodePorts] = map[nftKey]nftElement{}
		}
	}
	var errs []error
	for i := range entries {
		e := &entries[i]
		// A key either map of a pair already holds is the earlier entry's.
		l.elementsOf(e, func(fam nftFamily, name string, port int, k nftKey, proxyPort int, refused bool) {
			steer, refuse := els[name], els[fam.refuseMap(name)]
			old, ok := steer[k]
			if !ok {
				old, ok = refuse[k]
			}
			if ok {
				if old.owner != e.name {
					errs = append(errs, &PortalError{Service: e.name, Protocol: e.protocol, Port: port,
						Err: fmt.Errorf("%s in map %s already used by %s", k, name, old.owner)})
				}
				return
			}
			if refused {
				refuse[k] = nftElement{owner: e.name}
				return
			}
			steer[k] = nftElement{proxyPort: proxyPort, owner: e.name}
		})
	}
	return els, errs
}

// addAll adds every element of els to tx.
func (els nftElements) addAll(tx *knftables.Transaction) {
	for _, m := range sortedKeys(els) {
		keys := make([]nftKey, 0, len(els[m]))
		for k := range els[m] {
			keys = append(keys, k)
		}
		slices.SortFunc(keys, compareKeys)
		for _, k := range keys {
			tx.Add(els[m][k].object(m, k))
		}
	}
}

// addChanges adds changes (of diff) to tx.
func addChanges(tx *knftables.Transaction, changes []elementChange) {
	for _, c := range changes {
		if c.delete {
			tx.Delete(&knftables.Element{Map: c.m, Key: []string{c.k.String()}})
		} else {
			tx.Add(c.e.object(c.m, c.k))
		}
	}
}

// elementChange is one element of a map deleted, or added (with e).
type elementChange struct {
	delete bool
	m      string
	k      nftKey
	e      nftElement
}

// diff returns what turns els into now, in the order of one transaction. A
// changed element is deleted and added again: the kernel refuses to add a key
// that exists with another value. Deletions come first, so a transaction never
// holds a key twice; maps and keys are sorted, so the same change is written
// the same way.
func (els nftElements) diff(now nftElements) []elementChange {
	var dels, adds []elementChange
	for _, m := range sortedKeys(now) {
		was, cur := els[m], now[m]
		var gone, added []nftKey
		for k, old := range was {
			if e, ok := cur[k]; !ok || e != old {
				gone = append(gone, k)
			}
		}
		for k, e := range cur {
			if old, ok := was[k]; !ok || e != old {
				added = append(added, k)
			}
		}
		slices.SortFunc(gone, compareKeys)
		slices.SortFunc(added, compareKeys)
		for _, k := range gone {
			dels = append(dels, elementChange{delete: true, m: m, k: k})
		}
		for _, k := range added {
			adds = append(adds, elementChange{m: m, k: k, e: cur[k]})
		}
	}
	return append(dels, adds...)
}

// netlinkChanges returns changes for nftables.Kernel.WriteElements, which
// writes them over a netlink connection kept open instead of starting nft
// (whose exit waits for the kernel to free the elements a transaction
// deleted, and whose start reads the whole table: 80-90 ms at 10k Service
// ports for a new Service, which arrives without endpoints and so in a
// no-endpoint map): false when there are more than it takes.
func (l *nftLayout) netlinkChanges(changes []elementChange) (nftables.ElementChanges, bool) {
	if len(changes) > nftables.MaxElementChanges {
		return nil, false
	}
	out := make(nftables.ElementChanges, 0, len(changes))
	for _, c := range changes {
		typ, ok := l.steeringType(c.m)
		if !ok {
			return nil, false
		}
		ec := nftables.ElementChange{Delete: c.delete, Set: c.m, Type: typ, Key: c.k.String()}
		if !c.delete {
			ec.Value, ec.Comment = c.e.value(), nftables.Comment(c.e.owner.String())
		}
		out = append(out, ec)
	}
	return out, true
}

// steeringType returns the element type of map m: a steering map (address
// or NodePort to proxy port) or a no-endpoint map (the same keys to the
// refusing verdict); false for any other map.
func (l *nftLayout) steeringType(m string) (nftables.ElementType, bool) {
	port := []nftables.Field{nftables.InetService}
	verdict := []nftables.Field{nftables.Verdict}
	for _, fam := range l.fams {
		addr := nftables.IPv4Addr
		if fam.f == v6 {
			addr = nftables.IPv6Addr
		}
		vip := []nftables.Field{addr, nftables.InetProto, nftables.InetService}
		nodePort := []nftables.Field{nftables.InetProto, nftables.InetService}
		switch m {
		case fam.serviceIPs, fam.externalIPs:
			return nftables.ElementType{Key: vip, Value: port}, true
		case fam.nodePortMap:
			return nftables.ElementType{Key: nodePort, Value: port}, true
		case fam.noEndpointServiceIPs, fam.noEndpointExternalIPs:
			return nftables.ElementType{Key: vip, Value: verdict}, true
		case fam.noEndpointNodePorts:
			return nftables.ElementType{Key: nodePort, Value: verdict}, true
		}
	}
	return nftables.ElementType{}, false
}

// value is e's value as nft writes it: its proxy port, or the refusing
// verdict in a no-endpoint map.
func (e nftElement) value() string {
	if e.proxyPort != 0 {
		return strconv.Itoa(e.proxyPort)
	}
	return nftRefuseVerdict
}

func (e nftElement) object(m string, k nftKey) *knftables.Element {
	comment := nftables.Comment(e.owner.String())
	return &knftables.Element{Map: m, Key: []string{k.String()}, Value: []string{e.value()}, Comment: &comment}
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
