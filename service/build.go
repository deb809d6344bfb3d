package service

import (
	"cmp"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"time"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
)

// BuildOptions are the facts about this node that a Snapshot depends on.
type BuildOptions struct {
	// NodeName is this node's name; endpoints whose nodeName equals it are Local.
	// If empty, no endpoint is Local. Endpoints whose hints.forNodes name it are
	// preferred (Endpoint.ForThisNode).
	NodeName string
	// Zone is this node's topology zone (its topology.kubernetes.io/zone label),
	// for the zone hints; "" turns them off. It is handed on as Snapshot.Zone.
	Zone string
	// Unserved are the protocols the proxy mode cannot serve, each with why. A
	// Service port of one is left out of Ports and reported in Errors as an
	// *UnservedError naming it, rather than dropped without a word by the mode.
	// Empty: every protocol is served.
	Unserved []Unserved
}

// Unserved is a protocol a proxy mode cannot serve, and why.
type Unserved struct {
	Protocol Protocol
	// Reason ends the port's UnservedError, e.g. "the userspace mode has no
	// SCTP proxy".
	Reason string
}

func (o BuildOptions) equal(p BuildOptions) bool {
	return o.NodeName == p.NodeName && o.Zone == p.Zone && slices.Equal(o.Unserved, p.Unserved)
}

// unserved splits ports (in name order) into those the mode serves, in the
// same order, and an UnservedError for each of the others.
func (o BuildOptions) unserved(svc *v1.Service, ports []*Port) ([]*Port, []error) {
	if len(o.Unserved) == 0 {
		return ports, nil
	}
	var errs []error
	served := ports[:0:0]
	for _, p := range ports {
		i := slices.IndexFunc(o.Unserved, func(u Unserved) bool { return u.Protocol == p.Protocol })
		if i < 0 {
			served = append(served, p)
			continue
		}
		field := "spec.ports"
		if j := slices.IndexFunc(svc.Spec.Ports, func(sp v1.ServicePort) bool { return sp.Name == p.Name.Port }); j >= 0 {
			field = fmt.Sprintf("spec.ports[%d]", j)
		}
		errs = append(errs, &UnservedError{Port: p, Field: field, Reason: o.Unserved[i].Reason})
	}
	if errs == nil {
		return ports, nil
	}
	return served, errs
}

// objectKey names a namespaced object.
type objectKey struct{ namespace, name string }

// Build converts Services and EndpointSlices into a Snapshot with one Port per
// ServicePort, sorted by name.
//
// Headless and ExternalName Services are skipped silently, as are FQDN slices. Every
// object that fails ValidateService or ValidateEndpointSlice is left out and its
// errors go to Snapshot.Errors; so does every repeated Service or slice (same
// namespace and name), of which the first one given is used. Of two Service ports
// that claim one address (see Claim), the one of the older Service is served and
// the other is left out, with a Conflict in Snapshot.Conflicts and Errors. A
// Service whose uproxy.io/ policy annotations do not parse (see ParsePolicy) is
// served, with the flags' policy in place of each bad one, and each such error
// goes to Snapshot.Errors; so does a Service without a cluster IP (see
// noClusterIP), or a NodePort or LoadBalancer Service port without a nodePort
// (see noNodePorts), which is served too, or a load balancer ingress IP that
// is the node's own or no one host's (see specialIngress), which is left out. A Service port of a protocol the mode cannot serve
// (BuildOptions.Unserved) is left out, with an UnservedError in Errors. Build
// never modifies its arguments, which may come straight from an informer cache,
// and accepts nil entries.
func Build(svcs []*v1.Service, epSlices []*discoveryv1.EndpointSlice, opts BuildOptions) *Snapshot {
	return NewBuilder(opts).Build(svcs, epSlices)
}

