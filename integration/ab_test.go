package integration

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/measure/ab"
	"github.com/uproxy/uproxy/test/testbed"
)

// startEcho runs `uproxy echo` with flags in role's namespace on that
// namespace's IPv4 address and returns the address it listens on; t.Cleanup
// stops it.
func startEcho(t *testing.T, tp *testbed.Topology, role string, flags ...string) string {
	t.Helper()
	args := append([]string{"netns", "exec", tp.NS(role).Name, uproxyBin, "echo", tp.NS(role).IPv4.String() + ":0"}, flags...)
	cmd := exec.Command("ip", args...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	line, err := bufio.NewReader(stderr).ReadString('\n')
	addr, ok := strings.CutPrefix(strings.TrimSpace(line), "echo: listening on ")
	if err != nil || !ok {
		t.Fatalf("uproxy echo said %q (%v), want its address", line, err)
	}
	return addr
}

// runAB runs `uproxy ab -o json` with args in role's namespace and decodes
// the report.
func runAB(t *testing.T, tp *testbed.Topology, role string, args ...string) *ab.Report {
	t.Helper()
	cmd := exec.Command("ip", append([]string{"netns", "exec", tp.NS(role).Name, uproxyBin, "ab", "-o", "json"}, args...)...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("uproxy ab %s in %s: %v\n%s", strings.Join(args, " "), role, err, stderr.String())
	}
	var rep ab.Report
	if err := json.Unmarshal(out, &rep); err != nil {
		t.Fatalf("uproxy ab -o json: %v\n%s", err, out)
	}
	return &rep
}

func abRow(rep *ab.Report, metric, percentile string) ab.Row {
	for _, m := range rep.Metrics {
		for _, r := range m.Rows {
			if m.Name == metric && r.Percentile == percentile {
				return r
			}
		}
	}
	return ab.Row{Verdict: "row missing"}
}

// `uproxy ab` against the userspace mode: the echo backends (`uproxy echo`,
// one 2ms slower) on the external host, uproxy in the node namespace with
// iptables portals, the comparison run from the node on two proxy ports and
// from the pod namespace through the portals.
func TestABThroughTheUserspaceMode(t *testing.T) {
	tp := testbed.New(t)
	fast := startEcho(t, tp, testbed.External)
	slow := startEcho(t, tp, testbed.External, "--delay", "2ms")
	extIP := tp.NS(testbed.External).IPv4.String()
	portOf := func(addr string) int {
		var p int
		fmt.Sscanf(addr[strings.LastIndex(addr, ":")+1:], "%d", &p)
		return p
	}
	px := startProxy(t, tp, join(
		svc{name: "fast", proto: "TCP", clusterIPs: []string{"10.96.0.41"}, port: 80,
			endpoints: []string{extIP}, endpointPorts: []int{portOf(fast)}}.yaml(),
		svc{name: "slow", proto: "TCP", clusterIPs: []string{"10.96.0.42"}, port: 80,
			endpoints: []string{extIP}, endpointPorts: []int{portOf(slow)}}.yaml(),
	), 2)
	state := px.waitFor(func([]serviceState) bool { return true }, "state")

	t.Run("two proxy ports on loopback", func(t *testing.T) {
		a := fmt.Sprintf("127.0.0.1:%d", proxyPortOf(state, "it/fast:p"))
		b := fmt.Sprintf("127.0.0.1:%d", proxyPortOf(state, "it/slow:p"))
		rep := runAB(t, tp, testbed.Node, a, b, "--connections", "100")
		if rep.A.Failed+rep.B.Failed != 0 || rep.A.Exchanges != 100 || rep.B.Exchanges != 100 {
			t.Errorf("A %d exchanges %v, B %d exchanges %v; want 100 each, no errors", rep.A.Exchanges, rep.A.Errors, rep.B.Exchanges, rep.B.Errors)
		}
		if r := abRow(rep, "connection", "p50"); r.Verdict != ab.VerdictSlower || *r.CILow < 1000 {
			t.Errorf("connection p50: %q, B-A %.1fµs; want %q, its interval above 1ms", r.Verdict, r.Diff, ab.VerdictSlower)
		}
	})

	t.Run("from a pod: direct against the ClusterIP through the portals", func(t *testing.T) {
		rep := runAB(t, tp, testbed.Pod, fast, "10.96.0.41:80", "--connections", "200", "--requests-per-connection", "3")
		if rep.A.Failed+rep.B.Failed != 0 || rep.A.Exchanges != 600 || rep.B.Exchanges != 600 {
			t.Errorf("A %d exchanges %v, B %d exchanges %v; want 600 each, no errors", rep.A.Exchanges, rep.A.Errors, rep.B.Exchanges, rep.B.Errors)
		}
		if rep.B.Dialed != "10.96.0.41:80" {
			t.Errorf("B dialed %s, want the ClusterIP", rep.B.Dialed)
		}
	})

	t.Run("from a pod: a Service without endpoints", func(t *testing.T) {
		px.write("services.yaml", svc{name: "fast", proto: "TCP", clusterIPs: []string{"10.96.0.41"}, port: 80}.yaml())
		px.waitSynced(time.Now())
		start := time.Now()
		cmd := exec.Command("ip", "netns", "exec", tp.NS(testbed.Pod).Name, uproxyBin, "ab", fast, "10.96.0.41:80", "--max-errors", "5")
		out, err := cmd.CombinedOutput()
		if err == nil || !strings.Contains(string(out), "B (10.96.0.41:80) failed 5 connections") {
			t.Errorf("uproxy ab against a Service without endpoints: %v\n%s\nwant it stopped after 5 failed connections", err, out)
		}
		t.Logf("stopped after %v:\n%s", time.Since(start), out)
	})
}

// abFails runs `uproxy ab` with args in role's namespace, expecting it to
// stop early and fail; it returns the output (table and error).
func abFails(t *testing.T, tp *testbed.Topology, role string, args ...string) string {
	t.Helper()
	out, err := exec.Command("ip", append([]string{"netns", "exec", tp.NS(role).Name, uproxyBin, "ab"}, args...)...).CombinedOutput()
	if exitCode(err) != 1 {
		t.Errorf("uproxy ab %s: %v, want exit 1\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// `uproxy ab --mode http` and `--mode connect` against servers that do not
// echo, direct and through the userspace mode's portals from a pod: a net/http
// server and a listener that accepts and closes, on the external host. A 404
// and a Service without endpoints (refused at the portal) fail the run,
// saying so.
func TestABModesThroughTheUserspaceMode(t *testing.T) {
	tp := testbed.New(t)
	extIP := tp.NS(testbed.External).IPv4.String()
	webLn := tp.Listen(testbed.External, "tcp", extIP+":0")
	web := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/ok" {
			http.NotFound(w, r)
			return
		}
		fmt.Fprintln(w, "ok")
	})}
	go web.Serve(webLn)
	t.Cleanup(func() { web.Close() })
	plainLn := tp.Listen(testbed.External, "tcp", extIP+":0")
	go func() {
		for {
			c, err := plainLn.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	t.Cleanup(func() { plainLn.Close() })
	webAddr, plainAddr := webLn.Addr().(*net.TCPAddr), plainLn.Addr().(*net.TCPAddr)
	startProxy(t, tp, join(
		svc{name: "web", proto: "TCP", clusterIPs: []string{"10.96.0.51"}, port: 80, endpoints: []string{extIP}, endpointPorts: []int{webAddr.Port}}.yaml(),
		svc{name: "plain", proto: "TCP", clusterIPs: []string{"10.96.0.52"}, port: 80, endpoints: []string{extIP}, endpointPorts: []int{plainAddr.Port}}.yaml(),
		svc{name: "none", proto: "TCP", clusterIPs: []string{"10.96.0.53"}, port: 80}.yaml(),
	), 3)

	t.Run("http", func(t *testing.T) {
		for _, closing := range []string{"", "--http-close"} {
			args := []string{webAddr.String(), "10.96.0.51:80", "--mode", "http", "--path", "/ok", "--connections", "100"}
			if closing != "" {
				args = append(args, closing)
			}
			rep := runAB(t, tp, testbed.Pod, args...)
			if rep.A.Failed+rep.B.Failed != 0 || rep.A.Exchanges != 100 || rep.B.Exchanges != 100 || rep.Settings.HTTPClose != (closing != "") {
				t.Errorf("%s: A %d exchanges %v, B %d exchanges %v, settings %+v; want 100 each, no errors",
					closing, rep.A.Exchanges, rep.A.ErrorExamples, rep.B.Exchanges, rep.B.ErrorExamples, rep.Settings)
			}
		}
	})
	t.Run("http, a 404", func(t *testing.T) {
		out := abFails(t, tp, testbed.Pod, webAddr.String(), "10.96.0.51:80", "--mode", "http", "--path", "/missing", "--max-errors", "5")
		for _, want := range []string{"failed 5 connections (status 5)", "status, first: GET /missing answered 404 Not Found, want a 2xx status"} {
			if !strings.Contains(out, want) {
				t.Errorf("output lacks %q:\n%s", want, out)
			}
		}
	})
	t.Run("connect", func(t *testing.T) {
		rep := runAB(t, tp, testbed.Pod, plainAddr.String(), "10.96.0.52:80", "--mode", "connect", "--connections", "100")
		if rep.A.Failed+rep.B.Failed != 0 || rep.A.Connections != 100 || rep.B.Connections != 100 || len(rep.Metrics) != 1 {
			t.Errorf("A %+v, B %+v, %d metrics; want 100 connections each, none failed, connect alone", rep.A, rep.B, len(rep.Metrics))
		}
	})
	t.Run("connect, a Service without endpoints", func(t *testing.T) {
		out := abFails(t, tp, testbed.Pod, plainAddr.String(), "10.96.0.53:80", "--mode", "connect", "--max-errors", "5")
		for _, want := range []string{"B (10.96.0.53:80) failed 5 connections (refused 5)", "B refused, first: dial tcp 10.96.0.53:80: connect: connection refused"} {
			if !strings.Contains(out, want) {
				t.Errorf("output lacks %q:\n%s", want, out)
			}
		}
	})
}
