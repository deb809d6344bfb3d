package service

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Builders for test objects: a valid single-port ClusterIP Service and a valid IPv4
// slice, each changed by options to what a case needs.

func testService(ns, name string, opts ...func(*v1.Service)) *v1.Service {
	s := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: v1.ServiceSpec{
			ClusterIP: "10.96.0.10",
			Ports:     []v1.ServicePort{{Port: 80}},
		},
	}
	for _, o := range opts {
		o(s)
	}
	return s
}

func withPorts(ports ...v1.ServicePort) func(*v1.Service) {
	return func(s *v1.Service) { s.Spec.Ports = ports }
}

func withSpec(f func(*v1.ServiceSpec)) func(*v1.Service) {
	return func(s *v1.Service) { f(&s.Spec) }
}

func testSlice(ns, name, svc string, at discoveryv1.AddressType, ports []discoveryv1.EndpointPort, eps ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
	return &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: ns,
			Name:      name,
			Labels:    map[string]string{discoveryv1.LabelServiceName: svc},
		},
		AddressType: at,
		Ports:       ports,
		Endpoints:   eps,
	}
}

func slicePorts(spec ...string) []discoveryv1.EndpointPort {
	// spec entries are "name:port/proto"; name and proto may be empty.
	var out []discoveryv1.EndpointPort
	for _, s := range spec {
		var p discoveryv1.EndpointPort
		name, rest, _ := strings.Cut(s, ":")
		num, proto, _ := strings.Cut(rest, "/")
		if name != "" {
			p.Name = ptr(name)
		}
		var n int32
		fmt.Sscan(num, &n)
		p.Port = ptr(n)
		if proto != "" {
			p.Protocol = ptr(v1.Protocol(proto))
		}
		out = append(out, p)
	}
	return out
}

func testEndpoint(opts ...func(*discoveryv1.Endpoint)) discoveryv1.Endpoint {
	var e discoveryv1.Endpoint
	for _, o := range opts {
		o(&e)
	}
	return e
}

func addrs(a ...string) func(*discoveryv1.Endpoint) {
	return func(e *discoveryv1.Endpoint) { e.Addresses = a }
}

func conditions(ready, serving, terminating *bool) func(*discoveryv1.Endpoint) {
	return func(e *discoveryv1.Endpoint) {
		e.Conditions = discoveryv1.EndpointConditions{Ready: ready, Serving: serving, Terminating: terminating}
	}
}

func onNode(node, zone string) func(*discoveryv1.Endpoint) {
	return func(e *discoveryv1.Endpoint) { e.NodeName, e.Zone = &node, &zone }
}

func ptr[T any](v T) *T { return &v }

func ap(s string) netip.AddrPort { return netip.MustParseAddrPort(s) }
func ip(s string) netip.Addr     { return netip.MustParseAddr(s) }

// readyEP is the Endpoint an address with unknown conditions converts to.
func readyEP(addr string) Endpoint {
	return Endpoint{Addr: ap(addr), Ready: true, Serving: true}
}

