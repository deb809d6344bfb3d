package integration

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// TestRetryStrategies runs the three retry strategies side by side in one uproxy,
// each on a Service of its own chosen by annotations, on real faults: a backend
// whose SYNs the node drops (iptables DROP in the node namespace, so the dial is
// never answered), and backends that refuse. It checks what each strategy does
// with every connection, as /debug/events and the metrics record it, and that
// the hedges' losers leave no descriptor behind in the proxy.
func TestRetryStrategies(t *testing.T) {
	tp := testbed.New(t)
	pod := tp.NS(testbed.Pod)
	// Three backend addresses in the pod namespace, one per endpoint, so the
	// blackhole is one address.
	ips := []string{"10.244.1.11", "10.244.1.12", "10.244.1.13"}
	for _, ip := range ips {
		if out, err := tp.Exec(testbed.Pod, "ip", "addr", "add", ip+"/24", "dev", "eth0"); err != nil {
			t.Fatalf("add %s: %v: %s", ip, err, out)
		}
	}
	var ports []int
	for i, ip := range ips {
		ln := namedTCP(t, tp, testbed.Pod, ip+":0", fmt.Sprintf("b%d", i+1))
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	blackholed := ips[2]
	if out, err := tp.Exec(testbed.Node, "iptables", "-w", "-I", "OUTPUT", "-p", "tcp", "--syn", "-d", blackholed, "-j", "DROP"); err != nil {
		t.Fatalf("blackhole %s: %v: %s", blackholed, err, out)
	}
	// Two addresses that refuse: nothing listens on these ports.
	refusing := []string{pod.IPv4.String(), ips[0]}
	refusedPorts := []int{closedPort(t, tp, pod.IPv4.String()), closedPort(t, tp, ips[0])}

	annotated := func(s svc, annotations map[string]string) string {
		var kv []string
		for k, v := range annotations {
			kv = append(kv, fmt.Sprintf("%s: %q", k, v))
		}
		head := fmt.Sprintf("metadata: {name: %s, namespace: it}", s.name)
		return strings.Replace(s.yaml(), head, fmt.Sprintf("metadata: {name: %s, namespace: it, annotations: {%s}}", s.name, strings.Join(kv, ", ")), 1)
	}
	manifests := join(
		svc{name: "sequential", proto: "TCP", clusterIPs: []string{"10.96.7.1"}, port: 80, endpoints: ips, endpointPorts: ports}.yaml(),
		annotated(svc{name: "hedged", proto: "TCP", clusterIPs: []string{"10.96.7.2"}, port: 80, endpoints: ips, endpointPorts: ports},
			map[string]string{"uproxy.io/dial-hedge": "30ms"}),
		svc{name: "unbudgeted", proto: "TCP", clusterIPs: []string{"10.96.7.3"}, port: 80, endpoints: refusing, endpointPorts: refusedPorts}.yaml(),
		annotated(svc{name: "budgeted", proto: "TCP", clusterIPs: []string{"10.96.7.4"}, port: 80, endpoints: refusing, endpointPorts: refusedPorts},
			map[string]string{"uproxy.io/retry-budget": "10"}),
	)
	// No ejection: every connection meets the faults, as at the first moments
	// of an outage.
	// The client and the endpoints are addresses of one pod namespace: a dial
	// from the client's address would be answered inside it, never reaching
	// the node (as behind kube-proxy's DNAT), so the node's address it is.
	px := startProxy(t, tp, manifests, 4, "--eject-after", "0", "--events", "1024", "--preserve-client-address=false")

	policies := map[string]map[string]string{}
	body, err := px.get("/debug/services")
	if err != nil {
		t.Fatal(err)
	}
	var debug struct {
		Services []struct {
			Name   string                     `json:"name"`
			Policy map[string]json.RawMessage `json:"policy"`
		} `json:"services"`
	}
	if err := json.Unmarshal([]byte(body), &debug); err != nil {
		t.Fatal(err)
	}
	for _, s := range debug.Services {
		policies[s.Name] = map[string]string{}
		for k, raw := range s.Policy {
			var v struct{ Value, Source string }
			if json.Unmarshal(raw, &v) == nil { // retryTokens is a number
				policies[s.Name][k] = v.Value + " from " + v.Source
			}
		}
	}
	for svc, want := range map[string]map[string]string{
		"it/sequential:p": {"dialHedge": "off from --dial-hedge", "dialTimeouts": "250ms,500ms,1s,2s from --dial-timeouts"},
		"it/hedged:p":     {"dialHedge": "30ms from uproxy.io/dial-hedge", "retryBudget": "off from --retry-budget"},
		"it/budgeted:p":   {"retryBudget": "10% from uproxy.io/retry-budget"},
	} {
		for k, v := range want {
			if got := policies[svc][k]; got != v {
				t.Errorf("/debug/services %s policy %s: got %q, want %q", svc, k, got, v)
			}
		}
	}

	const conns = 12 // four rounds of three endpoints
	connect := func(addr string) (string, error) { return whoTCP(tp, testbed.Pod, addr) }
	fds := func() int {
		entries, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", px.cmd.Process.Pid))
		if err != nil {
			t.Fatal(err)
		}
		return len(entries)
	}
	// Warm up the hedged Service's path, then take the proxy's descriptors.
	if _, err := connect("10.96.7.2:80"); err != nil {
		t.Fatalf("warm-up connection: %v", err)
	}
	px.waitFor(func(s []serviceState) bool {
		for _, st := range s {
			for _, e := range st.Endpoints {
				if e.ActiveConnections != 0 {
					return false
				}
			}
		}
		return true
	}, "the warm-up connection closed")
	baseline := fds()

	for _, s := range []string{"sequential", "hedged"} {
		for i := range conns {
			if name, err := connect(map[string]string{"sequential": "10.96.7.1:80", "hedged": "10.96.7.2:80"}[s]); err != nil || name == "b3" {
				t.Errorf("%s connection %d: got %q, %v, want an answer from b1 or b2", s, i, name, err)
			}
		}
	}
	// A connection is recorded once the proxy has reset or closed both sides,
	// which the client may see first.
	awaitEvents := func(svc string, n int) {
		t.Helper()
		testbed.Await(t, 10*time.Second, fmt.Sprintf("%d connections of %s recorded", n, svc), func() bool {
			return len(px.events("it/"+svc+":p")) >= n
		})
	}
	awaitEvents("sequential", conns)
	awaitEvents("hedged", conns+1)
	results := func(svc string) map[string]int {
		out := map[string]int{}
		for _, ev := range px.events("it/" + svc + ":p") {
			for _, a := range ev.Attempts {
				host, _, _ := net.SplitHostPort(a.Endpoint)
				out[host+" "+a.Result]++
			}
		}
		return out
	}
	seq, hedged := results("sequential"), results("hedged")
	if seq[blackholed+" timeout"] == 0 || seq[blackholed+" hedge_lost"] != 0 {
		t.Errorf("sequential: attempts by result %v, want the blackholed endpoint timing out and no hedge", seq)
	}
	if hedged[blackholed+" hedge_lost"] == 0 || hedged[blackholed+" timeout"] != 0 {
		t.Errorf("hedged: attempts by result %v, want the blackholed endpoint's attempts lost to hedges, never timed out", hedged)
	}
	metrics, err := px.get("/metrics")
	if err != nil {
		t.Fatal(err)
	}
	if got := sumMetric(metrics, "uproxy_dial_attempts_total", `service="it/hedged:p"`, `endpoint="`+blackholed, `result="hedge_lost"`); got != float64(hedged[blackholed+" hedge_lost"]) {
		t.Errorf("uproxy_dial_attempts_total{result=hedge_lost} of the blackholed endpoint: got %v, want %d as in /debug/events", got, hedged[blackholed+" hedge_lost"])
	}
	// The losers' sockets are closed: the proxy holds what it held before.
	deadline := time.Now().Add(10 * time.Second)
	for fds() > baseline && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if got := fds(); got > baseline {
		t.Errorf("proxy descriptors after the hedged connections: got %d, want at most the %d before them", got, baseline)
	}

	// 100% failure: without a budget every connection makes all four attempts,
	// with one the retries stop after the burst.
	const failing = 40
	for _, s := range []string{"unbudgeted", "budgeted"} {
		addr := map[string]string{"unbudgeted": "10.96.7.3:80", "budgeted": "10.96.7.4:80"}[s]
		for i := range failing {
			if name, err := connect(addr); err == nil {
				t.Fatalf("%s connection %d: got an answer from %q, want a reset (every endpoint refuses)", s, i, name)
			}
		}
	}
	awaitEvents("unbudgeted", failing)
	awaitEvents("budgeted", failing)
	metrics, err = px.get("/metrics")
	if err != nil {
		t.Fatal(err)
	}
	unbudgeted := sumMetric(metrics, "uproxy_dial_attempts_total", `service="it/unbudgeted:p"`)
	budgeted := sumMetric(metrics, "uproxy_dial_attempts_total", `service="it/budgeted:p"`)
	if unbudgeted != 4*failing {
		t.Errorf("dials without a budget: got %v, want %d (4 per connection)", unbudgeted, 4*failing)
	}
	if limit := float64(failing + 10 + failing/10); budgeted > limit {
		t.Errorf("dials with a 10%% budget: got %v, want at most %v (one per connection, the burst of 10, 10%% more)", budgeted, limit)
	}
	refusals := sumMetric(metrics, "uproxy_retry_budget_refusals_total", `service="it/budgeted:p"`)
	if refusals == 0 || sumMetric(metrics, "uproxy_retry_budget_refusals_total", `service="it/unbudgeted:p"`) != 0 {
		t.Errorf("uproxy_retry_budget_refusals_total: got %v for the budgeted Service, want some, and none without a budget", refusals)
	}
	budgetEvents := 0
	for _, ev := range px.events("it/budgeted:p") {
		if ev.Reason == "budget" {
			budgetEvents++
		}
	}
	if float64(budgetEvents) != refusals {
		t.Errorf("/debug/events with reason budget: got %d, want one per refusal (%v)", budgetEvents, refusals)
	}
	t.Logf("sequential %v; hedged %v; dials under 100%% failure: %v without a budget, %v with 10%% (%v refusals)",
		seq, hedged, unbudgeted, budgeted, refusals)
}

// closedPort returns a port on ip in the pod namespace on which nothing listens
// (it was bound and released), so a connect there is refused.
func closedPort(t *testing.T, tp *testbed.Topology, ip string) int {
	t.Helper()
	ln := tp.Listen(testbed.Pod, "tcp", ip+":0")
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	return port
}

// retryEvent is the part of a /debug/events entry these tests read.
type retryEvent struct {
	Reason   string `json:"reason"`
	Attempts []struct {
		Endpoint string `json:"endpoint"`
		Result   string `json:"result"`
	} `json:"attempts"`
}

// events returns the connection events of a Service port.
func (p *proxy) events(service string) []retryEvent {
	p.t.Helper()
	body, err := p.get("/debug/events?kind=connection&service=" + service)
	if err != nil {
		p.t.Fatal(err)
	}
	var out struct {
		Events []retryEvent `json:"events"`
	}
	if err := json.Unmarshal([]byte(body), &out); err != nil {
		p.t.Fatalf("/debug/events: %v", err)
	}
	return out.Events
}

// sumMetric sums the samples of a metric whose label text contains every one of
// labels (e.g. `service="it/web:p"`).
func sumMetric(text, name string, labels ...string) float64 {
	sum := 0.0
	for _, line := range strings.Split(text, "\n") {
		rest, ok := strings.CutPrefix(line, name+"{")
		if !ok {
			continue
		}
		lbls, value, ok := strings.Cut(rest, "} ")
		if !ok {
			continue
		}
		match := true
		for _, l := range labels {
			if !strings.Contains(lbls, l) {
				match = false
			}
		}
		if v, err := strconv.ParseFloat(value, 64); err == nil && match {
			sum += v
		}
	}
	return sum
}
