package socket

import (
	"errors"
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/uproxy/uproxy/record"
)

func TestRetryBudgetBucket(t *testing.T) {
	t.Parallel()
	var b retryBudget
	if got := b.tokens(); got != budgetBurst {
		t.Fatalf("new bucket: got %v tokens, want %d (full)", got, budgetBurst)
	}
	b.deposit(50)
	if got := b.tokens(); got != budgetBurst {
		t.Errorf("deposit into a full bucket: got %v tokens, want it capped at %d", got, budgetBurst)
	}
	for i := range budgetBurst {
		if !b.withdraw() {
			t.Fatalf("withdrawal %d of a full bucket: refused, want %d granted", i+1, budgetBurst)
		}
	}
	if b.withdraw() {
		t.Fatalf("withdrawal from an empty bucket: granted, want refused")
	}
	// 20% per first attempt: five first attempts earn one retry.
	for i := range 4 {
		b.deposit(20)
		if b.withdraw() {
			t.Fatalf("after %d deposits of 20%%: withdrawal granted, want refused below one token", i+1)
		}
	}
	b.deposit(20)
	if !b.withdraw() {
		t.Fatalf("after five deposits of 20%%: withdrawal refused, want granted")
	}
	b.refund()
	if got := b.tokens(); got < 0.999 || got > 1.001 {
		t.Errorf("after a refund: got %v tokens, want 1", got)
	}
}

// TestTCPProxyRetryBudget fails every dial: without a budget every connection
// makes all its attempts; with one, the retries stop at the burst plus the
// budget's share of the first attempts, and the connections refused a retry
// say so.
func TestTCPProxyRetryBudget(t *testing.T) {
	t.Parallel()
	const conns = 60
	const percent = 10.0
	tests := []struct {
		name   string
		budget float64
	}{
		{name: "no budget", budget: 0},
		{name: "10% budget", budget: percent},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			eps := []netip.AddrPort{refusedAddr(t, "127.0.0.2"), refusedAddr(t, "127.0.0.3"), refusedAddr(t, "127.0.0.4")}
			picker := newCyclePicker(eps...)
			rec := &recorder{}
			p := &TCPProxy{Service: "ns/budget:tcp", Picker: picker, Observer: rec, RetryBudget: tt.budget,
				DialTimeouts: slices.Repeat([]time.Duration{10 * time.Second}, 4)}
			addr := startTCPProxy(t, p)
			for range conns {
				if err := connectAndRead(addr); !isReset(err) {
					t.Fatalf("connect and read with every endpoint refusing: got %v, want ECONNRESET", err)
				}
			}
			closed := rec.awaitClosed(t, conns)
			retries, refused := 0, 0
			for i, c := range closed {
				retries += len(c.Attempts) - 1
				if c.RetryRefused {
					refused++
					if !errors.Is(c.Err, record.ErrRetryBudget) {
						t.Errorf("connection %d: refused a retry, got Err %v, want it to wrap ErrRetryBudget", i, c.Err)
					}
				} else if len(c.Attempts) != 4 {
					t.Errorf("connection %d: got %d attempts and no refusal, want all 4", i, len(c.Attempts))
				}
			}
			if tt.budget == 0 {
				if retries != 3*conns || refused != 0 {
					t.Errorf("without a budget: got %d retries and %d refusals, want %d and 0", retries, refused, 3*conns)
				}
				return
			}
			// The burst is spent, then one retry per 100/percent connections.
			if limit := budgetBurst + int(conns*percent/100); retries > limit {
				t.Errorf("retries: got %d, want at most %d (burst %d + %v%% of %d first attempts)", retries, limit, budgetBurst, percent, conns)
			}
			if retries < budgetBurst {
				t.Errorf("retries: got %d, want at least the burst of %d", retries, budgetBurst)
			}
			if refused < conns/2 {
				t.Errorf("connections refused a retry: got %d of %d, want most of them", refused, conns)
			}
			// The last connections earn too little: they make one attempt.
			if last := closed[len(closed)-1]; len(last.Attempts) > 2 {
				t.Errorf("last connection: got %d attempts, want at most 2 with the budget spent", len(last.Attempts))
			}
			if u := picker.unreleased(); len(u) != 0 {
				t.Errorf("Pick without Release: %v", u)
			}
			if got := p.RetryTokens(); got >= 1 {
				t.Errorf("RetryTokens after the storm: got %v, want less than one", got)
			}
		})
	}
}

// TestTCPProxyRetryBudgetBoundsHedges: hedges are retries too. Once the budget
// is spent, a connection whose first endpoint does not answer is not hedged; it
// waits for that attempt's timeout and then fails, refused a retry.
func TestTCPProxyRetryBudgetBoundsHedges(t *testing.T) {
	t.Parallel()
	const conns = 15
	eps := []netip.AddrPort{unansweredAddr(t, "127.0.0.2"), startTCPServer(t, "127.0.0.3", echo).addr}
	picker := newCyclePicker(eps...)
	rec := &recorder{}
	p := &TCPProxy{Service: "ns/budget-hedge:tcp", Picker: picker, Observer: rec, RetryBudget: 10,
		DialTimeouts: []time.Duration{30 * time.Millisecond, 10 * time.Second}, DialHedge: time.Millisecond}
	addr := startTCPProxy(t, p)
	for range conns {
		picker.mu.Lock()
		picker.next = 0 // the unanswered endpoint first
		picker.mu.Unlock()
		// Served (an echo), or reset.
		if c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(addr)); err == nil {
			c.SetDeadline(time.Now().Add(awaitTimeout))
			roundTrip(c, []byte("x"))
			c.Close()
		}
	}
	closed := rec.awaitClosed(t, conns)
	hedged, refused := 0, 0
	for i, c := range closed {
		switch {
		case c.RetryRefused:
			refused++
			if got := attemptKinds(c, eps); !slices.Equal(got, []string{"0:timeout"}) {
				t.Errorf("connection %d, refused a hedge: got attempts %v, want only the first, timed out", i, got)
			}
			if !errors.Is(c.Err, record.ErrRetryBudget) {
				t.Errorf("connection %d, refused a hedge: got Err %v, want it to wrap ErrRetryBudget", i, c.Err)
			}
		case slices.ContainsFunc(c.Attempts, func(a record.Attempt) bool { return a.Lost() }):
			hedged++
		}
	}
	if limit := budgetBurst + conns/10; hedged > limit {
		t.Errorf("hedged connections: got %d, want at most %d", hedged, limit)
	}
	if hedged < budgetBurst || refused == 0 {
		t.Errorf("got %d hedged and %d refused connections, want the burst (%d) hedged, then refusals", hedged, refused, budgetBurst)
	}
}
