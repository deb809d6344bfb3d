package kube

import (
	"fmt"
	"net/netip"
	"slices"
	"testing"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
)

// BenchmarkBuildEndpointChange measures the source's share of an endpoint change
// with n Services of one port each: one slice replaced by a new object (as the
// informer cache does), then build and the comparison with the previous Snapshot
// that decides whether to hand it on.
func BenchmarkBuildEndpointChange(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		b.Run(fmt.Sprintf("services=%d", n), func(b *testing.B) {
			svcs := make([]*v1.Service, n)
			eps := make([]*discoveryv1.EndpointSlice, n)
			for i := range n {
				name := fmt.Sprintf("svc-%05d", i)
				svcs[i] = testService(name, netip.AddrFrom4([4]byte{10, 96, byte(i >> 8), byte(i)}).String(), nil)
				eps[i] = testSlice(name+"-1", name, netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)}).String())
			}
			moving := n / 2
			states := [2][]*discoveryv1.EndpointSlice{eps, slices.Clone(eps)}
			bl := newBuilder("")
			last := bl.build(svcs, states[0])
			for i := 0; b.Loop(); i++ {
				to := (i + 1) % 2
				states[to][moving] = testSlice(svcs[moving].Name+"-1", svcs[moving].Name, fmt.Sprintf("10.200.0.%d", to))
				snap := bl.build(svcs, states[to])
				if last.Equal(snap) {
					b.Fatalf("iteration %d: the change left the Snapshot as it was", i)
				}
				last = snap
			}
		})
	}
}
