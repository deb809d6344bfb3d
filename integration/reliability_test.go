package integration

import (
	"context"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/socket"
	"github.com/uproxy/uproxy/test/testbed"
)

// Reliability end to end: the uproxy binary under a tiny descriptor limit, SIGTERM
// under load, restarts, malformed objects and an unprivileged user.

// backoffLine matches the accept loop's backoff log lines, after a failed accept or
// a backend socket that could not be made, and captures the delay.
var backoffLine = regexp.MustCompile(`"(?:Accept failed, backing off|No socket for a backend, backing off accepts)".*delay="([^"]+)"`)

// Two limits whose data path shares (the limit less the control plane's
// reserve, a quarter of a limit this small: 24 and 25) differ in parity: each
// proxied connection takes two descriptors, so one share runs out at accept and
// the other at the backend socket of a connection just accepted. Both must back
// off.
func TestOverloadUnderTinyFileLimit(t *testing.T) {
	for _, limit := range []int{32, 33} {
		t.Run(fmt.Sprintf("limit %d", limit), func(t *testing.T) { overloadUnderFileLimit(t, limit) })
	}
}

func overloadUnderFileLimit(t *testing.T, limit int) {
	tp := testbed.New(t)
	pod := tp.NS(testbed.Pod)
	ln := echoTCP(t, tp, testbed.Pod, pod.IPv4.String()+":0")
	ln2 := echoTCP(t, tp, testbed.Pod, pod.IPv4.String()+":0")
	manifests := svc{name: "web", proto: "TCP", clusterIPs: []string{"10.96.0.10"}, port: 80,
		endpoints:     []string{pod.IPv4.String(), pod.IPv4.String()},
		endpointPorts: []int{ln.Addr().(*net.TCPAddr).Port, ln2.Addr().(*net.TCPAddr).Port}}.yaml()
	// An idle uproxy holds about a dozen descriptors: a share of 24 leaves room
	// for a few proxied connections (two sockets each, plus splice pipes) and no
	// more.
	px := runUproxy(t, tp, manifests, launch{want: 1,
		wrapper: []string{"prlimit", fmt.Sprintf("--nofile=%d:%d", limit, limit), "--"},
		flags:   []string{"--rules", "iptables", "--eject-after", "1"}})
	if want := fmt.Sprintf(`"Open file limit (RLIMIT_NOFILE)" soft="%d" hard="%d"`, limit, limit); !strings.Contains(px.logText(), want) {
		t.Errorf("log lacks %s", want)
	}
	if err := dialRoundTrip(tp, testbed.Pod, "10.96.0.10:80", 4096); err != nil {
		t.Fatalf("before the overload: %v", err)
	}

	// Overload: many clients at once, each holding its connection open.
	const clients = 200
	var mu sync.Mutex
	var held []net.Conn
	outcomes := map[string]int{}
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			c, err := tp.Dial(testbed.Pod, "tcp", "10.96.0.10:80")
			outcome := "served"
			if err == nil {
				mu.Lock()
				held = append(held, c)
				mu.Unlock()
				c.SetDeadline(time.Now().Add(3 * time.Second))
				if _, err = c.Write([]byte("x")); err == nil {
					_, err = io.ReadFull(c, make([]byte, 1))
				}
			}
			switch {
			case err == nil:
			case isReset(err):
				outcome = "reset"
			case isRefused(err):
				outcome = "refused"
			case isTimeout(err):
				outcome = "waiting"
			default:
				outcome = err.Error()
			}
			mu.Lock()
			outcomes[outcome]++
			mu.Unlock()
		})
	}
	wg.Wait()
	testbed.Await(t, 20*time.Second, "an accept backoff in the log", func() bool { return backoffLine.MatchString(px.logText()) })
	if !px.running() {
		t.Fatalf("uproxy exited under overload:\n%s", tail(px.logText(), 40))
	}
	// Every wait is a doubling of 5ms capped at 1s: the loop never spins.
	valid := map[string]bool{}
	for d := 5 * time.Millisecond; d < time.Second; d *= 2 {
		valid[d.String()] = true
	}
	valid[time.Second.String()] = true
	matches := backoffLine.FindAllStringSubmatch(px.logText(), -1)
	for _, m := range matches {
		if !valid[m[1]] {
			t.Errorf("backoff delay %s, want 5ms doubling up to 1s", m[1])
		}
	}
	if !strings.Contains(px.logText(), "too many open files") {
		t.Errorf("log does not name EMFILE (too many open files) as the cause")
	}
	// The node ran short, not the endpoints: a dial that could not make its
	// socket is no failure of its endpoint, which stays in rotation.
	if strings.Contains(px.logText(), `"Ejected endpoint"`) {
		t.Errorf("an endpoint was ejected for the node's shortage:\n%s", tail(px.logText(), 20))
	}

	// Load drops: the proxy serves again.
	for _, c := range held {
		c.Close()
	}
	testbed.Await(t, 30*time.Second, "a served connection after the load dropped", func() bool {
		return dialRoundTrip(tp, testbed.Pod, "10.96.0.10:80", 4096) == nil
	})
	for i := range 20 {
		if err := dialRoundTrip(tp, testbed.Pod, "10.96.0.10:80", 64<<10); err != nil {
			t.Fatalf("connection %d after recovery: %v", i, err)
		}
	}
	t.Logf("overload of %d clients under a limit of %d descriptors: %v; %d accept backoffs logged", clients, limit, outcomes, len(matches))
}

