package ab

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// httpServer is a net/http server on a loopback port that counts what it was
// asked.
type httpServer struct {
	addr string
	mu   sync.Mutex
	// conns counts the connections opened; requests the requests by path;
	// closing those that asked for Connection: close; hosts the Host headers.
	conns    int
	requests map[string]int
	closing  int
	hosts    map[string]bool
}

// serveHTTP runs handler behind a counting net/http server on a loopback port;
// t.Cleanup stops it.
func serveHTTP(t *testing.T, handler http.HandlerFunc) *httpServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &httpServer{addr: ln.Addr().String(), requests: map[string]int{}, hosts: map[string]bool{}}
	srv := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			hs.mu.Lock()
			hs.requests[r.URL.Path]++
			hs.hosts[r.Host] = true
			if r.Close {
				hs.closing++
			}
			hs.mu.Unlock()
			handler(w, r)
		}),
		ConnState: func(c net.Conn, st http.ConnState) {
			if st == http.StateNew {
				hs.mu.Lock()
				hs.conns++
				hs.mu.Unlock()
			}
		},
		ReadHeaderTimeout: 5 * time.Second,
	}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return hs
}

func (hs *httpServer) counts() (conns, requests, closing int) {
	hs.mu.Lock()
	defer hs.mu.Unlock()
	for _, n := range hs.requests {
		requests += n
	}
	return hs.conns, requests, hs.closing
}

// hello answers 200 with a small body, after delay.
func hello(delay time.Duration) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if delay > 0 {
			time.Sleep(delay)
		}
		fmt.Fprintln(w, "hello")
	}
}

// ModeHTTP against net/http servers: each exchange is a GET of the path, kept
// alive for the connection's requests or closed by the server with
// Connection: close, and a server 2ms slower is found slower.
func TestRunHTTP(t *testing.T) {
	for _, tc := range []struct {
		name       string
		close      bool
		perConn    int
		wantClosed bool
	}{
		{"keep-alive, 3 requests per connection", false, 3, false},
		{"Connection: close", true, 1, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fast, slow := serveHTTP(t, hello(0)), serveHTTP(t, hello(2*time.Millisecond))
			rep, err := Run(context.Background(), Config{A: fast.addr, B: slow.addr, Mode: ModeHTTP, Path: "/ok",
				HTTPClose: tc.close, Connections: 60, RequestsPerConnection: tc.perConn, Seed: 1})
			if err != nil {
				t.Fatal(err)
			}
			requireClean(t, rep, 60, tc.perConn)
			for _, hs := range []*httpServer{fast, slow} {
				conns, requests, closing := hs.counts()
				if conns != 60 || requests != 60*tc.perConn || hs.requests["/ok"] != requests {
					t.Errorf("server %s: %d connections, requests %v; want 60 connections, %d requests of /ok", hs.addr, conns, hs.requests, 60*tc.perConn)
				}
				if wantClosing := map[bool]int{true: requests}[tc.wantClosed]; closing != wantClosing {
					t.Errorf("server %s: %d requests with Connection: close, want %d", hs.addr, closing, wantClosing)
				}
				if !hs.hosts[hs.addr] {
					t.Errorf("server %s: Host headers %v, want the address as given", hs.addr, hs.hosts)
				}
			}
			if r := row(t, rep, "exchange", "p50"); r.Verdict != VerdictSlower || *r.CILow < 1000 {
				t.Errorf("exchange p50: %q, B-A %.1fµs [%.1f, %.1f]; want %q above 1ms", r.Verdict, r.Diff, *r.CILow, *r.CIHigh, VerdictSlower)
			}
			var table bytes.Buffer
			rep.WriteTable(&table)
			wantHow := map[bool]string{false: "keep-alive, closed by ab", true: "Connection: close"}[tc.close]
			if want := fmt.Sprintf("%d GET /ok per connection (%s), a 2xx expected", tc.perConn, wantHow); !strings.Contains(table.String(), want) {
				t.Errorf("table lacks %q:\n%s", want, table.String())
			}
		})
	}
}

