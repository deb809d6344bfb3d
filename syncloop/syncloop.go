// Package syncloop runs a proxy mode's sync loop: it takes the newest Snapshot from a
// source and hands it to the mode at most once per MinSyncPeriod and at least once
// per SyncPeriod, so bursts of changes cost one sync and drift is always repaired.
package syncloop

import (
	"context"
	"sync"
	"time"

	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/uproxy/uproxy/service"
)

// A Mode programs a Snapshot: the userspace proxier, or a kernel mode.
type Mode interface {
	// Sync makes the running state match s. It is only ever called from one
	// goroutine. An error means the sync should be retried; what could be
	// programmed stays programmed.
	Sync(s *service.Snapshot) error
}

// A Source keeps the desired state and announces every new Snapshot by calling
// update (never concurrently). Run blocks until ctx is done.
type Source interface {
	Run(ctx context.Context, update func(*service.Snapshot)) error
}

// Hooks are told about the loop's progress (metrics, health); any may be nil.
type Hooks struct {
	// Queued is called when a new snapshot arrives and a sync is pending.
	Queued func(at time.Time)
	// Synced is called after every sync with its start, duration and error.
	Synced func(start time.Time, took time.Duration, s *service.Snapshot, err error)
}

// Runner is the bounded-frequency sync loop. The zero value is not usable: set
// Mode. Update may be called from any goroutine.
type Runner struct {
	Mode Mode
	// MinSyncPeriod is the least time between two syncs; 0 means none.
	MinSyncPeriod time.Duration
	// SyncPeriod is the most time between two syncs (a periodic resync even
	// without changes); 0 means 30s.
	SyncPeriod time.Duration
	Hooks      Hooks
	// Clock times the periods and the syncs; nil means the real clock (tests set a
	// fake one).
	Clock clock.Clock
	// Check, if set, is asked every CheckPeriod between syncs whether what the
	// last sync programmed is still there (the mode's canary); false syncs at
	// once, so rules someone flushed are back within CheckPeriod rather than
	// SyncPeriod. It runs on the loop's goroutine, never during a Sync, and must
	// be cheap.
	Check func() bool
	// CheckPeriod is how often Check runs; 0 means DefaultCheckPeriod.
	CheckPeriod time.Duration

	mu      sync.Mutex
	latest  *service.Snapshot // newest snapshot, nil until the first arrives
	pending bool              // latest has not been synced yet
	kick    chan struct{}     // capacity 1: "something is pending"
}

func (r *Runner) syncPeriod() time.Duration {
	if r.SyncPeriod <= 0 {
		return 30 * time.Second
	}
	return r.SyncPeriod
}

// DefaultCheckPeriod is how often a Runner runs Check when CheckPeriod is 0.
const DefaultCheckPeriod = 5 * time.Second

func (r *Runner) checkPeriod() time.Duration {
	if r.CheckPeriod <= 0 {
		return DefaultCheckPeriod
	}
	return r.CheckPeriod
}

func (r *Runner) clock() clock.Clock {
	if r.Clock == nil {
		return clock.RealClock{}
	}
	return r.Clock
}

func (r *Runner) init() {
	r.mu.Lock()
	if r.kick == nil {
		r.kick = make(chan struct{}, 1)
	}
	r.mu.Unlock()
}

// Update records s as the desired state and queues a sync.
func (r *Runner) Update(s *service.Snapshot) {
	r.init()
	now := r.clock().Now()
	r.mu.Lock()
	r.latest = s
	wasPending := r.pending
	r.pending = true
	r.mu.Unlock()
	if !wasPending && r.Hooks.Queued != nil {
		r.Hooks.Queued(now)
	}
	select {
	case r.kick <- struct{}{}:
	default:
	}
}

// Latest returns the newest snapshot handed to Update (nil before the first).
func (r *Runner) Latest() *service.Snapshot {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.latest
}

// Run syncs until ctx is done. Nothing is synced before the first Update.
func (r *Runner) Run(ctx context.Context) {
	r.init()
	c := r.clock()
	var last time.Time // start of the previous sync
	periodic := c.NewTimer(r.syncPeriod())
	defer periodic.Stop()
	var check clock.Timer
	var checkC <-chan time.Time // nil, never ready, without Check
	if r.Check != nil {
		check = c.NewTimer(r.checkPeriod())
		defer check.Stop()
		checkC = check.C()
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.kick:
			// A kick left over from updates that the previous sync already took
			// in (it syncs the latest snapshot) needs no sync of its own.
			r.mu.Lock()
			pending := r.pending
			r.mu.Unlock()
			if !pending {
				continue
			}
		case <-periodic.C():
		case <-checkC:
			r.mu.Lock()
			synced := r.latest != nil
			r.mu.Unlock()
			intact := !synced || r.Check()
			// Re-armed once Check has answered, so whoever waits for the
			// timer sees the check done.
			check.Reset(r.checkPeriod())
			if intact {
				continue
			}
			klog.InfoS("Rules changed by someone else since the last sync; syncing now")
		}
		if wait := r.MinSyncPeriod - c.Since(last); !last.IsZero() && wait > 0 {
			t := c.NewTimer(wait)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C():
			}
		}
		r.mu.Lock()
		s := r.latest
		r.pending = false
		r.mu.Unlock()
		if s == nil {
			periodic.Reset(r.syncPeriod())
			continue
		}
		last = c.Now()
		err := r.Mode.Sync(s)
		took := c.Since(last)
		if err != nil {
			klog.ErrorS(err, "Sync failed; will retry", "took", took)
		} else {
			klog.V(3).InfoS("Synced", "ports", len(s.Ports), "took", took)
		}
		next := r.syncPeriod()
		if err != nil {
			// Retry soon rather than a whole period later, but never faster than
			// the minimum period (or once a second without one).
			next = max(r.MinSyncPeriod, time.Second)
		}
		if !periodic.Stop() {
			select {
			case <-periodic.C():
			default:
			}
		}
		periodic.Reset(next)
		// The hook runs once the next sync is scheduled, so whoever it tells
		// sees the loop's timing settled.
		if r.Hooks.Synced != nil {
			r.Hooks.Synced(last, took, s, err)
		}
	}
}
