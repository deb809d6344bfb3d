package service

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
)

// A port of a protocol the mode cannot serve is left out of Ports and said in
// Errors, naming the Service, the port and why; the Service's other ports and
// every other Service are served; with no Unserved, every protocol is served.
func TestBuildReportsUnservedPorts(t *testing.T) {
	t.Parallel()
	mixed := testService("ns", "mixed", withPorts(
		v1.ServicePort{Name: "web", Port: 80},
		v1.ServicePort{Name: "sig", Port: 3868, Protocol: v1.ProtocolSCTP},
	))
	sctp := testService("ns", "sctp", withPorts(v1.ServicePort{Port: 9999, Protocol: v1.ProtocolSCTP}))
	eps := testSlice("ns", "mixed-1", "mixed", discoveryv1.AddressTypeIPv4, slicePorts("web:8080", "sig:3868/SCTP"), testEndpoint(addrs("10.0.0.1")))
	svcs, slices := []*v1.Service{mixed, sctp}, []*discoveryv1.EndpointSlice{eps}
	userspace := BuildOptions{Unserved: []Unserved{{Protocol: SCTP, Reason: "no SCTP proxy"}}}

	for _, b := range []struct {
		name  string
		build func() *Snapshot
	}{
		{"Build", func() *Snapshot { return Build(svcs, slices, userspace) }},
		{"Builder, twice", func() *Snapshot {
			b := NewBuilder(userspace)
			b.Build(svcs, slices)
			return b.Build(svcs, slices)
		}},
	} {
		t.Run(b.name, func(t *testing.T) {
			snap := b.build()
			var names []string
			for _, p := range snap.Ports {
				names = append(names, p.Name.String())
			}
			if got, want := strings.Join(names, " "), "ns/mixed:web"; got != want {
				t.Errorf("ports: got %q, want %q", got, want)
			}
			want := []string{
				`Service ns/mixed: spec.ports[1]: SCTP port 3868 (ns/mixed:sig) is not served: no SCTP proxy`,
				`Service ns/sctp: spec.ports[0]: SCTP port 9999 (ns/sctp) is not served: no SCTP proxy`,
			}
			if len(snap.Errors) != len(want) {
				t.Fatalf("errors: got %v, want %q", snap.Errors, want)
			}
			for i, err := range snap.Errors {
				var ue *UnservedError
				if !errors.As(err, &ue) || err.Error() != want[i] {
					t.Errorf("error %d: got %v (%T), want an UnservedError %q", i, err, err, want[i])
					continue
				}
				if ue.Port.Protocol != SCTP || len(ue.Port.ClusterIPs) != 1 {
					t.Errorf("error %d: got port %+v, want the SCTP port with its cluster IP", i, ue.Port)
				}
			}
		})
	}

	b := NewBuilder(userspace)
	b.Build(svcs, slices)
	b.SetOptions(BuildOptions{})
	if snap := b.Build(svcs, slices); len(snap.Ports) != 3 || len(snap.Errors) != 0 {
		t.Errorf("without Unserved: got %d ports and errors %v, want 3 ports and none", len(snap.Ports), snap.Errors)
	}
}

// A Service without a cluster IP (the API server would have given it one; a
// hand-written manifest often leaves it out) is served, and warned of; a
// headless one is skipped without a word.
func TestBuildWarnsOfNoClusterIP(t *testing.T) {
	t.Parallel()
	bare := testService("ns", "bare", withSpec(func(s *v1.ServiceSpec) { s.ClusterIP = "" }))
	headless := testService("ns", "headless", withSpec(func(s *v1.ServiceSpec) { s.ClusterIP = v1.ClusterIPNone }))
	snap := Build([]*v1.Service{bare, headless, testService("ns", "web")}, nil, BuildOptions{})
	if len(snap.Ports) != 2 || snap.Ports[0].Name.Name != "bare" || len(snap.Ports[0].ClusterIPs) != 0 {
		t.Errorf("ports: got %s, want ns/bare without cluster IPs, then ns/web", dump(snap.Ports))
	}
	want := "Service ns/bare: spec.clusterIP: not set, so no cluster IP reaches the Service"
	if len(snap.Errors) != 1 || !strings.HasPrefix(snap.Errors[0].Error(), want) {
		t.Errorf("errors: got %v, want one starting %q", snap.Errors, want)
	}
}

