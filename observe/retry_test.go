package observe_test

import (
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/proxier"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/test/testbed"
)

// A hedged connection shows its loser as an attempt with result hedge_lost, in
// /debug/events and in uproxy_dial_attempts_total, and the loser's endpoint
// carries no failure; /debug/services shows where each policy value came from.
func TestHedgeEventsAndMetrics(t *testing.T) {
	w := mkWorld(t, proxier.Config{Scheduler: "rr"})
	unanswered, live := unansweredAddr(t, "127.0.0.4"), echoBackend(t, "127.0.0.2")
	hedge := 20 * time.Millisecond
	svc, pp := w.addPolicyService(service.Policy{DialHedge: &hedge, DialTimeouts: []time.Duration{10 * time.Second, 10 * time.Second}},
		service.TCP, false, unanswered, live)
	if got, err := echoThrough(t, pp, "hedged"); err != nil || got != "hedged" {
		t.Fatalf("through %s: got %q, %v, want hedged", svc, got, err)
	}
	testbed.Await(t, awaitTimeout, "the connection recorded", func() bool { return len(w.eventsOf("?service="+svc)) == 1 })
	ev := w.eventsOf("?service=" + svc)[0]
	if got, want := attemptsText(ev), unanswered.String()+" hedge_lost, "+live.String()+" success"; got != want {
		t.Errorf("attempts: got %q, want %q", got, want)
	}
	if ev.Outcome != observe.OutcomeRetried || ev.Endpoint != live.String() {
		t.Errorf("event: got outcome %q endpoint %q, want retried %s", ev.Outcome, ev.Endpoint, live)
	}
	if got := metricOr0(t, "uproxy_dial_attempts_total", map[string]string{"service": svc, "endpoint": unanswered.String(), "result": "hedge_lost"}); got != 1 {
		t.Errorf("uproxy_dial_attempts_total{result=hedge_lost} of %s: got %v, want 1", unanswered, got)
	}
	if got := metricOr0(t, "uproxy_dial_attempts_total", map[string]string{"service": svc, "endpoint": unanswered.String(), "result": "timeout"}); got != 0 {
		t.Errorf("uproxy_dial_attempts_total{result=timeout} of %s: got %v, want 0 (it lost a race, it did not fail)", unanswered, got)
	}
	if e := w.endpointState(svc, unanswered); e.ConsecutiveFailures != 0 {
		t.Errorf("consecutive failures of the loser %s: got %d, want 0", unanswered, e.ConsecutiveFailures)
	}
	sts := w.services("?service=" + svc)
	if len(sts) != 1 || sts[0].Policy == nil {
		t.Fatalf("/debug/services of %s: got %+v, want one port with a policy", svc, sts)
	}
	pol := sts[0].Policy
	for _, c := range []struct {
		name string
		got  observe.PolicyValue
		want observe.PolicyValue
	}{
		{"dialTimeouts", pol.DialTimeouts, observe.PolicyValue{Value: "10s,10s", From: "annotation", Source: service.AnnotationDialTimeouts}},
		{"dialHedge", pol.DialHedge, observe.PolicyValue{Value: "20ms", From: "annotation", Source: service.AnnotationDialHedge}},
		{"retryBudget", pol.RetryBudget, observe.PolicyValue{Value: "off", From: "flag", Source: "--retry-budget"}},
		{"scheduler", pol.Scheduler, observe.PolicyValue{Value: "rr", From: "flag", Source: "--scheduler"}},
	} {
		if c.got != c.want {
			t.Errorf("policy %s: got %+v, want %+v", c.name, c.got, c.want)
		}
	}
}

// Under 100% failure a retry budget stops the retries: the refusals are counted
// and the refused connections say "budget" in /debug/events.
func TestRetryBudgetEventsAndMetrics(t *testing.T) {
	w := mkWorld(t, proxier.Config{DialTimeouts: []time.Duration{time.Second, time.Second, time.Second, time.Second}})
	budget := 10.0
	svc, pp := w.addPolicyService(service.Policy{RetryBudget: &budget}, service.TCP, false,
		refusedAddr(t, "127.0.0.3"), refusedAddr(t, "127.0.0.5"))
	const conns = 20
	for range conns {
		if _, err := echoThrough(t, pp, "x"); err == nil {
			t.Fatalf("through %s: got no error, want a reset (every endpoint refuses)", svc)
		}
	}
	testbed.Await(t, awaitTimeout, "every connection recorded", func() bool { return len(w.eventsOf("?service="+svc)) == conns })
	refused := metricOr0(t, "uproxy_retry_budget_refusals_total", map[string]string{"service": svc})
	if refused == 0 {
		t.Fatalf("uproxy_retry_budget_refusals_total: got 0, want the connections past the burst")
	}
	budgetEvents := 0
	for _, ev := range w.eventsOf("?service=" + svc + "&outcome=failed") {
		if ev.Reason == observe.ReasonBudget {
			budgetEvents++
			if !strings.Contains(ev.Error, "retry budget") {
				t.Errorf("event with reason budget: got error %q, want it to name the retry budget", ev.Error)
			}
		}
	}
	if float64(budgetEvents) != refused {
		t.Errorf("events with reason %q: got %d, want one per refusal (%v)", observe.ReasonBudget, budgetEvents, refused)
	}
	dials := 0.0
	for _, ep := range w.services("?service=" + svc)[0].Endpoints {
		dials += metricOr0(t, "uproxy_dial_attempts_total", map[string]string{"service": svc, "endpoint": ep.Address, "result": "refused"})
	}
	if limit := float64(conns) + 10 + conns*budget/100; dials > limit {
		t.Errorf("dials: got %v, want at most %v (one per connection, the burst of 10 and %v%% of the connections)", dials, limit, budget)
	}
	pol := w.services("?service=" + svc)[0].Policy
	if pol.RetryBudget.Value != "10%" || pol.RetryBudget.From != "annotation" || pol.RetryTokens == nil || *pol.RetryTokens >= 1 {
		t.Errorf("policy: got retry budget %+v with tokens %v, want 10%% from the annotation and less than one token left", pol.RetryBudget, pol.RetryTokens)
	}
}