func TestBuildConversion(t *testing.T) {
	t0 := time.Date(2024, 5, 1, 10, 0, 0, 0, time.UTC)
	web := PortName{Namespace: "default", Name: "web"}
	tests := []struct {
		name   string
		svcs   []*v1.Service
		slices []*discoveryv1.EndpointSlice
		opts   BuildOptions
		want   []*Port
	}{
		{
			name:   "single port with defaults",
			svcs:   []*v1.Service{testService("default", "web")},
			slices: []*discoveryv1.EndpointSlice{testSlice("default", "web-1", "web", discoveryv1.AddressTypeIPv4, slicePorts(":8080"), testEndpoint(addrs("10.0.0.1")))},
			want: []*Port{{
				Name: web, Protocol: TCP, Port: 80,
				ClusterIPs: []netip.Addr{ip("10.96.0.10")},
				Endpoints:  []Endpoint{readyEP("10.0.0.1:8080")},
			}},
		},
		{
			name: "multi-port matched by name and protocol, sorted by port name",
			svcs: []*v1.Service{testService("default", "dns", withPorts(
				v1.ServicePort{Name: "dns", Port: 53, Protocol: v1.ProtocolUDP},
				v1.ServicePort{Name: "dns-tcp", Port: 53, Protocol: v1.ProtocolTCP},
				v1.ServicePort{Name: "metrics", Port: 9153},
			))},
			slices: []*discoveryv1.EndpointSlice{testSlice("default", "dns-1", "dns", discoveryv1.AddressTypeIPv4,
				// "metrics" on UDP does not serve the TCP metrics port.
				slicePorts("dns:5353/UDP", "dns-tcp:5353/TCP", "metrics:9153/UDP"),
				testEndpoint(addrs("10.0.0.1")))},
			want: []*Port{
				{Name: PortName{"default", "dns", "dns"}, Protocol: UDP, Port: 53, ClusterIPs: []netip.Addr{ip("10.96.0.10")}, Endpoints: []Endpoint{readyEP("10.0.0.1:5353")}},
				{Name: PortName{"default", "dns", "dns-tcp"}, Protocol: TCP, Port: 53, ClusterIPs: []netip.Addr{ip("10.96.0.10")}, Endpoints: []Endpoint{readyEP("10.0.0.1:5353")}},
				{Name: PortName{"default", "dns", "metrics"}, Protocol: TCP, Port: 9153, ClusterIPs: []netip.Addr{ip("10.96.0.10")}},
			},
		},
		{
			name: "several slices merged, duplicate address keeps the ready one, an endpoint is its first address",
			svcs: []*v1.Service{testService("default", "web")},
			slices: []*discoveryv1.EndpointSlice{
				testSlice("default", "web-b", "web", discoveryv1.AddressTypeIPv4, slicePorts(":8080"),
					testEndpoint(addrs("10.0.0.3")), testEndpoint(addrs("10.0.0.2"))),
				testSlice("default", "web-a", "web", discoveryv1.AddressTypeIPv4, slicePorts(":8080"),
					testEndpoint(addrs("10.0.0.2"), conditions(ptr(false), ptr(false), ptr(true))),
					testEndpoint(addrs("10.0.0.1", "10.0.0.4"))),
				// Another Service's slice and one in another namespace are not joined.
				testSlice("default", "api-1", "api", discoveryv1.AddressTypeIPv4, slicePorts(":8080"), testEndpoint(addrs("10.0.1.1"))),
				testSlice("other", "web-1", "web", discoveryv1.AddressTypeIPv4, slicePorts(":8080"), testEndpoint(addrs("10.0.2.1"))),
			},
			want: []*Port{{
				Name: web, Protocol: TCP, Port: 80,
				ClusterIPs: []netip.Addr{ip("10.96.0.10")},
				Endpoints: []Endpoint{
					// 10.0.0.4, a second address of 10.0.0.1's endpoint, is none.
					readyEP("10.0.0.1:8080"), readyEP("10.0.0.2:8080"), readyEP("10.0.0.3:8080"),
				},
			}},
		},
		{
			name: "conditions: unknown ready is ready, unknown serving follows ready, unknown terminating is false",
			svcs: []*v1.Service{testService("default", "web")},
			slices: []*discoveryv1.EndpointSlice{testSlice("default", "web-1", "web", discoveryv1.AddressTypeIPv4, slicePorts(":8080"),
				testEndpoint(addrs("10.0.0.1"), conditions(nil, nil, nil)),
				testEndpoint(addrs("10.0.0.2"), conditions(ptr(false), nil, nil)),
				testEndpoint(addrs("10.0.0.3"), conditions(ptr(false), ptr(true), ptr(true))),
				testEndpoint(addrs("10.0.0.4"), conditions(ptr(true), ptr(false), ptr(false))),
			)},
			want: []*Port{{
				Name: web, Protocol: TCP, Port: 80, ClusterIPs: []netip.Addr{ip("10.96.0.10")},
				Endpoints: []Endpoint{
					{Addr: ap("10.0.0.1:8080"), Ready: true, Serving: true},
					{Addr: ap("10.0.0.2:8080")},
					{Addr: ap("10.0.0.3:8080"), Serving: true, Terminating: true},
					{Addr: ap("10.0.0.4:8080"), Ready: true},
				},
			}},
		},
		{
			name: "FQDN slices, slice ports without number and unmatched names are ignored",
			svcs: []*v1.Service{testService("default", "web")},
			slices: []*discoveryv1.EndpointSlice{
				testSlice("default", "web-fqdn", "web", discoveryv1.AddressTypeFQDN, slicePorts(":8080"), testEndpoint(addrs("backend.example"))),
				testSlice("default", "web-all", "web", discoveryv1.AddressTypeIPv4, []discoveryv1.EndpointPort{{}}, testEndpoint(addrs("10.0.0.1"))),
				testSlice("default", "web-other", "web", discoveryv1.AddressTypeIPv4, slicePorts("http:8080"), testEndpoint(addrs("10.0.0.2"))),
			},
			want: []*Port{{Name: web, Protocol: TCP, Port: 80, ClusterIPs: []netip.Addr{ip("10.96.0.10")}}},
		},
		{
			name: "headless and ExternalName skipped",
			svcs: []*v1.Service{
				testService("default", "headless", withSpec(func(s *v1.ServiceSpec) { s.ClusterIP = "None" })),
				testService("default", "headless2", withSpec(func(s *v1.ServiceSpec) { s.ClusterIP, s.ClusterIPs = "", []string{"None"} })),
				testService("default", "alias", withSpec(func(s *v1.ServiceSpec) {
					s.Type, s.ClusterIP, s.ExternalName, s.Ports = v1.ServiceTypeExternalName, "", "db.example", nil
				})),
				testService("default", "web"),
			},
			want: []*Port{{Name: web, Protocol: TCP, Port: 80, ClusterIPs: []netip.Addr{ip("10.96.0.10")}}},
		},
		{
			name: "external addresses, node ports and traffic policies",
			svcs: []*v1.Service{testService("default", "web", func(s *v1.Service) {
				s.Spec.Type = v1.ServiceTypeLoadBalancer
				s.Spec.Ports[0].NodePort = 30080
				s.Spec.ExternalIPs = []string{"192.0.2.1", "2001:db8::1"}
				s.Spec.LoadBalancerSourceRanges = []string{"198.51.100.7/24", " 2001:db8:1::/48 "}
				s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
				s.Spec.InternalTrafficPolicy = ptr(v1.ServiceInternalTrafficPolicyLocal)
				s.Spec.HealthCheckNodePort = 32000
				s.Spec.TrafficDistribution = ptr(v1.ServiceTrafficDistributionPreferSameZone)
				s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: "203.0.113.5"}, {Hostname: "lb.example"}}
			})},
			want: []*Port{{
				Name: web, Protocol: TCP, Port: 80, NodePort: 30080, HealthCheckNodePort: 32000,
				ClusterIPs:               []netip.Addr{ip("10.96.0.10")},
				ExternalIPs:              []netip.Addr{ip("192.0.2.1"), ip("2001:db8::1")},
				LoadBalancerIPs:          []netip.Addr{ip("203.0.113.5")},
				LoadBalancerSourceRanges: []netip.Prefix{netip.MustParsePrefix("198.51.100.0/24"), netip.MustParsePrefix("2001:db8:1::/48")},
				ExternalPolicyLocal:      true,
				InternalPolicyLocal:      true,
				TrafficDistribution:      "PreferSameZone",
			}},
		},
		{
			name: "ClientIP affinity with default and explicit timeout",
			svcs: []*v1.Service{
				testService("default", "a", withSpec(func(s *v1.ServiceSpec) { s.SessionAffinity = v1.ServiceAffinityClientIP })),
				testService("default", "b", withSpec(func(s *v1.ServiceSpec) {
					s.ClusterIP = "10.96.0.11"
					s.SessionAffinity = v1.ServiceAffinityClientIP
					s.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr(int32(60))}}
				})),
				testService("default", "c", withSpec(func(s *v1.ServiceSpec) {
					s.ClusterIP = "10.96.0.12"
					s.SessionAffinity = v1.ServiceAffinityNone
				})),
			},
			want: []*Port{
				{Name: PortName{"default", "a", ""}, Protocol: TCP, Port: 80, ClusterIPs: []netip.Addr{ip("10.96.0.10")}, AffinityClientIP: true, AffinityTimeout: 3 * time.Hour},
				{Name: PortName{"default", "b", ""}, Protocol: TCP, Port: 80, ClusterIPs: []netip.Addr{ip("10.96.0.11")}, AffinityClientIP: true, AffinityTimeout: time.Minute},
				{Name: PortName{"default", "c", ""}, Protocol: TCP, Port: 80, ClusterIPs: []netip.Addr{ip("10.96.0.12")}},
			},
		},
		{
			name: "dual-stack: both cluster IPs, IPv4 and IPv6 slices merged in address order",
			svcs: []*v1.Service{testService("default", "web", withSpec(func(s *v1.ServiceSpec) {
				s.ClusterIPs = []string{"10.96.0.10", "fd00:96::10"}
				s.IPFamilies = []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol}
			}))},
			slices: []*discoveryv1.EndpointSlice{
				testSlice("default", "web-v6", "web", discoveryv1.AddressTypeIPv6, slicePorts(":8080"), testEndpoint(addrs("fd00::2")), testEndpoint(addrs("fd00::1"))),
				testSlice("default", "web-v4", "web", discoveryv1.AddressTypeIPv4, slicePorts(":8080"), testEndpoint(addrs("10.0.0.1"))),
			},
			want: []*Port{{
				Name: web, Protocol: TCP, Port: 80,
				ClusterIPs: []netip.Addr{ip("10.96.0.10"), ip("fd00:96::10")},
				Endpoints:  []Endpoint{readyEP("10.0.0.1:8080"), readyEP("[fd00::1]:8080"), readyEP("[fd00::2]:8080")},
			}},
		},
		{
			name: "node, zone, hints and Local",
			svcs: []*v1.Service{testService("default", "web")},
			slices: []*discoveryv1.EndpointSlice{testSlice("default", "web-1", "web", discoveryv1.AddressTypeIPv4, slicePorts(":8080"),
				testEndpoint(addrs("10.0.0.1"), onNode("node-a", "zone-a"), func(e *discoveryv1.Endpoint) {
					e.Hints = &discoveryv1.EndpointHints{
						ForZones: []discoveryv1.ForZone{{Name: "zone-a"}, {Name: "zone-b"}},
						ForNodes: []discoveryv1.ForNode{{Name: "node-a"}},
					}
				}),
				testEndpoint(addrs("10.0.0.2"), onNode("node-b", "zone-b")),
			)},
			opts: BuildOptions{NodeName: "node-a"},
			want: []*Port{{
				Name: web, Protocol: TCP, Port: 80, ClusterIPs: []netip.Addr{ip("10.96.0.10")},
				Endpoints: []Endpoint{
					{Addr: ap("10.0.0.1:8080"), Ready: true, Serving: true, NodeName: "node-a", Zone: "zone-a",
						ZoneHints: []string{"zone-a", "zone-b"}, NodeHints: []string{"node-a"}, ForThisNode: true, Local: true},
					{Addr: ap("10.0.0.2:8080"), Ready: true, Serving: true, NodeName: "node-b", Zone: "zone-b"},
				},
			}},
		},
		{
			name: "newest valid last-change-trigger-time of the Service's slices",
			svcs: []*v1.Service{testService("default", "web")},
			slices: func() []*discoveryv1.EndpointSlice {
				a := testSlice("default", "web-a", "web", discoveryv1.AddressTypeIPv4, nil)
				a.Annotations = map[string]string{v1.EndpointsLastChangeTriggerTime: t0.Format(time.RFC3339Nano)}
				b := testSlice("default", "web-b", "web", discoveryv1.AddressTypeIPv4, nil)
				b.Annotations = map[string]string{v1.EndpointsLastChangeTriggerTime: t0.Add(1500 * time.Millisecond).Format(time.RFC3339Nano)}
				c := testSlice("default", "web-c", "web", discoveryv1.AddressTypeIPv4, nil)
				c.Annotations = map[string]string{v1.EndpointsLastChangeTriggerTime: "yesterday"}
				return []*discoveryv1.EndpointSlice{a, b, c}
			}(),
			want: []*Port{{
				Name: web, Protocol: TCP, Port: 80, ClusterIPs: []netip.Addr{ip("10.96.0.10")},
				LastChangeTriggerTime: t0.Add(1500 * time.Millisecond),
			}},
		},
		{
			name:   "nil objects ignored",
			svcs:   []*v1.Service{nil, testService("default", "web")},
			slices: []*discoveryv1.EndpointSlice{nil},
			want:   []*Port{{Name: web, Protocol: TCP, Port: 80, ClusterIPs: []netip.Addr{ip("10.96.0.10")}}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			snap := Build(tt.svcs, tt.slices, tt.opts)
			if len(snap.Errors) > 0 {
				t.Fatalf("got errors %v, want none", snap.Errors)
			}
			if !reflect.DeepEqual(snap.Ports, tt.want) {
				t.Errorf("got ports\n%s\nwant\n%s", dump(snap.Ports), dump(tt.want))
			}
			for _, p := range tt.want {
				if got := snap.Lookup(p.Name); got == nil {
					t.Errorf("Lookup(%s): got nil, want the port", p.Name)
				}
			}
		})
	}
}