func isReset(err error) bool {
	return err != nil && strings.Contains(err.Error(), syscall.ECONNRESET.Error())
}

func isTimeout(err error) bool {
	ne, ok := err.(net.Error)
	return ok && ne.Timeout()
}

func TestShutdownUnderLoad(t *testing.T) {
	tp := testbed.New(t)
	pod := tp.NS(testbed.Pod)
	ln := echoTCP(t, tp, testbed.Pod, pod.IPv4.String()+":0")
	manifests := svc{name: "web", proto: "TCP", clusterIPs: []string{"10.96.0.10"}, port: 80,
		endpoints: []string{pod.IPv4.String()}, endpointPorts: []int{ln.Addr().(*net.TCPAddr).Port}}.yaml()

	openConns := func(t *testing.T, n int) []net.Conn {
		var conns []net.Conn
		for i := range n {
			c, err := tp.Dial(testbed.Pod, "tcp", "10.96.0.10:80")
			if err != nil {
				t.Fatalf("connection %d: %v", i, err)
			}
			t.Cleanup(func() { c.Close() })
			if err := checkedRoundTrip(c, 4096); err != nil {
				t.Fatalf("connection %d: %v", i, err)
			}
			conns = append(conns, c)
		}
		return conns
	}

	t.Run("open connections finish within the grace, new ones are refused", func(t *testing.T) {
		// A grace far longer than the test: the proxy must exit because its last
		// connection ended, not because the grace ran out.
		px := runUproxy(t, tp, manifests, launch{want: 1, flags: []string{"--rules", "iptables", "--shutdown-grace", "10m"}})
		conns := openConns(t, 10)
		px.signal(syscall.SIGTERM)
		testbed.Await(t, 10*time.Second, "new connections refused", func() bool {
			c, err := tp.Dial(testbed.Pod, "tcp", "10.96.0.10:80")
			if err == nil {
				// Accepted before the listener closed: left open, it would
				// hold uproxy for the whole grace.
				c.Close()
			}
			return isRefused(err)
		})
		for i, c := range conns {
			if err := checkedRoundTrip(c, 256<<10); err != nil {
				t.Errorf("open connection %d after SIGTERM: %v", i, err)
			}
			if !px.running() {
				t.Fatalf("uproxy exited with %d connections still open", len(conns)-i)
			}
			c.Close()
		}
		if code := px.awaitExit(20 * time.Second); code != 0 {
			t.Errorf("exit code: got %d, want 0", code)
		}
		if got := ruleChains(t, tp, "iptables-save", "UPROXY-"); len(got) == 0 {
			t.Errorf("portal chains after exit: got none, want them kept without --cleanup-on-exit")
		}
	})

	t.Run("connections still open when the grace ends are reset", func(t *testing.T) {
		px := runUproxy(t, tp, manifests, launch{want: 1, flags: []string{"--rules", "iptables", "--shutdown-grace", "500ms"}})
		c := openConns(t, 1)[0]
		px.signal(syscall.SIGTERM)
		if code := px.awaitExit(20 * time.Second); code != 0 {
			t.Errorf("exit code: got %d, want 0", code)
		}
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Read(make([]byte, 1)); !isReset(err) {
			t.Errorf("read on the connection left open: got %v, want a reset", err)
		}
	})
}