// Builder builds Snapshots like Build, but reuses the work of its previous Build
// for every object it is given again: an unchanged object is not validated again,
// and a Service whose object and slices are all unchanged keeps its Ports (the same
// pointers, which consumers may compare to skip unchanged ports).
//
// It also remembers which Service port served each address: of two ports that
// claim one address, the one that served it in the previous Build keeps it, even
// when the other belongs to an older Service (see conflicts.resolve). That is the
// one way its Snapshots differ from Build's.
//
// Objects are recognized by pointer: an object handed to Build must never be
// modified afterwards, and a changed object must be a new object. Informer caches
// (whose objects are replaced, never modified) and decoders meet this. A Builder
// is used by one goroutine.
type Builder struct {
	opts BuildOptions
	// gen numbers the Builds; every state below records the last Build that used
	// it, and what the current Build did not use is dropped at its end.
	gen uint64
	// svcs and slices hold what is known of every object of the previous Build.
	// Holding the pointers keeps the objects alive, so an address cannot be reused
	// by another object while it is a key here.
	svcs   map[*v1.Service]*svcState
	slices map[*discoveryv1.EndpointSlice]*sliceState
	// sliceNames records the last Build that took a slice of each name, to find
	// repeated ones.
	sliceNames map[objectKey]*nameState
	services   map[objectKey]*serviceState
	// order holds the Services of the previous Build in key order: when the set of
	// Services is unchanged, the Ports need no sorting.
	order []*serviceState
	// conflicts is the decision about shared addresses for the Services in order.
	// Only Service objects make addresses, so it holds while they are unchanged.
	conflicts *conflicts
}

// objectState is what Build learnt of one object: of a Service (svcState)
// or a slice (sliceState), each of which is kept for every object of every
// Build, so kept small: the keys of an object (its Service's, a slice's own)
// are read from the object when needed, not copied.
type objectState struct {
	gen  uint64
	errs []error // validation errors; nil when valid
	// skip is true for the Services and slices Build leaves out silently.
	skip bool
	// ss caches the state of the Service the object is or belongs to, to
	// save the lookup by key; a state that was dropped is looked up again.
	ss *serviceState
}

// svcState is what Build learnt of a Service object.
type svcState struct {
	objectState
	// policy is a valid Service's own policy. servedErrs are its problems that
	// leave it served all the same (annotations that did not parse, no cluster
	// IP, a port without its nodePort): they go to Snapshot.Errors.
	policy     Policy
	servedErrs []error
}

// sliceState is what Build learnt of an EndpointSlice object.
type sliceState struct {
	objectState
	// ns caches the state of the slice's own name, as ss does.
	ns *nameState
}

// serviceKey is the Service an EndpointSlice belongs to.
func serviceKey(s *discoveryv1.EndpointSlice) objectKey {
	return objectKey{s.Namespace, s.Labels[discoveryv1.LabelServiceName]}
}

// nameState records the last Build that took a slice of one name.
type nameState struct {
	gen     uint64
	dropped bool
}

// serviceState is one Service key's share of the current Build, and how its Ports
// were last built.
type serviceState struct {
	// slices are the valid slices of the current Build for this Service; valid
	// only when slicesGen is the current Build.
	slices    []*discoveryv1.EndpointSlice
	slicesGen uint64
	// svcGen is the last Build that took a Service of this key.
	svcGen  uint64
	dropped bool
	// The Ports last built, and the Service object and slices (a copy, in name
	// order) they were built from.
	svc      *v1.Service
	epSlices []*discoveryv1.EndpointSlice
	ports    []*Port
	// unserved are the UnservedErrors of the Service's ports left out of ports.
	unserved []error
}

// NewBuilder returns a Builder that has built nothing yet.
func NewBuilder(opts BuildOptions) *Builder {
	return &Builder{
		opts:       opts,
		svcs:       make(map[*v1.Service]*svcState),
		slices:     make(map[*discoveryv1.EndpointSlice]*sliceState),
		sliceNames: make(map[objectKey]*nameState),
		services:   make(map[objectKey]*serviceState),
		conflicts:  &conflicts{},
	}
}

// SetOptions changes the facts about this node that the next Build uses. When
// they differ from the current ones every Port is built afresh (new pointers),
// so consumers that skip unchanged Ports redo all of them: which endpoints are
// Local or preferred, and the Snapshot's Zone, may all have changed.
func (b *Builder) SetOptions(opts BuildOptions) {
	if opts.equal(b.opts) {
		return
	}
	b.opts = opts
	for _, ss := range b.services {
		ss.svc, ss.epSlices, ss.ports, ss.unserved = nil, nil, nil, nil
	}
}