func dump(v any) string {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return fmt.Sprintf("%+v", v)
	}
	return string(b)
}

func TestBuildUsableEndpoints(t *testing.T) {
	t.Parallel()
	ready, notReady := ptr(true), ptr(false)
	tests := []struct {
		name string
		eps  []discoveryv1.Endpoint
		want []string
	}{
		{
			name: "ready ones only when any is ready",
			eps: []discoveryv1.Endpoint{
				testEndpoint(addrs("10.0.0.1"), conditions(ready, ready, notReady)),
				testEndpoint(addrs("10.0.0.2"), conditions(notReady, ready, ready)),
				testEndpoint(addrs("10.0.0.3"), conditions(notReady, notReady, notReady)),
			},
			want: []string{"10.0.0.1:8080"},
		},
		{
			name: "all terminating: serving terminating ones carry traffic",
			eps: []discoveryv1.Endpoint{
				testEndpoint(addrs("10.0.0.1"), conditions(notReady, ready, ready)),
				testEndpoint(addrs("10.0.0.2"), conditions(notReady, notReady, ready)),
				testEndpoint(addrs("10.0.0.3"), conditions(notReady, ready, ready)),
			},
			want: []string{"10.0.0.1:8080", "10.0.0.3:8080"},
		},
		{
			name: "none serving: no endpoint",
			eps: []discoveryv1.Endpoint{
				testEndpoint(addrs("10.0.0.1"), conditions(notReady, notReady, ready)),
				testEndpoint(addrs("10.0.0.2"), conditions(notReady, nil, nil)),
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			snap := Build([]*v1.Service{testService("default", "web")},
				[]*discoveryv1.EndpointSlice{testSlice("default", "web-1", "web", discoveryv1.AddressTypeIPv4, slicePorts(":8080"), tt.eps...)},
				BuildOptions{})
			p := snap.Lookup(PortName{Namespace: "default", Name: "web"})
			if p == nil {
				t.Fatalf("got no port default/web, errors %v", snap.Errors)
			}
			var got []string
			for _, e := range p.ClusterEndpoints("") {
				got = append(got, e.Addr.String())
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got cluster endpoints %v, want %v", got, tt.want)
			}
		})
	}
}