func TestCleanupOnExit(t *testing.T) {
	tp := testbed.New(t, testbed.WithIPv6())
	pod := tp.NS(testbed.Pod)
	ln := echoTCP(t, tp, testbed.Pod, pod.IPv4.String()+":0")
	px := runUproxy(t, tp, svc{name: "web", proto: "TCP", clusterIPs: []string{"10.96.0.10", "fd00:96::10"}, port: 80, nodePort: 30080,
		endpoints: []string{pod.IPv4.String()}, endpointPorts: []int{ln.Addr().(*net.TCPAddr).Port}}.yaml(),
		launch{want: 1, flags: []string{"--rules", "iptables", "--cleanup-on-exit"}})
	for _, cmd := range []string{"iptables-save", "ip6tables-save"} {
		if got := ruleChains(t, tp, cmd, "UPROXY-"); len(got) == 0 {
			t.Fatalf("%s while running: no UPROXY chains", cmd)
		}
	}
	if err := dialRoundTrip(tp, testbed.Pod, "10.96.0.10:80", 4096); err != nil {
		t.Fatal(err)
	}
	px.signal(syscall.SIGTERM)
	px.awaitExit(20 * time.Second)
	for _, cmd := range []string{"iptables-save", "ip6tables-save"} {
		if got := ruleChains(t, tp, cmd, "UPROXY-"); len(got) != 0 {
			t.Errorf("%s after exit with --cleanup-on-exit: got chains %v, want none", cmd, got)
		}
	}
	if !strings.Contains(px.logText(), "Removed the mode's rules on exit") {
		t.Errorf("log does not say the rules were removed")
	}
}

// TestRestartRefusalWindow stops uproxy and starts another while a client keeps
// connecting: connections are refused (fast, never hanging) only until the new
// process's first sync has rewritten the portals to its proxy ports.
func TestRestartRefusalWindow(t *testing.T) {
	tp := testbed.New(t)
	pod := tp.NS(testbed.Pod)
	ln := echoTCP(t, tp, testbed.Pod, pod.IPv4.String()+":0")
	manifests := svc{name: "web", proto: "TCP", clusterIPs: []string{"10.96.0.10"}, port: 80,
		endpoints: []string{pod.IPv4.String()}, endpointPorts: []int{ln.Addr().(*net.TCPAddr).Port}}.yaml()
	first := runUproxy(t, tp, manifests, launch{want: 1, flags: []string{"--rules", "iptables"}})

	type attempt struct {
		start time.Time
		err   error
	}
	var mu sync.Mutex
	var attempts []attempt
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			a := attempt{start: time.Now()}
			a.err = dialRoundTrip(tp, testbed.Pod, "10.96.0.10:80", 1024)
			mu.Lock()
			attempts = append(attempts, a)
			mu.Unlock()
			time.Sleep(5 * time.Millisecond)
		}
	})
	successesAfter := func(at time.Time) int {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, a := range attempts {
			if a.err == nil && a.start.After(at) {
				n++
			}
		}
		return n
	}
	testbed.Await(t, 10*time.Second, "traffic through the first uproxy", func() bool { return successesAfter(time.Time{}) >= 10 })

	stopped := time.Now()
	first.stop()
	exited := time.Now()
	second := runUproxy(t, tp, manifests, launch{want: 1, flags: []string{"--rules", "iptables"}})
	synced := time.Now() // the second process's first sync has completed
	testbed.Await(t, 10*time.Second, "traffic through the second uproxy", func() bool { return successesAfter(synced) >= 20 })
	close(stop)
	wg.Wait()

	var firstFail, lastFail time.Time
	failures := 0
	for _, a := range attempts {
		if a.err == nil {
			continue
		}
		failures++
		if firstFail.IsZero() {
			firstFail = a.start
		}
		lastFail = a.start
		if !isRefused(a.err) && !isReset(a.err) {
			t.Errorf("attempt at +%v: got %v, want success or a refusal", a.start.Sub(stopped), a.err)
		}
		if a.start.After(synced) {
			t.Errorf("attempt at +%v, after the new process's first sync: got %v, want success", a.start.Sub(stopped), a.err)
		}
	}
	port := proxyPortOf(second.waitFor(func([]serviceState) bool { return true }, "state"), "it/web:p")
	if out, err := tp.Exec(testbed.Node, "iptables-save", "-t", "nat"); err != nil || !strings.Contains(string(out), "--to-ports "+strconv.Itoa(port)) {
		t.Errorf("nat rules do not redirect to the new proxy port %d (%v)", port, err)
	}
	window := time.Duration(0)
	if failures > 0 {
		window = lastFail.Sub(firstFail)
	}
	t.Logf("restart: SIGTERM to exit %v, exit to first sync of the new process %v; %d of %d attempts refused, refusal window %v",
		exited.Sub(stopped), synced.Sub(exited), failures, len(attempts), window)
}

