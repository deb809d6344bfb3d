package service

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

var t0 = time.Date(2024, 5, 1, 10, 0, 0, 0, time.UTC)

// created sets a Service's creationTimestamp to t0 plus d.
func created(d time.Duration) func(*v1.Service) {
	return func(s *v1.Service) { s.CreationTimestamp = metav1.NewTime(t0.Add(d)) }
}

// http gives a Service one TCP port named http on port 80, and the options'
// addresses.
func http(opts ...func(*v1.ServiceSpec)) func(*v1.Service) {
	return func(s *v1.Service) {
		s.Spec.Ports = []v1.ServicePort{{Name: "http", Port: 80}}
		for _, o := range opts {
			o(&s.Spec)
		}
	}
}

func clusterIP(ip string) func(*v1.ServiceSpec) { return func(s *v1.ServiceSpec) { s.ClusterIP = ip } }

func externalIPs(ips ...string) func(*v1.ServiceSpec) {
	return func(s *v1.ServiceSpec) { s.ExternalIPs = ips }
}

func nodePort(n int32) func(*v1.ServiceSpec) {
	return func(s *v1.ServiceSpec) {
		s.Type = v1.ServiceTypeNodePort
		for i := range s.Ports {
			s.Ports[i].NodePort = n
		}
	}
}

func udp(s *v1.ServiceSpec) {
	for i := range s.Ports {
		s.Ports[i].Protocol = v1.ProtocolUDP
	}
}

// lbIngress makes a LoadBalancer Service of ip, without NodePorts.
func lbIngress(ip string) func(*v1.Service) {
	return func(s *v1.Service) {
		s.Spec.Type = v1.ServiceTypeLoadBalancer
		s.Spec.AllocateLoadBalancerNodePorts = ptr(false)
		s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: ip}}
	}
}

// portNames lists a Snapshot's ports by name.
func portNames(s *Snapshot) []string {
	var out []string
	for _, p := range s.Ports {
		out = append(out, p.Name.String())
	}
	return out
}

func conflictStrings(s *Snapshot) []string {
	var out []string
	for _, c := range s.Conflicts {
		out = append(out, c.Error())
	}
	return out
}

