package kube

import (
	"cmp"
	"maps"
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
//
// Informer caches replace an object on every change and never modify one, so an
// object is known by its pointer: what the builder learnt of it (its validation,
// its key) is kept while the object is in the cache, and a build costs a few
// pointer lookups per unchanged object.
type builder struct {
	// snaps builds incrementally, by the same rule.
	snaps    *service.Builder
	nodeName string
	// unserved are the protocols the mode cannot serve (BuildOptions.Unserved).
	unserved []service.Unserved
	// gen numbers the builds; every state records the last build that saw it,
	// and what a build did not see is dropped at its end.
	gen    uint64
	svcs   map[*v1.Service]*objectState
	slices map[*discoveryv1.EndpointSlice]*objectState
	// svcKeys and sliceKeys hold, per object key, the last build that saw an
	// object of that key and its last valid version.
	svcKeys, sliceKeys map[types.NamespacedName]*keyState
	// logged holds the errors of the previous build, so that each problem is logged
	// when it appears rather than on every change.
	logged map[string]bool
}

// seen is the last build that saw a state.
type seen struct{ gen uint64 }

// see records that build gen saw the state, counting it in *used once per build.
func (s *seen) see(gen uint64, used *int) {
	if s.gen != gen {
		s.gen = gen
		*used++
	}
}

// objectState is what the builder learnt of one object.
type objectState struct {
	seen
	errs []error // validation errors; nil when valid
	key  types.NamespacedName
	// owner is a slice's kubernetes.io/service-name ("": none).
	owner string
	// ks and ownerKS cache the states of key and of the owner's key; a dropped
	// state is looked up again.
	ks, ownerKS *keyState
}

// keyState is one object key's share of the builds.
type keyState struct {
	seen
	// good is the last valid version of the object (nil: none), kept until a
	// build no longer sees the key.
	good    any
	dropped bool
}

// setZone makes the next build's Snapshot carry zone, and judge the hints by it.
func (b *builder) setZone(zone string) {
	b.snaps.SetOptions(service.BuildOptions{NodeName: b.nodeName, Zone: zone, Unserved: b.unserved})
}

func newBuilder(nodeName string) *builder {
	return &builder{
		nodeName:  nodeName,
		snaps:     service.NewBuilder(service.BuildOptions{NodeName: nodeName}),
		svcs:      make(map[*v1.Service]*objectState),
		slices:    make(map[*discoveryv1.EndpointSlice]*objectState),
		svcKeys:   make(map[types.NamespacedName]*keyState),
		sliceKeys: make(map[types.NamespacedName]*keyState),
		logged:    make(map[string]bool),
	}
}

// keyOf returns the state of key k in keys, from the cache c when it holds a live one.
func keyOf(keys map[types.NamespacedName]*keyState, k types.NamespacedName, c *keyState) *keyState {
	if c != nil && !c.dropped {
		return c
	}
	ks := keys[k]
	if ks == nil {
		ks = &keyState{}
		keys[k] = ks
	}
	return ks
}

// build makes a Snapshot of the selected Services svcs and of the slices among
// epSlices that belong to them. Slices without a kubernetes.io/service-name label
// belong to no Service and are ignored silently, as kube-proxy ignores them.
func (b *builder) build(svcs []*v1.Service, epSlices []*discoveryv1.EndpointSlice) *service.Snapshot {
	b.gen++
	gen := b.gen
	var errs []error
	var usedSvcs, usedSlices, usedSvcKeys, usedSliceKeys int
	useSvcs := make([]*v1.Service, 0, len(svcs))
	for _, svc := range svcs {
		st := b.svcs[svc]
		if st == nil {
			st = &objectState{errs: service.ValidateService(svc), key: types.NamespacedName{Namespace: svc.Namespace, Name: svc.Name}}
			b.svcs[svc] = st
		}
		st.see(gen, &usedSvcs)
		st.ks = keyOf(b.svcKeys, st.key, st.ks)
		st.ks.see(gen, &usedSvcKeys)
		errs = append(errs, st.errs...)
		if len(st.errs) == 0 {
			st.ks.good = svc
			useSvcs = append(useSvcs, svc)
		} else if good, _ := st.ks.good.(*v1.Service); good != nil {
			useSvcs = append(useSvcs, good)
		}
	}

	useSlices := make([]*discoveryv1.EndpointSlice, 0, len(epSlices))
	for _, s := range epSlices {
		st := b.slices[s]
		if st == nil {
			st = &objectState{key: types.NamespacedName{Namespace: s.Namespace, Name: s.Name},
				owner: s.Labels[discoveryv1.LabelServiceName]}
			b.slices[s] = st
		}
		st.see(gen, &usedSlices)
		if st.owner == "" {
			continue // no Service
		}
		if st.ownerKS == nil || st.ownerKS.dropped {
			st.ownerKS = b.svcKeys[types.NamespacedName{Namespace: s.Namespace, Name: st.owner}]
		}
		if st.ownerKS == nil || st.ownerKS.gen != gen {
			continue // no Service, or one another proxy handles
		}
		if st.ks == nil {
			// Validated only once it belongs to a selected Service.
			st.errs = service.ValidateEndpointSlice(s)
		}
		st.ks = keyOf(b.sliceKeys, st.key, st.ks)
		st.ks.see(gen, &usedSliceKeys)
		errs = append(errs, st.errs...)
		if len(st.errs) == 0 {
			st.ks.good = s
			useSlices = append(useSlices, s)
		} else if good, _ := st.ks.good.(*discoveryv1.EndpointSlice); good != nil && good.Labels[discoveryv1.LabelServiceName] == st.owner {
			useSlices = append(useSlices, good)
		}
	}

	// An object that is gone is forgotten: should it come back invalid, there is no
	// earlier version of it to fall back to.
	b.forget(usedSvcs, usedSlices, usedSvcKeys, usedSliceKeys)

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

// forget drops the states this build did not use, unless every one was used.
func (b *builder) forget(usedSvcs, usedSlices, usedSvcKeys, usedSliceKeys int) {
	stale := func(_ types.NamespacedName, ks *keyState) bool {
		ks.dropped = ks.gen != b.gen
		return ks.dropped
	}
	if usedSvcs != len(b.svcs) {
		maps.DeleteFunc(b.svcs, func(_ *v1.Service, st *objectState) bool { return st.gen != b.gen })
	}
	if usedSlices != len(b.slices) {
		maps.DeleteFunc(b.slices, func(_ *discoveryv1.EndpointSlice, st *objectState) bool { return st.gen != b.gen })
	}
	if usedSvcKeys != len(b.svcKeys) {
		maps.DeleteFunc(b.svcKeys, stale)
	}
	if usedSliceKeys != len(b.sliceKeys) {
		maps.DeleteFunc(b.sliceKeys, stale)
	}
}

// log reports the errors that the previous build did not have.
func (b *builder) log(errs []error) {
	now := make(map[string]bool, len(errs))
	for _, err := range errs {
		msg := err.Error()
		now[msg] = true
		if b.logged[msg] {
			continue
		}
		if _, ok := err.(*service.Conflict); ok {
			klog.ErrorS(err, "Service port left out")
		} else if _, ok := err.(*service.UnservedError); ok {
			klog.ErrorS(err, "Service port not served in this mode")
		} else if service.IsPolicyError(err) {
			klog.ErrorS(err, "Ignoring a Service annotation")
		} else if fe, ok := err.(*service.FieldError); ok && fe.Served {
			klog.ErrorS(err, "Serving a Service without what one of its fields gives")
		} else {
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