// Build returns the Snapshot of svcs and epSlices, as the package-level Build
// would but for the established owners of shared addresses.
func (b *Builder) Build(svcs []*v1.Service, epSlices []*discoveryv1.EndpointSlice) *Snapshot {
	snap := &Snapshot{Built: time.Now(), Zone: b.opts.Zone}
	b.gen++
	gen := b.gen
	// used counts the entries of each map that this Build touched: when it
	// equals the map's size, nothing is left to drop.
	var usedSvcs, usedSlices, usedNames, usedServices int
	// svcsChanged is true when a Service object differs from the previous Build's.
	svcsChanged := false

	for _, s := range epSlices {
		if s == nil {
			continue
		}
		st := b.slices[s]
		if st == nil {
			st = &sliceState{objectState: objectState{skip: s.AddressType == discoveryv1.AddressTypeFQDN}}
			if !st.skip {
				st.errs = ValidateEndpointSlice(s)
			}
			b.slices[s] = st
		}
		if st.gen != gen {
			st.gen = gen
			usedSlices++
		}
		if st.skip {
			continue
		}
		if len(st.errs) > 0 {
			snap.Errors = append(snap.Errors, st.errs...)
			continue
		}
		if st.ns == nil || st.ns.dropped {
			name := objectKey{s.Namespace, s.Name}
			if st.ns = b.sliceNames[name]; st.ns == nil {
				st.ns = &nameState{}
				b.sliceNames[name] = st.ns
			}
		}
		if st.ns.gen == gen {
			snap.Errors = append(snap.Errors, duplicate("EndpointSlice", s.Namespace, s.Name))
			continue
		}
		st.ns.gen = gen
		usedNames++
		svc := b.service(&st.objectState, serviceKey(s), &usedServices)
		if svc.slicesGen != gen {
			svc.slices, svc.slicesGen = svc.slices[:0], gen
		}
		svc.slices = append(svc.slices, s)
	}

	taken := make([]*serviceState, 0, len(svcs))
	for _, svc := range svcs {
		if svc == nil {
			continue
		}
		st := b.svcs[svc]
		if st == nil {
			st = &svcState{objectState: objectState{errs: ValidateService(svc)}}
			st.skip = len(st.errs) == 0 && skipService(svc)
			if len(st.errs) == 0 && !st.skip {
				st.policy, st.servedErrs = ParsePolicy(svc)
				if err := noClusterIP(svc); err != nil {
					st.servedErrs = append(st.servedErrs, err)
				}
				st.servedErrs = append(st.servedErrs, noNodePorts(svc)...)
				st.servedErrs = append(st.servedErrs, specialIngress(svc)...)
			}
			b.svcs[svc] = st
		}
		if st.gen != gen {
			st.gen = gen
			usedSvcs++
		}
		if len(st.errs) > 0 {
			snap.Errors = append(snap.Errors, st.errs...)
			continue
		}
		if st.skip {
			continue
		}
		ss := b.service(&st.objectState, objectKey{svc.Namespace, svc.Name}, &usedServices)
		if ss.svcGen == gen {
			snap.Errors = append(snap.Errors, duplicate("Service", svc.Namespace, svc.Name))
			continue
		}
		snap.Errors = append(snap.Errors, st.servedErrs...)
		ss.svcGen = gen
		var eps []*discoveryv1.EndpointSlice
		if ss.slicesGen == gen {
			eps = sortedByName(ss.slices)
		}
		if ss.svc != svc || !slices.Equal(ss.epSlices, eps) {
			svcsChanged = svcsChanged || ss.svc != svc
			// A copy: ss.slices is reused by the next Build.
			ss.svc, ss.epSlices = svc, slices.Clone(eps)
			ss.ports = servicePorts(svc, st.policy, ss.epSlices, b.opts)
			slices.SortFunc(ss.ports, comparePorts)
			ss.ports, ss.unserved = b.opts.unserved(svc, ss.ports)
		}
		snap.Errors = append(snap.Errors, ss.unserved...)
		taken = append(taken, ss)
	}

	// Each Service's Ports are in name order and share their namespace and name, so
	// ordering the Services by key orders every Port.
	if !b.sameServices(taken) {
		slices.SortFunc(taken, func(x, y *serviceState) int {
			return cmp.Or(cmp.Compare(x.svc.Namespace, y.svc.Namespace), cmp.Compare(x.svc.Name, y.svc.Name))
		})
		b.order = taken
		svcsChanged = true
	}
	if svcsChanged {
		b.conflicts = b.conflicts.resolve(b.order)
	}
	leftOut := b.conflicts.leftOut
	n := -len(leftOut)
	for _, ss := range b.order {
		n += len(ss.ports)
	}
	if n > 0 {
		snap.Ports = make([]*Port, 0, n)
	}
	for _, ss := range b.order {
		if len(leftOut) == 0 {
			snap.Ports = append(snap.Ports, ss.ports...)
			continue
		}
		for _, p := range ss.ports {
			if leftOut[p.Name] == nil {
				snap.Ports = append(snap.Ports, p)
			}
		}
	}
	// Conflicts are never modified once decided: Snapshots may share them.
	snap.Conflicts = b.conflicts.list
	for _, c := range snap.Conflicts {
		snap.Errors = append(snap.Errors, c)
	}
	b.forget(usedSvcs, usedSlices, usedNames, usedServices)

	// Sources hand objects over in no particular order (informer caches are maps);
	// ordering by object keeps Errors stable between identical Snapshots while each
	// object's own errors stay in field order.
	slices.SortStableFunc(snap.Errors, func(a, b error) int {
		fa, fb := objectOf(a), objectOf(b)
		return cmp.Or(
			cmp.Compare(fa.Kind, fb.Kind),
			cmp.Compare(fa.Namespace, fb.Namespace),
			cmp.Compare(fa.Name, fb.Name),
		)
	})
	return snap
}