// TestBuildConflicts: of the Service ports that claim one address (IP, port and
// protocol, or NodePort and protocol), only one is served: the one of the
// oldest Service, then the first by namespace and name. The others are left
// out, each with an error naming both ports and the address; everything else
// of theirs is served.
func TestBuildConflicts(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name          string
		svcs          []*v1.Service
		wantPorts     []string
		wantConflicts []string
	}{
		{
			name: "same ClusterIP and port: the older Service is served",
			svcs: []*v1.Service{
				testService("ns", "a", http(), created(time.Hour)),
				testService("ns", "b", http(), created(0)),
			},
			wantPorts:     []string{"ns/b:http"},
			wantConflicts: []string{"ns/a port http: 10.96.0.10:80/TCP is already served by ns/b port http"},
		},
		{
			name: "same creationTimestamp: the first by namespace and name is served",
			svcs: []*v1.Service{
				testService("other", "a", http()),
				testService("ns", "b", http()),
				testService("ns", "a", http()),
			},
			wantPorts: []string{"ns/a:http"},
			wantConflicts: []string{
				"ns/b port http: 10.96.0.10:80/TCP is already served by ns/a port http",
				"other/a port http: 10.96.0.10:80/TCP is already served by ns/a port http",
			},
		},
		{
			name: "unnamed ports are named by their Service",
			svcs: []*v1.Service{
				testService("ns", "a", created(0)),
				testService("ns", "b", created(time.Second)),
			},
			wantPorts:     []string{"ns/a"},
			wantConflicts: []string{"ns/b: 10.96.0.10:80/TCP is already served by ns/a"},
		},
		{
			name: "same ExternalIP and port",
			svcs: []*v1.Service{
				testService("ns", "a", http(clusterIP("10.96.0.1"), externalIPs("192.0.2.10")), created(0)),
				testService("ns", "b", http(clusterIP("10.96.0.2"), externalIPs("192.0.2.11", "192.0.2.10")), created(time.Second)),
			},
			wantPorts:     []string{"ns/a:http"},
			wantConflicts: []string{"ns/b port http: 192.0.2.10:80/TCP is already served by ns/a port http"},
		},
		{
			name: "an ExternalIP that is another Service's ClusterIP",
			svcs: []*v1.Service{
				testService("ns", "a", http(clusterIP("10.96.0.1")), created(0)),
				testService("ns", "b", http(clusterIP("10.96.0.2"), externalIPs("10.96.0.1")), created(time.Second)),
			},
			wantPorts:     []string{"ns/a:http"},
			wantConflicts: []string{"ns/b port http: 10.96.0.1:80/TCP is already served by ns/a port http"},
		},
		{
			name: "same LoadBalancer ingress IP and port",
			svcs: []*v1.Service{
				testService("ns", "a", http(clusterIP("10.96.0.1")), lbIngress("203.0.113.5"), created(0)),
				testService("ns", "b", http(clusterIP("10.96.0.2")), lbIngress("203.0.113.5"), created(time.Second)),
			},
			wantPorts:     []string{"ns/a:http"},
			wantConflicts: []string{"ns/b port http: 203.0.113.5:80/TCP is already served by ns/a port http"},
		},
		{
			name: "same NodePort",
			svcs: []*v1.Service{
				testService("ns", "a", http(clusterIP("10.96.0.1"), nodePort(30080)), created(0)),
				testService("ns", "b", http(clusterIP("10.96.0.2"), nodePort(30080)), created(time.Second)),
			},
			wantPorts:     []string{"ns/a:http"},
			wantConflicts: []string{"ns/b port http: nodePort 30080/TCP is already served by ns/a port http"},
		},
		{
			name: "IPv6 ClusterIP of a dual-stack Service",
			svcs: []*v1.Service{
				testService("ns", "a", http(func(s *v1.ServiceSpec) {
					s.ClusterIP, s.ClusterIPs = "10.96.0.1", []string{"10.96.0.1", "fd00::10"}
				}), created(0)),
				testService("ns", "b", http(clusterIP("fd00::10")), created(time.Second)),
			},
			wantPorts:     []string{"ns/a:http"},
			wantConflicts: []string{"ns/b port http: [fd00::10]:80/TCP is already served by ns/a port http"},
		},
		{
			name: "same address and port, other protocol: both served",
			svcs: []*v1.Service{
				testService("ns", "a", http(externalIPs("192.0.2.10"), nodePort(30080))),
				testService("ns", "b", http(externalIPs("192.0.2.10"), nodePort(30080), udp)),
			},
			wantPorts: []string{"ns/a:http", "ns/b:http"},
		},
		{
			name: "same address, other port: both served",
			svcs: []*v1.Service{
				testService("ns", "a", http()),
				testService("ns", "b", withPorts(v1.ServicePort{Name: "http", Port: 8080})),
			},
			wantPorts: []string{"ns/a:http", "ns/b:http"},
		},
		{
			name: "a NodePort equal to another Service's port: both served",
			svcs: []*v1.Service{
				testService("ns", "a", withPorts(v1.ServicePort{Name: "http", Port: 30080})),
				testService("ns", "b", http(clusterIP("10.96.0.2"), nodePort(30080))),
			},
			wantPorts: []string{"ns/a:http", "ns/b:http"},
		},
		{
			name: "only the conflicting port is left out; the newcomer's other ports are served",
			svcs: []*v1.Service{
				testService("ns", "a", http(), created(0)),
				testService("ns", "b", created(time.Second), withPorts(
					v1.ServicePort{Name: "http", Port: 80},
					v1.ServicePort{Name: "https", Port: 443},
					v1.ServicePort{Name: "dns", Port: 80, Protocol: v1.ProtocolUDP},
				)),
			},
			wantPorts:     []string{"ns/a:http", "ns/b:dns", "ns/b:https"},
			wantConflicts: []string{"ns/b port http: 10.96.0.10:80/TCP is already served by ns/a port http"},
		},
		{
			name: "a port left out takes no address: a younger one may have its other addresses",
			svcs: []*v1.Service{
				testService("ns", "a", http(clusterIP("10.96.0.1")), created(0)),
				testService("ns", "b", http(clusterIP("10.96.0.1"), externalIPs("192.0.2.10")), created(time.Second)),
				testService("ns", "c", http(clusterIP("10.96.0.3"), externalIPs("192.0.2.10")), created(2*time.Second)),
			},
			wantPorts:     []string{"ns/a:http", "ns/c:http"},
			wantConflicts: []string{"ns/b port http: 10.96.0.1:80/TCP is already served by ns/a port http"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			snap := Build(tt.svcs, nil, BuildOptions{})
			if got := portNames(snap); !slices.Equal(got, tt.wantPorts) {
				t.Errorf("got ports %q, want %q", got, tt.wantPorts)
			}
			if got := conflictStrings(snap); !slices.Equal(got, tt.wantConflicts) {
				t.Errorf("got conflicts\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(tt.wantConflicts, "\n"))
			}
			var errs []string
			for _, err := range snap.Errors {
				errs = append(errs, err.Error())
			}
			if !slices.Equal(errs, tt.wantConflicts) {
				t.Errorf("got errors %q, want the conflicts %q", errs, tt.wantConflicts)
			}
		})
	}
}