// badInputManifests has one good Service and one of each kind of invalid object.
func badInputManifests(podIP string, port int) string {
	eps := []string{podIP}
	ports := []int{port}
	return join(
		svc{name: "web", proto: "TCP", clusterIPs: []string{"10.96.0.10"}, port: 80, endpoints: eps, endpointPorts: ports}.yaml(),
		svc{name: "np-a", proto: "TCP", clusterIPs: []string{"10.96.0.31"}, port: 80, nodePort: 30090, endpoints: eps, endpointPorts: ports}.yaml(),
		svc{name: "np-b", proto: "TCP", clusterIPs: []string{"10.96.0.32"}, port: 80, nodePort: 30090, endpoints: eps, endpointPorts: ports}.yaml(),
		`apiVersion: v1
kind: Service
metadata: {name: dup-ports, namespace: it}
spec:
  clusterIP: 10.96.0.40
  ports: [{name: a, port: 80}, {name: b, port: 80}]
`,
		`apiVersion: v1
kind: Service
metadata: {name: wrong-family, namespace: it}
spec:
  clusterIP: 10.96.0.41
  clusterIPs: [10.96.0.41]
  ipFamilies: [IPv6]
  ports: [{name: p, port: 80}]
`,
		svc{name: "wfam", proto: "TCP", clusterIPs: []string{"10.96.0.42"}, port: 80, endpoints: []string{"fd00::1"}, endpointPorts: ports}.yaml(),
		svc{name: "zero", proto: "TCP", clusterIPs: []string{"10.96.0.43"}, port: 80, endpoints: eps, endpointPorts: []int{0}}.yaml(),
		`apiVersion: v1
kind: Service
metadata: {name: sticky, namespace: it}
spec:
  clusterIP: 10.96.0.44
  sessionAffinity: ClientIP
  sessionAffinityConfig: {clientIP: {timeoutSeconds: 999999999}}
  ports: [{name: p, port: 80}]
`,
	)
}

