package observe_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/observe"
)

// --profiling serves Go's profiles on the metrics address, the heap one after
// a forced GC on ?gc=1; without it /debug/pprof/ is not there, even with the
// other debug handlers on.
func TestProfilingHandlers(t *testing.T) {
	t.Parallel()
	for _, profiling := range []bool{true, false} {
		srv := httptest.NewServer((&observe.Server{Mode: "userspace", Debug: true, Profiling: profiling}).MetricsHandler())
		defer srv.Close()
		resp, err := http.Get(srv.URL + "/debug/pprof/heap?gc=1&debug=1")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if !profiling {
			if resp.StatusCode != http.StatusNotFound {
				t.Errorf("without profiling: got status %d, want 404", resp.StatusCode)
			}
			continue
		}
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "# HeapAlloc = ") {
			t.Errorf("with profiling: got status %d and %.200q, want 200 and a heap profile with its MemStats", resp.StatusCode, body)
		}
		// The live heap that GC marked is among the metrics.
		resp, err = http.Get(srv.URL + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		body, _ = io.ReadAll(resp.Body)
		resp.Body.Close()
		if !regexp.MustCompile(`(?m)^go_gc_heap_live_bytes [1-9]`).Match(body) {
			t.Errorf("/metrics: no go_gc_heap_live_bytes above zero")
		}
	}
}