// A response that is not 2xx fails its connection, counted as "status" with
// the status in the example; so does a reply that is not HTTP at all (an echo
// server's), as a mismatch, and a server that closes a kept-alive connection
// early, as a short read.
func TestRunHTTPFailures(t *testing.T) {
	cases := []struct {
		name    string
		server  func(t *testing.T) string
		perConn int
		kind    string
		example string
	}{
		{"404", func(t *testing.T) string {
			return serveHTTP(t, func(w http.ResponseWriter, r *http.Request) { http.NotFound(w, r) }).addr
		}, 1, ErrStatus, "GET /ok answered 404 Not Found, want a 2xx status"},
		{"500 on the second request", func(t *testing.T) string {
			var mu sync.Mutex
			n := 0
			return serveHTTP(t, func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				n++
				odd := n%2 == 1
				mu.Unlock()
				if !odd {
					http.Error(w, "broken", http.StatusInternalServerError)
				}
			}).addr
		}, 2, ErrStatus, "GET /ok answered 500 Internal Server Error"},
		{"an echo server", func(t *testing.T) string { return startEcho(t, 0) }, 1, ErrMismatch, "the reply is not an HTTP response"},
		{"closed after the first of two", func(t *testing.T) string {
			return serveHTTP(t, func(w http.ResponseWriter, r *http.Request) { w.Header().Set("Connection", "close") }).addr
		}, 2, ErrShortRead, "the server closed the connection after request 1 of 2"},
		{"nothing listens", deadAddress, 1, ErrRefused, "connection refused"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			good := serveHTTP(t, hello(0))
			rep, err := Run(context.Background(), Config{A: good.addr, B: tc.server(t), Mode: ModeHTTP, Path: "/ok",
				Connections: 4, Interleave: 2, RequestsPerConnection: tc.perConn, MaxErrors: -1})
			if err != nil {
				t.Fatal(err)
			}
			if rep.A.Failed != 0 || rep.A.Exchanges != 4*tc.perConn {
				t.Errorf("A: %d failed %v, %d exchanges; want none failed, %d exchanges", rep.A.Failed, rep.A.ErrorExamples, rep.A.Exchanges, 4*tc.perConn)
			}
			if rep.B.Failed != 4 || rep.B.Errors[tc.kind] != 4 || !strings.Contains(rep.B.ErrorExamples[tc.kind], tc.example) {
				t.Errorf("B: %d failed, %v %v; want 4 %s, the first saying %q", rep.B.Failed, rep.B.Errors, rep.B.ErrorExamples, tc.kind, tc.example)
			}
			var table bytes.Buffer
			rep.WriteTable(&table)
			if want := fmt.Sprintf("B %s, first: ", tc.kind); !strings.Contains(table.String(), want+rep.B.ErrorExamples[tc.kind]) {
				t.Errorf("table lacks %q with the example:\n%s", want, table.String())
			}
		})
	}
}

// ModeConnect connects and closes, so any TCP server does: a listener that
// never reads nor writes. It reports the connect latency alone, and a
// refused connect as such.
func TestRunConnect(t *testing.T) {
	accepted := make(chan struct{}, 1000)
	silent := serveTCP(t, func(c *net.TCPConn) {
		accepted <- struct{}{}
		c.Read(make([]byte, 1)) // until the client closes
	})
	rep, err := Run(context.Background(), Config{A: silent, B: silent, Mode: ModeConnect, Connections: 50, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	if rep.A.Connections != 50 || rep.B.Connections != 50 || rep.A.Failed+rep.B.Failed != 0 || rep.A.Exchanges+rep.B.Exchanges != 0 {
		t.Errorf("A %+v, B %+v; want 50 connections each, none failed, no exchange", rep.A, rep.B)
	}
	if len(rep.Metrics) != 1 || rep.Metrics[0].Name != "connect" || rep.Metrics[0].A.Count != 50 || rep.Metrics[0].B.Count != 50 {
		t.Errorf("metrics %+v, want connect alone, 50 samples a side", rep.Metrics)
	}
	testbed.Await(t, 5*time.Second, "100 connections accepted", func() bool { return len(accepted) == 100 })
	var table bytes.Buffer
	rep.WriteTable(&table)
	for _, want := range []string{"A  " + silent + ": 50 connections, 0 failed", "connect and close (no exchange)", "connect  A (n=50)"} {
		if !strings.Contains(table.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, table.String())
		}
	}

	dead := deadAddress(t)
	rep, err = Run(context.Background(), Config{A: silent, B: dead, Mode: ModeConnect, Connections: 100, MaxErrors: 5})
	if err != nil {
		t.Fatal(err)
	}
	if rep.B.Errors[ErrRefused] != 5 || !strings.Contains(rep.Stopped, "B ("+dead+") failed 5 connections (refused 5)") {
		t.Errorf("B: %v, stopped %q; want 5 refused and the run stopped on them", rep.B.Errors, rep.Stopped)
	}
}

// A setting of another mode is refused, named by its flag.
func TestModeConfigErrors(t *testing.T) {
	live := startEcho(t, 0)
	for _, tc := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"unknown mode", Config{Mode: "udp"}, `--mode "udp": want echo, http, connect`},
		{"payload in http", Config{Mode: ModeHTTP, Payload: 10}, "--payload 10: --mode http sends no payload"},
		{"payload in connect", Config{Mode: ModeConnect, Payload: 10}, "--payload 10: --mode connect sends no payload"},
		{"path in echo", Config{Path: "/x"}, "--path and --http-close are --mode http's; --mode echo sends no request"},
		{"close in connect", Config{Mode: ModeConnect, HTTPClose: true}, "--mode connect sends no request"},
		{"relative path", Config{Mode: ModeHTTP, Path: "x"}, `--path "x": want an absolute path`},
		{"path with a space", Config{Mode: ModeHTTP, Path: "/a b"}, `--path "/a b"`},
		{"exchanges in connect", Config{Mode: ModeConnect, RequestsPerConnection: 2}, "--requests-per-connection 2: --mode connect makes no exchange"},
		{"keep-alive requests with close", Config{Mode: ModeHTTP, HTTPClose: true, RequestsPerConnection: 3}, "--requests-per-connection 3: with --http-close"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.cfg.A, tc.cfg.B = live, live
			_, err := Run(context.Background(), tc.cfg)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}
