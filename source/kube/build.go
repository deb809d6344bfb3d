package kube

import (
	"cmp"
	"slices"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/service"
)

// builder turns the informers' objects into Snapshots. It remembers the last valid
// version of every object, so that an update the proxy cannot use (the API server
// accepts some values the proxy cannot program) keeps the Service as it was rather
// than taking it away; the problem is still reported in Snapshot.Errors. It is used
// by one goroutine.
type builder struct {
	// snaps builds incrementally: informer caches replace an object on every
	// change and never modify one, which is what service.Builder relies on.
	snaps *service.Builder
	// svcErrs and sliceErrs are the validation errors of the objects of the
	// previous build, by object, so that unchanged objects are not validated again.
	svcErrs    map[*v1.Service][]error
	sliceErrs  map[*discoveryv1.EndpointSlice][]error
	goodSvcs   map[types.NamespacedName]*v1.Service
	goodSlices map[types.NamespacedName]*discoveryv1.EndpointSlice
	// logged holds the errors of the previous build, so that each problem is logged
	// when it appears rather than on every change.
	logged map[string]bool
}

func newBuilder(nodeName string) *builder {
	return &builder{
		snaps:      service.NewBuilder(service.BuildOptions{NodeName: nodeName}),
		goodSvcs:   make(map[types.NamespacedName]*v1.Service),
		goodSlices: make(map[types.NamespacedName]*discoveryv1.EndpointSlice),
		logged:     make(map[string]bool),
	}
}

// build makes a Snapshot of the selected Services svcs and of the slices among
// epSlices that belong to them. Slices without a kubernetes.io/service-name label
// belong to no Service and are ignored silently, as kube-proxy ignores them.
func (b *builder) build(svcs []*v1.Service, epSlices []*discoveryv1.EndpointSlice) *service.Snapshot {
	var errs []error
	svcErrs := make(map[*v1.Service][]error, len(svcs))
	sliceErrs := make(map[*discoveryv1.EndpointSlice][]error, len(epSlices))
	seenSvcs := make(map[types.NamespacedName]bool, len(svcs))
	useSvcs := make([]*v1.Service, 0, len(svcs))
	for _, svc := range svcs {
		k := types.NamespacedName{Namespace: svc.Namespace, Name: svc.Name}
		seenSvcs[k] = true
		verrs, ok := b.svcErrs[svc]
		if !ok {
			verrs = service.ValidateService(svc)
		}
		svcErrs[svc] = verrs
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
		verrs, ok := b.sliceErrs[s]
		if !ok {
			verrs = service.ValidateEndpointSlice(s)
		}
		sliceErrs[s] = verrs
		errs = append(errs, verrs...)
		if len(verrs) == 0 {
			b.goodSlices[k] = s
			useSlices = append(useSlices, s)
		} else if good := b.goodSlices[k]; good != nil && good.Labels[discoveryv1.LabelServiceName] == owner {
			useSlices = append(useSlices, good)
		}
	}

	b.svcErrs, b.sliceErrs = svcErrs, sliceErrs

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
	snap := b.snaps.Build(useSvcs, useSlices)
	// Build found no errors in the objects it was given, all valid; the errors are
	// those of the versions it was not given.
	snap.Errors = append(errs, snap.Errors...)
	b.log(snap.Errors)
	return snap
}

// log reports the errors that the previous build did not have.
func (b *builder) log(errs []error) {
	now := make(map[string]bool, len(errs))
	for _, err := range errs {
		msg := err.Error()
		now[msg] = true
		if !b.logged[msg] {
			klog.ErrorS(err, "Ignoring invalid object")
		}
	}
	b.logged = now
}

func fieldError(err error) *service.FieldError {
	if fe, ok := err.(*service.FieldError); ok {
		return fe
	}
	return &service.FieldError{}
}
