package service

import (
	"fmt"
	"net/netip"
	"strings"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
)

// maxAffinityTimeout is the largest sessionAffinityConfig.clientIP.timeoutSeconds the
// API server accepts (one day).
const maxAffinityTimeout = 86400

// ValidateService checks what the proxy relies on in svc and returns one *FieldError
// per problem (nil when svc is usable). Services the proxy skips (headless,
// ExternalName) are only checked for their name, since nothing else of them is used.
func ValidateService(svc *v1.Service) []error {
	if svc == nil {
		return []error{&FieldError{Kind: "Service", Field: "metadata", Msg: "missing object"}}
	}
	v := validator{kind: "Service", namespace: svc.Namespace, name: svc.Name}
	v.metadata()
	if skipService(svc) {
		return v.errs
	}
	spec := &svc.Spec

	switch spec.Type {
	case "", v1.ServiceTypeClusterIP, v1.ServiceTypeNodePort, v1.ServiceTypeLoadBalancer:
	default:
		v.addf("spec.type", "unsupported value %q", spec.Type)
	}

	v.clusterIPs(spec)
	for i, s := range spec.ExternalIPs {
		v.ip(fmt.Sprintf("spec.externalIPs[%d]", i), s)
	}
	for i, ing := range svc.Status.LoadBalancer.Ingress {
		if ing.IP != "" { // hostname-only ingress points carry no address to program
			v.ip(fmt.Sprintf("status.loadBalancer.ingress[%d].ip", i), ing.IP)
		}
	}
	for i, s := range spec.LoadBalancerSourceRanges {
		if _, ok := parseSourceRange(s); !ok {
			v.addf(fmt.Sprintf("spec.loadBalancerSourceRanges[%d]", i), "%q is not a valid CIDR", s)
		}
	}

	v.servicePorts(spec)
	if hc := spec.HealthCheckNodePort; hc != 0 && !validPort(hc) {
		v.addf("spec.healthCheckNodePort", "%d is out of range 1-65535", hc)
	}

	switch spec.SessionAffinity {
	case "", v1.ServiceAffinityNone:
	case v1.ServiceAffinityClientIP:
		if c := spec.SessionAffinityConfig; c != nil && c.ClientIP != nil && c.ClientIP.TimeoutSeconds != nil {
			if t := *c.ClientIP.TimeoutSeconds; t <= 0 || t > maxAffinityTimeout {
				v.addf("spec.sessionAffinityConfig.clientIP.timeoutSeconds", "%d is out of range 1-%d", t, maxAffinityTimeout)
			}
		}
	default:
		v.addf("spec.sessionAffinity", "unsupported value %q", spec.SessionAffinity)
	}

	switch spec.ExternalTrafficPolicy {
	case "", v1.ServiceExternalTrafficPolicyCluster, v1.ServiceExternalTrafficPolicyLocal:
	default:
		v.addf("spec.externalTrafficPolicy", "unsupported value %q", spec.ExternalTrafficPolicy)
	}
	if p := spec.InternalTrafficPolicy; p != nil {
		switch *p {
		case v1.ServiceInternalTrafficPolicyCluster, v1.ServiceInternalTrafficPolicyLocal:
		default:
			v.addf("spec.internalTrafficPolicy", "unsupported value %q", *p)
		}
	}
	return v.errs
}

