package observe

import (
	"cmp"
	"reflect"
	"slices"
	"sync"
	"time"

	"github.com/uproxy/uproxy/service"
)

// Changes feeds kube-proxy's change metrics from the Snapshots a mode is given:
// Queued for every Snapshot the source produces, Synced for every Snapshot the
// mode programmed successfully. A change is counted per Service (namespace/name),
// as kube-proxy counts per object: a Service whose spec changed is a service
// change, one whose endpoints changed an endpoint change (both, for a Service
// added or removed with endpoints).
type Changes struct {
	mu     sync.Mutex
	queued *service.Snapshot // newest queued
	synced *service.Snapshot // newest programmed
}

// Queued counts the changes of s against the previously queued Snapshot and
// updates the pending gauges.
func (c *Changes) Queued(s *service.Snapshot) {
	c.mu.Lock()
	defer c.mu.Unlock()
	svc, eps := diffSnapshots(c.queued, s)
	ServiceChangesTotal.Add(float64(len(svc)))
	EndpointChangesTotal.Add(float64(len(eps)))
	c.queued = s
	c.setPending()
}

// Synced records that s is programmed: pending changes are now those of the
// newest queued Snapshot against s. It observes the network programming latency
// of every Service port whose endpoints changed and whose slices carry a
// last-change-trigger time.
func (c *Changes) Synced(s *service.Snapshot) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := time.Now()
	_, eps := diffSnapshots(c.synced, s)
	for _, p := range s.Ports {
		if _, ok := eps[serviceOf(p.Name)]; ok && !p.LastChangeTriggerTime.IsZero() {
			NetworkProgrammingDuration.Observe(now.Sub(p.LastChangeTriggerTime).Seconds())
		}
	}
	c.synced = s
	c.setPending()
}

func (c *Changes) setPending() {
	if c.queued == nil {
		return
	}
	svc, eps := diffSnapshots(c.synced, c.queued)
	ServiceChangesPending.Set(float64(len(svc)))
	EndpointChangesPending.Set(float64(len(eps)))
}

type serviceKey struct{ namespace, name string }

func serviceOf(n service.PortName) serviceKey { return serviceKey{n.Namespace, n.Name} }

// diffSnapshots returns the Services whose spec changed and those whose
// endpoints changed from a to b (a may be nil: everything in b is new).
func diffSnapshots(a, b *service.Snapshot) (svc, eps map[serviceKey]struct{}) {
	svc, eps = map[serviceKey]struct{}{}, map[serviceKey]struct{}{}
	for _, c := range service.Diff(a, b) {
		k := serviceOf(c.Name())
		switch {
		case c.Old == nil || c.New == nil: // added or removed
			svc[k] = struct{}{}
			if p := cmp.Or(c.Old, c.New); len(p.Endpoints) > 0 {
				eps[k] = struct{}{}
			}
		default:
			if !specEqual(c.Old, c.New) {
				svc[k] = struct{}{}
			}
			if !slices.EqualFunc(c.Old.Endpoints, c.New.Endpoints, func(x, y service.Endpoint) bool { return reflect.DeepEqual(x, y) }) {
				eps[k] = struct{}{}
			}
		}
	}
	return svc, eps
}

// specEqual compares two ports without their endpoints.
func specEqual(a, b *service.Port) bool {
	x, y := *a, *b
	x.Endpoints, y.Endpoints = nil, nil
	x.LastChangeTriggerTime, y.LastChangeTriggerTime = time.Time{}, time.Time{}
	return reflect.DeepEqual(x, y)
}
