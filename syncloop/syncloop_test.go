package syncloop

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/uproxy/uproxy/service"
)

// recorder is a Mode that records every snapshot it is given.
type recorder struct {
	mu    sync.Mutex
	syncs []*service.Snapshot
	at    []time.Time
	fail  int // fail this many syncs first
	kick  chan struct{}
}

func newRecorder() *recorder { return &recorder{kick: make(chan struct{}, 100)} }

func (r *recorder) Sync(s *service.Snapshot) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.syncs = append(r.syncs, s)
	r.at = append(r.at, time.Now())
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

func snap(n int) *service.Snapshot {
	return &service.Snapshot{Ports: make([]*service.Port, n)}
}

func TestNothingSyncedBeforeFirstUpdate(t *testing.T) {
	rec := newRecorder()
	r := &Runner{Mode: rec, SyncPeriod: 20 * time.Millisecond}
	start(t, r)
	// Several periodic ticks pass with no snapshot: nothing to sync.
	time.Sleep(100 * time.Millisecond)
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
	rec := newRecorder()
	var queued int
	r := &Runner{Mode: rec, MinSyncPeriod: 300 * time.Millisecond, SyncPeriod: time.Hour,
		Hooks: Hooks{Queued: func(time.Time) { queued++ }}}
	start(t, r)
	first := snap(0)
	r.Update(first)
	rec.await(t, 1)
	// A burst within the minimum period: one more sync, of the last snapshot.
	var last *service.Snapshot
	for i := 1; i <= 50; i++ {
		last = snap(i)
		r.Update(last)
	}
	if got := rec.await(t, 2); got != last {
		t.Errorf("sync after the burst: got a snapshot of %d ports, want the last (%d)", len(got.Ports), len(last.Ports))
	}
	time.Sleep(400 * time.Millisecond)
	if n := rec.count(); n != 2 {
		t.Errorf("syncs for 1 + a burst of 50 updates: got %d, want 2", n)
	}
	rec.mu.Lock()
	gap := rec.at[1].Sub(rec.at[0])
	rec.mu.Unlock()
	if gap < 300*time.Millisecond {
		t.Errorf("second sync %v after the first, want at least the minimum period 300ms", gap)
	}
	if r.Latest() != last {
		t.Errorf("Latest: want the last snapshot handed to Update")
	}
}

func TestPeriodicResync(t *testing.T) {
	rec := newRecorder()
	r := &Runner{Mode: rec, SyncPeriod: 50 * time.Millisecond}
	start(t, r)
	s := snap(1)
	r.Update(s)
	// Without further updates the same snapshot is synced again each period.
	for i := 2; i <= 4; i++ {
		if got := rec.await(t, i); got != s {
			t.Fatalf("resync %d: got another snapshot, want the same", i)
		}
	}
}

func TestFailedSyncIsRetriedBeforeThePeriod(t *testing.T) {
	rec := newRecorder()
	rec.fail = 1
	var errs []error
	var mu sync.Mutex
	r := &Runner{Mode: rec, SyncPeriod: time.Hour, Hooks: Hooks{
		Synced: func(_ time.Time, _ time.Duration, _ *service.Snapshot, err error) {
			mu.Lock()
			errs = append(errs, err)
			mu.Unlock()
		},
	}}
	start(t, r)
	r.Update(snap(1))
	rec.await(t, 2) // the retry comes after about a second, not after the hour
	// The hook runs after Sync returns: wait for the second call too.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		mu.Lock()
		n := len(errs)
		mu.Unlock()
		if n >= 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Synced hook: %d calls, want 2", n)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if errs[0] == nil || errs[1] != nil {
		t.Errorf("Synced hook errors: got %v, want [failure, nil]", errs)
	}
}
