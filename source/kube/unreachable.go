package kube

import (
	"fmt"
	"net/http"
	"sync"
	"time"

	"k8s.io/klog/v2"
)

// DefaultFailureLogInterval is how often, at most, a failing API server is
// logged again while it keeps failing.
const DefaultFailureLogInterval = 30 * time.Second

// failureLog is a RoundTripper that says at the default verbosity when
// requests to the API server fail, and when they succeed again. client-go's
// informers retry failed lists and watches on their own and say so only at -v=2,
// so an API server that cannot be reached (or that refuses the client's
// credentials) would otherwise look like a long wait for the first Services.
// The first failure is logged at once, then at most one line per interval
// while failures go on, each with how many there were since the last.
type failureLog struct {
	next     http.RoundTripper
	host     string
	interval time.Duration
	now      func() time.Time

	// mu guards the state below, which describes the failures since the server
	// last answered: since is when the first of them came, total how many,
	// unlogged how many since logged, the time of the last failure line.
	mu       sync.Mutex
	failing  bool
	since    time.Time
	total    int
	unlogged int
	logged   time.Time
}

func newFailureLog(host string, next http.RoundTripper) *failureLog {
	return &failureLog{next: next, host: host, interval: DefaultFailureLogInterval, now: time.Now}
}

func (f *failureLog) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := f.next.RoundTrip(req)
	switch {
	case err != nil && req.Context().Err() != nil:
		// Cancelled by its caller (a watch ended at shutdown): not the server's doing.
	case err != nil:
		f.failed(err)
	case resp.StatusCode == http.StatusUnauthorized || resp.StatusCode == http.StatusForbidden || resp.StatusCode >= 500:
		f.failed(fmt.Errorf("%s %s: %s", req.Method, req.URL.Path, resp.Status))
	default:
		f.answered()
	}
	return resp, err
}

// failed records a failed request, and logs it unless a failure was logged
// less than an interval ago.
func (f *failureLog) failed(err error) {
	now := f.now()
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.failing {
		f.failing, f.since = true, now
	}
	f.total++
	f.unlogged++
	if f.total > 1 && now.Sub(f.logged) < f.interval {
		return
	}
	klog.ErrorS(err, "API server request failed; retrying", "host", f.host, "failures", f.unlogged, "failingFor", now.Sub(f.since).Round(time.Second))
	f.unlogged, f.logged = 0, now
}

// answered records a request the server answered, and logs the recovery
// once after failures.
func (f *failureLog) answered() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.failing {
		return
	}
	klog.InfoS("API server answers again", "host", f.host, "failures", f.total, "failedFor", f.now().Sub(f.since).Round(time.Second))
	f.failing, f.total, f.unlogged = false, 0, 0
}
