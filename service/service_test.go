package service

import (
	"errors"
	"net/netip"
	"slices"
	"testing"
	"time"
)

func TestSnapshotEqual(t *testing.T) {
	t.Parallel()
	port := func(p int, eps ...string) *Port {
		sp := &Port{Name: PortName{Namespace: "ns", Name: "web"}, Protocol: TCP, Port: p,
			ClusterIPs: []netip.Addr{netip.MustParseAddr("10.96.0.10")}}
		for _, e := range eps {
			sp.Endpoints = append(sp.Endpoints, Endpoint{Addr: netip.MustParseAddrPort(e), Ready: true})
		}
		return sp
	}
	base := func() *Snapshot {
		return &Snapshot{Ports: []*Port{port(80, "10.244.1.2:8080")}, Errors: []error{errors.New("Service ns/bad: spec.ports: none")}, Built: time.Unix(1, 0)}
	}
	tests := []struct {
		name   string
		change func(*Snapshot)
		equal  bool
	}{
		{"same state", func(*Snapshot) {}, true},
		{"built later", func(s *Snapshot) { s.Built = time.Unix(2, 0) }, true},
		{"equal ports, other pointers", func(s *Snapshot) { s.Ports = []*Port{port(80, "10.244.1.2:8080")} }, true},
		{"equal error text, other error", func(s *Snapshot) { s.Errors = []error{errors.New("Service ns/bad: spec.ports: none")} }, true},
		{"port changed", func(s *Snapshot) { s.Ports = []*Port{port(81, "10.244.1.2:8080")} }, false},
		{"endpoint changed", func(s *Snapshot) { s.Ports = []*Port{port(80, "10.244.1.3:8080")} }, false},
		{"port removed", func(s *Snapshot) { s.Ports = nil }, false},
		{"error text changed", func(s *Snapshot) { s.Errors = []error{errors.New("Service ns/bad: spec.ports[0]: none")} }, false},
		{"error fixed", func(s *Snapshot) { s.Errors = nil }, false},
		{"zone changed", func(s *Snapshot) { s.Zone = "zone-b" }, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, b := base(), base()
			tt.change(b)
			if got := a.Equal(b); got != tt.equal {
				t.Errorf("a.Equal(b): got %v, want %v", got, tt.equal)
			}
			if got := b.Equal(a); got != tt.equal {
				t.Errorf("b.Equal(a): got %v, want %v", got, tt.equal)
			}
		})
	}
}

func TestDiff(t *testing.T) {
	t.Parallel()
	port := func(name string, p int, eps ...string) *Port {
		sp := &Port{Name: PortName{Namespace: "ns", Name: name}, Protocol: TCP, Port: p}
		for _, e := range eps {
			sp.Endpoints = append(sp.Endpoints, Endpoint{Addr: netip.MustParseAddrPort(e), Ready: true})
		}
		return sp
	}
	shared := port("b", 80)
	base := &Snapshot{Ports: []*Port{port("a", 80), shared, port("c", 80, "10.0.0.1:80")}}
	tests := []struct {
		name string
		a, b *Snapshot
		want []string
	}{
		{"nothing before: every port added", nil, base, []string{"+ns/a", "+ns/b", "+ns/c"}},
		{"same ports, other pointers", base, &Snapshot{Ports: []*Port{port("a", 80), shared, port("c", 80, "10.0.0.1:80")}}, nil},
		{"everything removed", base, &Snapshot{}, []string{"-ns/a", "-ns/b", "-ns/c"}},
		{"first and last replaced, one in between added",
			base, &Snapshot{Ports: []*Port{port("a0", 80), shared, port("bb", 80), port("d", 80)}},
			[]string{"-ns/a", "+ns/a0", "+ns/bb", "-ns/c", "+ns/d"}},
		{"port number and endpoints changed",
			base, &Snapshot{Ports: []*Port{port("a", 81), shared, port("c", 80, "10.0.0.2:80")}},
			[]string{"~ns/a", "~ns/c"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got []string
			for _, c := range Diff(tt.a, tt.b) {
				switch {
				case c.Old == nil:
					got = append(got, "+"+c.Name().String())
				case c.New == nil:
					got = append(got, "-"+c.Name().String())
				default:
					got = append(got, "~"+c.Name().String())
				}
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("got %q, want %q", got, tt.want)
			}
		})
	}
}

