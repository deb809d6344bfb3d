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
	ineligible  bool      // the Node is being deleted or drained
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

// Started records that the sync loop starts at at: until the first sync, it
// stands as the last update, as kube-proxy's sync loop records its start, so
// lastUpdated is never the zero time.
func (h *Health) Started(at time.Time) {
	h.mu.Lock()
	if h.lastUpdated.IsZero() {
		h.lastUpdated = at
	}
	h.mu.Unlock()
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

// SetNodeEligible records whether this node should receive external traffic
// (false while its Node is being deleted or drained by the cluster autoscaler,
// or, with an API server, while it is not known: kube-proxy's /healthz answers
// 503 without a Node, among others before its first sync).
func (h *Health) SetNodeEligible(eligible bool) {
	h.mu.Lock()
	h.ineligible = !eligible
	h.mu.Unlock()
}

// ServeHTTP answers /healthz: 200 when healthy and the node is eligible, 503
// otherwise, with kube-proxy's body.
func (h *Health) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h.serve(w, true)
}

// Livez answers /livez: like /healthz, but only about the proxy itself (a node
// being drained is still alive), and without nodeEligible, as kube-proxy.
func (h *Health) Livez() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { h.serve(w, false) })
}

func (h *Health) serve(w http.ResponseWriter, withNode bool) {
	now := time.Now()
	ok, last := h.Healthy(now)
	var body healthStatus
	if withNode {
		h.mu.Lock()
		eligible := !h.ineligible
		h.mu.Unlock()
		body.NodeEligible = &eligible
		ok = ok && eligible
	}
	// As kube-proxy, a healthy answer's lastUpdated is the current time (what
	// it meant in older releases, where the sync loop ran periodically).
	if ok {
		last = now
	}
	body.LastUpdated, body.CurrentTime = last.String(), now.String()
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	if !ok {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	json.NewEncoder(w).Encode(body)
}
