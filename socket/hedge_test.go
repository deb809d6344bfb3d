package socket

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/record"
)

// attemptKinds names each attempt of c by its result: "success", "lost",
// "refused", "timeout" or the error.
func attemptKinds(c record.Conn, eps []netip.AddrPort) []string {
	var out []string
	for _, a := range c.Attempts {
		k := ""
		var ne net.Error
		switch {
		case a.Err == nil:
			k = "success"
		case a.Lost():
			k = "lost"
		case errors.Is(a.Err, syscall.ECONNREFUSED):
			k = "refused"
		case errors.As(a.Err, &ne) && ne.Timeout():
			k = "timeout"
		default:
			k = a.Err.Error()
		}
		out = append(out, fmt.Sprintf("%d:%s", slices.Index(eps, a.Endpoint), k))
	}
	return out
}

func TestTCPProxyHedgedDials(t *testing.T) {
	t.Parallel()
	ms := time.Millisecond
	long := 10 * time.Second
	tests := []struct {
		name     string
		eps      []endpointKind
		timeouts []time.Duration
		hedge    time.Duration
		// want lists the attempts by start, as endpoint index and result.
		want       []string
		wantServed bool
		// wantReports lists what the Picker heard, in order.
		wantReports []string
	}{
		{
			name: "an unanswered dial is hedged, the hedge serves and the first is closed",
			eps:  []endpointKind{unanswered, serving}, timeouts: []time.Duration{long, long}, hedge: 20 * ms,
			want: []string{"0:lost", "1:success"}, wantServed: true,
			wantReports: []string{"succeeded 1"},
		},
		{
			name: "a dial that connects before the hedge is due is not hedged",
			eps:  []endpointKind{serving, unanswered}, timeouts: []time.Duration{long, long}, hedge: long,
			want: []string{"0:success"}, wantServed: true,
			wantReports: []string{"succeeded 0"},
		},
		{
			name: "hedges go on while every earlier attempt is pending",
			eps:  []endpointKind{unanswered, unanswered, serving}, timeouts: []time.Duration{long, long, long}, hedge: 20 * ms,
			want: []string{"0:lost", "1:lost", "2:success"}, wantServed: true,
			wantReports: []string{"succeeded 2"},
		},
		{
			name: "a refused hedge is a failure, and the next attempt starts at once",
			eps:  []endpointKind{unanswered, refused, serving}, timeouts: []time.Duration{long, long, long}, hedge: 20 * ms,
			want: []string{"0:lost", "1:refused", "2:success"}, wantServed: true,
			wantReports: []string{"failed 1", "succeeded 2"},
		},
		{
			name: "every attempt unanswered: each times out on its own deadline",
			eps:  []endpointKind{unanswered, unanswered}, timeouts: []time.Duration{100 * ms, 100 * ms}, hedge: 20 * ms,
			want:        []string{"0:timeout", "1:timeout"},
			wantReports: []string{"failed 0", "failed 1"},
		},
		{
			name: "the first attempt times out before the hedge is due: a plain retry",
			eps:  []endpointKind{unanswered, serving}, timeouts: []time.Duration{50 * ms, long}, hedge: long,
			want: []string{"0:timeout", "1:success"}, wantServed: true,
			wantReports: []string{"failed 0", "succeeded 1"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			eps := endpointsOf(t, tt.eps)
			picker := newCyclePicker(eps...)
			rec := &recorder{}
			p := &TCPProxy{Service: "ns/hedge:tcp", Picker: picker, Observer: rec, DialTimeouts: tt.timeouts, DialHedge: tt.hedge}
			addr := startTCPProxy(t, p)
			msg := []byte("hedged")
			if tt.wantServed {
				client := dialProxy(t, addr)
				got, err := roundTrip(client, msg)
				if err != nil || !bytes.Equal(got, msg) {
					t.Fatalf("round trip: got %q, %v, want %q", got, err, msg)
				}
				client.Close()
			} else if err := connectAndRead(addr); !isReset(err) {
				t.Fatalf("connect and read with no endpoint answering: got %v, want ECONNRESET", err)
			}
			c := rec.awaitClosed(t, 1)[0]
			if got := attemptKinds(c, eps); !slices.Equal(got, tt.want) {
				t.Errorf("attempts by start: got %v, want %v", got, tt.want)
			}
			for i := 1; i < len(c.Attempts); i++ {
				if c.Attempts[i].Start.Before(c.Attempts[i-1].Start) {
					t.Errorf("attempt %d began before attempt %d: record not in start order", i, i-1)
				}
			}
			var reports []string
			for _, r := range picker.dialReports() {
				verb := "succeeded"
				if r.failed {
					verb = "failed"
				}
				reports = append(reports, fmt.Sprintf("%s %d", verb, slices.Index(eps, r.ep)))
			}
			if !slices.Equal(reports, tt.wantReports) {
				t.Errorf("dial reports to the Picker: got %v, want %v (a hedge's loser is no failure)", reports, tt.wantReports)
			}
			// Every Pick avoided the endpoints begun before, pending or ended.
			for i, tried := range picker.tried {
				if len(tried) != i {
					t.Errorf("Pick %d: got tried %v, want the %d endpoints begun before", i, tried, i)
				}
			}
			if u := picker.unreleased(); len(u) != 0 {
				t.Errorf("Pick without Release: %v", u)
			}
			if tt.wantServed {
				var served int
				for _, w := range tt.want {
					if i, ok := strings.CutSuffix(w, ":success"); ok {
						fmt.Sscan(i, &served)
					}
				}
				if want := eps[served]; c.Endpoint != want {
					t.Errorf("record Endpoint: got %v, want %v", c.Endpoint, want)
				}
			} else if c.Err == nil || !strings.Contains(c.Err.Error(), "dial attempts failed") {
				t.Errorf("record Err: got %v, want the dial attempts failed", c.Err)
			}
			if c.RetryRefused {
				t.Errorf("record RetryRefused: got true, want false without a budget")
			}
		})
	}
}