func TestBuildLeavesInvalidObjectsOut(t *testing.T) {
	t.Parallel()
	svcs := []*v1.Service{
		testService("default", "web"),
		testService("default", "bad", withPorts(v1.ServicePort{Port: 70000})),
		testService("default", "web", withPorts(v1.ServicePort{Port: 81})), // repeated: first wins
	}
	slices := []*discoveryv1.EndpointSlice{
		testSlice("default", "web-1", "web", discoveryv1.AddressTypeIPv4, slicePorts(":8080"), testEndpoint(addrs("10.0.0.1"))),
		testSlice("default", "web-2", "web", discoveryv1.AddressTypeIPv4, slicePorts(":8080"), testEndpoint(addrs("fd00::1"))),
		testSlice("default", "web-1", "web", discoveryv1.AddressTypeIPv4, slicePorts(":8080"), testEndpoint(addrs("10.0.0.9"))),
	}
	snap := Build(svcs, slices, BuildOptions{})

	var gotErrs []string
	for _, err := range snap.Errors {
		gotErrs = append(gotErrs, err.Error())
	}
	wantErrs := []string{
		"EndpointSlice default/web-1: metadata.name: defined more than once; the first definition is used",
		"EndpointSlice default/web-2: endpoints[0].addresses[0]: fd00::1 is not an IPv4 address (addressType IPv4)",
		"Service default/bad: spec.ports[0].port: 70000 is out of range 1-65535",
		"Service default/web: metadata.name: defined more than once; the first definition is used",
	}
	if !reflect.DeepEqual(gotErrs, wantErrs) {
		t.Errorf("got errors\n%s\nwant\n%s", strings.Join(gotErrs, "\n"), strings.Join(wantErrs, "\n"))
	}
	want := []*Port{{
		Name: PortName{Namespace: "default", Name: "web"}, Protocol: TCP, Port: 80,
		ClusterIPs: []netip.Addr{ip("10.96.0.10")},
		Endpoints:  []Endpoint{readyEP("10.0.0.1:8080")},
	}}
	if !reflect.DeepEqual(snap.Ports, want) {
		t.Errorf("got ports\n%s\nwant\n%s", dump(snap.Ports), dump(want))
	}
}

