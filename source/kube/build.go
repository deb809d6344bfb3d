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
	opts       service.BuildOptions
	goodSvcs   map[types.NamespacedName]*v1.Service
	goodSlices map[types.NamespacedName]*discoveryv1.EndpointSlice
	// logged holds the errors of the previous build, so that each problem is logged
	// when it appears rather than on every change.
	logged map[string]bool
}

func newBuilder(nodeName string) *builder {
	return &builder{
		opts:       service.BuildOptions{NodeName: nodeName},
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
	snap := service.Build(useSvcs, useSlices, b.opts)
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