// TestTCPProxyHedgeLoserThatConnectedIsASuccess races two answering endpoints
// with a hedge due at once: whenever the loser had connected too (its event
// not yet handled), the Picker hears of its success, never of a failure.
func TestTCPProxyHedgeLoserThatConnectedIsASuccess(t *testing.T) {
	t.Parallel()
	eps := []netip.AddrPort{startTCPServer(t, "127.0.0.2", echo).addr, startTCPServer(t, "127.0.0.3", echo).addr}
	picker := newCyclePicker(eps...)
	rec := &recorder{}
	p := &TCPProxy{Service: "ns/race:tcp", Picker: picker, Observer: rec, DialHedge: time.Nanosecond}
	addr := startTCPProxy(t, p)
	const n = 200
	for range n {
		c := dialProxy(t, addr)
		if got, err := roundTrip(c, []byte("x")); err != nil || string(got) != "x" {
			t.Fatalf("round trip: got %q, %v", got, err)
		}
		c.Close()
	}
	conns := rec.awaitClosed(t, n)
	lost := 0
	for _, c := range conns {
		for _, a := range c.Attempts {
			if a.Lost() {
				lost++
			}
		}
	}
	successes := 0
	for _, r := range picker.dialReports() {
		if r.failed {
			t.Errorf("the Picker heard of a failure (%v): no dial failed", r)
		} else {
			successes++
		}
	}
	// One success per connection, plus one per loser found connected.
	if successes < n || successes > n+lost {
		t.Errorf("successes reported: got %d, want %d to %d (one per connection, one per loser that had connected)", successes, n, n+lost)
	}
	if lost == 0 {
		t.Errorf("no hedge lost over %d connections with a hedge due at once, want some", n)
	}
	t.Logf("%d connections, %d losers, %d of them found connected", n, lost, successes-n)
	if u := picker.unreleased(); len(u) != 0 {
		t.Errorf("Pick without Release: %v", u)
	}
}

// TestTCPProxySetDialPolicy changes the policy while the proxy serves: new
// connections dial by the new one.
func TestTCPProxySetDialPolicy(t *testing.T) {
	t.Parallel()
	eps := []netip.AddrPort{unansweredAddr(t, "127.0.0.2"), startTCPServer(t, "127.0.0.3", echo).addr}
	picker := newCyclePicker(eps...)
	rec := &recorder{}
	p := &TCPProxy{Service: "ns/set:tcp", Picker: picker, Observer: rec, DialTimeouts: []time.Duration{50 * time.Millisecond, 10 * time.Second}}
	addr := startTCPProxy(t, p)
	connect := func() {
		t.Helper()
		picker.mu.Lock()
		picker.next = 0 // the unanswered endpoint first
		picker.mu.Unlock()
		c := dialProxy(t, addr)
		if _, err := roundTrip(c, []byte("x")); err != nil {
			t.Fatalf("round trip: %v", err)
		}
		c.Close()
	}
	connect()
	p.SetDialPolicy(DialPolicy{Timeouts: []time.Duration{10 * time.Second, 10 * time.Second}, Hedge: 10 * time.Millisecond})
	if got := p.DialPolicy().Hedge; got != 10*time.Millisecond {
		t.Fatalf("DialPolicy().Hedge: got %v, want 10ms", got)
	}
	connect()
	conns := rec.awaitClosed(t, 2)
	if got, want := attemptKinds(conns[0], eps), []string{"0:timeout", "1:success"}; !slices.Equal(got, want) {
		t.Errorf("before SetDialPolicy: got attempts %v, want %v", got, want)
	}
	if got, want := attemptKinds(conns[1], eps), []string{"0:lost", "1:success"}; !slices.Equal(got, want) {
		t.Errorf("after SetDialPolicy: got attempts %v, want %v", got, want)
	}
}
