package kube

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// DefaultFailureLogInterval is how often, at most, a failure of the API server
// (or of one resource's requests) is logged again while it goes on.
const DefaultFailureLogInterval = 30 * time.Second

// failureLog is a RoundTripper that says at the default verbosity when
// requests to the API server fail, and when they succeed again. client-go's
// informers retry failed lists and watches on their own, and their default
// watch error handler logs every failure at the default verbosity (except a
// refused connection, which it does not log at all); the Source gives them
// watchError instead, which leaves to failureLog the failures it logs, so
// that those lines are the only ones.
//
// Failures are tracked apart for what fails. The server fails as a whole when
// it cannot be reached or refuses the client's credentials (401), and answers
// again with any other response. A resource fails when a verb's requests of it
// are forbidden (403), not found (404: no such resource, or no API server) or
// fail in the server (5xx), and succeeds again only when its own failed verbs
// do: a Service list that succeeds says nothing of EndpointSlices, nor a
// list of a watch that is forbidden. A watch that succeeds clears its
// resource's list too: an informer whose watch streams the initial list
// (client-go's WatchListClient) needs nothing else. The first failure of each
// is logged at once, then at most one line per interval while failures go on,
// each with how many there were since the last.
type failureLog struct {
	next     http.RoundTripper
	host     string
	interval time.Duration
	now      func() time.Time

	// mu guards failing, which holds what fails now: the server under "",
	// a resource under its name (resourceOf).
	mu      sync.Mutex
	failing map[string]*failures
}

// failures describes the failures of one thing since it last succeeded: since
// is when the first of them came, total how many, unlogged how many since
// logged, the time of the last failure line; verbs are the verbs that fail
// (for the server, none).
type failures struct {
	verbs    map[string]bool
	since    time.Time
	total    int
	unlogged int
	logged   time.Time
}

// server is failureLog's key for the API server as a whole.
const server = ""

func newFailureLog(host string, next http.RoundTripper) *failureLog {
	return &failureLog{next: next, host: host, interval: DefaultFailureLogInterval, now: time.Now, failing: map[string]*failures{}}
}

func (f *failureLog) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := f.next.RoundTrip(req)
	switch {
	case err != nil && req.Context().Err() != nil:
		// Cancelled by its caller (a watch ended at shutdown): not the server's doing.
	case err != nil:
		f.failed(server, "", err)
	case resp.StatusCode == http.StatusUnauthorized:
		f.failed(server, "", fmt.Errorf("%s %s: %s: the API server refuses the client's credentials", req.Method, req.URL.Path, resp.Status))
	default:
		f.succeeded(server, "")
		res, verb := resourceOf(req)
		switch code := resp.StatusCode; {
		case code == http.StatusForbidden:
			hint := ""
			if verb == "list" || verb == "watch" {
				hint = ": the ClusterRole needs list and watch"
			}
			f.failed(res, verb, fmt.Errorf("%s %s: %s: cannot %s %s%s", req.Method, req.URL.Path, resp.Status, verb, res, hint))
		case failedStatus(code):
			f.failed(res, verb, fmt.Errorf("%s %s: %s", req.Method, req.URL.Path, resp.Status))
		case code < 400:
			f.succeeded(res, verb)
		}
		// Other statuses (409, 410 for a list too old, 429 while throttled)
		// are the informers' ordinary business: neither failure nor success.
	}
	return resp, err
}

// failedStatus reports whether a response of status code is a failure of the
// request's resource (401 is the server's).
func failedStatus(code int) bool {
	return code == http.StatusForbidden || code == http.StatusNotFound || code >= 500
}

// failed records a failed request of what (server or a resource) by verb, and
// logs it unless a failure of what was logged less than an interval ago.
func (f *failureLog) failed(what, verb string, err error) {
	now := f.now()
	f.mu.Lock()
	defer f.mu.Unlock()
	s := f.failing[what]
	if s == nil {
		s = &failures{since: now, verbs: map[string]bool{}}
		f.failing[what] = s
	}
	if what != server {
		s.verbs[verb] = true
	}
	s.total++
	s.unlogged++
	if s.total > 1 && now.Sub(s.logged) < f.interval {
		return
	}
	kv := []any{"host", f.host}
	if what != server {
		kv = append(kv, "resource", what)
	}
	kv = append(kv, "failures", s.unlogged, "failingFor", now.Sub(s.since).Round(time.Second))
	klog.ErrorS(err, "API server request failed; retrying", kv...)
	s.unlogged, s.logged = 0, now
}

// succeeded records a request of what by verb that succeeded, and logs the
// recovery once, when nothing of what fails any more.
func (f *failureLog) succeeded(what, verb string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s := f.failing[what]
	if s == nil {
		return
	}
	if verb == "watch" {
		clear(s.verbs)
	}
	delete(s.verbs, verb)
	if len(s.verbs) > 0 {
		return
	}
	delete(f.failing, what)
	failedFor := f.now().Sub(s.since).Round(time.Second)
	if what == server {
		klog.InfoS("API server answers again", "host", f.host, "failures", s.total, "failedFor", failedFor)
		return
	}
	klog.InfoS("API server requests succeed again", "host", f.host, "resource", what, "failures", s.total, "failedFor", failedFor)
}

// resourceOf names the resource a request is for as RBAC names it
// ("services", "endpointslices.discovery.k8s.io"), and the verb RBAC checks
// (get, list, watch; the method otherwise). A path that names no resource
// (/version, /apis) stands for itself.
func resourceOf(req *http.Request) (resource, verb string) {
	segs := strings.Split(strings.Trim(req.URL.Path, "/"), "/")
	group := ""
	switch {
	case len(segs) >= 3 && segs[0] == "api":
		segs = segs[2:]
	case len(segs) >= 4 && segs[0] == "apis":
		group, segs = segs[1], segs[3:]
	default:
		return req.URL.Path, strings.ToLower(req.Method)
	}
	if len(segs) >= 3 && segs[0] == "namespaces" {
		segs = segs[2:] // a namespaced resource
	}
	resource = segs[0]
	if group != "" {
		resource += "." + group
	}
	switch w := req.URL.Query().Get("watch"); {
	case req.Method != http.MethodGet:
		verb = strings.ToLower(req.Method)
	case w == "true" || w == "1":
		verb = "watch"
	case len(segs) == 1:
		verb = "list"
	default:
		verb = "get"
	}
	return resource, verb
}

// watchError is the informers' watch error handler. The failures failureLog
// logs (a server that cannot be reached, a response of a failed status) it
// logs at -v=2 only: client-go's default handler would log each of them again
// at the default verbosity, beside failureLog's rate-limited line. Anything
// else (an answer that does not decode, an error inside a watch stream) goes
// to client-go's default handler, as it would without uproxy's.
func watchError(ctx context.Context, r *cache.Reflector, err error) {
	if loggedByTransport(err) {
		klog.FromContext(ctx).V(2).Info("Failed to watch", "reflector", r.Name(), "type", r.TypeDescription(), "err", err)
		return
	}
	cache.DefaultWatchErrorHandler(ctx, r, err)
}

// loggedByTransport reports whether err, from a list or watch, is one that
// failureLog has seen and logged.
func loggedByTransport(err error) bool {
	var ue *url.Error
	if errors.As(err, &ue) {
		return true
	}
	var status apierrors.APIStatus
	if errors.As(err, &status) {
		code := int(status.Status().Code)
		return code == http.StatusUnauthorized || failedStatus(code)
	}
	return false
}