// ValidateEndpointSlice checks what the proxy relies on in s and returns one
// *FieldError per problem (nil when s is usable). FQDN slices are only checked for
// their name, since the proxy ignores them.
func ValidateEndpointSlice(s *discoveryv1.EndpointSlice) []error {
	if s == nil {
		return []error{&FieldError{Kind: "EndpointSlice", Field: "metadata", Msg: "missing object"}}
	}
	v := validator{kind: "EndpointSlice", namespace: s.Namespace, name: s.Name}
	v.metadata()

	var family func(netip.Addr) bool
	switch s.AddressType {
	case discoveryv1.AddressTypeIPv4:
		family = netip.Addr.Is4
	case discoveryv1.AddressTypeIPv6:
		family = netip.Addr.Is6
	case discoveryv1.AddressTypeFQDN:
		return v.errs
	default:
		v.addf("addressType", "unsupported value %q (want IPv4, IPv6 or FQDN)", s.AddressType)
	}

	if s.Labels[discoveryv1.LabelServiceName] == "" {
		v.addf("metadata.labels["+discoveryv1.LabelServiceName+"]", "required")
	}

	names := make(map[string]int, len(s.Ports))
	for i, p := range s.Ports {
		field := fmt.Sprintf("ports[%d]", i)
		name := deref(p.Name)
		if j, dup := names[name]; dup {
			v.addf(field+".name", "%q is already used by ports[%d]", name, j)
		} else {
			names[name] = i
		}
		if p.Protocol != nil {
			v.protocol(field+".protocol", *p.Protocol)
		}
		// A nil port stands for "all ports" in the API, which no proxy can program;
		// the port is skipped during conversion rather than failing the slice.
		if p.Port != nil && !validPort(*p.Port) {
			v.addf(field+".port", "%d is out of range 1-65535", *p.Port)
		}
	}

	// Slices hold most of a cluster's objects: field paths are only formatted for errors.
	for i, ep := range s.Endpoints {
		if len(ep.Addresses) == 0 {
			v.addf(fmt.Sprintf("endpoints[%d].addresses", i), "required")
		}
		for j, a := range ep.Addresses {
			ip, ok := parseIP(a)
			switch {
			case !ok:
				v.addf(fmt.Sprintf("endpoints[%d].addresses[%d]", i, j), "%q is not a valid IP address", a)
			case family != nil && !family(ip):
				v.addf(fmt.Sprintf("endpoints[%d].addresses[%d]", i, j), "%s is not an %s address (addressType %s)", ip, s.AddressType, s.AddressType)
			}
		}
	}
	return v.errs
}

// validator collects the FieldErrors of one object.
type validator struct {
	kind, namespace, name string
	errs                  []error
}

func (v *validator) addf(field, format string, args ...any) {
	v.errs = append(v.errs, &FieldError{
		Kind:      v.kind,
		Namespace: v.namespace,
		Name:      v.name,
		Field:     field,
		Msg:       fmt.Sprintf(format, args...),
	})
}

func (v *validator) metadata() {
	if v.name == "" {
		v.addf("metadata.name", "required")
	}
	if v.namespace == "" {
		v.addf("metadata.namespace", "required")
	}
}

// ip parses s as an IP address, reporting it under field when it is not one.
func (v *validator) ip(field, s string) (netip.Addr, bool) {
	ip, ok := parseIP(s)
	if !ok {
		v.addf(field, "%q is not a valid IP address", s)
	}
	return ip, ok
}

func (v *validator) protocol(field string, p v1.Protocol) {
	switch p {
	case v1.ProtocolTCP, v1.ProtocolUDP, v1.ProtocolSCTP:
	default:
		v.addf(field, "unsupported value %q (want TCP, UDP or SCTP)", p)
	}
}

// clusterIPs checks spec.clusterIP and spec.clusterIPs as the API server would for
// an allocated Service: valid addresses, at most one per family, the primary one
// repeated in clusterIP, and the order of ipFamilies when it is given.
func (v *validator) clusterIPs(spec *v1.ServiceSpec) {
	if spec.ClusterIP != "" {
		v.ip("spec.clusterIP", spec.ClusterIP)
	}
	if len(spec.ClusterIPs) == 0 {
		return
	}
	if spec.ClusterIP != "" && spec.ClusterIPs[0] != spec.ClusterIP {
		v.addf("spec.clusterIPs[0]", "%s does not match spec.clusterIP %s", spec.ClusterIPs[0], spec.ClusterIP)
	}
	if len(spec.ClusterIPs) > 2 {
		v.addf("spec.clusterIPs", "%d addresses, at most 2 (one per IP family)", len(spec.ClusterIPs))
	}
	var ips []netip.Addr
	for i, s := range spec.ClusterIPs {
		field := fmt.Sprintf("spec.clusterIPs[%d]", i)
		ip, ok := v.ip(field, s)
		if !ok {
			continue
		}
		if i == 1 && len(ips) == 1 && ips[0].Is4() == ip.Is4() {
			v.addf(field, "%s is %s like spec.clusterIPs[0]; a dual-stack Service needs one address of each family", ip, familyOf(ip))
		}
		// A value that is no family is the API server's to refuse (and a
		// manifest's checks report it): saying that it is not ip's family too
		// would report it twice.
		if i < len(spec.IPFamilies) && isFamily(spec.IPFamilies[i]) && spec.IPFamilies[i] != familyOf(ip) {
			v.addf(field, "%s is %s but spec.ipFamilies[%d] is %s", ip, familyOf(ip), i, spec.IPFamilies[i])
		}
		ips = append(ips, ip)
	}
}

