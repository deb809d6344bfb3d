package main

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/syncloop"
)

// syncingMode is a Mode whose Sync blocks until released, and whose Cleanup
// records whether it ran while a Sync was still in flight.
type syncingMode struct {
	entered, release chan struct{}
	cleaned          chan struct{}

	mu             sync.Mutex
	inSync         bool
	cleanedMidSync bool
}

func (m *syncingMode) Sync(*service.Snapshot) error {
	m.mu.Lock()
	m.inSync = true
	m.mu.Unlock()
	m.entered <- struct{}{}
	<-m.release
	m.mu.Lock()
	m.inSync = false
	m.mu.Unlock()
	return nil
}

func (m *syncingMode) Cleanup() error {
	m.mu.Lock()
	m.cleanedMidSync = m.inSync
	m.mu.Unlock()
	close(m.cleaned)
	return nil
}

// A sync in flight when the proxy is told to stop completes before
// --cleanup-on-exit removes the rules: otherwise it would write them back after
// their removal.
func TestFinishWaitsForTheSyncInFlight(t *testing.T) {
	m := &syncingMode{entered: make(chan struct{}), release: make(chan struct{}), cleaned: make(chan struct{})}
	r := &syncloop.Runner{Mode: m, SyncPeriod: time.Hour}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	syncDone := make(chan struct{})
	go func() {
		defer close(syncDone)
		r.Run(ctx)
	}()
	r.Update(&service.Snapshot{})
	select {
	case <-m.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the first sync never started")
	}

	cancel()
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		finish(syncDone, nil, time.Second, m, true)
	}()
	// finish must not clean up while the sync runs. Give it the chance to (a
	// cleanup would come at once), then let the sync end.
	select {
	case <-m.cleaned:
	case <-time.After(200 * time.Millisecond):
	}
	close(m.release)
	select {
	case <-finished:
	case <-time.After(10 * time.Second):
		t.Fatal("finish did not return once the sync ended")
	}
	select {
	case <-m.cleaned:
	default:
		t.Fatal("--cleanup-on-exit: Cleanup never ran")
	}
	if m.cleanedMidSync {
		t.Error("Cleanup ran while a sync was in flight; want it after the sync loop returned")
	}
}