// service returns the state of the Service of key, which st is or belongs to, counting it
// as used by this Build the first time it is asked for.
func (b *Builder) service(st *objectState, key objectKey, used *int) *serviceState {
	if st.ss == nil || st.ss.dropped {
		if st.ss = b.services[key]; st.ss == nil {
			st.ss = &serviceState{}
			b.services[key] = st.ss
		}
	}
	ss := st.ss
	if ss.svcGen != b.gen && ss.slicesGen != b.gen {
		*used++
	}
	return ss
}

// sameServices reports whether taken, the Services of this Build (each once), are
// those of the previous one, whose order then still holds.
func (b *Builder) sameServices(taken []*serviceState) bool {
	if len(taken) != len(b.order) {
		return false
	}
	for _, ss := range b.order {
		if ss.svcGen != b.gen {
			return false
		}
	}
	return true
}

// forget drops the states this Build did not use, unless every one was used.
func (b *Builder) forget(usedSvcs, usedSlices, usedNames, usedServices int) {
	if usedSvcs != len(b.svcs) {
		maps.DeleteFunc(b.svcs, func(_ *v1.Service, st *svcState) bool { return st.gen != b.gen })
	}
	if usedSlices != len(b.slices) {
		maps.DeleteFunc(b.slices, func(_ *discoveryv1.EndpointSlice, st *sliceState) bool { return st.gen != b.gen })
	}
	if usedNames != len(b.sliceNames) {
		maps.DeleteFunc(b.sliceNames, func(_ objectKey, ns *nameState) bool {
			ns.dropped = ns.gen != b.gen
			return ns.dropped
		})
	}
	if usedServices != len(b.services) {
		maps.DeleteFunc(b.services, func(_ objectKey, ss *serviceState) bool {
			ss.dropped = ss.svcGen != b.gen && ss.slicesGen != b.gen
			return ss.dropped
		})
	}
}

func comparePorts(a, b *Port) int { return a.Name.Compare(b.Name) }