// servicePorts checks every ServicePort and the rules between them: names are required
// and unique when there are several, and port/protocol and nodePort/protocol pairs are
// unique.
func (v *validator) servicePorts(spec *v1.ServiceSpec) {
	if len(spec.Ports) == 0 {
		v.addf("spec.ports", "required")
		return
	}
	type portKey struct {
		port  int32
		proto v1.Protocol
	}
	names := make(map[string]int, len(spec.Ports))
	ports := make(map[portKey]int, len(spec.Ports))
	nodePorts := make(map[portKey]int, len(spec.Ports))
	for i, p := range spec.Ports {
		field := fmt.Sprintf("spec.ports[%d]", i)
		proto := protocolOrTCP(p.Protocol)
		v.protocol(field+".protocol", proto)

		if len(spec.Ports) > 1 {
			if p.Name == "" {
				v.addf(field+".name", "required when a Service has several ports")
			} else if j, dup := names[p.Name]; dup {
				v.addf(field+".name", "%q is already used by spec.ports[%d]", p.Name, j)
			} else {
				names[p.Name] = i
			}
		}

		if !validPort(p.Port) {
			v.addf(field+".port", "%d is out of range 1-65535", p.Port)
		} else if j, dup := ports[portKey{p.Port, proto}]; dup {
			v.addf(field, "%d/%s is already used by spec.ports[%d]", p.Port, proto, j)
		} else {
			ports[portKey{p.Port, proto}] = i
		}

		switch {
		case p.NodePort == 0:
		case !validPort(p.NodePort):
			v.addf(field+".nodePort", "%d is out of range 1-65535", p.NodePort)
		case spec.Type == "" || spec.Type == v1.ServiceTypeClusterIP:
			v.addf(field+".nodePort", "may not be set when type is ClusterIP")
		default:
			if j, dup := nodePorts[portKey{p.NodePort, proto}]; dup {
				v.addf(field+".nodePort", "%d/%s is already used by spec.ports[%d]", p.NodePort, proto, j)
			} else {
				nodePorts[portKey{p.NodePort, proto}] = i
			}
		}
	}
}

// skipService reports whether the proxy has nothing to do for svc: headless Services
// have no virtual IP, ExternalName Services are DNS aliases.
func skipService(svc *v1.Service) bool {
	if svc.Spec.Type == v1.ServiceTypeExternalName {
		return true
	}
	if svc.Spec.ClusterIP == v1.ClusterIPNone {
		return true
	}
	return len(svc.Spec.ClusterIPs) > 0 && svc.Spec.ClusterIPs[0] == v1.ClusterIPNone
}

// noClusterIP warns of a Service (neither headless nor ExternalName) without a
// cluster IP. The API server assigns every such Service one; a hand-written
// manifest often leaves it out, and the Service is then reached only through
// its other addresses, which would otherwise go unsaid.
func noClusterIP(svc *v1.Service) error {
	if svc.Spec.ClusterIP != "" || len(svc.Spec.ClusterIPs) > 0 {
		return nil
	}
	return &FieldError{Kind: "Service", Namespace: svc.Namespace, Name: svc.Name, Field: "spec.clusterIP",
		Served: true, Msg: "not set, so no cluster IP reaches the Service (only its NodePort, external or load balancer IPs, and in the userspace mode its proxy port); the API server would have assigned one: give one from the cluster's service CIDR"}
}

