package affinity

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"testing"
	"time"
)

// A Balancer finds its endpoints by a walk below indexMin endpoints and by an
// index from there on: both ways, an address given twice (or once more as
// IPv4-mapped IPv6) is one endpoint, and an endpoint keeps its counts,
// failures, ejection and affinity entries across an Update that reorders the
// set and drops another endpoint.
func TestEndpointLookupWithAndWithoutIndex(t *testing.T) {
	t.Parallel()
	for _, n := range []int{3, indexMin - 1, indexMin, 2 * indexMin} {
		t.Run(fmt.Sprintf("%d endpoints", n), func(t *testing.T) {
			var eps []netip.AddrPort
			for i := range n {
				eps = append(eps, netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 0, 0, byte(i + 1)}), 80))
			}
			given := slices.Concat(eps, []netip.AddrPort{eps[0], netip.AddrPortFrom(netip.AddrFrom16(eps[1].Addr().As16()), 80)})
			b, err := NewBalancer("rr")
			if err != nil {
				t.Fatal(err)
			}
			b.SetEjection(Ejection{After: 2, Base: time.Hour})
			b.Update(given, netip.Addr{}, true, time.Hour)
			if _, st := b.Stats(); len(st) != n {
				t.Fatalf("endpoints after an Update with two repeats: got %d, want %d", len(st), n)
			}
			client := netip.MustParseAddr("192.0.2.1")
			stuck, err := b.Pick(client, nil)
			if err != nil {
				t.Fatal(err)
			}
			failing := eps[n-1]
			if failing == stuck {
				failing = eps[n-2]
			}
			for range 2 {
				b.DialFailed(failing, errors.New("refused"))
			}

			// Reversed, and without eps[0] unless it is the one the client
			// is stuck to.
			next := slices.Clone(eps)
			slices.Reverse(next)
			if stuck != eps[0] {
				next = slices.DeleteFunc(next, func(ep netip.AddrPort) bool { return ep == eps[0] })
			}
			b.Update(next, netip.Addr{}, true, time.Hour)
			_, st := b.Stats()
			state := map[netip.AddrPort]EndpointState{}
			for _, e := range st {
				state[e.Addr] = e
			}
			if got := state[stuck].Active; got != 1 {
				t.Errorf("%s: active %d after the Update, want the 1 Pick gave it", stuck, got)
			}
			if e := state[failing]; e.Failures != 2 || e.EjectedUntil.IsZero() {
				t.Errorf("%s: %+v after the Update, want its 2 failures and its ejection", failing, e)
			}
			if got, err := b.Pick(client, nil); err != nil || got != stuck {
				t.Errorf("the client's next Pick: got %v (%v), want %s, its affinity", got, err, stuck)
			}
			for range 3 * n {
				if got, _ := b.Pick(netip.MustParseAddr("192.0.2.2"), []netip.AddrPort{stuck}); got == failing {
					t.Fatalf("Pick gave the ejected %s", failing)
				}
			}
			b.Release(stuck)
			b.Release(stuck)
			if _, st := b.Stats(); st[slices.IndexFunc(st, func(e EndpointState) bool { return e.Addr == stuck })].Active != 0 {
				t.Errorf("%s: active after two Releases of its two Picks: want 0", stuck)
			}
		})
	}
}