// sortedByName returns eps ordered by name (a copy when it had to be reordered).
// Merging slices in name order makes which of two equally ready duplicates wins
// independent of the order the source listed them in.
func sortedByName(eps []*discoveryv1.EndpointSlice) []*discoveryv1.EndpointSlice {
	byName := func(a, b *discoveryv1.EndpointSlice) int { return cmp.Compare(a.Name, b.Name) }
	if slices.IsSortedFunc(eps, byName) {
		return eps
	}
	eps = slices.Clone(eps)
	slices.SortFunc(eps, byName)
	return eps
}

// objectOf returns the object an error of Build is about, as a FieldError
// whose Kind, Namespace and Name are set.
func objectOf(err error) *FieldError {
	switch e := err.(type) {
	case *FieldError:
		return e
	case *Conflict:
		return &FieldError{Kind: "Service", Namespace: e.LeftOut.Namespace, Name: e.LeftOut.Name}
	case *UnservedError:
		return &FieldError{Kind: "Service", Namespace: e.Port.Name.Namespace, Name: e.Port.Name.Name}
	}
	return &FieldError{}
}

func duplicate(kind, namespace, name string) error {
	return &FieldError{Kind: kind, Namespace: namespace, Name: name, Field: "metadata.name",
		Msg: "defined more than once; the first definition is used"}
}

// servicePorts converts a valid, proxyable Service and its valid slices (sorted by
// name) into one Port per ServicePort. The Ports of one Service share their address slices: a Snapshot is
// never modified, so sharing is safe and saves copies for many-port Services.
func servicePorts(svc *v1.Service, policy Policy, eps []*discoveryv1.EndpointSlice, opts BuildOptions) []*Port {
	spec := &svc.Spec
	base := Port{
		Policy:              policy,
		InternalPolicyLocal: deref(spec.InternalTrafficPolicy) == v1.ServiceInternalTrafficPolicyLocal,
		ExternalPolicyLocal: spec.ExternalTrafficPolicy == v1.ServiceExternalTrafficPolicyLocal,
		TrafficDistribution: deref(spec.TrafficDistribution),
		HealthCheckNodePort: int(spec.HealthCheckNodePort),
	}

	// Validation guarantees every address below parses.
	clusterIPs := spec.ClusterIPs
	if len(clusterIPs) == 0 && spec.ClusterIP != "" {
		clusterIPs = []string{spec.ClusterIP}
	}
	base.ClusterIPs = parseIPs(clusterIPs)
	base.ExternalIPs = parseIPs(spec.ExternalIPs)
	for _, ing := range svc.Status.LoadBalancer.Ingress {
		// The API server checks no ingress IP for what it is (specialIngress
		// reports those left out here).
		if ip, ok := parseIP(ing.IP); ok && SpecialAddressKind(ip) == "" {
			base.LoadBalancerIPs = append(base.LoadBalancerIPs, ip)
		}
	}
	for _, s := range spec.LoadBalancerSourceRanges {
		if p, ok := parseSourceRange(s); ok {
			base.LoadBalancerSourceRanges = append(base.LoadBalancerSourceRanges, p)
		}
	}

	if spec.SessionAffinity == v1.ServiceAffinityClientIP {
		base.AffinityClientIP = true
		base.AffinityTimeout = DefaultAffinityTimeout
		if c := spec.SessionAffinityConfig; c != nil && c.ClientIP != nil && c.ClientIP.TimeoutSeconds != nil {
			base.AffinityTimeout = time.Duration(*c.ClientIP.TimeoutSeconds) * time.Second
		}
	}

	for _, s := range eps {
		t, err := time.Parse(time.RFC3339, s.Annotations[v1.EndpointsLastChangeTriggerTime])
		// An unparsable trigger time only costs a latency measurement; it is ignored
		// rather than failing an otherwise good slice.
		if err == nil && t.After(base.LastChangeTriggerTime) {
			base.LastChangeTriggerTime = t
		}
	}

	ports := make([]*Port, 0, len(spec.Ports))
	for _, sp := range spec.Ports {
		p := base
		p.Name = PortName{Namespace: svc.Namespace, Name: svc.Name, Port: sp.Name}
		p.Protocol = Protocol(protocolOrTCP(sp.Protocol))
		p.Port = int(sp.Port)
		p.NodePort = int(sp.NodePort)
		p.Endpoints = portEndpoints(sp, eps, opts)
		ports = append(ports, &p)
	}
	return ports
}

