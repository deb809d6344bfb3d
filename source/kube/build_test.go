package kube

import (
	"github.com/uproxy/uproxy/test/testbed/logs"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/utils/ptr"

	"github.com/uproxy/uproxy/service"
)

func testService(name, ip string, lbls map[string]string) *v1.Service {
	return &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name, Labels: lbls},
		Spec: v1.ServiceSpec{
			ClusterIP:  ip,
			ClusterIPs: []string{ip},
			Ports:      []v1.ServicePort{{Name: "p", Protocol: v1.ProtocolTCP, Port: 80}},
		},
	}
}

func testSlice(name, svc string, addrs ...string) *discoveryv1.EndpointSlice {
	s := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "ns", Name: name, Labels: map[string]string{}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("p"), Protocol: ptr.To(v1.ProtocolTCP), Port: ptr.To[int32](8080)}},
	}
	if svc != "" {
		s.Labels[discoveryv1.LabelServiceName] = svc
	}
	for _, a := range addrs {
		s.Endpoints = append(s.Endpoints, discoveryv1.Endpoint{Addresses: []string{a}})
	}
	return s
}

// portsOf renders a Snapshot as "name=addr,addr" entries for comparison.
func portsOf(s *service.Snapshot) []string {
	var out []string
	for _, p := range s.Ports {
		var eps []string
		for _, e := range p.Endpoints {
			eps = append(eps, e.Addr.String())
		}
		out = append(out, p.Name.String()+"="+strings.Join(eps, ","))
	}
	return out
}

func TestBuilderSelectsSlicesOfSelectedServices(t *testing.T) {
	tests := []struct {
		name   string
		svcs   []*v1.Service
		slices []*discoveryv1.EndpointSlice
		want   []string
	}{{
		name:   "slices of one Service merge",
		svcs:   []*v1.Service{testService("a", "10.96.0.1", nil)},
		slices: []*discoveryv1.EndpointSlice{testSlice("a-1", "a", "10.0.0.1"), testSlice("a-2", "a", "10.0.0.2")},
		want:   []string{"ns/a:p=10.0.0.1:8080,10.0.0.2:8080"},
	}, {
		name:   "a slice without service-name label is ignored without an error",
		svcs:   []*v1.Service{testService("a", "10.96.0.1", nil)},
		slices: []*discoveryv1.EndpointSlice{testSlice("a-1", "a", "10.0.0.1"), testSlice("stray", "", "10.0.0.9")},
		want:   []string{"ns/a:p=10.0.0.1:8080"},
	}, {
		name:   "slices of a Service that is not selected are dropped",
		svcs:   []*v1.Service{testService("a", "10.96.0.1", nil)},
		slices: []*discoveryv1.EndpointSlice{testSlice("a-1", "a", "10.0.0.1"), testSlice("b-1", "b", "10.0.0.2")},
		want:   []string{"ns/a:p=10.0.0.1:8080"},
	}, {
		name:   "a Service without slices has no endpoints",
		svcs:   []*v1.Service{testService("a", "10.96.0.1", nil)},
		slices: nil,
		want:   []string{"ns/a:p="},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			snap := newBuilder("").build(tt.svcs, tt.slices)
			if got := portsOf(snap); !slices.Equal(got, tt.want) {
				t.Errorf("got ports %q, want %q", got, tt.want)
			}
			if len(snap.Errors) != 0 {
				t.Errorf("got errors %v, want none", snap.Errors)
			}
		})
	}
}

// TestBuilderKeepsLastValidVersion: an update the proxy cannot use keeps the
// previous version in service and is reported; once the object is deleted, its
// invalid return has nothing to fall back to.
func TestBuilderKeepsLastValidVersion(t *testing.T) {
	b := newBuilder("")
	good := testService("a", "10.96.0.1", nil)
	other := testService("b", "10.96.0.2", nil)
	slice := testSlice("a-1", "a", "10.0.0.1")

	snap := b.build([]*v1.Service{good, other}, []*discoveryv1.EndpointSlice{slice})
	if got, want := portsOf(snap), []string{"ns/a:p=10.0.0.1:8080", "ns/b:p="}; !slices.Equal(got, want) {
		t.Fatalf("first build: got %q, want %q", got, want)
	}

	bad := good.DeepCopy()
	bad.Spec.ExternalIPs = []string{"010.1.2.3"} // leading zeros: ambiguous, refused
	badSlice := slice.DeepCopy()
	badSlice.Endpoints[0].Addresses = []string{"not-an-ip"}
	snap = b.build([]*v1.Service{bad, other}, []*discoveryv1.EndpointSlice{badSlice})
	if got, want := portsOf(snap), []string{"ns/a:p=10.0.0.1:8080", "ns/b:p="}; !slices.Equal(got, want) {
		t.Errorf("after invalid updates: got %q, want %q (last valid versions)", got, want)
	}
	if p := snap.Lookup(service.PortName{Namespace: "ns", Name: "a", Port: "p"}); p == nil || len(p.ExternalIPs) != 0 {
		t.Errorf("after invalid update: got port %+v, want the previous spec without externalIPs", p)
	}
	if len(snap.Errors) != 2 {
		t.Errorf("got errors %v, want 2 (one per invalid object)", snap.Errors)
	}

	b.build([]*v1.Service{other}, nil) // both deleted
	snap = b.build([]*v1.Service{bad, other}, []*discoveryv1.EndpointSlice{badSlice})
	if got, want := portsOf(snap), []string{"ns/b:p="}; !slices.Equal(got, want) {
		t.Errorf("invalid after deletion: got %q, want %q", got, want)
	}
}

