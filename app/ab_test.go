package app

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/measure/ab"
)

// runCommand runs the root command with args, as the binary would, and
// returns its stdout, stderr and error.
func runCommand(ctx context.Context, args ...string) (string, string, error) {
	root := NewRootCommand()
	var stdout, stderr bytes.Buffer
	root.SetOut(&stdout)
	root.SetErr(&stderr)
	root.SetArgs(args)
	err := root.ExecuteContext(ctx)
	return stdout.String(), stderr.String(), err
}

// startEchoCommand runs `uproxy echo` with args on a loopback port and returns
// the address it reports; t.Cleanup stops it and checks that it exited cleanly.
func startEchoCommand(t *testing.T, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	root := NewRootCommand()
	pr, pw := io.Pipe()
	root.SetErr(pw)
	root.SetArgs(append([]string{"echo", "127.0.0.1:0"}, args...))
	done := make(chan error, 1)
	go func() { done <- root.ExecuteContext(ctx); pw.Close() }()
	line, err := bufio.NewReader(pr).ReadString('\n')
	go io.Copy(io.Discard, pr)
	addr, ok := strings.CutPrefix(strings.TrimSpace(line), "echo: listening on ")
	if err != nil || !ok {
		cancel()
		t.Fatalf("uproxy echo said %q (%v), want its address; exit: %v", line, err, <-done)
	}
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("uproxy echo: %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Errorf("uproxy echo did not stop within 5s of its context")
		}
	})
	return addr
}

func TestABCommand(t *testing.T) {
	fast := startEchoCommand(t)
	slow := startEchoCommand(t, "--delay", "2ms")
	chart := filepath.Join(t.TempDir(), "ab.svg")
	stdout, stderr, err := runCommand(context.Background(), "ab", fast, slow,
		"--connections", "60", "--requests-per-connection", "2", "--payload", "100", "--interleave", "5", "-o", "json", "--chart", chart)
	if err != nil {
		t.Fatalf("uproxy ab: %v\n%s", err, stderr)
	}
	var rep ab.Report
	if err := json.Unmarshal([]byte(stdout), &rep); err != nil {
		t.Fatalf("-o json: %v\n%s", err, stdout)
	}
	s := rep.Settings
	if s.Connections != 60 || s.RequestsPerConnection != 2 || s.Payload != 100 || s.Interleave != 5 || rep.B.Exchanges != 120 {
		t.Errorf("settings %+v, B %d exchanges; want the flags' values, 120 exchanges", s, rep.B.Exchanges)
	}
	if v := rep.Metrics[1].Rows[0].Verdict; v != ab.VerdictSlower {
		t.Errorf("exchange p50 verdict %q, want %q (B echoes 2ms later)", v, ab.VerdictSlower)
	}
	if !strings.Contains(stderr, "A 60/60  B 60/60") {
		t.Errorf("stderr %q, want a progress line", stderr)
	}
	svg, err := os.ReadFile(chart)
	if err != nil || !strings.Contains(string(svg), "<svg") {
		t.Errorf("--chart wrote %d bytes (%v), want an SVG", len(svg), err)
	}
}

// A dead address ends the run at --max-errors: the table is printed, and the
// command fails saying why.
// deadAddress is a loopback address nothing listens on: a port just freed.
func deadAddress(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

func TestABCommandDeadAddress(t *testing.T) {
	live := startEchoCommand(t)
	dead := deadAddress(t)
	stdout, _, err := runCommand(context.Background(), "ab", live, dead, "--max-errors", "10")
	if err == nil || !strings.Contains(err.Error(), "stopped early: B ("+dead+") failed 10 connections (refused 10)") {
		t.Errorf("got error %v, want the run stopped at B's 10th refused connection", err)
	}
	if !strings.Contains(stdout, "10 failed: refused 10") {
		t.Errorf("table lacks B's errors:\n%s", stdout)
	}
}

// Every connection to one address failed, fewer than --max-errors: no
// comparison was made, and the exit status says so.
func TestABCommandFailsWithoutASampleOnASide(t *testing.T) {
	live := startEchoCommand(t)
	dead := deadAddress(t)
	_, _, err := runCommand(context.Background(), "ab", live, dead, "--connections", "5", "--interleave", "1")
	if want := "every connection to B (" + dead + ") failed (5), so nothing was compared"; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("got error %v, want %q", err, want)
	}
}