func TestBuildDoesNotModifyInputs(t *testing.T) {
	t.Parallel()
	svcs := []*v1.Service{
		testService("default", "web", withSpec(func(s *v1.ServiceSpec) {
			s.LoadBalancerSourceRanges = []string{" 10.1.2.3/8"}
			s.SessionAffinity = v1.ServiceAffinityClientIP
		})),
		testService("default", "b"),
	}
	slices := []*discoveryv1.EndpointSlice{
		testSlice("default", "web-z", "web", discoveryv1.AddressTypeIPv4, slicePorts(":1"), testEndpoint(addrs("10.0.0.2"))),
		testSlice("default", "web-a", "web", discoveryv1.AddressTypeIPv4, slicePorts(":1"), testEndpoint(addrs("10.0.0.1"))),
	}
	var before []any
	for _, s := range svcs {
		before = append(before, s.DeepCopy())
	}
	for _, s := range slices {
		before = append(before, s.DeepCopy())
	}
	Build(svcs, slices, BuildOptions{NodeName: "n"})
	var after []any
	for _, s := range svcs {
		after = append(after, s)
	}
	for _, s := range slices {
		after = append(after, s)
	}
	if !reflect.DeepEqual(before, after) {
		t.Errorf("got inputs changed by Build:\n%s\nwant\n%s", dump(after), dump(before))
	}
	if slices[0].Name != "web-z" {
		t.Errorf("got slice order changed (first %s), want web-z first", slices[0].Name)
	}
}

func BenchmarkBuild(b *testing.B) {
	// 1000 two-port Services with 3 slices of 20 endpoints each: a large cluster's
	// worth of objects for one node's proxy.
	var svcs []*v1.Service
	var slices []*discoveryv1.EndpointSlice
	for i := range 1000 {
		name := fmt.Sprintf("svc-%d", i)
		svcs = append(svcs, testService("default", name, withSpec(func(s *v1.ServiceSpec) {
			s.ClusterIP = fmt.Sprintf("10.96.%d.%d", i/256, i%256)
		}), withPorts(v1.ServicePort{Name: "http", Port: 80}, v1.ServicePort{Name: "https", Port: 443})))
		for j := range 3 {
			var eps []discoveryv1.Endpoint
			for k := range 20 {
				eps = append(eps, testEndpoint(addrs(fmt.Sprintf("10.%d.%d.%d", j, i/256, (i+k)%256)), onNode(fmt.Sprintf("node-%d", k), "z")))
			}
			slices = append(slices, testSlice("default", fmt.Sprintf("%s-%d", name, j), name, discoveryv1.AddressTypeIPv4,
				slicePorts("http:8080", "https:8443"), eps...))
		}
	}
	b.ReportAllocs()
	for b.Loop() {
		Build(svcs, slices, BuildOptions{NodeName: "node-1"})
	}
}

