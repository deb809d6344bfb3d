package ab

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/xml"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
)

// startEcho serves Echo on a loopback port and returns its address; t.Cleanup
// stops it.
func startEcho(t *testing.T, delay time.Duration) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return serveEcho(t, ln, delay)
}

// serveEcho serves Echo with delay on ln and returns its address; t.Cleanup
// closes ln and checks that Serve returned cleanly.
func serveEcho(t *testing.T, ln net.Listener, delay time.Duration) string {
	e := &Echo{Delay: delay}
	done := make(chan error, 1)
	go func() { done <- e.Serve(ln) }()
	t.Cleanup(func() {
		ln.Close()
		if err := <-done; err != nil {
			t.Errorf("echo server: %v", err)
		}
	})
	return ln.Addr().String()
}

// serveTCP runs handle on every connection to a loopback port and returns
// its address; t.Cleanup stops it.
func serveTCP(t *testing.T, handle func(c *net.TCPConn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() {
		ln.Close()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				handle(c.(*net.TCPConn))
			}()
		}
	}()
	return ln.Addr().String()
}

// deadAddress is a loopback port nothing listens on.
func deadAddress(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

func metric(t *testing.T, rep *Report, name string) Metric {
	t.Helper()
	for _, m := range rep.Metrics {
		if m.Name == name {
			return m
		}
	}
	t.Fatalf("report has no metric %q", name)
	return Metric{}
}

func row(t *testing.T, rep *Report, name, percentile string) Row {
	t.Helper()
	for _, r := range metric(t, rep, name).Rows {
		if r.Percentile == percentile {
			return r
		}
	}
	t.Fatalf("metric %q has no row %q", name, percentile)
	return Row{}
}

func requireClean(t *testing.T, rep *Report, connections, perConnection int) {
	t.Helper()
	for _, s := range []Side{rep.A, rep.B} {
		if s.Connections != connections || s.Failed != 0 || s.Exchanges != connections*perConnection {
			t.Errorf("%s: %d connections, %d failed (%v), %d exchanges; want %d, 0, %d",
				s.Address, s.Connections, s.Failed, s.ErrorExamples, s.Exchanges, connections, connections*perConnection)
		}
	}
	if rep.Stopped != "" {
		t.Errorf("stopped early: %s", rep.Stopped)
	}
}

// A server 2ms slower per exchange is found slower, with an interval around
// 2ms, on every metric that includes an exchange.
func TestRunDetectsADelayedServer(t *testing.T) {
	fast, slow := startEcho(t, 0), startEcho(t, 2*time.Millisecond)
	for _, k := range []int{1, 5} {
		rep, err := Run(context.Background(), Config{A: fast, B: slow, Connections: 100, RequestsPerConnection: k, Seed: 1})
		if err != nil {
			t.Fatal(err)
		}
		requireClean(t, rep, 100, k)
		for _, m := range []string{"exchange", "connection"} {
			r := row(t, rep, m, "p50")
			if r.Verdict != VerdictSlower {
				t.Errorf("%d per connection, %s p50: verdict %q (B-A %.1fµs [%.1f, %.1f]), want %q",
					k, m, r.Verdict, r.Diff, *r.CILow, *r.CIHigh, VerdictSlower)
			}
			if *r.CILow < 1000 {
				t.Errorf("%d per connection, %s p50: interval [%.1fµs, %.1fµs], want it above 1ms (B sleeps 2ms a reply)", k, m, *r.CILow, *r.CIHigh)
			}
		}
	}
}

// Two identical servers: no difference at the median (at 99.9%, so that the
// 1 in 20 chance a 95% interval has of missing 0 does not make the test fail
// one run in twenty).
func TestRunIdenticalServers(t *testing.T) {
	a, b := startEcho(t, 0), startEcho(t, 0)
	rep, err := Run(context.Background(), Config{A: a, B: b, Connections: 400, Interleave: 1, Confidence: 0.999, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	requireClean(t, rep, 400, 1)
	for _, m := range []string{"connect", "exchange", "connection"} {
		r := row(t, rep, m, "p50")
		if r.Verdict != VerdictNone || *r.CILow > 0 || *r.CIHigh < 0 {
			t.Errorf("%s p50: verdict %q, B-A %.1fµs [%.1f, %.1f]; want %q, an interval across 0",
				m, r.Verdict, r.Diff, *r.CILow, *r.CIHigh, VerdictNone)
		}
	}
}

// Blocks of Interleave connections alternate, and so does the side that goes
// first in each round.
func TestRunInterleavesBlocks(t *testing.T) {
	a, b := startEcho(t, 0), startEcho(t, 0)
	var order []string
	d := &net.Dialer{}
	dial := func(ctx context.Context, addr string) (net.Conn, error) {
		switch addr {
		case a:
			order = append(order, "A")
		case b:
			order = append(order, "B")
		}
		return d.DialContext(ctx, "tcp", addr)
	}
	if _, err := Run(context.Background(), Config{A: a, B: b, Connections: 5, Interleave: 2, Dial: dial}); err != nil {
		t.Fatal(err)
	}
	if got, want := strings.Join(order, ""), "AABBBBAAAB"; got != want {
		t.Errorf("connection order %s, want %s", got, want)
	}
}

// Every way an exchange can fail is counted under its kind, and the run goes
// on (MaxErrors negative).
func TestRunCountsErrorsByKind(t *testing.T) {
	readRequest := func(c *net.TCPConn) bool {
		_, err := io.ReadFull(c, make([]byte, DefaultPayload))
		return err == nil
	}
	cases := []struct {
		name string
		addr func(t *testing.T) string
		cfg  Config
		want string
	}{
		{"nothing listens", deadAddress, Config{}, ErrRefused},
		{"no reply", func(t *testing.T) string {
			return serveTCP(t, func(c *net.TCPConn) { io.Copy(io.Discard, c) })
		}, Config{Timeout: 50 * time.Millisecond}, ErrTimeout},
		{"half a reply, then close", func(t *testing.T) string {
			return serveTCP(t, func(c *net.TCPConn) {
				if readRequest(c) {
					c.Write(make([]byte, DefaultPayload/2))
				}
			})
		}, Config{}, ErrShortRead},
		{"reset after the request", func(t *testing.T) string {
			return serveTCP(t, func(c *net.TCPConn) {
				if readRequest(c) {
					c.SetLinger(0)
				}
			})
		}, Config{}, ErrReset},
		{"a reply that is not the request", func(t *testing.T) string {
			return serveTCP(t, func(c *net.TCPConn) {
				for readRequest(c) {
					c.Write(bytes.Repeat([]byte("x"), DefaultPayload))
				}
			})
		}, Config{}, ErrMismatch},
		{"connect never answered", func(t *testing.T) string { return "192.0.2.1:80" }, Config{
			DialTimeout: 50 * time.Millisecond,
			// A black hole: the dial waits for the context's deadline, as a
			// SYN the network drops does.
			Dial: func(ctx context.Context, addr string) (net.Conn, error) {
				if addr != "192.0.2.1:80" {
					return (&net.Dialer{}).DialContext(ctx, "tcp", addr)
				}
				<-ctx.Done()
				return nil, &net.OpError{Op: "dial", Net: "tcp", Err: ctx.Err()}
			},
		}, ErrConnectTimeout},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tc.cfg
			cfg.A, cfg.B = startEcho(t, 0), tc.addr(t)
			cfg.Connections, cfg.Interleave, cfg.MaxErrors = 4, 2, -1
			rep, err := Run(context.Background(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			if rep.A.Failed != 0 || rep.A.Exchanges != 4 {
				t.Errorf("A: %d failed %v, %d exchanges; want 0 failed, 4 exchanges", rep.A.Failed, rep.A.Errors, rep.A.Exchanges)
			}
			if rep.B.Failed != 4 || rep.B.Errors[tc.want] != 4 {
				t.Errorf("B: %d failed, errors %v (%v); want 4 %s", rep.B.Failed, rep.B.Errors, rep.B.ErrorExamples, tc.want)
			}
			if rep.Stopped != "" {
				t.Errorf("stopped early: %s", rep.Stopped)
			}
		})
	}
}

// A dead address stops the run at MaxErrors, with the report of what was
// measured.
func TestRunStopsAtMaxErrors(t *testing.T) {
	live, dead := startEcho(t, 0), deadAddress(t)
	rep, err := Run(context.Background(), Config{A: live, B: dead, Connections: 100000, MaxErrors: 25})
	if err != nil {
		t.Fatal(err)
	}
	if rep.B.Failed != 25 || rep.B.Errors[ErrRefused] != 25 {
		t.Errorf("B: %d failed, %v; want 25 refused", rep.B.Failed, rep.B.Errors)
	}
	if !strings.Contains(rep.Stopped, "B ("+dead+") failed 25 connections (refused 25)") {
		t.Errorf("Stopped %q, want B's 25 refused connections named", rep.Stopped)
	}
	if r := row(t, rep, "connect", "p50"); r.Verdict != VerdictNoSample || r.CILow != nil {
		t.Errorf("connect p50 with no sample of B: %+v, want verdict %q and no interval", r, VerdictNoSample)
	}
	var table bytes.Buffer
	if err := rep.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"stopped early", "B refused, first:", "connection refused"} {
		if !strings.Contains(table.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, table.String())
		}
	}
}

// A cancelled context ends the run with what it measured so far.
func TestRunInterrupted(t *testing.T) {
	a := startEcho(t, 0)
	ctx, cancel := context.WithCancel(context.Background())
	n := 0
	dial := func(ctx context.Context, addr string) (net.Conn, error) {
		if n++; n == 7 {
			cancel()
		}
		return (&net.Dialer{}).DialContext(ctx, "tcp", addr)
	}
	rep, err := Run(ctx, Config{A: a, B: a, Connections: 1000, Interleave: 3, Dial: dial})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Stopped != "interrupted" {
		t.Errorf("Stopped %q, want interrupted", rep.Stopped)
	}
	if got := rep.A.Connections + rep.B.Connections; got != 6 || rep.A.Failed+rep.B.Failed != 0 {
		t.Errorf("%d connections, %d failed; want the 6 before the interruption, none failed", got, rep.A.Failed+rep.B.Failed)
	}
}

func TestConfigErrors(t *testing.T) {
	live := startEcho(t, 0)
	cases := []struct {
		name string
		cfg  Config
		want string
	}{
		{"negative connections", Config{A: live, B: live, Connections: -1}, "--connections -1: want at least 1"},
		{"zero-byte payload", Config{A: live, B: live, Payload: -5}, "--payload -5"},
		{"huge payload", Config{A: live, B: live, Payload: MaxPayload + 1}, "--payload 16777217: want at most"},
		{"few resamples", Config{A: live, B: live, Resamples: 10}, "--resamples 10"},
		{"confidence of 95", Config{A: live, B: live, Confidence: 95}, "--confidence 95: want a level between 0 and 1"},
		{"negative dial timeout", Config{A: live, B: live, DialTimeout: -time.Second}, "--dial-timeout -1s"},
		{"no port", Config{A: "127.0.0.1", B: live}, `ADDR_A "127.0.0.1": address 127.0.0.1: missing port in address`},
		{"port zero", Config{A: live, B: "127.0.0.1:0"}, `ADDR_B "127.0.0.1:0": port "0": want a port number`},
		{"port out of range", Config{A: live, B: "127.0.0.1:70000"}, `ADDR_B "127.0.0.1:70000": port "70000"`},
		{"no host", Config{A: ":80", B: live}, `ADDR_A ":80": no host`},
		{"unknown host", Config{A: live, B: "no-such-host.invalid:80"}, `ADDR_B "no-such-host.invalid:80"`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rep, err := Run(context.Background(), tc.cfg)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got error %v, want one containing %q", err, tc.want)
			}
			if rep != nil {
				t.Errorf("got a report with a configuration error")
			}
		})
	}
}

