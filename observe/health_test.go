package observe

import (
	"encoding/json"
	"net/http/httptest"
	"testing"
	"time"
)

func TestHealth(t *testing.T) {
	type body struct {
		LastUpdated  string `json:"lastUpdated"`
		CurrentTime  string `json:"currentTime"`
		NodeEligible *bool  `json:"nodeEligible"`
	}
	get := func(t *testing.T, h *Health, path string) (int, body) {
		t.Helper()
		rec := httptest.NewRecorder()
		if path == "/livez" {
			h.Livez().ServeHTTP(rec, httptest.NewRequest("GET", path, nil))
		} else {
			h.ServeHTTP(rec, httptest.NewRequest("GET", path, nil))
		}
		var b body
		if err := json.Unmarshal(rec.Body.Bytes(), &b); err != nil {
			t.Fatalf("%s body %q: %v", path, rec.Body.String(), err)
		}
		return rec.Code, b
	}
	now := time.Now()
	tests := []struct {
		name                  string
		queuedAgo             time.Duration // 0: nothing queued
		synced                bool
		ineligible            bool
		wantHealthz, wantLive int
	}{
		{"fresh, nothing queued", 0, false, false, 200, 200},
		{"update queued briefly", time.Second, false, false, 200, 200},
		{"update queued too long", time.Minute, false, false, 503, 503},
		{"update queued too long, then synced", time.Minute, true, false, 200, 200},
		{"node not eligible", 0, false, true, 503, 200},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := &Health{Timeout: 10 * time.Second}
			if tt.queuedAgo != 0 {
				h.Queued(now.Add(-tt.queuedAgo))
			}
			if tt.synced {
				h.Synced(now)
			}
			if tt.ineligible {
				h.SetNodeEligible(false)
			}
			code, b := get(t, h, "/healthz")
			if code != tt.wantHealthz {
				t.Errorf("/healthz: got %d, want %d", code, tt.wantHealthz)
			}
			if b.NodeEligible == nil || *b.NodeEligible == tt.ineligible {
				t.Errorf("/healthz nodeEligible: got %v, want %v", b.NodeEligible, !tt.ineligible)
			}
			if b.CurrentTime == "" || b.LastUpdated == "" {
				t.Errorf("/healthz body lacks times: %+v", b)
			}
			code, b = get(t, h, "/livez")
			if code != tt.wantLive {
				t.Errorf("/livez: got %d, want %d", code, tt.wantLive)
			}
			if b.NodeEligible != nil {
				t.Errorf("/livez carries nodeEligible; kube-proxy's does not")
			}
		})
	}
}

// Before the first sync, /healthz answers as kube-proxy's: healthy while nothing
// has waited too long, with lastUpdated the current time; unhealthy, the sync
// loop's start stands as the last update, never the zero time.
func TestHealthBeforeTheFirstSync(t *testing.T) {
	h := &Health{Timeout: 10 * time.Second}
	start := time.Now().Add(-time.Minute)
	h.Started(start)
	get := func() (int, healthStatus) {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest("GET", "/healthz", nil))
		var b healthStatus
		if err := json.Unmarshal(rec.Body.Bytes(), &b); err != nil {
			t.Fatalf("/healthz body %q: %v", rec.Body.String(), err)
		}
		return rec.Code, b
	}
	if code, b := get(); code != 200 || b.LastUpdated != b.CurrentTime {
		t.Errorf("healthy before the first sync: got %d %+v, want 200 with lastUpdated the current time", code, b)
	}
	h.SetNodeEligible(false)
	if code, b := get(); code != 503 || b.LastUpdated != start.String() {
		t.Errorf("node not known: got %d %+v, want 503 with lastUpdated the start, %s", code, b, start)
	}
	h.Started(time.Now()) // only the first start counts
	if _, b := get(); b.LastUpdated != start.String() {
		t.Errorf("after a second Started: got lastUpdated %s, want the first start %s", b.LastUpdated, start)
	}
}
