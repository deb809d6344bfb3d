// Package service holds the domain types every proxy mode works from: a Snapshot of
// Service ports and their endpoints, built from Kubernetes Service and EndpointSlice
// objects whatever their source (API server or manifests on disk).
package service

import (
	"cmp"
	"fmt"
	"net/netip"
	"reflect"
	"slices"
	"sort"
	"time"
)

// PortName names one port of one Service: namespace/name:port. Port is the
// ServicePort's name and may be empty for single-port Services.
type PortName struct {
	Namespace string
	Name      string
	Port      string
}

func (n PortName) String() string {
	if n.Port == "" {
		return n.Namespace + "/" + n.Name
	}
	return n.Namespace + "/" + n.Name + ":" + n.Port
}

// Less orders PortNames by namespace, name, then port name.
func (n PortName) Less(o PortName) bool {
	if n.Namespace != o.Namespace {
		return n.Namespace < o.Namespace
	}
	if n.Name != o.Name {
		return n.Name < o.Name
	}
	return n.Port < o.Port
}

// Compare is Less as a three-way comparison (-1, 0, +1), for slices.SortFunc.
func (n PortName) Compare(o PortName) int {
	return cmp.Or(cmp.Compare(n.Namespace, o.Namespace), cmp.Compare(n.Name, o.Name), cmp.Compare(n.Port, o.Port))
}

// Protocol is a Service port's transport protocol, spelled as in the Kubernetes API.
type Protocol string

const (
	TCP  Protocol = "TCP"
	UDP  Protocol = "UDP"
	SCTP Protocol = "SCTP"
)

// DefaultAffinityTimeout is the ClientIP affinity timeout when a Service gives none
// (Kubernetes' default of 10800 seconds).
const DefaultAffinityTimeout = 10800 * time.Second

// Endpoint is one backend address of a Service port, with the conditions reported
// for it by its EndpointSlice.
type Endpoint struct {
	Addr        netip.AddrPort
	Ready       bool
	Serving     bool
	Terminating bool
	NodeName    string
	Zone        string
	// ZoneHints and NodeHints are the topology hints of the endpoint (empty when none).
	ZoneHints []string
	NodeHints []string
	// ForThisNode is true when NodeHints name this node (the node name the
	// snapshot was built for): trafficDistribution PreferSameNode.
	ForThisNode bool
	// Local is true when the endpoint runs on this node (NodeName equals the node
	// name the snapshot was built for).
	Local bool
}

func (e Endpoint) String() string { return e.Addr.String() }

// Port is one Service port with everything any mode needs to program it.
type Port struct {
	Name     PortName
	Protocol Protocol
	// Port is the Service's port number (the port clients connect to on the virtual IPs).
	Port int

	ClusterIPs      []netip.Addr
	ExternalIPs     []netip.Addr
	LoadBalancerIPs []netip.Addr
	// LoadBalancerSourceRanges restricts which clients may reach LoadBalancerIPs
	// (empty: everyone).
	LoadBalancerSourceRanges []netip.Prefix
	NodePort                 int
	HealthCheckNodePort      int

	// AffinityClientIP is true for sessionAffinity: ClientIP; AffinityTimeout then
	// holds timeoutSeconds (DefaultAffinityTimeout when unset).
	AffinityClientIP bool
	AffinityTimeout  time.Duration

	// ExternalPolicyLocal and InternalPolicyLocal are the traffic policies
	// externalTrafficPolicy: Local and internalTrafficPolicy: Local.
	ExternalPolicyLocal bool
	InternalPolicyLocal bool
	// TrafficDistribution is spec.trafficDistribution ("" when unset).
	TrafficDistribution string

	// Endpoints are every endpoint of this port across all the Service's slices,
	// sorted by address, without duplicates. Use ClusterEndpoints / LocalEndpoints
	// for the ones that should carry traffic.
	Endpoints []Endpoint

	// Policy is the Service's own retry and scheduling policy, from its
	// uproxy.io/ annotations (see ParsePolicy); what it leaves unset, the
	// proxy's flags decide.
	Policy Policy

	// LastChangeTriggerTime is the newest endpoints.kubernetes.io/last-change-trigger-time
	// of the Service's slices (zero when unknown).
	LastChangeTriggerTime time.Time
}

// Snapshot is the complete desired state at one moment: every proxyable Service port,
// ordered by name. A Snapshot is never modified once built; modes may keep it.
type Snapshot struct {
	Ports []*Port
	// Errors are the objects that could not be used, each naming the object and field.
	// Their Services are left out (or keep their last good state, at the source's choice);
	// every other Service is unaffected.
	Errors []error
	// Conflicts are the Service ports left out because another Service port
	// already serves one of their addresses, in name order; each is also in Errors.
	Conflicts []*Conflict
	// Built is when the snapshot was assembled.
	Built time.Time
	// Zone is this node's topology zone when the snapshot was built ("": none),
	// the zone every mode hands to ClusterEndpoints and ExternalEndpoints. It
	// lives in the snapshot so that a change of the Node's zone label reaches
	// every mode the way any other change does: as a new snapshot.
	Zone string
}

// Lookup returns the port with the given name, or nil.
func (s *Snapshot) Lookup(name PortName) *Port {
	i := sort.Search(len(s.Ports), func(i int) bool { return !s.Ports[i].Name.Less(name) })
	if i < len(s.Ports) && s.Ports[i].Name == name {
		return s.Ports[i]
	}
	return nil
}

