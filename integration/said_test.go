package integration

import (
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// TestSCTPServiceSaidInTheUserspaceMode: the userspace mode has no SCTP proxy.
// An SCTP Service port is not dropped without a word: the manifest problem names
// it in the log (and counts in the reload's problems), /debug/services lists it
// with why it is not served, and `uproxy explain` says so rather than that no
// Service has the address. The TCP Service beside it is served as ever.
func TestSCTPServiceSaidInTheUserspaceMode(t *testing.T) {
	tp := testbed.New(t)
	manifests := join(webService(t, tp),
		"apiVersion: v1\nkind: Service\nmetadata: {name: sig, namespace: it}\nspec:\n  clusterIP: 10.96.0.20\n  ports:\n  - {name: p, protocol: SCTP, port: 3868}\n")
	px := startProxy(t, tp, manifests, 1)

	log := px.logText()
	for _, want := range []string{`"Manifest problem"`, `SCTP port 3868 (it/sig:p) is not served: the userspace mode has no SCTP proxy`, `problems=1`} {
		if !strings.Contains(log, want) {
			t.Errorf("log lacks %q:\n%s", want, tail(log, 30))
		}
	}

	body, err := px.get("/debug/services")
	if err != nil {
		t.Fatal(err)
	}
	var debug struct {
		Services []struct {
			Name, Protocol, NotServed string
			ProxyPort                 int
			ClusterIPs                []string
		}
	}
	if err := json.Unmarshal([]byte(body), &debug); err != nil {
		t.Fatalf("decode /debug/services: %v\n%s", err, body)
	}
	found := false
	for _, s := range debug.Services {
		if s.Name != "it/sig:p" {
			continue
		}
		found = true
		if s.Protocol != "SCTP" || s.ProxyPort != 0 || !strings.Contains(s.NotServed, "no SCTP proxy") || strings.Join(s.ClusterIPs, ",") != "10.96.0.20" {
			t.Errorf("/debug/services it/sig:p: got %+v, want SCTP, no proxy port, cluster IP 10.96.0.20 and why it is not served", s)
		}
	}
	if !found {
		t.Errorf("/debug/services lacks it/sig:p:\n%s", body)
	}

	out, err := tp.Exec(testbed.Node, uproxyBin, "explain", "10.96.0.20:3868/sctp", "--metrics-address", px.metrics)
	if err != nil {
		t.Fatalf("uproxy explain: %v\n%s", err, out)
	}
	for _, want := range []string{"Service port it/sig:p (SCTP, matched as clusterIP)", "Served by nothing: the userspace mode has no SCTP proxy"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("uproxy explain 10.96.0.20:3868/sctp lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(string(out), "no Service port of the running proxy") {
		t.Errorf("uproxy explain says no Service has the address:\n%s", out)
	}
	if name, err := whoTCP(tp, testbed.Pod, "10.96.0.10:80"); err != nil || !strings.HasPrefix(name, "web-") {
		t.Errorf("the TCP Service beside it: got %q (%v), want a web backend", name, err)
	}
}

// TestServiceWithoutClusterIPIsWarnedOf: a manifest's Service without a
// clusterIP (the API server would have assigned one) is still served on its
// proxy port, and the log says once that no cluster IP reaches it.
func TestServiceWithoutClusterIPIsWarnedOf(t *testing.T) {
	tp := testbed.New(t)
	px := runUproxy(t, tp, "apiVersion: v1\nkind: Service\nmetadata: {name: bare, namespace: it}\nspec:\n  ports:\n  - {name: p, port: 80}\n",
		launch{want: 1, flags: []string{"--rules", "none"}})
	log := px.logText()
	want := `Service it/bare: spec.clusterIP: not set, so no cluster IP reaches the Service`
	if n := strings.Count(log, want); n != 1 {
		t.Errorf("log has %q %d times, want once:\n%s", want, n, tail(log, 30))
	}
	if !strings.Contains(log, "problems=1") {
		t.Errorf("the manifest load does not count the problem:\n%s", tail(log, 30))
	}
}

// startUnsynced starts uproxy in the node namespace with args, its metrics
// and healthz on their usual loopback addresses there and the default log
// verbosity, and returns at once: it waits for no sync.
func startUnsynced(t *testing.T, tp *testbed.Topology, args ...string) *proxy {
	t.Helper()
	p := &proxy{t: t, tp: tp, exited: make(chan struct{}), metrics: "127.0.0.1:10249"}
	args = append([]string{"netns", "exec", tp.NS(testbed.Node).Name, uproxyBin,
		"--metrics-bind-address", p.metrics, "--healthz-bind-address", "127.0.0.1:10256"}, args...)
	p.start(args)
	return p
}

// TestUnreachableAPIServerIsSaid: with an API server that cannot be reached,
// the log says so at the default verbosity, once (the informers retry every
// second or so; the failures are logged at most every 30s), and /healthz
// answers as kube-proxy's does before its first sync without a Node: 503,
// nodeEligible false, the start as lastUpdated (never 0001-01-01), while
// /livez, which is about the proxy alone, answers 200.
func TestUnreachableAPIServerIsSaid(t *testing.T) {
	tp := testbed.New(t)
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	master := "http://" + closed.Addr().String()
	closed.Close()
	px := startUnsynced(t, tp, "--master", master, "--rules", "none", "--hostname-override", "node-a")
	const failed = `"API server request failed; retrying"`
	testbed.Await(t, 15*time.Second, "the failure in the log", func() bool { return strings.Contains(px.logText(), failed) })
	for _, want := range []string{"connection refused", `host="` + master + `"`} {
		if !strings.Contains(px.logText(), want) {
			t.Errorf("log lacks %q:\n%s", want, tail(px.logText(), 20))
		}
	}

	get := func(path string) (int, map[string]any) {
		t.Helper()
		resp, err := px.client.Get("http://127.0.0.1:10256" + path)
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		var body map[string]any
		if err := json.Unmarshal(b, &body); err != nil {
			t.Fatalf("%s: %v: %s", path, err, b)
		}
		return resp.StatusCode, body
	}
	code, body := get("/healthz")
	if code != http.StatusServiceUnavailable || body["nodeEligible"] != false {
		t.Errorf("/healthz before the first sync: got %d %v, want 503 with nodeEligible false", code, body)
	}
	if last, _ := body["lastUpdated"].(string); last == "" || strings.HasPrefix(last, "0001-01-01") {
		t.Errorf("/healthz lastUpdated: got %q, want the start of the sync loop", last)
	}
	if code, body := get("/livez"); code != http.StatusOK {
		t.Errorf("/livez before the first sync: got %d %v, want 200", code, body)
	}
	time.Sleep(5 * time.Second) // several retries of every informer
	if n := strings.Count(px.logText(), failed); n != 1 {
		t.Errorf("failure logged %d times in 5s, want once:\n%s", n, tail(px.logText(), 20))
	}
}