// TestTopology: the endpoints for cluster traffic follow node hints
// (PreferSameNode) first, then zone hints, each only when every usable endpoint
// carries that kind of hint and one names this node (zone); as kube-proxy 1.35.
func TestTopology(t *testing.T) {
	t.Parallel()
	type ep struct {
		addr        string
		zones       []string
		nodes       []string
		forThisNode bool
		ready       bool
	}
	tests := []struct {
		name string
		eps  []ep
		zone string
		want []string
	}{
		{"no hints", []ep{{addr: "10.0.0.1:80", ready: true}, {addr: "10.0.0.2:80", ready: true}}, "z1",
			[]string{"10.0.0.1:80", "10.0.0.2:80"}},
		{"zone hints for this zone", []ep{{addr: "10.0.0.1:80", zones: []string{"z1"}, ready: true}, {addr: "10.0.0.2:80", zones: []string{"z2"}, ready: true}}, "z1",
			[]string{"10.0.0.1:80"}},
		{"zone hints, node has no zone", []ep{{addr: "10.0.0.1:80", zones: []string{"z1"}, ready: true}, {addr: "10.0.0.2:80", zones: []string{"z2"}, ready: true}}, "",
			[]string{"10.0.0.1:80", "10.0.0.2:80"}},
		{"zone hints, none for this zone", []ep{{addr: "10.0.0.1:80", zones: []string{"z1"}, ready: true}, {addr: "10.0.0.2:80", zones: []string{"z2"}, ready: true}}, "z3",
			[]string{"10.0.0.1:80", "10.0.0.2:80"}},
		{"zone hints missing on one endpoint", []ep{{addr: "10.0.0.1:80", zones: []string{"z1"}, ready: true}, {addr: "10.0.0.2:80", ready: true}}, "z1",
			[]string{"10.0.0.1:80", "10.0.0.2:80"}},
		{"node hints for this node", []ep{
			{addr: "10.0.0.1:80", zones: []string{"z1"}, nodes: []string{"n1"}, forThisNode: true, ready: true},
			{addr: "10.0.0.2:80", zones: []string{"z1"}, nodes: []string{"n2"}, ready: true},
			{addr: "10.0.0.3:80", zones: []string{"z2"}, nodes: []string{"n3"}, ready: true}}, "z1",
			[]string{"10.0.0.1:80"}},
		{"node hints, none for this node: zone hints apply", []ep{
			{addr: "10.0.0.1:80", zones: []string{"z1"}, nodes: []string{"n2"}, ready: true},
			{addr: "10.0.0.2:80", zones: []string{"z2"}, nodes: []string{"n3"}, ready: true}}, "z1",
			[]string{"10.0.0.1:80"}},
		{"node hints missing on one endpoint", []ep{
			{addr: "10.0.0.1:80", nodes: []string{"n1"}, forThisNode: true, ready: true},
			{addr: "10.0.0.2:80", ready: true}}, "z1",
			[]string{"10.0.0.1:80", "10.0.0.2:80"}},
		{"node hints without a zone", []ep{
			{addr: "10.0.0.1:80", nodes: []string{"n1"}, forThisNode: true, ready: true},
			{addr: "10.0.0.2:80", nodes: []string{"n2"}, ready: true}}, "",
			[]string{"10.0.0.1:80"}},
		{"unready endpoints do not count", []ep{
			{addr: "10.0.0.1:80", nodes: []string{"n1"}, forThisNode: true, ready: true},
			{addr: "10.0.0.2:80", nodes: []string{"n2"}, ready: true},
			{addr: "10.0.0.3:80"}}, "",
			[]string{"10.0.0.1:80"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := &Port{}
			for _, e := range tt.eps {
				p.Endpoints = append(p.Endpoints, Endpoint{Addr: netip.MustParseAddrPort(e.addr), Ready: e.ready, Serving: e.ready,
					ZoneHints: e.zones, NodeHints: e.nodes, ForThisNode: e.forThisNode})
			}
			for _, got := range [][]Endpoint{p.ClusterEndpoints(tt.zone), p.ExternalEndpoints(tt.zone)} {
				var addrs []string
				for _, e := range got {
					addrs = append(addrs, e.Addr.String())
				}
				if !slices.Equal(addrs, tt.want) {
					t.Errorf("got %v, want %v", addrs, tt.want)
				}
			}
		})
	}
}

func TestSplitsExternal(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		port Port
		want bool
	}{
		{"cluster policies", Port{NodePort: 30080}, false},
		{"external Local with a NodePort", Port{NodePort: 30080, ExternalPolicyLocal: true}, true},
		{"external Local with an ExternalIP", Port{ExternalIPs: []netip.Addr{netip.MustParseAddr("192.0.2.1")}, ExternalPolicyLocal: true}, true},
		{"external Local with a LoadBalancer IP", Port{LoadBalancerIPs: []netip.Addr{netip.MustParseAddr("192.0.2.1")}, ExternalPolicyLocal: true}, true},
		{"external Local without external addresses", Port{ExternalPolicyLocal: true}, false},
		{"internal Local with a NodePort", Port{NodePort: 30080, InternalPolicyLocal: true}, true},
		{"both Local", Port{NodePort: 30080, InternalPolicyLocal: true, ExternalPolicyLocal: true}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.port.SplitsExternal(); got != tt.want {
				t.Errorf("got %v, want %v", got, tt.want)
			}
		})
	}
}
