package service

import (
	"encoding/json"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
)

// fuzzInput is what FuzzBuild decodes its bytes into; the seeds in testdata/build-*.json
// have this shape.
type fuzzInput struct {
	Services []*v1.Service                `json:"services"`
	Slices   []*discoveryv1.EndpointSlice `json:"slices"`
}

// FuzzBuild feeds Build arbitrary decoded objects and checks the invariants every mode
// relies on: no panic, inputs untouched, ports sorted and unique, endpoints valid,
// sorted and unique, no address served by two ports, errors all *FieldError or
// *Conflict, and the same result twice.
func FuzzBuild(f *testing.F) {
	seeds, err := filepath.Glob(filepath.Join("testdata", "build-*.json"))
	if err != nil || len(seeds) == 0 {
		f.Fatalf("got seeds %v (err %v), want testdata/build-*.json", seeds, err)
	}
	for _, name := range seeds {
		data, err := os.ReadFile(name)
		if err != nil {
			f.Fatal(err)
		}
		var in fuzzInput
		if err := json.Unmarshal(data, &in); err != nil {
			f.Fatalf("seed %s: %v", name, err)
		}
		f.Add(data)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var in, orig fuzzInput
		if json.Unmarshal(data, &in) != nil || json.Unmarshal(data, &orig) != nil {
			return
		}
		opts := BuildOptions{NodeName: "n1"}
		snap := Build(in.Services, in.Slices, opts)
		if !reflect.DeepEqual(in, orig) {
			t.Fatalf("got inputs changed by Build")
		}
		served := map[Claim]PortName{}
		for i, p := range snap.Ports {
			for _, c := range p.Claims() {
				if o, dup := served[c]; dup {
					t.Errorf("got %s served by %s and %s, want one port per address", c, o, p.Name)
				}
				served[c] = p.Name
			}
			if i > 0 && !snap.Ports[i-1].Name.Less(p.Name) {
				t.Errorf("got port %s after %s, want strictly increasing names", p.Name, snap.Ports[i-1].Name)
			}
			if p.Port < 1 || p.Port > 65535 {
				t.Errorf("port %s: got port number %d, want 1-65535", p.Name, p.Port)
			}
			switch p.Protocol {
			case TCP, UDP, SCTP:
			default:
				t.Errorf("port %s: got protocol %q, want TCP, UDP or SCTP", p.Name, p.Protocol)
			}
			for _, ip := range append(append(append([]netip.Addr{}, p.ClusterIPs...), p.ExternalIPs...), p.LoadBalancerIPs...) {
				if !ip.IsValid() || ip.Zone() != "" {
					t.Errorf("port %s: got address %v, want a valid address without zone", p.Name, ip)
				}
			}
			for j, e := range p.Endpoints {
				if !e.Addr.IsValid() || e.Addr.Port() == 0 {
					t.Errorf("port %s: got endpoint %v, want a valid address and port", p.Name, e.Addr)
				}
				if j > 0 && p.Endpoints[j-1].Addr.Compare(e.Addr) >= 0 {
					t.Errorf("port %s: got endpoint %v after %v, want strictly increasing", p.Name, e.Addr, p.Endpoints[j-1].Addr)
				}
				if e.Local != (e.NodeName == opts.NodeName) {
					t.Errorf("port %s: endpoint %v on node %q: got Local %v", p.Name, e.Addr, e.NodeName, e.Local)
				}
			}
		}
		for _, err := range snap.Errors {
			var fe *FieldError
			var c *Conflict
			switch {
			case errors.As(err, &c):
				if served[c.Claim] != c.ServedBy {
					t.Errorf("got conflict %q, want %s served by %s", c, c.Claim, c.ServedBy)
				}
			case !errors.As(err, &fe) || fe.Kind == "" || fe.Field == "" || fe.Msg == "":
				t.Errorf("got error %q (%T), want a complete *FieldError or a *Conflict", err, err)
			}
		}
		again := Build(in.Services, in.Slices, opts)
		if !reflect.DeepEqual(snap.Ports, again.Ports) || !reflect.DeepEqual(snap.Errors, again.Errors) {
			t.Errorf("got two different Snapshots from the same input")
		}
	})
}