// A NodePort or LoadBalancer Service port without a nodePort (the API server
// would have allocated one; a manifest has no allocator) is served, on its
// other addresses, and warned of; a LoadBalancer Service that asks for no
// NodePorts, and a port that has one, are not.
func TestBuildWarnsOfNoNodePort(t *testing.T) {
	t.Parallel()
	twoPorts := withPorts(v1.ServicePort{Name: "a", Port: 80}, v1.ServicePort{Name: "b", Port: 81, NodePort: 30081})
	np := testService("ns", "np", twoPorts, withSpec(func(s *v1.ServiceSpec) { s.Type = v1.ServiceTypeNodePort }))
	lb := testService("ns", "lb", withSpec(func(s *v1.ServiceSpec) { s.ClusterIP = "10.96.0.11"; s.Type = v1.ServiceTypeLoadBalancer }))
	lbWithout := testService("ns", "lb-without", withSpec(func(s *v1.ServiceSpec) {
		s.ClusterIP = "10.96.0.12"
		s.Type = v1.ServiceTypeLoadBalancer
		s.AllocateLoadBalancerNodePorts = ptr(false)
	}))
	np.Spec.ClusterIP = "10.96.0.13"
	snap := Build([]*v1.Service{np, lb, lbWithout}, nil, BuildOptions{})
	if got, want := len(snap.Ports), 4; got != want {
		t.Errorf("got %d ports %s, want %d: every port served", got, dump(snap.Ports), want)
	}
	var errs []string
	for _, err := range snap.Errors {
		errs = append(errs, err.Error())
	}
	want := []string{
		"Service ns/lb: spec.ports[0].nodePort: not set: manifests are not allocated NodePorts (the API server would have allocated one), " +
			"so this port of the LoadBalancer Service is reached on no NodePort; set it to a port of the cluster's NodePort range",
		"Service ns/np: spec.ports[0].nodePort: not set: manifests are not allocated NodePorts (the API server would have allocated one), " +
			"so this port of the NodePort Service is reached on no NodePort; set it to a port of the cluster's NodePort range",
	}
	if !slices.Equal(errs, want) {
		t.Errorf("errors:\ngot  %q\nwant %q", errs, want)
	}
}

// A load balancer ingress IP that is the node's own or no one host's (the API
// server takes any) is left out and reported; the Service is served on its
// other addresses, a good ingress IP among them.
func TestBuildLeavesOutSpecialIngressIPs(t *testing.T) {
	t.Parallel()
	lb := testService("ns", "lb", withSpec(func(s *v1.ServiceSpec) {
		s.ClusterIP = "10.96.0.11"
		s.Type = v1.ServiceTypeLoadBalancer
		s.AllocateLoadBalancerNodePorts = ptr(false)
	}))
	for _, a := range []string{"127.0.0.1", "192.0.2.5", "169.254.169.254", "0.0.0.0", "224.0.0.1", "255.255.255.255", "::ffff:127.0.0.1"} {
		lb.Status.LoadBalancer.Ingress = append(lb.Status.LoadBalancer.Ingress, v1.LoadBalancerIngress{IP: a})
	}
	snap := Build([]*v1.Service{lb}, nil, BuildOptions{})
	if len(snap.Ports) != 1 {
		t.Fatalf("got ports %s, want the Service's one port served", dump(snap.Ports))
	}
	if got, want := snap.Ports[0].LoadBalancerIPs, []netip.Addr{netip.MustParseAddr("192.0.2.5")}; !slices.Equal(got, want) {
		t.Errorf("got load balancer IPs %v, want %v", got, want)
	}
	var errs []string
	for _, err := range snap.Errors {
		errs = append(errs, err.Error())
	}
	const left = ": left out, the Service is served on its other addresses"
	want := []string{
		"Service ns/lb: status.loadBalancer.ingress[0].ip: 127.0.0.1 is a loopback address" + left,
		"Service ns/lb: status.loadBalancer.ingress[2].ip: 169.254.169.254 is a link-local address" + left,
		"Service ns/lb: status.loadBalancer.ingress[3].ip: 0.0.0.0 is an unspecified address" + left,
		"Service ns/lb: status.loadBalancer.ingress[4].ip: 224.0.0.1 is a multicast address" + left,
		"Service ns/lb: status.loadBalancer.ingress[5].ip: 255.255.255.255 is the broadcast address" + left,
		"Service ns/lb: status.loadBalancer.ingress[6].ip: ::ffff:127.0.0.1 is a loopback address" + left,
	}
	if !slices.Equal(errs, want) {
		t.Errorf("errors:\ngot  %q\nwant %q", errs, want)
	}
}
