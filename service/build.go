package service

import (
	"cmp"
	"net/netip"
	"slices"
	"time"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
)

// BuildOptions are the facts about this node that a Snapshot depends on.
type BuildOptions struct {
	// NodeName is this node's name; endpoints whose nodeName equals it are Local.
	// If empty, no endpoint is Local.
	NodeName string
}

// objectKey names a namespaced object.
type objectKey struct{ namespace, name string }

// Build converts Services and EndpointSlices into a Snapshot with one Port per
// ServicePort, sorted by name.
//
// Headless and ExternalName Services are skipped silently, as are FQDN slices. Every
// object that fails ValidateService or ValidateEndpointSlice is left out and its
// errors go to Snapshot.Errors; so does every repeated Service or slice (same
// namespace and name), of which the first one given is used. Build never modifies
// its arguments, which may come straight from an informer cache, and accepts nil
// entries.
func Build(svcs []*v1.Service, epSlices []*discoveryv1.EndpointSlice, opts BuildOptions) *Snapshot {
	return NewBuilder(opts).Build(svcs, epSlices)
}

// Builder builds Snapshots like Build, but reuses the work of its previous Build
// for every object it is given again: an unchanged object is not validated again,
// and a Service whose object and slices are all unchanged keeps its Ports (the same
// pointers, which consumers may compare to skip unchanged ports).
//
// Objects are recognized by pointer: an object handed to Build must never be
// modified afterwards, and a changed object must be a new object. Informer caches
// (whose objects are replaced, never modified) and decoders meet this. A Builder
// is used by one goroutine.
type Builder struct {
	opts BuildOptions
	// svcErrs and sliceErrs are the validation errors (nil: valid) of the objects
	// of the previous Build. Holding the pointers keeps the objects alive, so an
	// address cannot be reused by another object while it is a key here.
	svcErrs   map[*v1.Service][]error
	sliceErrs map[*discoveryv1.EndpointSlice][]error
	// built are the Services of the previous Build, by object key.
	built map[objectKey]*builtService
}

// builtService is one Service as last built: its object, its slices sorted by
// name, and its Ports in name order.
type builtService struct {
	svc    *v1.Service
	slices []*discoveryv1.EndpointSlice
	ports  []*Port
}

// NewBuilder returns a Builder that has built nothing yet.
func NewBuilder(opts BuildOptions) *Builder {
	return &Builder{opts: opts}
}

// Build returns the Snapshot of svcs and epSlices, exactly as the package-level
// Build would.
func (b *Builder) Build(svcs []*v1.Service, epSlices []*discoveryv1.EndpointSlice) *Snapshot {
	snap := &Snapshot{Built: time.Now()}
	svcErrs := make(map[*v1.Service][]error, len(svcs))
	sliceErrs := make(map[*discoveryv1.EndpointSlice][]error, len(epSlices))
	built := make(map[objectKey]*builtService, len(svcs))

	bySvc := make(map[objectKey][]*discoveryv1.EndpointSlice, len(svcs))
	seenSlices := make(map[objectKey]bool, len(epSlices))
	for _, s := range epSlices {
		if s == nil || s.AddressType == discoveryv1.AddressTypeFQDN {
			continue
		}
		errs, ok := sliceErrs[s]
		if !ok {
			if errs, ok = b.sliceErrs[s]; !ok {
				errs = ValidateEndpointSlice(s)
			}
			sliceErrs[s] = errs
		}
		if len(errs) > 0 {
			snap.Errors = append(snap.Errors, errs...)
			continue
		}
		if seenSlices[objectKey{s.Namespace, s.Name}] {
			snap.Errors = append(snap.Errors, duplicate("EndpointSlice", s.Namespace, s.Name))
			continue
		}
		seenSlices[objectKey{s.Namespace, s.Name}] = true
		k := objectKey{s.Namespace, s.Labels[discoveryv1.LabelServiceName]}
		bySvc[k] = append(bySvc[k], s)
	}

	var reused []*builtService // in the order of svcs, for the merge below
	for _, svc := range svcs {
		if svc == nil {
			continue
		}
		errs, ok := svcErrs[svc]
		if !ok {
			if errs, ok = b.svcErrs[svc]; !ok {
				errs = ValidateService(svc)
			}
			svcErrs[svc] = errs
		}
		if len(errs) > 0 {
			snap.Errors = append(snap.Errors, errs...)
			continue
		}
		if skipService(svc) {
			continue
		}
		k := objectKey{svc.Namespace, svc.Name}
		if built[k] != nil {
			snap.Errors = append(snap.Errors, duplicate("Service", svc.Namespace, svc.Name))
			continue
		}
		eps := sortedByName(bySvc[k])
		bs := b.built[k]
		if bs == nil || bs.svc != svc || !slices.Equal(bs.slices, eps) {
			bs = &builtService{svc: svc, slices: eps, ports: servicePorts(svc, eps, b.opts)}
			slices.SortFunc(bs.ports, comparePorts)
		}
		built[k] = bs
		reused = append(reused, bs)
	}
	b.svcErrs, b.sliceErrs, b.built = svcErrs, sliceErrs, built

	// Each Service's Ports are in name order and share their namespace and name, so
	// ordering the Services by key orders every Port.
	slices.SortFunc(reused, func(x, y *builtService) int {
		return cmp.Or(cmp.Compare(x.svc.Namespace, y.svc.Namespace), cmp.Compare(x.svc.Name, y.svc.Name))
	})
	n := 0
	for _, bs := range reused {
		n += len(bs.ports)
	}
	if n > 0 {
		snap.Ports = make([]*Port, 0, n)
	}
	for _, bs := range reused {
		snap.Ports = append(snap.Ports, bs.ports...)
	}
	// Sources hand objects over in no particular order (informer caches are maps);
	// ordering by object keeps Errors stable between identical Snapshots while each
	// object's own errors stay in field order.
	slices.SortStableFunc(snap.Errors, func(a, b error) int {
		fa, fb := asFieldError(a), asFieldError(b)
		return cmp.Or(
			cmp.Compare(fa.Kind, fb.Kind),
			cmp.Compare(fa.Namespace, fb.Namespace),
			cmp.Compare(fa.Name, fb.Name),
		)
	})
	return snap
}

func comparePorts(a, b *Port) int {
	switch {
	case a.Name.Less(b.Name):
		return -1
	case b.Name.Less(a.Name):
		return 1
	}
	return 0
}

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

func asFieldError(err error) *FieldError {
	if fe, ok := err.(*FieldError); ok {
		return fe
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
func servicePorts(svc *v1.Service, eps []*discoveryv1.EndpointSlice, opts BuildOptions) []*Port {
	spec := &svc.Spec
	base := Port{
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
		if ip, ok := parseIP(ing.IP); ok {
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
		for _, ep := range s.Endpoints {
			n += len(ep.Addresses)
		}
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
				}
			}
			for _, a := range ep.Addresses {
				ip, ok := parseIP(a)
				if !ok {
					continue // unreachable after validation; kept for safety
				}
				e.Addr = netip.AddrPortFrom(ip, nums[i])
				out = append(out, e)
			}
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
