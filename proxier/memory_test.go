package proxier

import (
	"net/netip"
	"testing"
	"time"

	"github.com/uproxy/uproxy/service"
)

// What a proxier's routes learnt (affinity entries, the retry budget spent)
// is recalled by a successor's routes at their first sync, before they
// serve, and the memory of a Service port the successor does not have is
// dropped at EndRecall.
func TestRememberRecallRoutes(t *testing.T) {
	a, b := netip.MustParseAddrPort("127.0.0.2:81"), netip.MustParseAddrPort("127.0.0.3:81")
	sticky := func() *service.Port {
		sp := port("sticky", service.TCP, a, b)
		sp.AffinityClientIP, sp.AffinityTimeout = true, time.Hour
		return sp
	}
	old := newProxier(t, Config{})
	mustSync(t, old, snapshot(sticky(), port("gone", service.TCP, a)))
	name := sticky().Name
	oldRoute := old.ports[name].cluster
	// Another client takes the rotation's first endpoint; this one the second.
	oldRoute.picker.Pick(netip.MustParseAddr("10.0.0.1"), nil)
	client := netip.MustParseAddr("10.0.0.2")
	had, err := oldRoute.picker.Pick(client, nil)
	if err != nil {
		t.Fatal(err)
	}
	oldRoute.tcp.SpendRetryBudget(3_000_000)
	oldRoute.tcp.SpendRetryBudget(1_000_000) // never less spent than already
	ms := old.Remember()

	succ := newProxier(t, Config{})
	succ.RecallAtSync(ms)
	mustSync(t, succ, snapshot(sticky()))
	succ.EndRecall()
	r := succ.ports[name].cluster
	if got, sticky, err := r.picker.family(0).Peek(client); err != nil || !sticky || got != had {
		t.Errorf("the client in the successor: %v (sticky %v, %v), want %v from its affinity entry", got, sticky, err, had)
	}
	if got := r.tcp.RetryBudgetSpent(); got != 3_000_000 {
		t.Errorf("the successor's retry budget: %d spent, want 3000000", got)
	}
	if n := len(succ.recall.pending); n != 0 {
		t.Errorf("%d memories kept after EndRecall, want none", n)
	}
	// Recall, later, merges into the routes there are.
	if taken := succ.Recall(ms); taken != len(ms)-countRoute(ms, "gone") {
		t.Errorf("Recall took %d of %d memories, want all but those of the gone port", taken, len(ms))
	}
}

func countRoute(ms []RouteMemory, name string) int {
	n := 0
	for _, m := range ms {
		if m.Route.Service.Name == name {
			n++
		}
	}
	return n
}