// TestBuilderMatchesBuild: whatever a Builder built before, its Snapshot equals
// Build's for the same objects, Ports and Errors alike.
func TestBuilderMatchesBuild(t *testing.T) {
	t.Parallel()
	web := testService("ns", "web", withPorts(v1.ServicePort{Name: "a", Port: 80}, v1.ServicePort{Name: "b", Port: 81}))
	web2 := web.DeepCopy()
	web2.Spec.ClusterIP = "10.96.0.11"
	db := testService("ns", "db", withSpec(func(s *v1.ServiceSpec) { s.ClusterIP = "10.96.0.20" }))
	dbBad := db.DeepCopy()
	dbBad.Spec.Ports[0].Port = 0
	dbDup := testService("ns", "db", withSpec(func(s *v1.ServiceSpec) { s.ClusterIP = "10.96.0.12" }))
	headless := testService("ns", "headless", withSpec(func(s *v1.ServiceSpec) { s.ClusterIP = v1.ClusterIPNone }))
	ports := slicePorts("a:8080", "b:8081", ":5432")
	webZ := testSlice("ns", "web-z", "web", discoveryv1.AddressTypeIPv4, ports, testEndpoint(addrs("10.0.0.1")))
	webA := testSlice("ns", "web-a", "web", discoveryv1.AddressTypeIPv4, ports, testEndpoint(addrs("10.0.0.2")))
	webA2 := testSlice("ns", "web-a", "web", discoveryv1.AddressTypeIPv4, ports, testEndpoint(addrs("10.0.0.3")))
	webABad := testSlice("ns", "web-a", "web", discoveryv1.AddressTypeIPv4, ports, testEndpoint(addrs("not-an-ip")))
	dbS := testSlice("ns", "db-1", "db", discoveryv1.AddressTypeIPv4, ports, testEndpoint(addrs("10.0.1.1")))

	type state struct {
		svcs   []*v1.Service
		slices []*discoveryv1.EndpointSlice
	}
	steps := []struct {
		name string
		state
	}{
		{"first", state{[]*v1.Service{web, db, headless}, []*discoveryv1.EndpointSlice{webZ, webA, dbS}}},
		{"same objects", state{[]*v1.Service{web, db, headless}, []*discoveryv1.EndpointSlice{webZ, webA, dbS}}},
		{"other order", state{[]*v1.Service{headless, db, web}, []*discoveryv1.EndpointSlice{dbS, webA, webZ}}},
		{"new slice version", state{[]*v1.Service{web, db}, []*discoveryv1.EndpointSlice{webZ, webA2, dbS}}},
		{"invalid slice", state{[]*v1.Service{web, db}, []*discoveryv1.EndpointSlice{webZ, webABad, dbS}}},
		{"slice removed", state{[]*v1.Service{web, db}, []*discoveryv1.EndpointSlice{webZ, dbS}}},
		{"new service version", state{[]*v1.Service{web2, db}, []*discoveryv1.EndpointSlice{webZ, webA2, dbS}}},
		{"invalid service", state{[]*v1.Service{web2, dbBad}, []*discoveryv1.EndpointSlice{webZ, webA2, dbS}}},
		{"duplicate service", state{[]*v1.Service{dbDup, web2, db}, []*discoveryv1.EndpointSlice{webZ, webA2, dbS}}},
		{"duplicate slice", state{[]*v1.Service{db, web2}, []*discoveryv1.EndpointSlice{webA2, webZ, dbS, webA}}},
		{"nil entries", state{[]*v1.Service{nil, db}, []*discoveryv1.EndpointSlice{nil, dbS}}},
		{"empty", state{}},
		{"back", state{[]*v1.Service{web, db, headless}, []*discoveryv1.EndpointSlice{webZ, webA, dbS}}},
	}
	b := NewBuilder(BuildOptions{NodeName: "node-1"})
	for _, st := range steps {
		t.Run(st.name, func(t *testing.T) {
			got := b.Build(st.svcs, st.slices)
			want := Build(st.svcs, st.slices, BuildOptions{NodeName: "node-1"})
			if !reflect.DeepEqual(got.Ports, want.Ports) {
				t.Errorf("got ports %s, want %s", dump(got.Ports), dump(want.Ports))
			}
			if g, w := fmt.Sprint(got.Errors), fmt.Sprint(want.Errors); g != w {
				t.Errorf("got errors %s, want %s", g, w)
			}
		})
	}
}