func TestBadInputIsolatedPerService(t *testing.T) {
	tp := testbed.New(t)
	pod := tp.NS(testbed.Pod)
	ln := echoTCP(t, tp, testbed.Pod, pod.IPv4.String()+":0")
	port := ln.Addr().(*net.TCPAddr).Port
	manifests := badInputManifests(pod.IPv4.String(), port)
	// Valid Services: web, np-a, np-b (its NodePort is np-a's, so its port is
	// left out whole), and wfam and zero, whose Services are valid while their
	// EndpointSlices are not. The NodePort clash is np-b's problem alone: syncs
	// still succeed (the wait below is for a completed sync), and the clash is
	// logged.
	px := runUproxy(t, tp, manifests, launch{want: 4, flags: []string{"--rules", "iptables"}})
	px.write("broken.yaml", "kind: [\n")

	problems := []string{
		"Service it/dup-ports: spec.ports[1]: 80/TCP is already used by spec.ports[0]",
		"Service it/wrong-family: spec.clusterIPs[0]: 10.96.0.41 is IPv4 but spec.ipFamilies[0] is IPv6",
		"EndpointSlice it/wfam-0: endpoints[0].addresses[0]: fd00::1 is not an IPv4 address",
		"EndpointSlice it/zero-0: ports[0].port: 0 is out of range 1-65535",
		"Service it/sticky: spec.sessionAffinityConfig.clientIP.timeoutSeconds: 999999999 is out of range",
		"it/np-b port p: nodePort 30090/TCP is already served by it/np-a port p",
		"broken.yaml: document 1 (line 1): ",
	}
	for _, want := range problems {
		testbed.Await(t, 15*time.Second, "the log to report "+want, func() bool { return strings.Contains(px.logText(), want) })
	}
	st := px.waitFor(func([]serviceState) bool { return true }, "state")
	var names []string
	for _, s := range st {
		names = append(names, s.Name)
	}
	if got, want := strings.Join(names, " "), "it/np-a:p it/web:p it/wfam:p it/zero:p"; got != want {
		t.Errorf("Service ports served: got %s, want %s", got, want)
	}
	// Every sync since has seen the same problems: each is logged once.
	px.waitSynced(time.Now())
	for _, p := range problems {
		if n := strings.Count(px.logText(), p); n != 1 {
			t.Errorf("got %q logged %d times, want once", p, n)
		}
	}

	node := tp.NS(testbed.Node)
	paths := []struct{ name, from, addr string }{
		{"good Service", testbed.Pod, "10.96.0.10:80"},
		{"first claimant of a NodePort, by NodePort", testbed.External, node.IPv4.String() + ":30090"},
	}
	for _, p := range paths {
		t.Run(p.name, func(t *testing.T) {
			if err := dialRoundTrip(tp, p.from, p.addr, 16<<10); err != nil {
				t.Errorf("%s from %s: %v", p.addr, p.from, err)
			}
		})
	}
	t.Run("Service whose slice is invalid refuses its clients at the portal", func(t *testing.T) {
		// No usable endpoint: the connect itself is refused, never accepted and reset.
		if err := dialRoundTrip(tp, testbed.Pod, "10.96.0.42:80", 16); !isRefused(err) {
			t.Errorf("10.96.0.42:80: got %v, want connection refused (no endpoints)", err)
		}
	})

	t.Run("fixing one object brings it in, the others keep working", func(t *testing.T) {
		px.write("services.yaml", strings.Replace(manifests, "timeoutSeconds: 999999999", "timeoutSeconds: 600", 1))
		px.waitFor(func(s []serviceState) bool { return proxyPortOf(s, "it/sticky:p") != 0 }, "it/sticky:p served")
		if err := dialRoundTrip(tp, testbed.Pod, "10.96.0.10:80", 16<<10); err != nil {
			t.Errorf("good Service after the rewrite: %v", err)
		}
	})
	if !px.running() {
		t.Errorf("uproxy exited")
	}
}