// TestBuilderErrorsStable: the same objects in another order give the same errors,
// so identical states never look like a change.
func TestBuilderErrorsStable(t *testing.T) {
	var svcs []*v1.Service
	for _, n := range []string{"a", "b", "c", "d"} {
		s := testService(n, "10.96.0.1", nil)
		s.Spec.Ports[0].Port = 0
		svcs = append(svcs, s)
	}
	first := newBuilder("").build(svcs, nil)
	slices.Reverse(svcs)
	second := newBuilder("").build(svcs, nil)
	if !first.Equal(second) {
		t.Errorf("got errors %v then %v, want the same", first.Errors, second.Errors)
	}
}

func TestServiceSelector(t *testing.T) {
	tests := []struct {
		proxyName string
		labels    map[string]string
		want      bool
	}{
		{"", nil, true},
		{"", map[string]string{LabelServiceProxyName: "uproxy"}, false},
		{"", map[string]string{LabelServiceProxyName: ""}, false},
		{"uproxy", nil, false},
		{"uproxy", map[string]string{LabelServiceProxyName: "uproxy"}, true},
		{"uproxy", map[string]string{LabelServiceProxyName: "other"}, false},
	}
	for _, tt := range tests {
		t.Run(tt.proxyName+"/"+labels.Set(tt.labels).String(), func(t *testing.T) {
			if got := ServiceSelector(tt.proxyName).Matches(labels.Set(tt.labels)); got != tt.want {
				t.Errorf("got %v, want %v", got, tt.want)
			}
		})
	}
	if got := sliceSelector().Matches(labels.Set{LabelHeadless: ""}); got {
		t.Errorf("slice selector matches a headless slice: got true, want false")
	}
}

func TestNodeEligible(t *testing.T) {
	now := metav1.Now()
	tests := []struct {
		name string
		node *v1.Node
		want bool
	}{
		{"unknown node", nil, false},
		{"plain node", &v1.Node{}, true},
		{"being deleted", &v1.Node{ObjectMeta: metav1.ObjectMeta{DeletionTimestamp: &now}}, false},
		{"tainted for removal", &v1.Node{Spec: v1.NodeSpec{Taints: []v1.Taint{{Key: ToBeDeletedTaint, Effect: v1.TaintEffectNoSchedule}}}}, false},
		{"other taint", &v1.Node{Spec: v1.NodeSpec{Taints: []v1.Taint{{Key: "x", Effect: v1.TaintEffectNoSchedule}}}}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := NodeEligible(tt.node); got != tt.want {
				t.Errorf("got %v, want %v", got, tt.want)
			}
		})
	}
}

func TestValidateProxyName(t *testing.T) {
	for _, name := range []string{"", "uproxy", "a.b-c_d"} {
		if err := ValidateProxyName(name); err != nil {
			t.Errorf("ValidateProxyName(%q): got %v, want nil", name, err)
		}
	}
	for _, name := range []string{"has space", "-leading", strings.Repeat("x", 64)} {
		if err := ValidateProxyName(name); err == nil {
			t.Errorf("ValidateProxyName(%q): got nil, want an error", name)
		}
	}
}

// TestBuilderRepeatsErrorsOfUnchangedObjects: an invalid object handed over again
// unchanged (validated once, remembered) is still reported on every build, and
// its last valid version still serves.
func TestBuilderRepeatsErrorsOfUnchangedObjects(t *testing.T) {
	b := newBuilder("")
	good := testService("a", "10.96.0.1", nil)
	bad := good.DeepCopy()
	bad.Spec.ExternalIPs = []string{"010.1.2.3"}
	slice := testSlice("a-1", "a", "10.0.0.1")
	b.build([]*v1.Service{good}, []*discoveryv1.EndpointSlice{slice})
	for i := range 3 {
		snap := b.build([]*v1.Service{bad}, []*discoveryv1.EndpointSlice{slice})
		if got, want := portsOf(snap), []string{"ns/a:p=10.0.0.1:8080"}; !slices.Equal(got, want) {
			t.Errorf("build %d: got %q, want %q (last valid version)", i, got, want)
		}
		if len(snap.Errors) != 1 || !strings.Contains(snap.Errors[0].Error(), "spec.externalIPs") {
			t.Errorf("build %d: got errors %v, want one about spec.externalIPs", i, snap.Errors)
		}
	}
}

// An object served without one of its fields is logged as served, once; an
// invalid one as ignored.
func TestBuilderLogsServedProblemsAsServed(t *testing.T) {
	log := logs.Capture(t)
	b := newBuilder("")
	lb := testService("a", "10.96.0.1", nil)
	lb.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: "127.0.0.1"}}
	bad := testService("b", "10.96.0.2", nil)
	bad.Spec.ExternalIPs = []string{"010.1.2.3"}
	for range 2 {
		b.build([]*v1.Service{lb, bad}, []*discoveryv1.EndpointSlice{testSlice("a-1", "a", "10.0.0.1")})
	}
	logs.Check(t, "two builds", log.Since(), [][]string{
		{"E", `"Ignoring invalid object"`, "spec.externalIPs"},
		{"E", `"Serving a Service without what one of its fields gives"`, "status.loadBalancer.ingress[0].ip: 127.0.0.1 is a loopback address"},
	})
}