// TestBuilderReusesUnchangedPorts: a Service whose object and slices are the same
// objects keeps its Port pointers; any changed object gives its Service new Ports.
func TestBuilderReusesUnchangedPorts(t *testing.T) {
	t.Parallel()
	web := testService("ns", "web")
	db := testService("ns", "db", withSpec(func(s *v1.ServiceSpec) { s.ClusterIP = "10.96.0.20" }))
	webS := testSlice("ns", "web-1", "web", discoveryv1.AddressTypeIPv4, slicePorts(":8080"), testEndpoint(addrs("10.0.0.1")))
	dbS := testSlice("ns", "db-1", "db", discoveryv1.AddressTypeIPv4, slicePorts(":5432"), testEndpoint(addrs("10.0.1.1")))
	dbS2 := testSlice("ns", "db-1", "db", discoveryv1.AddressTypeIPv4, slicePorts(":5432"), testEndpoint(addrs("10.0.1.2")))
	web2 := web.DeepCopy()

	tests := []struct {
		name            string
		svcs            []*v1.Service
		slices          []*discoveryv1.EndpointSlice
		sameWeb, sameDB bool
	}{
		{"nothing changed", []*v1.Service{web, db}, []*discoveryv1.EndpointSlice{webS, dbS}, true, true},
		{"db slice replaced", []*v1.Service{web, db}, []*discoveryv1.EndpointSlice{webS, dbS2}, true, false},
		{"web object replaced by an equal copy", []*v1.Service{web2, db}, []*discoveryv1.EndpointSlice{webS, dbS}, false, true},
		{"web slice removed", []*v1.Service{web, db}, []*discoveryv1.EndpointSlice{dbS}, false, true},
	}
	webName, dbName := PortName{Namespace: "ns", Name: "web"}, PortName{Namespace: "ns", Name: "db"}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := NewBuilder(BuildOptions{})
			first := b.Build([]*v1.Service{web, db}, []*discoveryv1.EndpointSlice{webS, dbS})
			second := b.Build(tt.svcs, tt.slices)
			for _, c := range []struct {
				name PortName
				same bool
			}{{webName, tt.sameWeb}, {dbName, tt.sameDB}} {
				p1, p2 := first.Lookup(c.name), second.Lookup(c.name)
				if p1 == nil || p2 == nil {
					t.Fatalf("%s: got ports %v and %v, want both", c.name, p1, p2)
				}
				if got := p1 == p2; got != c.same {
					t.Errorf("%s: got same Port pointer %v, want %v", c.name, got, c.same)
				}
			}
		})
	}
}

// TestBuilderSetOptions: new facts about the node rebuild every Port (new
// pointers, Local and node hints judged again) and reach the Snapshot's Zone;
// the same facts again change nothing.
func TestBuilderSetOptions(t *testing.T) {
	t.Parallel()
	web := testService("ns", "web")
	webS := testSlice("ns", "web-1", "web", discoveryv1.AddressTypeIPv4, slicePorts(":8080"),
		testEndpoint(addrs("10.0.0.1"), onNode("node-a", "zone-a"), func(e *discoveryv1.Endpoint) {
			e.Hints = &discoveryv1.EndpointHints{ForNodes: []discoveryv1.ForNode{{Name: "node-a"}}}
		}))
	name := PortName{Namespace: "ns", Name: "web"}
	b := NewBuilder(BuildOptions{NodeName: "node-a", Zone: "zone-a"})
	first := b.Build([]*v1.Service{web}, []*discoveryv1.EndpointSlice{webS})
	if first.Zone != "zone-a" {
		t.Errorf("first Zone: got %q, want zone-a", first.Zone)
	}
	b.SetOptions(BuildOptions{NodeName: "node-a", Zone: "zone-a"})
	if same := b.Build([]*v1.Service{web}, []*discoveryv1.EndpointSlice{webS}); same.Lookup(name) != first.Lookup(name) {
		t.Errorf("same options: got a new Port, want the same pointer")
	}
	b.SetOptions(BuildOptions{NodeName: "node-b", Zone: "zone-b"})
	second := b.Build([]*v1.Service{web}, []*discoveryv1.EndpointSlice{webS})
	if second.Zone != "zone-b" {
		t.Errorf("second Zone: got %q, want zone-b", second.Zone)
	}
	if first.Equal(second) {
		t.Errorf("snapshots of other options are Equal, want not")
	}
	p := second.Lookup(name)
	if p == first.Lookup(name) {
		t.Fatalf("new options: got the same Port pointer, want a new one")
	}
	if e := p.Endpoints[0]; e.Local || e.ForThisNode {
		t.Errorf("endpoint on node-a seen from node-b: got Local %v ForThisNode %v, want false", e.Local, e.ForThisNode)
	}
}