// TestBuilderConflicts: a Builder keeps every address with the Service port that
// served it in its previous Build, whatever the age of a newcomer, until that
// port goes away or stops claiming it; a port that starts claiming a served
// address is the newcomer.
func TestBuilderConflicts(t *testing.T) {
	t.Parallel()
	// a is younger than b: Build alone would serve b.
	a := testService("ns", "a", http(), created(time.Hour))
	aSlice := testSlice("ns", "a-1", "a", discoveryv1.AddressTypeIPv4, slicePorts("http:8080"), testEndpoint(addrs("10.0.0.1")))
	aSlice2 := testSlice("ns", "a-1", "a", discoveryv1.AddressTypeIPv4, slicePorts("http:8080"), testEndpoint(addrs("10.0.0.2")))
	b := testService("ns", "b", http(), created(0))
	c := testService("ns", "c", http(clusterIP("10.96.0.3"), externalIPs("192.0.2.10")), created(2*time.Hour))
	// cGrown is c (older than d) claiming d's address too.
	cGrown := testService("ns", "c", http(clusterIP("10.96.0.3"), externalIPs("192.0.2.10", "192.0.2.20")), created(2*time.Hour))
	d := testService("ns", "d", http(clusterIP("10.96.0.4"), externalIPs("192.0.2.20")), created(3*time.Hour))
	const bLeftOut = "ns/b port http: 10.96.0.10:80/TCP is already served by ns/a port http"
	const aLeftOut = "ns/a port http: 10.96.0.10:80/TCP is already served by ns/b port http"

	steps := []struct {
		name          string
		svcs          []*v1.Service
		slices        []*discoveryv1.EndpointSlice
		wantPorts     []string
		wantConflicts []string
	}{
		{"a alone", []*v1.Service{a}, []*discoveryv1.EndpointSlice{aSlice}, []string{"ns/a:http"}, nil},
		{"an older newcomer is left out", []*v1.Service{b, a}, []*discoveryv1.EndpointSlice{aSlice}, []string{"ns/a:http"}, []string{bLeftOut}},
		{"the owner's endpoints change", []*v1.Service{a, b}, []*discoveryv1.EndpointSlice{aSlice2}, []string{"ns/a:http"}, []string{bLeftOut}},
		{"an unrelated Service comes", []*v1.Service{a, b, c}, nil, []string{"ns/a:http", "ns/c:http"}, []string{bLeftOut}},
		{"the owner goes away: the other takes over", []*v1.Service{b, c}, nil, []string{"ns/b:http", "ns/c:http"}, nil},
		{"the owner comes back: it is the newcomer now", []*v1.Service{a, b, c}, []*discoveryv1.EndpointSlice{aSlice}, []string{"ns/b:http", "ns/c:http"}, []string{aLeftOut}},
		{"d takes its own address", []*v1.Service{b, c, d}, nil, []string{"ns/b:http", "ns/c:http", "ns/d:http"}, nil},
		{"a served port that claims a served address is left out", []*v1.Service{b, cGrown, d}, nil, []string{"ns/b:http", "ns/d:http"},
			[]string{"ns/c port http: 192.0.2.20:80/TCP is already served by ns/d port http"}},
		{"and served again without it", []*v1.Service{b, c, d}, nil, []string{"ns/b:http", "ns/c:http", "ns/d:http"}, nil},
	}
	bl := NewBuilder(BuildOptions{})
	for _, st := range steps {
		snap := bl.Build(st.svcs, st.slices)
		if got := portNames(snap); !slices.Equal(got, st.wantPorts) {
			t.Errorf("%s: got ports %q, want %q", st.name, got, st.wantPorts)
		}
		if got := conflictStrings(snap); !slices.Equal(got, st.wantConflicts) {
			t.Errorf("%s: got conflicts %q, want %q", st.name, got, st.wantConflicts)
		}
	}
}

