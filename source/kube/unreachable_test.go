package kube

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"syscall"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/tools/cache"

	"github.com/uproxy/uproxy/test/testbed/logs"
)

// roundTripFunc is an http.RoundTripper of one function.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// fakeAPI is a failureLog in front of a server whose answers the test sets:
// err for every request, else status by path and watch ("/api/v1/services",
// "/api/v1/services?watch"), else 200. Its clock stands until the test moves it.
type fakeAPI struct {
	t      *testing.T
	f      *failureLog
	now    time.Time
	err    error
	status map[string]int
}

func newFakeAPI(t *testing.T) *fakeAPI {
	a := &fakeAPI{t: t, now: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC), status: map[string]int{}}
	a.f = newFailureLog("https://10.0.0.1:6443", roundTripFunc(func(r *http.Request) (*http.Response, error) {
		if a.err != nil {
			return nil, a.err
		}
		key := r.URL.Path
		if r.URL.Query().Has("watch") {
			key += "?watch"
		}
		code, ok := a.status[key]
		if !ok {
			code = http.StatusOK
		}
		return &http.Response{StatusCode: code, Status: fmt.Sprintf("%d %s", code, http.StatusText(code)), Body: http.NoBody}, nil
	}))
	a.f.now = func() time.Time { return a.now }
	return a
}

// get sends n GETs of each target in turn (a path, with ?watch=true for a watch).
func (a *fakeAPI) get(n int, targets ...string) {
	a.t.Helper()
	for range n {
		for _, target := range targets {
			req, err := http.NewRequest("GET", "https://10.0.0.1:6443"+target, nil)
			if err != nil {
				a.t.Fatal(err)
			}
			if resp, _ := a.f.RoundTrip(req); resp != nil {
				resp.Body.Close()
			}
		}
	}
}

const (
	servicesPath = "/api/v1/services"
	slicesPath   = "/apis/discovery.k8s.io/v1/endpointslices"
)

// A server that cannot be reached, or refuses the client's credentials, is
// logged at the default verbosity: the first failure at once, then one line
// per interval while they go on, with how many there were; the first answer
// after them is logged once, the next not.
func TestFailureLogIsRateLimited(t *testing.T) {
	log := logs.Capture(t)
	a := newFakeAPI(t)

	a.err = fmt.Errorf("dial tcp 10.0.0.1:6443: %w", syscall.ECONNREFUSED)
	a.get(50, servicesPath)
	logs.Check(t, "50 refused requests", log.Since(), [][]string{{"E", `"API server request failed; retrying"`, "connection refused", `host="https://10.0.0.1:6443"`, "failures=1"}})
	a.now = a.now.Add(10 * time.Second)
	a.get(10, servicesPath, slicesPath)
	logs.Check(t, "20 more within the interval, of two resources", log.Since(), nil)
	a.now = a.now.Add(DefaultFailureLogInterval)
	a.err, a.status[servicesPath] = nil, http.StatusUnauthorized
	a.get(1, servicesPath)
	logs.Check(t, "a 401 an interval later", log.Since(), [][]string{{"E", "401 Unauthorized: the API server refuses the client's credentials", "failures=70", `failingFor="40s"`}})

	delete(a.status, servicesPath)
	a.get(3, servicesPath)
	logs.Check(t, "the server answers", log.Since(), [][]string{{"I", `"API server answers again"`, "failures=71", `failedFor="40s"`}})
	a.status[servicesPath] = http.StatusForbidden
	a.get(1, servicesPath)
	logs.Check(t, "a forbidden list after the recovery", log.Since(), [][]string{{"E", "cannot list services", `resource="services"`, "failures=1"}})
}

