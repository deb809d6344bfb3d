package file

import (
	"fmt"
	"net/netip"
	"strings"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	apivalidation "k8s.io/apimachinery/pkg/util/validation"

	"github.com/uproxy/uproxy/service"
)

// The checks here are the API server's that service.ValidateService and
// service.ValidateEndpointSlice leave out, because objects read from the API
// server have passed them already: names, addresses that are not a
// Service's or an endpoint's to take, and fields the proxy does not use. A
// manifest has passed nothing, and a name or address the API server would
// refuse can do harm here: a loopback external IP captures the node's own
// 127.0.0.1 services, a loopback endpoint lets a Service's clients reach
// servers that listen only on the node, and a name is written into rule
// comments. A field the proxy does not use is checked all the same, so that a
// manifest that works here works when applied to a cluster.

// validateServiceManifest returns what the API server would refuse in svc
// and service.ValidateService does not check, one *service.FieldError per
// problem. Empty names and addresses that do not parse are left to
// service.ValidateService, which reports them.
func validateServiceManifest(svc *v1.Service) []error {
	c := checker{kind: "Service", namespace: svc.Namespace, name: svc.Name}
	c.checkName("metadata.name", svc.Name, "DNS-1035 label", apivalidation.IsDNS1035Label)
	c.checkName("metadata.namespace", svc.Namespace, "DNS-1123 label", apivalidation.IsDNS1123Label)
	for i, p := range svc.Spec.Ports {
		c.checkName(fmt.Sprintf("spec.ports[%d].name", i), p.Name, "DNS-1123 label", apivalidation.IsDNS1123Label)
		c.targetPort(fmt.Sprintf("spec.ports[%d].targetPort", i), p.TargetPort)
	}
	if p := svc.Spec.IPFamilyPolicy; p != nil {
		switch *p {
		case v1.IPFamilyPolicySingleStack, v1.IPFamilyPolicyPreferDualStack, v1.IPFamilyPolicyRequireDualStack:
		default:
			c.addf("spec.ipFamilyPolicy", "unsupported value %q (want SingleStack, PreferDualStack or RequireDualStack)", *p)
		}
	}
	for i, f := range svc.Spec.IPFamilies {
		if f != v1.IPv4Protocol && f != v1.IPv6Protocol {
			c.addf(fmt.Sprintf("spec.ipFamilies[%d]", i), "unsupported value %q (want IPv4 or IPv6)", f)
		}
	}
	for i, ip := range svc.Spec.ClusterIPs {
		c.ordinaryIP(fmt.Sprintf("spec.clusterIPs[%d]", i), ip)
	}
	if len(svc.Spec.ClusterIPs) == 0 || svc.Spec.ClusterIPs[0] != svc.Spec.ClusterIP {
		// Reported once, under clusterIPs[0], when both say the same.
		c.ordinaryIP("spec.clusterIP", svc.Spec.ClusterIP)
	}
	for i, ip := range svc.Spec.ExternalIPs {
		c.ordinaryIP(fmt.Sprintf("spec.externalIPs[%d]", i), ip)
	}
	c.ordinaryIP("spec.loadBalancerIP", svc.Spec.LoadBalancerIP)
	for i, ing := range svc.Status.LoadBalancer.Ingress {
		c.ordinaryIP(fmt.Sprintf("status.loadBalancer.ingress[%d].ip", i), ing.IP)
	}
	return c.errs
}

// validateSliceManifest is validateServiceManifest for an EndpointSlice;
// loopbackOK accepts endpoints at loopback addresses (Source.LoopbackEndpoints).
func validateSliceManifest(s *discoveryv1.EndpointSlice, loopbackOK bool) []error {
	c := checker{kind: "EndpointSlice", namespace: s.Namespace, name: s.Name}
	c.checkName("metadata.name", s.Name, "DNS-1123 subdomain", apivalidation.IsDNS1123Subdomain)
	c.checkName("metadata.namespace", s.Namespace, "DNS-1123 label", apivalidation.IsDNS1123Label)
	if svc := s.Labels[discoveryv1.LabelServiceName]; svc != "" {
		c.checkName("metadata.labels["+discoveryv1.LabelServiceName+"]", svc, "label value", apivalidation.IsValidLabelValue)
	}
	for i, p := range s.Ports {
		if p.Name != nil {
			c.checkName(fmt.Sprintf("ports[%d].name", i), *p.Name, "DNS-1123 label", apivalidation.IsDNS1123Label)
		}
	}
	if s.AddressType == discoveryv1.AddressTypeFQDN {
		return c.errs // the proxy ignores such slices
	}
	for i, ep := range s.Endpoints {
		for j, a := range ep.Addresses {
			// Slices hold most of a cluster's objects: field paths are only
			// formatted for errors.
			if ip, err := netip.ParseAddr(a); err == nil {
				if kind := service.SpecialAddressKind(ip); kind != "" && !(loopbackOK && ip.Unmap().IsLoopback()) {
					hint := ""
					if ip.Unmap().IsLoopback() {
						hint = loopbackEndpointHint
					}
					c.addf(fmt.Sprintf("endpoints[%d].addresses[%d]", i, j), "%s is %s%s", a, kind, hint)
				}
			}
		}
	}
	return c.errs
}