func TestABCommandRejectsBadInput(t *testing.T) {
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"ab", "127.0.0.1:1"}, "want two addresses, ADDR_A and ADDR_B (host:port), got 1 arguments"},
		{[]string{"ab", "127.0.0.1", "127.0.0.1:1"}, `ab: ADDR_A "127.0.0.1": address 127.0.0.1: missing port in address`},
		{[]string{"ab", "127.0.0.1:1", "127.0.0.1:http-alt-nope"}, `ADDR_B "127.0.0.1:http-alt-nope": port "http-alt-nope"`},
		{[]string{"ab", "127.0.0.1:1", "127.0.0.1:2", "--payload", "0"}, "--payload 0: want at least 1"},
		{[]string{"ab", "127.0.0.1:1", "127.0.0.1:2", "--connections", "-1"}, "--connections -1: want at least 1"},
		{[]string{"ab", "127.0.0.1:1", "127.0.0.1:2", "--requests-per-connection", "0"}, "--requests-per-connection 0"},
		{[]string{"ab", "127.0.0.1:1", "127.0.0.1:2", "--interleave", "0"}, "--interleave 0"},
		{[]string{"ab", "127.0.0.1:1", "127.0.0.1:2", "--payload", "20000000"}, "--payload 20000000: want at most 16777216 bytes"},
		{[]string{"ab", "127.0.0.1:1", "127.0.0.1:2", "--confidence", "95"}, "--confidence 95: want a level between 0 and 1"},
		{[]string{"ab", "127.0.0.1:1", "127.0.0.1:2", "--timeout", "-1s"}, "--timeout -1s: want a positive duration"},
		{[]string{"ab", "127.0.0.1:1", "127.0.0.1:2", "--confidence", "0"}, "--confidence 0: want a level between 0 and 1"},
		{[]string{"ab", "127.0.0.1:1", "127.0.0.1:2", "--dial-timeout", "0"}, "--dial-timeout 0s: want a positive duration"},
		{[]string{"ab", "127.0.0.1:1", "127.0.0.1:2", "--max-errors", "-2"}, "--max-errors -2"},
		{[]string{"ab", "127.0.0.1:1", "127.0.0.1:2", "-o", "yaml"}, `-o "yaml": want table or json`},
		{[]string{"ab", "127.0.0.1:1", "127.0.0.1:2", "--mode", "udp"}, `--mode "udp": want echo, http, connect`},
		{[]string{"ab", "127.0.0.1:1", "127.0.0.1:2", "--path", "/x"}, "--path and --http-close are --mode http's; --mode echo sends no request"},
		{[]string{"ab", "127.0.0.1:1", "127.0.0.1:2", "--mode", "connect", "--http-close"}, "--mode connect sends no request"},
		{[]string{"ab", "127.0.0.1:1", "127.0.0.1:2", "--mode", "http", "--payload", "10"}, "--payload 10: --mode http sends no payload"},
		{[]string{"ab", "127.0.0.1:1", "127.0.0.1:2", "--mode", "http", "--path", "healthz"}, `--path "healthz": want an absolute path`},
		{[]string{"ab", "127.0.0.1:1", "127.0.0.1:2", "--mode", "connect", "--requests-per-connection", "2"}, "--mode connect makes no exchange"},
		{[]string{"ab", "127.0.0.1:1", "127.0.0.1:2", "--mode", "http", "--http-close", "--requests-per-connection", "2"}, "with --http-close the server closes each connection"},
		{[]string{"ab", "127.0.0.1:1", "127.0.0.1:2", "--chart", "/nonexistent/dir/x.svg"}, "--chart /nonexistent/dir/x.svg: stat /nonexistent/dir: no such file or directory"},
		{[]string{"echo"}, "want one address to listen on (e.g. :8080), got 0 arguments"},
		{[]string{"echo", "127.0.0.1:0", "--delay", "-1ms"}, "--delay -1ms: want zero or a positive duration"},
	}
	for _, tc := range cases {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			_, _, err := runCommand(context.Background(), tc.args...)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// serveHTTPCommand serves handler with net/http on a loopback port and returns
// its address; t.Cleanup stops it.
func serveHTTPCommand(t *testing.T, handler http.HandlerFunc) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return ln.Addr().String()
}

