package app

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/spf13/cobra"

	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/syncloop"
	"github.com/uproxy/uproxy/test/testbed/logs"
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

// With the API server as the source, the first Snapshot counts as an update
// queued at the start, as the manifests' first load does: when it never comes
// (here every request is forbidden), /livez, and so /healthz, answers 503 once
// it is two --sync-periods late, where it had answered 200 for ever.
func TestAPISourceFirstSnapshotIsQueued(t *testing.T) {
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusForbidden)
		fmt.Fprint(w, `{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Forbidden","code":403}`)
	}))
	defer api.Close()
	free, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	healthz := free.Addr().String()
	free.Close()

	logs.Capture(t) // the failures are logged; not this test's business
	o := defaultOptions()
	cmd := &cobra.Command{Use: "uproxy"}
	o.addFlags(cmd)
	const syncPeriod = 500 * time.Millisecond
	if err := cmd.Flags().Parse([]string{"--master", api.URL, "--rules", "none", "--hostname-override", "node-a",
		"--sync-period", syncPeriod.String(), "--min-sync-period", "0",
		"--metrics-bind-address", "", "--healthz-bind-address", healthz}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- runProxy(ctx, o, nil) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("runProxy: %v", err)
		}
	}()

	livez := func() int {
		resp, err := http.Get("http://" + healthz + "/livez")
		if err != nil {
			return 0 // not serving yet
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	deadline := time.Now().Add(10 * time.Second)
	for livez() != http.StatusServiceUnavailable {
		if time.Now().After(deadline) {
			t.Fatalf("/livez, nothing ever synced: got %d %v after the start, want 503 after 2 × --sync-period (%v)", livez(), time.Since(start).Round(time.Millisecond), 2*syncPeriod)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if took := time.Since(start); took < 2*syncPeriod {
		t.Errorf("/livez failed %v after the start, before 2 × --sync-period (%v)", took, 2*syncPeriod)
	}
}

// A server is built without running: its mode is made and its HTTP addresses
// are bound, and Close releases them for a server that never runs.
func TestServerBuiltThenClosed(t *testing.T) {
	logs.Capture(t)
	o := defaultOptions()
	cmd := &cobra.Command{Use: "uproxy"}
	o.addFlags(cmd)
	if err := cmd.Flags().Parse([]string{"--services", t.TempDir(), "--proxy-mode", "userspace", "--rules", "none",
		"--hostname-override", "node-a", "--metrics-bind-address", "127.0.0.1:0", "--healthz-bind-address", ""}); err != nil {
		t.Fatal(err)
	}
	s, err := newServer(context.Background(), o)
	if err != nil {
		t.Fatalf("newServer: %v", err)
	}
	if s.modeName != "userspace" || s.mode == nil {
		t.Errorf("built mode: got %q (%v), want userspace", s.modeName, s.mode)
	}
	metrics := s.http.MetricsListener.Addr().String()
	s.Close()
	ln, err := net.Listen("tcp", metrics)
	if err != nil {
		t.Fatalf("the metrics address %s after Close: %v, want it released", metrics, err)
	}
	ln.Close()
}
