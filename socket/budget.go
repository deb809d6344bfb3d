package socket

import (
	"math"
	"sync/atomic"
	"time"
)

// DialPolicy is how a TCPProxy dials the endpoints of each connection.
type DialPolicy struct {
	// Timeouts holds one timeout per dial attempt; nil means DefaultDialTimeouts.
	// At most the first 255 are used.
	// Attempts go to another endpoint each while any remains (the Picker's
	// promise), and a failed attempt is followed by the next at once.
	Timeouts []time.Duration
	// Hedge, when positive, hedges the dials: once the attempt begun last has
	// not connected for Hedge, the next attempt begins, to another endpoint,
	// while the earlier ones stay pending. The first to connect carries the
	// connection; the others are closed and recorded with record.ErrHedgeLost,
	// which is not reported to the Picker as a failure. Zero: one attempt at a
	// time, the next only after a failure.
	Hedge time.Duration
	// RetryBudget, when positive, bounds the attempts after the first (retries
	// and hedges alike) to that percentage of the connections' first attempts,
	// through a token bucket per proxy (see retryBudget). A connection the
	// budget refuses makes no further attempt: it fails once its attempts in
	// flight have, with an Err wrapping record.ErrRetryBudget, and its record's
	// RetryRefused is set. Zero: no budget.
	RetryBudget float64
}

func (d *DialPolicy) timeouts() []time.Duration {
	if len(d.Timeouts) == 0 {
		return DefaultDialTimeouts
	}
	// A session counts its attempts in a byte.
	return d.Timeouts[:min(len(d.Timeouts), math.MaxUint8)]
}

// Retry budget: a token bucket per TCPProxy (Service port), as the retry budgets
// of Finagle and Envoy. Every connection's first attempt deposits
// RetryBudget/100 of a token; every further attempt withdraws a whole token and
// is refused when less than one is left. The bucket holds at most budgetBurst
// tokens and starts full.
//
// Over any stretch of time, then, retries add at most RetryBudget percent of the
// first attempts, plus budgetBurst. The cap is what makes the budget follow
// recent traffic: tokens earned by a long healthy spell do not pile up into a
// retry storm later. The full start and the cap's burst are the minimum a quiet
// Service keeps: with few connections it earns tokens slowly, but a few
// retries are always there for the first failures after a calm, when they are
// most likely to help. (Finagle keeps a minimum retry rate for the same reason;
// a burst needs no clock.)
const budgetBurst = 10

// tokenUnit is one token in the bucket's fixed-point count.
const tokenUnit = 1_000_000

// retryBudget is the bucket. Its zero value is full. It is shared by the
// connections of every event loop, hence atomic.
type retryBudget struct {
	// spent is how far the bucket is below full, in millionths of a token.
	spent atomic.Int64
}

// deposit adds percent/100 of a token, up to full.
func (b *retryBudget) deposit(percent float64) {
	b.add(int64(percent * tokenUnit / 100))
}

// refund gives back the token of an attempt that did not take place.
func (b *retryBudget) refund() { b.add(tokenUnit) }

func (b *retryBudget) add(n int64) {
	for {
		old := b.spent.Load()
		if old == 0 {
			return
		}
		if b.spent.CompareAndSwap(old, max(old-n, 0)) {
			return
		}
	}
}

// withdraw takes one token, or reports false when less than one is left.
func (b *retryBudget) withdraw() bool {
	for {
		old := b.spent.Load()
		n := old + tokenUnit
		if n > budgetBurst*tokenUnit {
			return false
		}
		if b.spent.CompareAndSwap(old, n) {
			return true
		}
	}
}

// tokens returns the tokens left.
func (b *retryBudget) tokens() float64 {
	return float64(budgetBurst*tokenUnit-b.spent.Load()) / tokenUnit
}