func TestReportOutputs(t *testing.T) {
	a, b := startEcho(t, 0), startEcho(t, time.Millisecond)
	rep, err := Run(context.Background(), Config{A: a, B: b, Connections: 30, Seed: 5})
	if err != nil {
		t.Fatal(err)
	}
	t.Run("table", func(t *testing.T) {
		var out bytes.Buffer
		if err := rep.WriteTable(&out); err != nil {
			t.Fatal(err)
		}
		table := out.String()
		for _, want := range []string{
			"A  " + a + ": 30 connections, 30 exchanges, 0 failed",
			"1 exchange of 64 bytes per connection; blocks of 10 connections",
			"95% of B-A over 2000 bootstrap resamples (seed 5)",
			"connect", "exchange", "connection", "A (n=30)", "p99.9",
			VerdictSlower, "too few samples (want 5000 a side)",
		} {
			if !strings.Contains(table, want) {
				t.Errorf("table lacks %q:\n%s", want, table)
			}
		}
	})
	t.Run("json", func(t *testing.T) {
		var out bytes.Buffer
		if err := rep.WriteJSON(&out); err != nil {
			t.Fatal(err)
		}
		var back Report
		if err := json.Unmarshal(out.Bytes(), &back); err != nil {
			t.Fatalf("JSON does not decode: %v", err)
		}
		if back.A.Address != a || back.B.Exchanges != 30 || len(back.Metrics) != 3 || len(back.Metrics[1].Rows) != 4 {
			t.Errorf("decoded %+v, want A %s, 30 exchanges of B, 3 metrics of 4 rows", back, a)
		}
		r := back.Metrics[1].Rows[0]
		if r.Percentile != "p50" || r.CILow == nil || r.B <= r.A || r.Verdict != VerdictSlower {
			t.Errorf("exchange p50 row %+v, want B above A, an interval, verdict %q", r, VerdictSlower)
		}
	})
	t.Run("chart", func(t *testing.T) {
		var out bytes.Buffer
		if err := rep.WriteChart(&out); err != nil {
			t.Fatal(err)
		}
		svg := out.String()
		if n := strings.Count(svg, "<polyline"); n != 6 {
			t.Errorf("%d curves, want 6 (A and B for 3 metrics)", n)
		}
		d := xml.NewDecoder(strings.NewReader(svg))
		for {
			_, err := d.Token()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatalf("SVG is not well-formed XML: %v", err)
			}
		}
	})
}

func TestProgress(t *testing.T) {
	a := startEcho(t, 0)
	for _, live := range []bool{false, true} {
		var out bytes.Buffer
		if _, err := Run(context.Background(), Config{A: a, B: a, Connections: 20, Progress: &out, Live: live}); err != nil {
			t.Fatal(err)
		}
		got := out.String()
		if !strings.Contains(got, "A 20/20  B 20/20") || !strings.HasSuffix(got, "\n") {
			t.Errorf("live=%v: progress %q, want a last line with both counts", live, got)
		}
		if live != strings.HasPrefix(got, "\r") {
			t.Errorf("live=%v: progress %q; a live line starts with \\r, a plain one does not", live, got)
		}
	}
}

func TestEchoServeClosesItsConnections(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	e := &Echo{}
	done := make(chan error, 1)
	go func() { done <- e.Serve(ln) }()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("echo: got %q, %v; want ping", buf, err)
	}
	ln.Close()
	if err := <-done; err != nil {
		t.Errorf("Serve: %v, want nil after the listener closed", err)
	}
	if n, err := c.Read(buf); err == nil {
		t.Errorf("read after Serve returned: %d bytes, want the connection closed", n)
	}
}