// noNodePorts warns of each port of a NodePort or LoadBalancer Service that has
// no nodePort. The API server allocates one to every such port (a LoadBalancer
// Service's unless allocateLoadBalancerNodePorts is false); a hand-written
// manifest has no allocator, and the port is then served on no NodePort,
// which would otherwise go unsaid.
func noNodePorts(svc *v1.Service) []error {
	switch svc.Spec.Type {
	case v1.ServiceTypeNodePort:
	case v1.ServiceTypeLoadBalancer:
		if a := svc.Spec.AllocateLoadBalancerNodePorts; a != nil && !*a {
			return nil
		}
	default:
		return nil
	}
	var errs []error
	for i, p := range svc.Spec.Ports {
		if p.NodePort != 0 {
			continue
		}
		errs = append(errs, &FieldError{Kind: "Service", Namespace: svc.Namespace, Name: svc.Name, Field: fmt.Sprintf("spec.ports[%d].nodePort", i), Served: true,
			Msg: fmt.Sprintf("not set: manifests are not allocated NodePorts (the API server would have allocated one), so this port of the %s Service is reached on no NodePort; set it to a port of the cluster's NodePort range", svc.Spec.Type)})
	}
	return errs
}

// specialIngress reports each load balancer ingress IP of svc that
// SpecialAddressKind names. The API server takes any address there, from
// whoever may write a Service's status: 127.0.0.1 would capture the node's own
// servers on the Service's ports (uproxy's metrics among them), as
// externalIPs would if the API server let them be such addresses. The
// Service is served without them.
func specialIngress(svc *v1.Service) []error {
	var errs []error
	for i, ing := range svc.Status.LoadBalancer.Ingress {
		ip, ok := parseIP(ing.IP)
		if !ok {
			continue
		}
		if kind := SpecialAddressKind(ip); kind != "" {
			errs = append(errs, &FieldError{Kind: "Service", Namespace: svc.Namespace, Name: svc.Name,
				Field: fmt.Sprintf("status.loadBalancer.ingress[%d].ip", i), Served: true,
				Msg: fmt.Sprintf("%s is %s: left out, the Service is served on its other addresses", ing.IP, kind)})
		}
	}
	return errs
}

// SpecialAddressKind says what ip is when it is an address of the node itself or of
// no single host: unspecified, loopback, link-local, multicast or the IPv4
// broadcast address. Such addresses are refused as Service and endpoint
// addresses, as the API server refuses the first three (the node's own and
// its metadata services live there) and the others reach no one host. It is
// "" for any other address. An IPv4-mapped IPv6 address is judged as the IPv4
// address it holds, which is what a socket makes of it.
func SpecialAddressKind(ip netip.Addr) string {
	ip = ip.Unmap()
	switch {
	case ip.IsUnspecified():
		return "an unspecified address"
	case ip.IsLoopback():
		return "a loopback address"
	case ip.IsLinkLocalUnicast():
		return "a link-local address"
	case ip.IsMulticast():
		return "a multicast address"
	case ip == netip.AddrFrom4([4]byte{255, 255, 255, 255}):
		return "the broadcast address"
	}
	return ""
}

// parseIP accepts an IPv4 or IPv6 address without zone: a zone has no meaning for a
// Service or endpoint address and would make two spellings of one address differ.
func parseIP(s string) (netip.Addr, bool) {
	ip, err := netip.ParseAddr(s)
	if err != nil || ip.Zone() != "" {
		return netip.Addr{}, false
	}
	return ip, true
}

// parseSourceRange parses a loadBalancerSourceRanges entry. Surrounding spaces are
// tolerated as the API server does; host bits are cleared so equal ranges compare equal.
func parseSourceRange(s string) (netip.Prefix, bool) {
	p, err := netip.ParsePrefix(strings.TrimSpace(s))
	if err != nil || p.Addr().Zone() != "" {
		return netip.Prefix{}, false
	}
	return p.Masked(), true
}

func validPort(p int32) bool { return p >= 1 && p <= 65535 }

func isFamily(f v1.IPFamily) bool { return f == v1.IPv4Protocol || f == v1.IPv6Protocol }

func familyOf(ip netip.Addr) v1.IPFamily {
	if ip.Is4() {
		return v1.IPv4Protocol
	}
	return v1.IPv6Protocol
}

// protocolOrTCP applies the API's default protocol, which manifests on disk may omit.
func protocolOrTCP(p v1.Protocol) v1.Protocol {
	if p == "" {
		return v1.ProtocolTCP
	}
	return p
}

func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}
