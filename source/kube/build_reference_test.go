package kube

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/uproxy/uproxy/service"
)

// referenceBuilder is the builder's rule written plainly, every object validated
// and every key looked up on every build: the model the builder must match.
type referenceBuilder struct {
	goodSvcs   map[types.NamespacedName]*v1.Service
	goodSlices map[types.NamespacedName]*discoveryv1.EndpointSlice
}

func (b *referenceBuilder) build(svcs []*v1.Service, epSlices []*discoveryv1.EndpointSlice) *service.Snapshot {
	var errs []error
	seenSvcs := make(map[types.NamespacedName]bool, len(svcs))
	useSvcs := make([]*v1.Service, 0, len(svcs))
	for _, svc := range svcs {
		k := types.NamespacedName{Namespace: svc.Namespace, Name: svc.Name}
		seenSvcs[k] = true
		verrs := service.ValidateService(svc)
		errs = append(errs, verrs...)
		if len(verrs) == 0 {
			b.goodSvcs[k] = svc
			useSvcs = append(useSvcs, svc)
		} else if good := b.goodSvcs[k]; good != nil {
			useSvcs = append(useSvcs, good)
		}
	}

	seenSlices := make(map[types.NamespacedName]bool, len(epSlices))
	useSlices := make([]*discoveryv1.EndpointSlice, 0, len(epSlices))
	for _, s := range epSlices {
		owner := s.Labels[discoveryv1.LabelServiceName]
		if owner == "" || !seenSvcs[types.NamespacedName{Namespace: s.Namespace, Name: owner}] {
			continue // no Service, or one another proxy handles
		}
		k := types.NamespacedName{Namespace: s.Namespace, Name: s.Name}
		seenSlices[k] = true
		verrs := service.ValidateEndpointSlice(s)
		errs = append(errs, verrs...)
		if len(verrs) == 0 {
			b.goodSlices[k] = s
			useSlices = append(useSlices, s)
		} else if good := b.goodSlices[k]; good != nil && good.Labels[discoveryv1.LabelServiceName] == owner {
			useSlices = append(useSlices, good)
		}
	}

	// An object that is gone is forgotten: should it come back invalid, there is no
	// earlier version of it to fall back to.
	for k := range b.goodSvcs {
		if !seenSvcs[k] {
			delete(b.goodSvcs, k)
		}
	}
	for k := range b.goodSlices {
		if !seenSlices[k] {
			delete(b.goodSlices, k)
		}
	}

	// Listers return objects in map order: sorting by object keeps the errors of
	// identical states identical, and each object's errors in field order.
	slices.SortStableFunc(errs, func(x, y error) int {
		fx, fy := fieldError(x), fieldError(y)
		return cmp.Or(cmp.Compare(fx.Kind, fy.Kind), cmp.Compare(fx.Namespace, fy.Namespace), cmp.Compare(fx.Name, fy.Name))
	})
	snap := service.Build(useSvcs, useSlices, service.BuildOptions{})
	// Build found no errors in the objects it was given, all valid; the errors are
	// those of the versions it was not given.
	snap.Errors = append(errs, snap.Errors...)
	return snap
}

// TestBuilderMatchesReference: random sequences of object sets, drawn from a pool
// with valid and invalid versions, orphan slices and slices of unselected
// Services, give the same Snapshots from the builder as from the plain model.
func TestBuilderMatchesReference(t *testing.T) {
	var svcPool []*v1.Service
	var slicePool []*discoveryv1.EndpointSlice
	// Each name has addresses of its own: which of two Services sharing one is
	// served depends on the builder's past, which the model does not keep.
	for n, name := range []string{"a", "b", "c"} {
		for v := range 3 {
			svc := testService(name, fmt.Sprintf("10.96.%d.%d", n, v+1), nil)
			if v == 1 {
				svc.Spec.ExternalIPs = []string{"010.1.2.3"} // invalid
			}
			svcPool = append(svcPool, svc, svc.DeepCopy())
			for sl := range 2 {
				addr := fmt.Sprintf("10.0.%d.%d", sl, v)
				if v == 2 && sl == 0 {
					addr = "bad"
				}
				slicePool = append(slicePool, testSlice(fmt.Sprintf("%s-%d", name, sl), name, addr))
			}
		}
		// An orphan, a slice of a Service that never exists, and an invalid version
		// of a slice moved to another Service (whose fallback must not be taken).
		other := map[string]string{"a": "b", "b": "c", "c": "a"}[name]
		slicePool = append(slicePool, testSlice(name+"-x", "", "10.0.9.9"), testSlice(name+"-0", "d", "10.0.9.8"),
			testSlice(name+"-0", other, "bad"))
	}
	rng := rand.New(rand.NewPCG(3, 4))
	// pick draws up to n/2 indexes into a pool of n, repeats allowed.
	pick := func(n int) []int {
		var out []int
		for range rng.IntN(n/2 + 1) {
			out = append(out, rng.IntN(n))
		}
		return out
	}
	b := newBuilder("")
	ref := &referenceBuilder{
		goodSvcs:   make(map[types.NamespacedName]*v1.Service),
		goodSlices: make(map[types.NamespacedName]*discoveryv1.EndpointSlice),
	}
	for step := range 500 {
		var svcs []*v1.Service
		var eps []*discoveryv1.EndpointSlice
		for _, i := range pick(len(svcPool)) {
			svcs = append(svcs, svcPool[i])
		}
		for _, i := range pick(len(slicePool)) {
			eps = append(eps, slicePool[i])
		}
		got, want := b.build(svcs, eps), ref.build(svcs, eps)
		if !reflect.DeepEqual(got.Ports, want.Ports) {
			t.Fatalf("step %d: got ports %q, want %q", step, portsOf(got), portsOf(want))
		}
		if g, w := fmt.Sprint(got.Errors), fmt.Sprint(want.Errors); g != w {
			t.Fatalf("step %d: got errors %s, want %s", step, g, w)
		}
	}
}