// Equal reports whether s and o describe the same state: the same ports and the
// same errors (by message). When they were built does not count, so a source
// that rebuilds on every event can tell the sync loop about effective changes
// only.
func (s *Snapshot) Equal(o *Snapshot) bool {
	if s.Zone != o.Zone || !reflect.DeepEqual(s.Ports, o.Ports) || len(s.Errors) != len(o.Errors) {
		return false
	}
	for i := range s.Errors {
		if s.Errors[i].Error() != o.Errors[i].Error() {
			return false
		}
	}
	return true
}

// usable returns the endpoints that should carry traffic among eps: the ready ones,
// or, when none is ready, the serving and terminating ones (as kube-proxy does, so a
// Service whose pods are all shutting down keeps working until they stop serving).
func usable(eps []Endpoint, keep func(Endpoint) bool) []Endpoint {
	var ready, terminating []Endpoint
	for _, e := range eps {
		if !keep(e) {
			continue
		}
		switch {
		case e.Ready:
			ready = append(ready, e)
		case e.Serving && e.Terminating:
			terminating = append(terminating, e)
		}
	}
	if len(ready) > 0 {
		return ready
	}
	return terminating
}

// ClusterEndpoints returns the endpoints for traffic to the ClusterIPs: with
// internalTrafficPolicy Local only this node's, otherwise all, narrowed by
// topology hints (see byTopology) for zone, this node's zone ("": no zone hints).
func (p *Port) ClusterEndpoints(zone string) []Endpoint {
	if p.InternalPolicyLocal {
		return p.LocalEndpoints()
	}
	return p.byTopology(zone)
}

// ExternalEndpoints returns the endpoints for traffic arriving through NodePorts,
// ExternalIPs and LoadBalancer IPs: with externalTrafficPolicy Local only this
// node's, otherwise those of ClusterEndpoints with the Cluster policy.
func (p *Port) ExternalEndpoints(zone string) []Endpoint {
	if p.ExternalPolicyLocal {
		return p.LocalEndpoints()
	}
	return p.byTopology(zone)
}

// SplitsExternal reports whether traffic through the external addresses
// (NodePort, ExternalIPs, LoadBalancer IPs) may go to other endpoints than
// traffic to the ClusterIPs: the port has external addresses and its two
// traffic policies differ. It depends on the Service's spec alone, never on
// its endpoints of the moment.
func (p *Port) SplitsExternal() bool {
	if p.ExternalPolicyLocal == p.InternalPolicyLocal {
		return false
	}
	return p.NodePort != 0 || len(p.ExternalIPs) > 0 || len(p.LoadBalancerIPs) > 0
}

// LocalEndpoints returns the usable endpoints on this node.
func (p *Port) LocalEndpoints() []Endpoint {
	return usable(p.Endpoints, func(e Endpoint) bool { return e.Local })
}

// byTopology applies topology hints the way kube-proxy (1.35 and later) does.
// Node hints (trafficDistribution: PreferSameNode) come first: when every
// usable endpoint has some and one of them names this node, only the endpoints
// so hinted. Else zone hints: when every usable endpoint has some and one of
// them names zone, only the endpoints hinted for zone. Otherwise every usable
// endpoint.
func (p *Port) byTopology(zone string) []Endpoint {
	all := usable(p.Endpoints, func(Endpoint) bool { return true })
	if len(all) == 0 {
		return all
	}
	allNode, forNode, allZone, forZone := true, false, zone != "", false
	for _, e := range all {
		if len(e.NodeHints) == 0 {
			allNode = false
		} else if e.ForThisNode {
			forNode = true
		}
		if len(e.ZoneHints) == 0 {
			allZone = false
		} else if slices.Contains(e.ZoneHints, zone) {
			forZone = true
		}
	}
	var keep func(Endpoint) bool
	switch {
	case allNode && forNode:
		keep = func(e Endpoint) bool { return e.ForThisNode }
	case allZone && forZone:
		keep = func(e Endpoint) bool { return slices.Contains(e.ZoneHints, zone) }
	default:
		return all
	}
	out := make([]Endpoint, 0, len(all))
	for _, e := range all {
		if keep(e) {
			out = append(out, e)
		}
	}
	return out
}

// IdentityEqual reports whether a and b would be served by the same proxy listener:
// same name and protocol. Everything else (virtual IPs, ports, endpoints, affinity)
// can change under a running listener.
func IdentityEqual(a, b *Port) bool {
	return a.Name == b.Name && a.Protocol == b.Protocol
}

// FieldError is an error about one field of one object, as "kind ns/name: field: msg".
type FieldError struct {
	Kind      string // "Service" or "EndpointSlice"
	Namespace string
	Name      string
	Field     string // JSON path, e.g. spec.ports[1].port
	Msg       string
	// Served says the object is served all the same, without what the
	// field would have given it; else it is left out (or its last valid
	// version kept).
	Served bool
}

func (e *FieldError) Error() string {
	return fmt.Sprintf("%s %s/%s: %s: %s", e.Kind, e.Namespace, e.Name, e.Field, e.Msg)
}

// UnservedError is a Service port left out of a Snapshot because the proxy mode
// cannot serve its protocol (BuildOptions.Unserved). The Service is valid: a
// mode that serves the protocol would serve it.
type UnservedError struct {
	// Port is the Service port as it would be served.
	Port *Port
	// Field is where the port is in the Service, e.g. spec.ports[1].
	Field  string
	Reason string
}

func (e *UnservedError) Error() string {
	return fmt.Sprintf("Service %s/%s: %s: %s port %d (%s) is not served: %s",
		e.Port.Name.Namespace, e.Port.Name.Name, e.Field, e.Port.Protocol, e.Port.Port, e.Port.Name, e.Reason)
}