// loopbackEndpointHint follows the refusal of a loopback endpoint: it says how
// such endpoints are taken (run.go sets Source.LoopbackEndpoints from
// --bind-address).
const loopbackEndpointHint = " (as the API server refuses it); endpoints at loopback addresses are taken only " +
	"when --bind-address is a loopback address, such as --bind-address 127.0.0.1 (the demo's), " +
	"so that only the node's own processes reach the proxy ports"

// The API server's limits on an EndpointSlice's lists (its discovery
// validation; the type's documentation says 100 ports, the API server takes
// up to 20000).
const (
	maxSliceEndpoints    = 1000
	maxSlicePorts        = 20000
	maxEndpointAddresses = 100
)

// sliceLimits returns an error for each of the API server's limits on a
// list that s exceeds. Such a slice is refused whole, and its items are not
// checked one by one: a manifest of 64 MiB holds millions of them, and as
// many errors would say nothing more.
func sliceLimits(s *discoveryv1.EndpointSlice) []error {
	c := checker{kind: "EndpointSlice", namespace: s.Namespace, name: s.Name}
	if n := len(s.Ports); n > maxSlicePorts {
		c.addf("ports", "%d items, must have at most %d", n, maxSlicePorts)
	}
	if n := len(s.Endpoints); n > maxSliceEndpoints {
		c.addf("endpoints", "%d items, must have at most %d", n, maxSliceEndpoints)
		return c.errs
	}
	for i, ep := range s.Endpoints {
		if n := len(ep.Addresses); n > maxEndpointAddresses {
			c.addf(fmt.Sprintf("endpoints[%d].addresses", i), "%d items, must have at most %d", n, maxEndpointAddresses)
		}
	}
	return c.errs
}

// checker collects the FieldErrors of one object.
type checker struct {
	kind, namespace, name string
	errs                  []error
}

func (c *checker) addf(field, format string, args ...any) {
	c.errs = append(c.errs, &service.FieldError{Kind: c.kind, Namespace: c.namespace, Name: c.name,
		Field: field, Msg: fmt.Sprintf(format, args...)})
}

// checkName checks a non-empty value with one of apimachinery's validators,
// which return what is wrong with it (nothing when it is valid).
func (c *checker) checkName(field, value, what string, valid func(string) []string) {
	if value == "" {
		return
	}
	if msgs := valid(value); len(msgs) > 0 {
		c.addf(field, "%q is not a valid %s: %s", value, what, strings.Join(msgs, "; "))
	}
}

// targetPort checks a Service port's targetPort: a port number or the name
// of a container port (an IANA_SVC_NAME). Its zero value, 0 or "", is the
// API server's to default to the port, as it does before validating.
func (c *checker) targetPort(field string, tp intstr.IntOrString) {
	switch {
	case tp.Type == intstr.String:
		c.checkName(field, tp.StrVal, "port name", apivalidation.IsValidPortName)
	case tp.IntVal < 0 || tp.IntVal > 65535:
		c.addf(field, "%d is out of range 1-65535", tp.IntVal)
	}
}

// ordinaryIP reports an address that no Service may take. Values that are not
// addresses ("None", typos) are left to service.ValidateService.
func (c *checker) ordinaryIP(field, s string) {
	ip, err := netip.ParseAddr(s)
	if err != nil {
		return
	}
	if kind := service.SpecialAddressKind(ip); kind != "" {
		c.addf(field, "%s is %s", s, kind)
	}
}

// virtualIPs are the addresses of a Service that its portals capture.
type virtualIPs map[netip.Addr]string // address -> the field that holds it

// serviceVIPs returns svc's cluster, external and load balancer IPs.
func serviceVIPs(svc *v1.Service) virtualIPs {
	vips := make(virtualIPs)
	add := func(field, s string) {
		if ip, err := netip.ParseAddr(s); err == nil {
			if _, dup := vips[ip.Unmap()]; !dup {
				vips[ip.Unmap()] = field
			}
		}
	}
	add("spec.clusterIP", svc.Spec.ClusterIP)
	for i, s := range svc.Spec.ClusterIPs {
		add(fmt.Sprintf("spec.clusterIPs[%d]", i), s)
	}
	for i, s := range svc.Spec.ExternalIPs {
		add(fmt.Sprintf("spec.externalIPs[%d]", i), s)
	}
	add("spec.loadBalancerIP", svc.Spec.LoadBalancerIP)
	for i, ing := range svc.Status.LoadBalancer.Ingress {
		add(fmt.Sprintf("status.loadBalancer.ingress[%d].ip", i), ing.IP)
	}
	return vips
}

// loops returns an error for each endpoint address of s that is one of the
// virtual IPs of s's Service (vips, named by svc): a connection to the Service
// would be sent back to the Service, again and again.
func loops(s *discoveryv1.EndpointSlice, svc string, vips virtualIPs) []error {
	c := checker{kind: "EndpointSlice", namespace: s.Namespace, name: s.Name}
	for i, ep := range s.Endpoints {
		for j, a := range ep.Addresses {
			ip, err := netip.ParseAddr(a)
			if err != nil {
				continue
			}
			if field, ok := vips[ip.Unmap()]; ok {
				c.addf(fmt.Sprintf("endpoints[%d].addresses[%d]", i, j),
					"%s is Service %s/%s's own address (%s): connections to it would loop back to the Service", a, s.Namespace, svc, field)
			}
		}
	}
	return c.errs
}