// benchObjects returns n single-port Services with one slice of three endpoints
// each: n Service ports.
func benchObjects(n int) ([]*v1.Service, []*discoveryv1.EndpointSlice) {
	svcs := make([]*v1.Service, n)
	eps := make([]*discoveryv1.EndpointSlice, n)
	for i := range n {
		name := fmt.Sprintf("svc-%05d", i)
		svcs[i] = testService("default", name, withSpec(func(s *v1.ServiceSpec) {
			s.ClusterIP = fmt.Sprintf("10.96.%d.%d", i/256, i%256)
		}), withPorts(v1.ServicePort{Name: "http", Port: 80}))
		var e []discoveryv1.Endpoint
		for k := range 3 {
			e = append(e, testEndpoint(addrs(fmt.Sprintf("10.%d.%d.%d", k, i/256, i%256)), onNode(fmt.Sprintf("node-%d", k), "z")))
		}
		eps[i] = testSlice("default", name+"-1", name, discoveryv1.AddressTypeIPv4, slicePorts("http:8080"), e...)
	}
	return svcs, eps
}

// BenchmarkBuilderEndpointChange measures one slice changing among 10k Service
// ports: "full" builds everything with Build, "incremental" with a Builder that
// built the previous state.
func BenchmarkBuilderEndpointChange(b *testing.B) {
	const n = 10000
	svcs, eps := benchObjects(n)
	changed := eps[n/2].DeepCopy()
	changed.Endpoints[0].Addresses = []string{"10.200.0.1"}
	states := [2][]*discoveryv1.EndpointSlice{eps, slices.Clone(eps)}
	states[1][n/2] = changed
	b.Run("full", func(b *testing.B) {
		b.ReportAllocs()
		for i := 0; b.Loop(); i++ {
			Build(svcs, states[i%2], BuildOptions{NodeName: "node-1"})
		}
	})
	b.Run("incremental", func(b *testing.B) {
		bl := NewBuilder(BuildOptions{NodeName: "node-1"})
		bl.Build(svcs, states[1])
		b.ReportAllocs()
		for i := 0; b.Loop(); i++ {
			bl.Build(svcs, states[i%2])
		}
	})
}

// TestBuilderMatchesBuildRandom: random sequences of object sets, drawn from a pool
// with several versions (valid, invalid, duplicates, headless) per name, give the
// same Snapshots from one Builder as from Build.
func TestBuilderMatchesBuildRandom(t *testing.T) {
	t.Parallel()
	var svcPool []*v1.Service
	var slicePool []*discoveryv1.EndpointSlice
	// Each name has addresses of its own: which of two Services sharing one is
	// served depends on the Builder's past (TestBuilderConflictsRandom).
	for n, name := range []string{"a", "b", "c"} {
		for v := range 3 {
			svc := testService("ns", name, withSpec(func(s *v1.ServiceSpec) { s.ClusterIP = fmt.Sprintf("10.96.%d.%d", n, v+1) }),
				withPorts(v1.ServicePort{Name: "x", Port: 80}, v1.ServicePort{Name: "y", Port: 81}))
			switch v {
			case 1:
				svc.Spec.Ports[1].Port = 0 // invalid
			case 2:
				svc.Spec.ClusterIP = v1.ClusterIPNone // headless
			}
			svcPool = append(svcPool, svc, svc.DeepCopy())
			for sl := range 2 {
				addr := fmt.Sprintf("10.0.%d.%d", sl, v)
				if v == 1 && sl == 1 {
					addr = "bad"
				}
				slicePool = append(slicePool, testSlice("ns", fmt.Sprintf("%s-%d", name, sl), name, discoveryv1.AddressTypeIPv4,
					slicePorts("x:8080", "y:8081"), testEndpoint(addrs(addr))))
			}
		}
	}
	rng := rand.New(rand.NewPCG(1, 2))
	// pick draws up to n/2 indexes into a pool of n, repeats allowed.
	pick := func(n int) []int {
		var out []int
		for range rng.IntN(n/2 + 1) {
			out = append(out, rng.IntN(n))
		}
		return out
	}
	b := NewBuilder(BuildOptions{})
	for step := range 500 {
		var svcs []*v1.Service
		var eps []*discoveryv1.EndpointSlice
		for _, i := range pick(len(svcPool)) {
			svcs = append(svcs, svcPool[i])
		}
		for _, i := range pick(len(slicePool)) {
			eps = append(eps, slicePool[i])
		}
		got, want := b.Build(svcs, eps), Build(svcs, eps, BuildOptions{})
		if !reflect.DeepEqual(got.Ports, want.Ports) {
			t.Fatalf("step %d: got ports %s, want %s", step, dump(got.Ports), dump(want.Ports))
		}
		if g, w := fmt.Sprint(got.Errors), fmt.Sprint(want.Errors); g != w {
			t.Fatalf("step %d: got errors %s, want %s", step, g, w)
		}
	}
}
