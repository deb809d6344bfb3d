package affinity

import (
	"encoding/json"
	"net/netip"
	"testing"
	"time"
)

// A successor's balancer that recalls its predecessor's memory gives every
// client the endpoint it had, keeps an ejected endpoint ejected for the rest
// of its period, and goes on with the rotation where it stood; a client
// that connected to the successor first keeps its newer entry. The memory
// survives a JSON round trip, as it travels.
func TestRememberRecall(t *testing.T) {
	eps := endpoints(4)
	old, clock := mkBalancer(t, "rr", eps, true, time.Hour)
	old.SetEjection(Ejection{After: 2, Base: time.Minute})
	had := map[int]string{}
	for i := range 20 {
		had[i] = mustPick(t, old, clientAddr(i), nil).String()
	}
	old.DialFailed(eps[3], errDial)
	old.DialFailed(eps[3], errDial)
	mustPick(t, old, clientAddr(100), nil) // moves the rotation on
	m := old.Remember()
	if len(m.Entries) != 21 || len(m.Endpoints) != 1 || !m.Next.IsValid() {
		t.Fatalf("memory: %d entries, endpoints %v, next %v; want 21, one ejected, a next", len(m.Entries), m.Endpoints, m.Next)
	}
	data, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	var got Memory
	if err := json.Unmarshal(data, &got); err != nil {
		t.Fatal(err)
	}

	// The successor: the same endpoints in another order, the same clock.
	succ, _ := mkBalancer(t, "rr", []netip.AddrPort{eps[2], eps[0], eps[3], eps[1]}, true, time.Hour)
	withClock(succ, clock.now)
	succ.SetEjection(Ejection{After: 2, Base: time.Minute})
	// Client 0 came to the successor first: its own pick is newer.
	clock.advance(time.Second)
	first := mustPick(t, succ, clientAddr(0), nil)
	succ.Recall(got)
	// The rotation: a new client gets what it would have got from the old
	// balancer.
	if o, n := old.State().Next, succ.State().Next; o != n {
		t.Errorf("the next new client: %v in the successor, %v in the old balancer", n, o)
	}

	if ep := mustPick(t, succ, clientAddr(0), nil); ep != first {
		t.Errorf("client 0: %v after the recall, want its newer %v", ep, first)
	}
	for i := 1; i < 20; i++ {
		if had[i] == eps[3].String() {
			continue // its endpoint is ejected, here as there
		}
		if ep := mustPick(t, succ, clientAddr(i), nil).String(); ep != had[i] {
			t.Errorf("client %d: %s in the successor, %s before", i, ep, had[i])
		}
	}
	st := succ.State()
	ejected := 0
	for _, e := range st.Endpoints {
		if !e.EjectedUntil.IsZero() {
			ejected++
			if e.Addr != eps[3] {
				t.Errorf("%v ejected in the successor, want %v", e.Addr, eps[3])
			}
		}
	}
	if ejected != 1 {
		t.Errorf("%d endpoints ejected in the successor, want 1", ejected)
	}
}