// Allowed Services but not EndpointSlices (a ClusterRole short of a rule), the
// Service requests that succeed between the forbidden slice requests are no
// recovery: the slices' failure is logged once per interval, and recovers
// only when a slice request succeeds.
func TestFailureLogTracksEachResource(t *testing.T) {
	log := logs.Capture(t)
	a := newFakeAPI(t)

	a.status[slicesPath] = http.StatusForbidden
	a.status[slicesPath+"?watch"] = http.StatusForbidden
	a.get(20, servicesPath, slicesPath, servicesPath+"?watch=true", slicesPath+"?watch=true")
	logs.Check(t, "slices forbidden, Services allowed", log.Since(), [][]string{{"E", `"API server request failed; retrying"`,
		"403 Forbidden: cannot list endpointslices.discovery.k8s.io: the ClusterRole needs list and watch",
		`resource="endpointslices.discovery.k8s.io"`, "failures=1"}})
	a.now = a.now.Add(DefaultFailureLogInterval)
	a.get(1, servicesPath, slicesPath+"?watch=true")
	logs.Check(t, "an interval later", log.Since(), [][]string{{"E", "cannot watch endpointslices.discovery.k8s.io", "failures=40", `failingFor="30s"`}})

	delete(a.status, slicesPath)
	a.get(1, slicesPath)
	logs.Check(t, "slices listed, watch still forbidden", log.Since(), nil)
	delete(a.status, slicesPath+"?watch")
	a.get(1, slicesPath+"?watch=true")
	logs.Check(t, "slices watched", log.Since(), [][]string{{"I", `"API server requests succeed again"`, `resource="endpointslices.discovery.k8s.io"`, "failures=41"}})
	a.get(3, slicesPath, slicesPath+"?watch=true")
	logs.Check(t, "after the recovery", log.Since(), nil)

	// An informer whose watch streams the initial list needs no list: its
	// watch that succeeds clears its list's failure too.
	a.status[servicesPath] = http.StatusInternalServerError
	a.get(1, servicesPath)
	a.get(1, servicesPath+"?watch=true&sendInitialEvents=true")
	logs.Check(t, "a list fails, a watch list succeeds", log.Since(), [][]string{
		{"E", "GET /api/v1/services: 500 Internal Server Error", `resource="services"`},
		{"I", `"API server requests succeed again"`, `resource="services"`, "failures=1"},
	})
}

func TestResourceOf(t *testing.T) {
	tests := []struct{ method, target, resource, verb string }{
		{"GET", "/api/v1/services?labelSelector=x", "services", "list"},
		{"GET", "/api/v1/services?watch=true&resourceVersion=5", "services", "watch"},
		{"GET", "/api/v1/nodes?fieldSelector=metadata.name%3Dnode-a&watch=1", "nodes", "watch"},
		{"GET", "/api/v1/nodes/node-a", "nodes", "get"},
		{"GET", "/apis/discovery.k8s.io/v1/endpointslices", "endpointslices.discovery.k8s.io", "list"},
		{"GET", "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices", "endpointslices.discovery.k8s.io", "list"},
		{"GET", "/api/v1/namespaces/default/services/web", "services", "get"},
		{"GET", "/api/v1/namespaces", "namespaces", "list"},
		{"GET", "/api/v1/namespaces/default", "namespaces", "get"},
		{"POST", "/api/v1/namespaces/default/services", "services", "post"},
		{"GET", "/version", "/version", "get"},
		{"GET", "/apis", "/apis", "get"},
	}
	for _, tt := range tests {
		req, err := http.NewRequest(tt.method, "https://10.0.0.1:6443"+tt.target, nil)
		if err != nil {
			t.Fatal(err)
		}
		if res, verb := resourceOf(req); res != tt.resource || verb != tt.verb {
			t.Errorf("%s %s: got %q %q, want %q %q", tt.method, tt.target, res, verb, tt.resource, tt.verb)
		}
	}
}

// The informers' watch error handler logs at the default verbosity only what
// failureLog has not: client-go's own line for a failed list or watch would
// repeat failureLog's, at every retry.
func TestWatchErrorLeavesFailuresToTheTransport(t *testing.T) {
	slicesGR := schema.GroupResource{Group: "discovery.k8s.io", Resource: "endpointslices"}
	tests := []struct {
		name   string
		err    error
		logged bool // by watchError at the default verbosity
	}{
		{"connection refused", &url.Error{Op: "Get", URL: "https://10.0.0.1:6443/api/v1/services", Err: syscall.ECONNREFUSED}, false},
		{"forbidden", apierrors.NewForbidden(slicesGR, "", errors.New("no rule")), false},
		{"unauthorized", apierrors.NewUnauthorized("bad token"), false},
		{"not found", apierrors.NewNotFound(slicesGR, ""), false},
		{"internal error", apierrors.NewInternalError(errors.New("etcd")), false},
		{"an answer that does not decode", errors.New("couldn't get version/kind; json parse error"), true},
		{"expired", apierrors.NewResourceExpired("too old resource version"), false}, // client-go's default: -v=4
	}
	r := cache.NewReflector(&cache.ListWatch{}, nil, cache.NewStore(cache.MetaNamespaceKeyFunc), 0)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			log := logs.Capture(t)
			watchError(context.Background(), r, fmt.Errorf("failed to list *v1.EndpointSlice: %w", tt.err))
			got := len(log.Since()) > 0
			if got != tt.logged {
				t.Errorf("logged at the default verbosity: got %v, want %v", got, tt.logged)
			}
		})
	}
}