// portEndpoints collects the endpoints of one ServicePort from the Service's slices:
// a slice port serves it when name and protocol match. Each address is one Endpoint;
// an address seen twice keeps its ready instance, or else its first one.
func portEndpoints(sp v1.ServicePort, eps []*discoveryv1.EndpointSlice, opts BuildOptions) []Endpoint {
	proto := protocolOrTCP(sp.Protocol)
	nums := make([]uint16, len(eps))
	n := 0
	for i, s := range eps {
		num, ok := slicePort(s, sp.Name, proto)
		if !ok {
			continue
		}
		nums[i] = num
		n += len(s.Endpoints)
	}
	if n == 0 {
		return nil
	}
	out := make([]Endpoint, 0, n)
	for i, s := range eps {
		if nums[i] == 0 {
			continue
		}
		for _, ep := range s.Endpoints {
			// Unknown readiness counts as ready (the API's advice to consumers);
			// unknown serving follows ready; unknown terminating is not terminating.
			ready := ep.Conditions.Ready == nil || *ep.Conditions.Ready
			serving := ready
			if ep.Conditions.Serving != nil {
				serving = *ep.Conditions.Serving
			}
			node := deref(ep.NodeName)
			e := Endpoint{
				Ready:       ready,
				Serving:     serving,
				Terminating: deref(ep.Conditions.Terminating),
				NodeName:    node,
				Zone:        deref(ep.Zone),
				Local:       opts.NodeName != "" && node == opts.NodeName,
			}
			if h := ep.Hints; h != nil {
				for _, z := range h.ForZones {
					e.ZoneHints = append(e.ZoneHints, z.Name)
				}
				for _, n := range h.ForNodes {
					e.NodeHints = append(e.NodeHints, n.Name)
					e.ForThisNode = e.ForThisNode || (opts.NodeName != "" && n.Name == opts.NodeName)
				}
			}
			// An endpoint is its first address: the API defines nothing for
			// the others, which the EndpointSlice controller never writes
			// and kube-proxy does not read.
			if len(ep.Addresses) == 0 {
				continue // unreachable after validation; kept for safety
			}
			ip, ok := parseIP(ep.Addresses[0])
			if !ok {
				continue // likewise
			}
			e.Addr = netip.AddrPortFrom(ip, nums[i])
			out = append(out, e)
		}
	}
	// A stable sort keeps duplicates in slice order, so after it the first ready
	// instance of each address (or its first instance) is easy to keep.
	slices.SortStableFunc(out, func(a, b Endpoint) int { return a.Addr.Compare(b.Addr) })
	kept := out[:0]
	for i := 0; i < len(out); {
		j, pick := i+1, i
		for ; j < len(out) && out[j].Addr == out[i].Addr; j++ {
			if out[j].Ready && !out[pick].Ready {
				pick = j
			}
		}
		kept = append(kept, out[pick])
		i = j
	}
	clear(out[len(kept):]) // drop references held by the discarded tail
	return kept
}

// slicePort finds the port number that s gives for the ServicePort named name.
// Ports without a number (the API's "all ports") cannot be programmed and never match.
func slicePort(s *discoveryv1.EndpointSlice, name string, proto v1.Protocol) (uint16, bool) {
	for _, p := range s.Ports {
		if deref(p.Name) != name || p.Port == nil || !validPort(*p.Port) {
			continue
		}
		pp := v1.ProtocolTCP
		if p.Protocol != nil {
			pp = *p.Protocol
		}
		if pp == proto {
			return uint16(*p.Port), true
		}
	}
	return 0, false
}

func parseIPs(ss []string) []netip.Addr {
	if len(ss) == 0 {
		return nil
	}
	ips := make([]netip.Addr, 0, len(ss))
	for _, s := range ss {
		if ip, ok := parseIP(s); ok {
			ips = append(ips, ip)
		}
	}
	return ips
}
