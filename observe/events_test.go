package observe

import (
	"net/netip"
	"testing"
	"time"
)

// A handover event keeps its own outcome, a slot reused by another kind
// afterwards does not carry it, and a nil ring (--events 0) takes one.
func TestHandoverEvents(t *testing.T) {
	var none *Events
	none.AddHandover(HandoverDoneOutcome, "nothing recorded", time.Second)

	e := NewEvents(2)
	e.AddHandover(HandoverRefusedOutcome, "another_uproxy: process 7: --rules", 0)
	e.AddHandover(HandoverDoneOutcome, "took over from process 7", 80*time.Millisecond)
	got := e.Query(Query{Kind: KindHandover, Outcome: HandoverRefusedOutcome})
	if len(got) != 1 || got[0].Reason != "another_uproxy: process 7: --rules" || got[0].Outcome != HandoverRefusedOutcome {
		t.Fatalf("refused handovers: %+v", got)
	}
	if got := e.Query(Query{Outcome: HandoverDoneOutcome}); len(got) != 1 || got[0].DurationMs != 80 {
		t.Fatalf("done handovers: %+v", got)
	}
	// The ring of two wraps: the refusal's slot becomes an ejection's.
	e.AddEndpoint(KindEjection, "ns/svc:p", "TCP", netip.MustParseAddrPort("10.0.0.1:80"), time.Second, "3 failures")
	if got := e.Query(Query{Kind: KindEjection}); len(got) != 1 || got[0].Outcome != "" {
		t.Fatalf("the ejection in a slot a handover held: %+v", got)
	}
	if got := e.Query(Query{Outcome: HandoverRefusedOutcome}); len(got) != 0 {
		t.Fatalf("a refused handover still found after its slot was reused: %+v", got)
	}
}