// uproxy ab --mode http and --mode connect against servers that do not echo:
// a net/http server and a plain listener; a 404 and a refused address fail
// the run, saying what failed and how.
func TestABCommandModes(t *testing.T) {
	web := serveHTTPCommand(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/ok" {
			http.NotFound(w, r)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	t.Run("http", func(t *testing.T) {
		stdout, stderr, err := runCommand(context.Background(), "ab", web, web, "--mode", "http", "--path", "/ok",
			"--connections", "40", "--requests-per-connection", "2", "-o", "json")
		if err != nil {
			t.Fatalf("uproxy ab --mode http: %v\n%s", err, stderr)
		}
		var rep ab.Report
		if err := json.Unmarshal([]byte(stdout), &rep); err != nil {
			t.Fatalf("-o json: %v\n%s", err, stdout)
		}
		if s := rep.Settings; s.Mode != "http" || s.Path != "/ok" || s.Payload != 0 || rep.A.Exchanges != 80 || rep.B.Failed != 0 {
			t.Errorf("settings %+v, A %+v, B %+v; want mode http, path /ok, no payload, 80 exchanges, none failed", s, rep.A, rep.B)
		}
	})
	t.Run("http, a 404", func(t *testing.T) {
		stdout, _, err := runCommand(context.Background(), "ab", web, web, "--mode", "http", "--path", "/missing", "--max-errors", "3")
		if err == nil || !strings.Contains(err.Error(), "stopped early: A ("+web+") failed 3 connections (status 3)") {
			t.Errorf("got error %v, want the run stopped at A's third non-2xx status", err)
		}
		if want := "A status, first: GET /missing answered 404 Not Found, want a 2xx status"; !strings.Contains(stdout, want) {
			t.Errorf("table lacks %q:\n%s", want, stdout)
		}
	})
	t.Run("connect", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				c.Close()
			}
		}()
		stdout, stderr, err := runCommand(context.Background(), "ab", ln.Addr().String(), web, "--mode", "connect", "--connections", "50")
		if err != nil {
			t.Fatalf("uproxy ab --mode connect: %v\n%s", err, stderr)
		}
		for _, want := range []string{"A  " + ln.Addr().String() + ": 50 connections, 0 failed", "connect and close (no exchange)"} {
			if !strings.Contains(stdout, want) {
				t.Errorf("table lacks %q:\n%s", want, stdout)
			}
		}
	})
	t.Run("connect, refused", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		dead := ln.Addr().String()
		ln.Close()
		stdout, _, err := runCommand(context.Background(), "ab", web, dead, "--mode", "connect", "--max-errors", "4")
		if err == nil || !strings.Contains(err.Error(), "stopped early: B ("+dead+") failed 4 connections (refused 4)") {
			t.Errorf("got error %v, want the run stopped at B's fourth refused connect", err)
		}
		if !strings.Contains(stdout, "B refused, first: dial tcp "+dead+": connect: connection refused") {
			t.Errorf("table lacks B's refusal:\n%s", stdout)
		}
	})
}
