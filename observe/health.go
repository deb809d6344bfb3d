package observe

import (
	"encoding/json"
	"net/http"
	"sync"
	"time"
)

// Health tracks whether the proxy keeps up with its source, with kube-proxy's
// semantics: unhealthy when an update has been queued for longer than Timeout
// without a successful sync.
type Health struct {
	// Timeout is how long a queued update may wait (kube-proxy: 2 × sync period).
	Timeout time.Duration

	mu          sync.Mutex
	lastUpdated time.Time // last successful sync
	oldestQueue time.Time // first update queued since the last sync; zero when none
}

// Queued records that an update is waiting for a sync.
func (h *Health) Queued(at time.Time) {
	h.mu.Lock()
	if h.oldestQueue.IsZero() {
		h.oldestQueue = at
	}
	h.mu.Unlock()
	SyncLastQueuedTimestamp.Set(float64(at.UnixNano()) / 1e9)
}

// Synced records a successful sync that began at start: every update queued
// before it is now programmed.
func (h *Health) Synced(start time.Time) {
	h.mu.Lock()
	h.lastUpdated = time.Now()
	if !h.oldestQueue.IsZero() && !h.oldestQueue.After(start) {
		h.oldestQueue = time.Time{}
	}
	h.mu.Unlock()
}

// healthStatus is kube-proxy's /healthz body.
type healthStatus struct {
	LastUpdated  string `json:"lastUpdated"`
	CurrentTime  string `json:"currentTime"`
	NodeEligible *bool  `json:"nodeEligible,omitempty"`
}

// Healthy reports the verdict at now with the last successful sync time.
func (h *Health) Healthy(now time.Time) (bool, time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	ok := h.oldestQueue.IsZero() || now.Sub(h.oldestQueue) < h.Timeout
	return ok, h.lastUpdated
}

// ServeHTTP answers /healthz and /livez: 200 when healthy, 503 otherwise.
func (h *Health) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	now := time.Now()
	ok, last := h.Healthy(now)
	eligible := true
	body := healthStatus{LastUpdated: last.String(), CurrentTime: now.String(), NodeEligible: &eligible}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	if !ok {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	json.NewEncoder(w).Encode(body)
}