// TestRulesNoneUnprivileged runs uproxy as nobody with no capabilities at all and
// --rules none: it must start and proxy on its proxy ports.
func TestRulesNoneUnprivileged(t *testing.T) {
	tp := testbed.New(t)
	pod := tp.NS(testbed.Pod)
	ln := echoTCP(t, tp, testbed.Pod, pod.IPv4.String()+":0")
	bin, dir := worldReadableCopy(t)
	px := runUproxy(t, tp, svc{name: "web", proto: "TCP", clusterIPs: []string{"10.96.0.10"}, port: 80,
		endpoints: []string{pod.IPv4.String()}, endpointPorts: []int{ln.Addr().(*net.TCPAddr).Port}}.yaml(),
		launch{want: 1, bin: bin, dir: dir,
			wrapper: []string{"prlimit", "--nofile=256:4096", "--",
				"setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"},
			flags: []string{"--rules", "none"}})
	pid := px.cmd.Process.Pid
	if got := procStatus(t, pid, "Uid"); got != "65534\t65534\t65534\t65534" {
		t.Errorf("uids: got %q, want nobody (65534) throughout", got)
	}
	if got := procStatus(t, pid, "CapEff"); got != "0000000000000000" {
		t.Errorf("effective capabilities: got %s, want none", got)
	}
	if want := `soft="4096" hard="4096"`; !strings.Contains(px.logText(), want) {
		t.Errorf("log lacks the raised file limit %s", want)
	}
	port := proxyPortOf(px.waitFor(func([]serviceState) bool { return true }, "state"), "it/web:p")
	for i := range 10 {
		if err := dialRoundTrip(tp, testbed.Node, fmt.Sprintf("127.0.0.1:%d", port), 64<<10); err != nil {
			t.Fatalf("connection %d to the proxy port %d: %v", i, port, err)
		}
	}
}

func TestObservabilityExposure(t *testing.T) {
	tp := testbed.New(t)
	pod := tp.NS(testbed.Pod)
	node := tp.NS(testbed.Node)
	ln := echoTCP(t, tp, testbed.Pod, pod.IPv4.String()+":0")
	manifests := svc{name: "web", proto: "TCP", clusterIPs: []string{"10.96.0.10"}, port: 80,
		endpoints: []string{pod.IPv4.String()}, endpointPorts: []int{ln.Addr().(*net.TCPAddr).Port}}.yaml()

	status := func(role, url string) (int, error) {
		c := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true,
			DialContext: func(_ context.Context, network, addr string) (net.Conn, error) { return tp.Dial(role, network, addr) }}}
		resp, err := c.Get(url)
		if err != nil {
			return 0, err
		}
		resp.Body.Close()
		return resp.StatusCode, nil
	}

	t.Run("metrics and debug listen on loopback by default", func(t *testing.T) {
		px := runUproxy(t, tp, manifests, launch{want: 1, defaultAddrs: true, flags: []string{"--rules", "none"}})
		if code, err := status(testbed.Node, "http://127.0.0.1:10249/debug/services"); err != nil || code != http.StatusOK {
			t.Errorf("/debug/services on loopback: got %d, %v, want 200", code, err)
		}
		if _, err := status(testbed.External, "http://"+node.IPv4.String()+":10249/metrics"); !isRefused(err) {
			t.Errorf("/metrics on the node IP from outside: got %v, want connection refused", err)
		}
		px.stop()
	})

	t.Run("debug handlers can be turned off", func(t *testing.T) {
		runUproxy(t, tp, manifests, launch{want: -1, flags: []string{"--rules", "none", "--debug-handlers=false"}})
		for path, want := range map[string]int{"/metrics": http.StatusOK, "/debug/services": http.StatusNotFound, "/debug/events": http.StatusNotFound, "/debug/memory": http.StatusNotFound, "/debug/": http.StatusNotFound} {
			if code, err := status(testbed.Node, "http://127.0.0.1:10249"+path); err != nil || code != want {
				t.Errorf("%s: got %d, %v, want %d", path, code, err, want)
			}
		}
	})
}