// TestBuilderConflictsRandom: over random sequences of Services that share a few
// addresses, every Snapshot serves each address at most once, accounts for every
// port (served, or left out by a Conflict with a served port that has the
// address), and keeps every port whose Service is unchanged and that was served
// before.
func TestBuilderConflictsRandom(t *testing.T) {
	t.Parallel()
	var pool []*v1.Service
	addrs := []string{"10.96.0.1", "10.96.0.2", "192.0.2.1", "192.0.2.2"}
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range 24 {
		name := fmt.Sprintf("s%d", i%8) // three versions of each name
		spec := []func(*v1.ServiceSpec){clusterIP(addrs[rng.IntN(2)])}
		if rng.IntN(2) == 0 {
			spec = append(spec, externalIPs(addrs[2+rng.IntN(2)]))
		}
		if rng.IntN(3) == 0 {
			spec = append(spec, nodePort(30000+int32(rng.IntN(2))))
		}
		if rng.IntN(4) == 0 {
			spec = append(spec, udp)
		}
		pool = append(pool, testService("ns", name, http(spec...), created(time.Duration(rng.IntN(3))*time.Second)))
	}

	bl := NewBuilder(BuildOptions{})
	var prev *Snapshot
	var prevSvcs map[string]*v1.Service
	for step := range 1000 {
		svcs := map[string]*v1.Service{}
		var in []*v1.Service
		for range rng.IntN(8) {
			s := pool[rng.IntN(len(pool))]
			if svcs[s.Name] == nil {
				svcs[s.Name] = s
				in = append(in, s)
			}
		}
		snap := bl.Build(in, nil)

		served := map[Claim]PortName{}
		for _, p := range snap.Ports {
			for _, c := range p.Claims() {
				if o, dup := served[c]; dup {
					t.Fatalf("step %d: %s served by %s and %s", step, c, o, p.Name)
				}
				served[c] = p.Name
			}
		}
		if got, want := len(snap.Ports)+len(snap.Conflicts), len(in); got != want {
			t.Fatalf("step %d: got %d ports and %d conflicts, want one of them for each of %d Services", step, len(snap.Ports), len(snap.Conflicts), want)
		}
		for _, c := range snap.Conflicts {
			if served[c.Claim] != c.ServedBy || snap.Lookup(c.LeftOut) != nil {
				t.Fatalf("step %d: got conflict %q, want its address served by %s and %s left out", step, c, c.ServedBy, c.LeftOut)
			}
		}
		if prev != nil {
			for _, p := range prev.Ports {
				if s := svcs[p.Name.Name]; s != nil && s == prevSvcs[p.Name.Name] && snap.Lookup(p.Name) == nil {
					t.Fatalf("step %d: %s, served before and unchanged, got left out: %q", step, p.Name, conflictStrings(snap))
				}
			}
		}
		prev, prevSvcs = snap, svcs
	}
}

func TestClaims(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		port Port
		want string
	}{
		{"none", Port{Port: 80, Protocol: TCP}, ""},
		{"every kind of address, in order", Port{Port: 53, Protocol: UDP, NodePort: 30053,
			ClusterIPs:      []netip.Addr{ip("10.96.0.10"), ip("fd00::a")},
			ExternalIPs:     []netip.Addr{ip("192.0.2.1")},
			LoadBalancerIPs: []netip.Addr{ip("203.0.113.7")}},
			"10.96.0.10:53/UDP [fd00::a]:53/UDP 192.0.2.1:53/UDP 203.0.113.7:53/UDP nodePort 30053/UDP"},
	}
	for _, tt := range tests {
		if got := tt.port.Claims().String(); got != tt.want {
			t.Errorf("%s: got %q, want %q", tt.name, got, tt.want)
		}
	}
}
