package kube

import (
	"fmt"
	"net/http"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/testbed/logs"
)

// roundTripFunc is an http.RoundTripper of one function.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// Failed requests to the API server are logged at the default verbosity: the
// first at once, then one line per interval while they go on, with how many
// there were; the first answer after them is logged once, the next not.
func TestFailureLogIsRateLimited(t *testing.T) {
	log := logs.Capture(t)
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	var status int
	var err error
	f := newFailureLog("https://10.0.0.1:6443", roundTripFunc(func(*http.Request) (*http.Response, error) {
		if err != nil {
			return nil, err
		}
		return &http.Response{StatusCode: status, Status: http.StatusText(status), Body: http.NoBody}, nil
	}))
	f.now = func() time.Time { return now }
	req, _ := http.NewRequest("GET", "https://10.0.0.1:6443/api/v1/services", nil)
	do := func(n int) {
		for range n {
			if resp, _ := f.RoundTrip(req); resp != nil {
				resp.Body.Close()
			}
		}
	}

	err = fmt.Errorf("dial tcp 10.0.0.1:6443: %w", syscall.ECONNREFUSED)
	do(50)
	logs.Check(t, "50 refused requests", log.Since(), [][]string{{"E", `"API server request failed; retrying"`, "connection refused", `host="https://10.0.0.1:6443"`, "failures=1"}})
	now = now.Add(10 * time.Second)
	do(10)
	logs.Check(t, "10 more within the interval", log.Since(), nil)
	now = now.Add(DefaultFailureLogInterval)
	err, status = nil, http.StatusServiceUnavailable
	do(1)
	logs.Check(t, "a 503 an interval later", log.Since(), [][]string{{"E", "Service Unavailable", "failures=60", `failingFor="40s"`}})

	status = http.StatusOK
	do(3)
	logs.Check(t, "the server answers", log.Since(), [][]string{{"I", `"API server answers again"`, "failures=61"}})
	status = http.StatusForbidden
	do(1)
	logs.Check(t, "refused credentials after the recovery", log.Since(), [][]string{{"E", "Forbidden", "failures=1"}})
}
