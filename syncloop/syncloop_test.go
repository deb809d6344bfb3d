package syncloop

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	testingclock "k8s.io/utils/clock/testing"

	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/test/testbed"
)

// recorder is a Mode that records every snapshot it is given, and when (on the
// test's clock).
type recorder struct {
	clock *testingclock.FakeClock
	mu    sync.Mutex
	syncs []*service.Snapshot
	at    []time.Time
	fail  int // fail this many syncs first
	kick  chan struct{}
}

func newRecorder(c *testingclock.FakeClock) *recorder {
	return &recorder{clock: c, kick: make(chan struct{}, 100)}
}

func (r *recorder) Sync(s *service.Snapshot) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.syncs = append(r.syncs, s)
	r.at = append(r.at, r.clock.Now())
	r.kick <- struct{}{}
	if r.fail > 0 {
		r.fail--
		return errors.New("injected failure")
	}
	return nil
}

func (r *recorder) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.syncs)
}

// await waits for the n-th sync (1-based) and returns its snapshot.
func (r *recorder) await(t *testing.T, n int) *service.Snapshot {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for r.count() < n {
		select {
		case <-r.kick:
		case <-deadline:
			t.Fatalf("waiting for sync %d: got %d syncs", n, r.count())
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.syncs[n-1]
}

func start(t *testing.T, r *Runner) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { r.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
}

func newClock() *testingclock.FakeClock {
	return testingclock.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
}

// awaitWaiters waits until the runner has armed n timers on c: it is then
// blocked until c is stepped, or an Update arrives.
func awaitWaiters(t *testing.T, c *testingclock.FakeClock, n int) {
	t.Helper()
	testbed.AwaitNoError(t, 10*time.Second, fmt.Sprintf("%d timers armed", n), func() error {
		if got := c.Waiters(); got != n {
			return fmt.Errorf("timers armed: got %d, want %d", got, n)
		}
		return nil
	})
}

// notFired checks, right after a Step, that none of the runner's timers fired:
// all of them are still armed. A timer that fired is gone until the runner
// re-arms it, which it does only after the sync it caused; so no timer missing
// and no new sync together rule a firing out.
func notFired(t *testing.T, c *testingclock.FakeClock, rec *recorder, timers, syncs int, when string) {
	t.Helper()
	if got := c.Waiters(); got != timers {
		t.Fatalf("%s: %d timers armed, want %d (one fired)", when, got, timers)
	}
	if n := rec.count(); n != syncs {
		t.Fatalf("%s: %d syncs, want %d", when, n, syncs)
	}
}

func snap(n int) *service.Snapshot {
	return &service.Snapshot{Ports: make([]*service.Port, n)}
}

func TestNothingSyncedBeforeFirstUpdate(t *testing.T) {
	c := newClock()
	rec := newRecorder(c)
	r := &Runner{Mode: rec, SyncPeriod: 20 * time.Millisecond, Clock: c}
	start(t, r)
	// Several periodic ticks pass with no snapshot: nothing to sync. The runner
	// re-arms its timer after each tick, so each has been handled once it is back.
	for range 5 {
		awaitWaiters(t, c, 1)
		c.Step(20 * time.Millisecond)
	}
	awaitWaiters(t, c, 1)
	if n := rec.count(); n != 0 {
		t.Fatalf("syncs before the first Update: got %d, want 0", n)
	}
	s := snap(1)
	r.Update(s)
	if got := rec.await(t, 1); got != s {
		t.Errorf("first sync: got %p, want the updated snapshot %p", got, s)
	}
}

func TestBurstCoalescesAndLatestWins(t *testing.T) {
	c := newClock()
	rec := newRecorder(c)
	var queued atomic.Int32
	r := &Runner{Mode: rec, MinSyncPeriod: 300 * time.Millisecond, SyncPeriod: time.Hour, Clock: c,
		Hooks: Hooks{Queued: func(time.Time) { queued.Add(1) }}}
	start(t, r)
	first := snap(0)
	r.Update(first)
	rec.await(t, 1)
	awaitWaiters(t, c, 1) // the periodic timer, re-armed after the sync
	// A burst within the minimum period: one more sync, of the last snapshot, once
	// the minimum period has passed and not before.
	var last *service.Snapshot
	for i := 1; i <= 50; i++ {
		last = snap(i)
		r.Update(last)
	}
	awaitWaiters(t, c, 2) // periodic, and the wait for the minimum period
	c.Step(299 * time.Millisecond)
	notFired(t, c, rec, 2, 1, "299ms after the first sync, within the minimum period")
	c.Step(time.Millisecond)
	if got := rec.await(t, 2); got != last {
		t.Errorf("sync after the burst: got a snapshot of %d ports, want the last (%d)", len(got.Ports), len(last.Ports))
	}
	awaitWaiters(t, c, 1)
	// Another minimum period passes with nothing new: no sync.
	c.Step(300 * time.Millisecond)
	awaitWaiters(t, c, 1)
	if n := rec.count(); n != 2 {
		t.Errorf("syncs for 1 + a burst of 50 updates: got %d, want 2", n)
	}
	rec.mu.Lock()
	gap := rec.at[1].Sub(rec.at[0])
	rec.mu.Unlock()
	if gap != 300*time.Millisecond {
		t.Errorf("second sync %v after the first, want the minimum period 300ms", gap)
	}
	if got := queued.Load(); got != 2 {
		t.Errorf("Queued hook calls: got %d, want 2 (the first update, and the first of the burst)", got)
	}
	if r.Latest() != last {
		t.Errorf("Latest: want the last snapshot handed to Update")
	}
}

func TestPeriodicResync(t *testing.T) {
	c := newClock()
	rec := newRecorder(c)
	// The Synced hook runs once the next sync is scheduled: waiting for it
	// keeps each Step after the timer's re-arming.
	synced := make(chan struct{}, 10)
	r := &Runner{Mode: rec, SyncPeriod: 50 * time.Millisecond, Clock: c,
		Hooks: Hooks{Synced: func(time.Time, time.Duration, *service.Snapshot, error) { synced <- struct{}{} }}}
	start(t, r)
	s := snap(1)
	r.Update(s)
	rec.await(t, 1)
	// Without further updates the same snapshot is synced again each period.
	for i := 2; i <= 4; i++ {
		<-synced
		c.Step(49 * time.Millisecond)
		notFired(t, c, rec, 1, i-1, fmt.Sprintf("49ms into period %d", i))
		c.Step(time.Millisecond)
		if got := rec.await(t, i); got != s {
			t.Fatalf("resync %d: got another snapshot, want the same", i)
		}
	}
}

func TestFailedSyncIsRetriedBeforeThePeriod(t *testing.T) {
	c := newClock()
	rec := newRecorder(c)
	rec.fail = 1
	errs := make(chan error, 10)
	r := &Runner{Mode: rec, SyncPeriod: time.Hour, Clock: c, Hooks: Hooks{
		Synced: func(_ time.Time, _ time.Duration, _ *service.Snapshot, err error) { errs <- err },
	}}
	start(t, r)
	r.Update(snap(1))
	if err := <-errs; err == nil {
		t.Fatalf("first Synced hook: got no error, want the injected failure")
	}
	// The retry comes a second later (no minimum period is set), not an hour
	// later. The hook runs once the retry is scheduled.
	c.Step(999 * time.Millisecond)
	notFired(t, c, rec, 1, 1, "999ms after the failure")
	c.Step(time.Millisecond)
	rec.await(t, 2)
	if err := <-errs; err != nil {
		t.Errorf("second Synced hook: got %v, want nil", err)
	}
}

// Between syncs the runner asks Check every CheckPeriod; a false answer (rules
// flushed by someone else) syncs at once instead of a whole SyncPeriod later.
func TestCheckFailureSyncsBeforeThePeriod(t *testing.T) {
	c := newClock()
	rec := newRecorder(c)
	var intact atomic.Bool
	intact.Store(true)
	var checks atomic.Int32
	r := &Runner{Mode: rec, SyncPeriod: time.Hour, CheckPeriod: 5 * time.Second, Clock: c,
		Check: func() bool { checks.Add(1); return intact.Load() }}
	start(t, r)
	// Before the first snapshot there is nothing to check.
	awaitWaiters(t, c, 2)
	c.Step(5 * time.Second)
	awaitWaiters(t, c, 2)
	if n := checks.Load(); n != 0 {
		t.Fatalf("checks before the first sync: got %d, want 0", n)
	}
	r.Update(snap(1))
	rec.await(t, 1)
	awaitWaiters(t, c, 2) // periodic and check
	c.Step(5 * time.Second)
	awaitWaiters(t, c, 2)
	if n, syncs := checks.Load(), rec.count(); n != 1 || syncs != 1 {
		t.Fatalf("after a check that found the rules intact: %d checks, %d syncs; want 1, 1", n, syncs)
	}
	intact.Store(false)
	c.Step(5 * time.Second)
	rec.await(t, 2)
	if n := checks.Load(); n != 2 {
		t.Errorf("checks: got %d, want 2", n)
	}
}
