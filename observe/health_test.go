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