// TestExternalCommandsTakeArgumentLists reads every non-test Go file of the module
// and fails on an exec.Command whose program is a shell: every external command
// must get its arguments as a list, so no Service field can become shell syntax.
func TestExternalCommandsTakeArgumentLists(t *testing.T) {
	shells := map[string]bool{"sh": true, "bash": true, "/bin/sh": true, "/bin/bash": true, "dash": true, "zsh": true}
	fset := token.NewFileSet()
	checked := 0
	err := filepath.WalkDir("..", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "tools" || d.Name() == "testdata" || strings.HasPrefix(d.Name(), ".")) && path != ".." {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			return err
		}
		ast.Inspect(f, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok {
				return true
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok || (sel.Sel.Name != "Command" && sel.Sel.Name != "CommandContext") {
				return true
			}
			if id, ok := sel.X.(*ast.Ident); !ok || id.Name != "exec" {
				return true
			}
			checked++
			arg := 0
			if sel.Sel.Name == "CommandContext" {
				arg = 1
			}
			if len(call.Args) > arg {
				if lit, ok := call.Args[arg].(*ast.BasicLit); ok && lit.Kind == token.STRING {
					if prog, _ := strconv.Unquote(lit.Value); shells[prog] {
						t.Errorf("%s: exec of the shell %q; pass the program and its arguments instead", fset.Position(call.Pos()), prog)
					}
				}
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if checked == 0 {
		t.Fatalf("found no exec.Command call at all; the walk is broken")
	}
}

// TestHealthzConnectionsLeaveTheControlPlaneItsDescriptors: a client holding
// more idle connections to /healthz than the process has descriptors (the
// health port listens on every address by default) gets at most the HTTP
// servers' share of them; the rest wait in the listen queue. Meanwhile the
// Services, /metrics and a manifest change go on, and once the client lets go
// /healthz answers again.
func TestHealthzConnectionsLeaveTheControlPlaneItsDescriptors(t *testing.T) {
	const limit = 1024
	tp := testbed.New(t)
	pod := tp.NS(testbed.Pod)
	ln := echoTCP(t, tp, testbed.Pod, pod.IPv4.String()+":0")
	web := svc{name: "web", proto: "TCP", clusterIPs: []string{"10.96.0.10"}, port: 80,
		endpoints: []string{pod.IPv4.String()}, endpointPorts: []int{ln.Addr().(*net.TCPAddr).Port}}
	px := runUproxy(t, tp, web.yaml(), launch{want: 1,
		wrapper: []string{"prlimit", fmt.Sprintf("--nofile=%d:%d", limit, limit), "--"},
		flags:   []string{"--rules", "iptables"}})

	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	for len(held) < limit+100 {
		c, err := tp.Dial(testbed.Node, "tcp", "127.0.0.1:10256")
		if err != nil {
			t.Fatalf("connection %d to /healthz: %v", len(held)+1, err)
		}
		held = append(held, c)
	}
	fds := func() int {
		ents, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", px.cmd.Process.Pid))
		return len(ents)
	}
	if n := fds(); n > limit-socket.ReservedDescriptors/2 {
		t.Errorf("uproxy holds %d descriptors with %d connections to /healthz open; want the HTTP servers' share at most", n, len(held))
	}
	if err := dialRoundTrip(tp, testbed.Pod, "10.96.0.10:80", 4096); err != nil {
		t.Errorf("the Service while /healthz is flooded: %v", err)
	}
	if _, err := px.get("/metrics"); err != nil {
		t.Errorf("/metrics while /healthz is flooded: %v", err)
	}
	api := svc{name: "api", proto: "TCP", clusterIPs: []string{"10.96.0.11"}, port: 80,
		endpoints: []string{pod.IPv4.String()}, endpointPorts: []int{ln.Addr().(*net.TCPAddr).Port}}
	px.write("services.yaml", join(web.yaml(), api.yaml()))
	px.waitFor(func(s []serviceState) bool { return len(s) == 2 }, "the manifest change while /healthz is flooded")
	testbed.Await(t, 20*time.Second, "the new Service through its portal while /healthz is flooded", func() bool {
		return dialRoundTrip(tp, testbed.Pod, "10.96.0.11:80", 4096) == nil
	})
	if !strings.Contains(px.logText(), "HTTP connections at their cap") {
		t.Errorf("log does not say the HTTP connections reached their cap")
	}

	for _, c := range held {
		c.Close()
	}
	held = nil
	testbed.Await(t, 20*time.Second, "/healthz answering once the connections are closed", func() bool {
		out, err := tp.Exec(testbed.Node, "curl", "-s", "-m", "2", "-o", "/dev/null", "-w", "%{http_code}", "http://127.0.0.1:10256/healthz")
		return err == nil && string(out) == "200"
	})
}
