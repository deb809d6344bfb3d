package integration

import (
	"encoding/json"
	"fmt"
	"math"
	"net"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// explained is the part of `uproxy explain -o json` these tests read.
type explained struct {
	Mode       string
	Notes      []string
	NFTPortals []struct {
		Map, Key, Service string
		ProxyPort         int
	}
	Services []struct {
		MatchedAs string
		ServedBy  string
		Service   struct {
			Name      string
			ProxyPort int
			Endpoints []struct {
				Address             string
				Ready, Usable       bool
				ConsecutiveFailures int
				Packets             uint64
			}
			NextForClient *struct {
				Client, Endpoint, Reason string
				Sticky                   bool
			}
		}
	}
	Rules []struct {
		Hook  string
		Steps []struct {
			Chain string
			Rule  int
			Line  int
			Text  string
		}
		Verdicts []struct {
			Target, To string
			Via        int
			Certain    bool
			Chance     float64
		}
	}
	RulesError     string
	RecentFailures []struct {
		Kind, Outcome, Client string
		Attempts              []struct{ Endpoint, Result string }
	}
}

// explainWorld is one run of explain's end-to-end test: three named backends on
// the external host, one of them killed, behind two Services (one with ClientIP
// affinity), and uproxy in the node namespace in the mode under test.
type explainWorld struct {
	tp     *testbed.Topology
	px     *proxy
	names  map[string]string // endpoint address -> backend name
	killed string            // the killed backend's address
	client string            // the pod's IP
}

func newExplainWorld(t *testing.T, flags ...string) *explainWorld {
	tp := testbed.New(t)
	ext := tp.NS(testbed.External).IPv4.String()
	w := &explainWorld{tp: tp, names: map[string]string{}, client: tp.NS(testbed.Pod).IPv4.String()}
	var lns []net.Listener
	var eps []string
	var ports []int
	for i := 1; i <= 3; i++ {
		ln := namedTCP(t, tp, testbed.External, ext+":0", fmt.Sprintf("web-%d", i))
		t.Cleanup(func() { ln.Close() })
		lns = append(lns, ln)
		w.names[ln.Addr().String()] = fmt.Sprintf("web-%d", i)
		eps = append(eps, ext)
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	// Killed: its address refuses connections from now on.
	w.killed = lns[1].Addr().String()
	lns[1].Close()
	manifests := join(
		svc{name: "web", proto: "TCP", clusterIPs: []string{"10.96.0.10"}, port: 80, endpoints: eps, endpointPorts: ports}.yaml(),
		svc{name: "sticky", proto: "TCP", clusterIPs: []string{"10.96.0.11"}, port: 80, affinity: true, endpoints: eps, endpointPorts: ports}.yaml(),
	)
	want := -1
	if strings.Contains(strings.Join(flags, " "), "userspace") {
		want = 2
	}
	w.px = runUproxy(t, tp, manifests, launch{want: want, flags: flags})
	return w
}

// connect makes n connections from the pod to vip and returns how many each
// backend answered, and how many were refused.
func (w *explainWorld) connect(t *testing.T, vip string, n int) (answered map[string]int, refused int) {
	t.Helper()
	answered = map[string]int{}
	for i := range n {
		name, err := whoTCP(w.tp, testbed.Pod, vip)
		switch {
		case err == nil:
			answered[name]++
		case isRefused(err):
			refused++
		default:
			t.Fatalf("connection %d to %s: %v", i, vip, err)
		}
	}
	return answered, refused
}

// explain runs `uproxy explain` in the node namespace, as a user on the node
// would, and returns its text and its -o json form.
func (w *explainWorld) explain(t *testing.T, dst string) (string, explained) {
	t.Helper()
	args := []string{"netns", "exec", w.tp.NS(testbed.Node).Name, uproxyBin, "explain", dst, "--client", w.client, "--metrics-address", w.px.metrics}
	text, err := exec.Command("ip", args...).Output()
	if err != nil {
		t.Fatalf("uproxy explain %s: %v: %s", dst, err, stderrOf(err))
	}
	js, err := exec.Command("ip", append(args, "-o", "json")...).Output()
	if err != nil {
		t.Fatalf("uproxy explain %s -o json: %v: %s", dst, err, stderrOf(err))
	}
	var x explained
	if err := json.Unmarshal(js, &x); err != nil {
		t.Fatalf("decode explain -o json: %v\n%s", err, js)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("uproxy explain %s:\n%s", dst, text)
		}
	})
	return string(text), x
}

func stderrOf(err error) string {
	if ee, ok := err.(*exec.ExitError); ok {
		return string(ee.Stderr)
	}
	return ""
}

// checkRulesAreReal checks that every rule explain names is at its line of the
// node's iptables-save, with its chain and number as iptables counts them.
func (w *explainWorld) checkRulesAreReal(t *testing.T, x explained) {
	t.Helper()
	saved, err := w.tp.Exec(testbed.Node, "iptables-save")
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(saved), "\n")
	for _, rp := range x.Rules {
		for _, s := range rp.Steps {
			if s.Line < 1 || s.Line > len(lines) || lines[s.Line-1] != s.Text {
				t.Errorf("%s step %s rule %d: line %d of iptables-save is not %q", rp.Hook, s.Chain, s.Rule, s.Line, s.Text)
				continue
			}
			// The position within the chain of the step's table: the
			// mangle table has a PREROUTING of its own.
			n := 0
			for _, l := range lines[:s.Line] {
				if strings.HasPrefix(l, "*") {
					n = 0
				}
				if strings.HasPrefix(l, "-A "+s.Chain+" ") {
					n++
				}
			}
			if n != s.Rule {
				t.Errorf("%s step %q: got rule %d, want %d (its position in %s)", rp.Hook, s.Text, s.Rule, n, s.Chain)
			}
		}
	}
}

func contains(t *testing.T, text string, wants ...string) {
	t.Helper()
	for _, want := range wants {
		if !strings.Contains(text, want) {
			t.Errorf("explain text: missing %q", want)
		}
	}
}

// TestExplainUserspaceMode: explain against the userspace mode with iptables
// portals, after traffic while a backend is killed, names the REDIRECT rule to
// the proxy port, the endpoints with their failures, the client's next endpoint
// (which the next connection then gets) and the retried connections.
func TestExplainUserspaceMode(t *testing.T) {
	w := newExplainWorld(t, "--proxy-mode", "userspace", "--rules", "iptables", "--shutdown-grace", "1s")
	answered, refused := w.connect(t, "10.96.0.10:80", 12)
	if refused != 0 || answered["web-2"] != 0 {
		t.Fatalf("userspace mode with web-2 killed: got %v and %d refused, want every connection answered by web-1 or web-3", answered, refused)
	}
	svcs := w.px.waitFor(func([]serviceState) bool { return true }, "services")
	proxyPort := map[string]int{}
	for _, s := range svcs {
		proxyPort[s.Name] = s.ProxyPort
	}

	text, x := w.explain(t, "10.96.0.10:80/tcp")
	pp := proxyPort["it/web:p"]
	contains(t, text,
		"Destination 10.96.0.10:80/TCP from client "+w.client,
		"Proxy mode: userspace",
		"Service port it/web:p (TCP, matched as clusterIP)",
		fmt.Sprintf("Served by uproxy's proxy port %d (userspace mode)", pp),
		"From pods and other hosts (PREROUTING):",
		fmt.Sprintf("=> always REDIRECT to local port %d, the proxy port of it/web:p", pp),
		"Recent retried or failed connections, newest first:",
		w.killed+" refused after",
	)
	if strings.Contains(text, "From this node") {
		t.Errorf("explain text: a pod client must be traced from PREROUTING only")
	}
	if x.Mode != "userspace" || len(x.Services) != 1 || x.Services[0].Service.ProxyPort != pp {
		t.Fatalf("json: got mode %q and %d services, want userspace and it/web:p on proxy port %d", x.Mode, len(x.Services), pp)
	}
	st := x.Services[0].Service
	for _, e := range st.Endpoints {
		wantFailures := e.Address == w.killed
		if !e.Ready || (e.ConsecutiveFailures > 0) != wantFailures {
			t.Errorf("endpoint %s (%s): got ready %v, %d consecutive failures; want ready, failures only for the killed one", e.Address, w.names[e.Address], e.Ready, e.ConsecutiveFailures)
		}
	}
	if c := st.NextForClient; c == nil || w.names[c.Endpoint] == "" || !strings.Contains(c.Reason, "scheduler rr") {
		t.Errorf("next for client: got %+v, want one of the endpoints by the rr scheduler", c)
	}
	if len(x.Rules) != 1 || len(x.Rules[0].Verdicts) != 1 {
		t.Fatalf("rules: got %+v, want one PREROUTING path with one verdict", x.Rules)
	}
	v := x.Rules[0].Verdicts[0]
	if v.Target != "REDIRECT" || v.To != fmt.Sprint(pp) || !v.Certain {
		t.Errorf("verdict: got %+v, want a certain REDIRECT to %d", v, pp)
	}
	if s := x.Rules[0].Steps[v.Via]; s.Chain != "UPROXY-PORTALS-CONTAINER" || !strings.Contains(s.Text, "-d 10.96.0.10/32") {
		t.Errorf("deciding rule: got %s %q, want the UPROXY-PORTALS-CONTAINER rule of 10.96.0.10", s.Chain, s.Text)
	}
	w.checkRulesAreReal(t, x)
	retried := 0
	for _, ev := range x.RecentFailures {
		if ev.Kind == "connection" && ev.Outcome == "retried" && len(ev.Attempts) == 2 &&
			ev.Attempts[0].Endpoint == w.killed && ev.Attempts[0].Result == "refused" && ev.Attempts[1].Result == "success" &&
			strings.HasPrefix(ev.Client, w.client+":") {
			retried++
		}
	}
	if retried == 0 {
		t.Errorf("recent failures: got %+v, want connections from %s retried after %s refused", x.RecentFailures, w.client, w.killed)
	}

	t.Run("the next new client: /debug/services and explain name what the next connection gets", func(t *testing.T) {
		w.checkNextNewClient(t, "10.96.0.10:80", "it/web:p", 30)
	})

	t.Run("ClientIP affinity: the next connection gets the endpoint explain names", func(t *testing.T) {
		first, _ := w.connect(t, "10.96.0.11:80", 1)
		_, x := w.explain(t, "10.96.0.11:80")
		if len(x.Services) != 1 || x.Services[0].Service.NextForClient == nil {
			t.Fatalf("json: got %+v, want it/sticky:p with a next choice", x.Services)
		}
		c := x.Services[0].Service.NextForClient
		if !c.Sticky || first[w.names[c.Endpoint]] != 1 {
			t.Errorf("next for client: got %+v, want the affinity entry to the endpoint that answered (%v)", c, first)
		}
		if next, _ := w.connect(t, "10.96.0.11:80", 1); next[w.names[c.Endpoint]] != 1 {
			t.Errorf("next connection: answered by %v, want %s as explain said", next, w.names[c.Endpoint])
		}
	})
}

// TestExplainNFTablesPortals: with --rules nftables, explain names the map
// element that catches the destination (read from the kernel), and the
// connection it describes is answered.
func TestExplainNFTablesPortals(t *testing.T) {
	testbed.Needs(t, testbed.NFTables)
	w := newExplainWorld(t, "--proxy-mode", "userspace", "--rules", "nftables", "--shutdown-grace", "1s")
	if answered, _ := w.connect(t, "10.96.0.10:80", 3); len(answered) == 0 {
		t.Fatalf("no connection through the nftables portals was answered")
	}
	svcs := w.px.waitFor(func([]serviceState) bool { return true }, "services")
	pp := 0
	for _, s := range svcs {
		if s.Name == "it/web:p" {
			pp = s.ProxyPort
		}
	}
	text, x := w.explain(t, "10.96.0.10:80/tcp")
	contains(t, text, "nftables portals (table inet uproxy):",
		fmt.Sprintf("map service-ips4: 10.96.0.10 . tcp . 80 : %d (it/web:p)", pp))
	if len(x.NFTPortals) != 1 || x.NFTPortals[0].ProxyPort != pp || x.NFTPortals[0].Map != "service-ips4" {
		t.Errorf("json nftPortals: got %+v, want the service-ips4 element to proxy port %d", x.NFTPortals, pp)
	}
	for _, n := range x.Notes {
		if strings.Contains(n, "no portal rule") {
			t.Errorf("note %q: the nftables portals catch the destination", n)
		}
	}
	// The nat path is the element's: to the proxy port, not "itself".
	contains(t, text, fmt.Sprintf("=> always REDIRECT to local port %d, the proxy port of it/web:p (nftables inet uproxy, service-ips4)", pp))
	if strings.Contains(text, "no rule rewrites it") {
		t.Errorf("explain text: says no rule rewrites %s, which the portals' element steers to proxy port %d", "10.96.0.10:80", pp)
	}
	if len(x.Rules) != 1 || len(x.Rules[0].Verdicts) != 1 || x.Rules[0].Verdicts[0].Target != "REDIRECT" ||
		x.Rules[0].Verdicts[0].To != fmt.Sprint(pp) || !x.Rules[0].Verdicts[0].Certain {
		t.Errorf("json rules: got %+v, want one PREROUTING path to a certain REDIRECT to %d", x.Rules, pp)
	}
}

// TestExplainNFTablesKernelMode: explain against the nftables kernel mode
// shows the mode's DNAT elements as the nat path, a third of new
// connections to each endpoint, and gives the client the kernel's random
// pick among them, as the connections found it (the killed one refused).
func TestExplainNFTablesKernelMode(t *testing.T) {
	testbed.Needs(t, testbed.NFTables)
	w := newExplainWorld(t, "--proxy-mode", "nftables")
	// The kernel picks at random: with 36 connections each of the three
	// endpoints is missed with a chance of (2/3)^36, about 5e-7 (12 had
	// missed one in a run).
	answered, refused := w.connect(t, "10.96.0.10:80", 36)
	if refused == 0 || answered["web-2"] != 0 || len(answered) != 2 {
		t.Fatalf("nftables mode with web-2 killed: got %v and %d refused, want some refused and the others answered by web-1 and web-3", answered, refused)
	}
	text, x := w.explain(t, "10.96.0.10:80/tcp")
	contains(t, text, "Proxy mode: nftables", "nftables kernel mode (table inet uproxy-kernel):",
		"Next for client "+w.client+": the kernel picks at random for each new connection (numgen random, one slot per endpoint): ")
	for _, bad := range []string{"no rule rewrites it", "no rule sends it to an endpoint"} {
		if strings.Contains(text, bad) {
			t.Errorf("explain text: says %q beside the DNAT elements", bad)
		}
	}
	if len(x.Services) != 1 || x.Services[0].Service.NextForClient == nil || len(x.Rules) != 1 {
		t.Fatalf("json: got %d services, %d rule paths; want it/web:p with a next choice, PREROUTING", len(x.Services), len(x.Rules))
	}
	dnat := map[string]float64{}
	for _, v := range x.Rules[0].Verdicts {
		if v.Target != "DNAT" || v.Certain {
			t.Errorf("verdict %+v: want a DNAT to an endpoint, one of a random pick", v)
		}
		dnat[v.To] += v.Chance
	}
	for ep, name := range w.names {
		if math.Abs(dnat[ep]-1.0/3) > 0.01 {
			t.Errorf("share of new connections to %s (%s): got %.3f, want 1/3 (all verdicts %v)", ep, name, dnat[ep], dnat)
		}
		if c := x.Services[0].Service.NextForClient; !strings.Contains(c.Reason, ep+" 33%") {
			t.Errorf("next for client: got %q, want %s with 33%%", c.Reason, ep)
		}
	}
}

// TestExplainIPTablesMode: explain against the iptables kernel mode names the
// Service chain and the endpoint chains with each one's share, the DNAT
// counters (which match what the clients saw, refusals included), the client's
// pinned endpoint from the kernel's recent list, and says that uproxy records
// no failures because it never sees these connections.
func TestExplainIPTablesMode(t *testing.T) {
	w := newExplainWorld(t, "--proxy-mode", "iptables")
	const n = 30
	answered, refused := w.connect(t, "10.96.0.10:80", n)
	if refused == 0 || answered["web-2"] != 0 {
		t.Fatalf("iptables mode with web-2 killed: got %v and %d refused, want some refused and none from web-2", answered, refused)
	}

	text, x := w.explain(t, "10.96.0.10:80/tcp")
	contains(t, text,
		"Proxy mode: iptables",
		"Service port it/web:p (TCP, matched as clusterIP)",
		"Served by the kernel (iptables mode)",
		"in the iptables mode the kernel forwards each connection itself",
		"Next for client "+w.client+": the kernel picks at random for each new connection (-m statistic)",
		"UPROXY-SERVICES rule",
		"% of new connections)",
		"none recorded: in the iptables mode uproxy does not see connections",
	)
	if x.Mode != "iptables" || len(x.Services) != 1 || len(x.Rules) != 1 {
		t.Fatalf("json: got mode %q, %d services, %d rule paths; want iptables, it/web:p, PREROUTING", x.Mode, len(x.Services), len(x.Rules))
	}
	st := x.Services[0].Service
	if st.ProxyPort != 0 {
		t.Errorf("proxy port: got %d, want none", st.ProxyPort)
	}
	for _, e := range st.Endpoints {
		want := uint64(answered[w.names[e.Address]])
		if e.Address == w.killed {
			want = uint64(refused)
		}
		if e.Packets != want || !e.Usable {
			t.Errorf("endpoint %s (%s): got %d connections by the DNAT counter (usable %v), want %d (what the clients saw), usable", e.Address, w.names[e.Address], e.Packets, e.Usable, want)
		}
	}
	rp := x.Rules[0]
	dnat := map[string]float64{}
	for _, v := range rp.Verdicts {
		if v.Target != "DNAT" {
			t.Errorf("verdict %+v: want DNAT to an endpoint", v)
			continue
		}
		dnat[v.To] = v.Chance
		chain := rp.Steps[v.Via].Chain
		if !strings.HasPrefix(chain, "UPROXY-SEP-") {
			t.Errorf("DNAT to %s in chain %s, want an UPROXY-SEP- chain", v.To, chain)
		}
	}
	for ep := range w.names {
		if math.Abs(dnat[ep]-1.0/3) > 0.01 {
			t.Errorf("share of new connections to %s: got %.3f, want 1/3 (all verdicts %v)", ep, dnat[ep], dnat)
		}
	}
	svcChain := false
	for _, s := range rp.Steps {
		svcChain = svcChain || strings.HasPrefix(s.Chain, "UPROXY-SVC-")
	}
	if !svcChain {
		t.Errorf("steps: got %+v, want the Service's UPROXY-SVC- chain", rp.Steps)
	}
	w.checkRulesAreReal(t, x)
	if len(x.RecentFailures) != 0 {
		t.Errorf("recent failures: got %+v, want none (the kernel forwards)", x.RecentFailures)
	}

	t.Run("ClientIP affinity: the recent list pins the client, refused or not", func(t *testing.T) {
		first, refused := w.connect(t, "10.96.0.11:80", 1)
		text, x := w.explain(t, "10.96.0.11:80")
		if len(x.Services) != 1 || x.Services[0].Service.NextForClient == nil {
			t.Fatalf("json: got %+v, want it/sticky:p with a next choice", x.Services)
		}
		c := x.Services[0].Service.NextForClient
		name := w.names[c.Endpoint]
		if !c.Sticky || (first[name] != 1 && !(refused == 1 && c.Endpoint == w.killed)) {
			t.Errorf("next for client: got %+v, want the endpoint the first connection went to (answered %v, refused %d)", c, first, refused)
		}
		contains(t, text, "because ClientIP affinity: the kernel's recent list UPROXY-SEP-")
		next, refusedNext := w.connect(t, "10.96.0.11:80", 1)
		if c.Endpoint == w.killed && refusedNext != 1 || c.Endpoint != w.killed && next[name] != 1 {
			t.Errorf("next connection: answered by %v, refused %d; want it to go to %s (%s) as explain said", next, refusedNext, c.Endpoint, name)
		}
	})
}

// nextView is what /debug/services says of a Service port's next new client
// and of the killed endpoint's ejection.
type nextView struct {
	next, reason string
	ejected      bool
	until        time.Time
}

func (w *explainWorld) nextView(t *testing.T, name string) nextView {
	t.Helper()
	body, err := w.px.get("/debug/services")
	if err != nil {
		t.Fatalf("GET /debug/services: %v", err)
	}
	var x struct {
		Services []struct {
			Name, NextEndpoint, NextReason string
			Endpoints                      []struct {
				Address      string
				Ejected      bool
				EjectedUntil time.Time
			}
		}
	}
	if err := json.Unmarshal([]byte(body), &x); err != nil {
		t.Fatalf("decode /debug/services: %v\n%s", err, body)
	}
	for _, s := range x.Services {
		if s.Name != name {
			continue
		}
		v := nextView{next: s.NextEndpoint, reason: s.NextReason}
		for _, e := range s.Endpoints {
			if e.Address == w.killed {
				v.ejected, v.until = e.Ejected, e.EjectedUntil
			}
		}
		return v
	}
	t.Fatalf("/debug/services has no %s:\n%s", name, body)
	return nextView{}
}

// checkNextNewClient samples, n times while the killed endpoint is ejected,
// the next new client that /debug/services names (and every tenth time the
// "Next new client" of `uproxy explain` without --client), then connects:
// the connection must be answered by the endpoint named, and the ejected
// endpoint is never named. Between samples, connections drive the killed
// endpoint back into ejection when its period ends.
func (w *explainWorld) checkNextNewClient(t *testing.T, vip, name string, n int) {
	t.Helper()
	nextRE := regexp.MustCompile(`Next new client: ([^\s,]+),? ([^\n]*)`)
	deadline := time.Now().Add(60 * time.Second)
	samples := 0
	for samples < n && time.Now().Before(deadline) {
		v := w.nextView(t, name)
		if !v.ejected || time.Until(v.until) < 500*time.Millisecond {
			w.connect(t, vip, 1) // on probation, one failed dial ejects it again
			continue
		}
		next, reason, from := v.next, v.reason, "/debug/services"
		if samples%10 == 0 {
			args := []string{"netns", "exec", w.tp.NS(testbed.Node).Name, uproxyBin, "explain", vip, "--metrics-address", w.px.metrics}
			text, err := exec.Command("ip", args...).Output()
			if err != nil {
				t.Fatalf("uproxy explain %s: %v: %s", vip, err, stderrOf(err))
			}
			m := nextRE.FindStringSubmatch(string(text))
			if m == nil {
				t.Fatalf("uproxy explain %s: no \"Next new client\" line:\n%s", vip, text)
			}
			next, reason, from = m[1], m[2], "uproxy explain"
		}
		samples++
		if next == w.killed {
			t.Errorf("sample %d: %s names the ejected %s as the next new client (%s)", samples, from, next, reason)
		}
		answered, refused := w.connect(t, vip, 1)
		if answered[w.names[next]] != 1 {
			t.Errorf("sample %d: %s named %s (%s, %s), the connection was answered by %v (%d refused)", samples, from, next, w.names[next], reason, answered, refused)
		}
	}
	if samples < n {
		t.Fatalf("took %d samples while %s was ejected in 60s, want %d", samples, w.killed, n)
	}
}

// TestExplainShowsSourceProblemsAndLeftOutPorts: what the log says once, when
// it happens, /debug/services and uproxy explain say for as long as it lasts:
// a Service port the last sync left out (no proxy port free) and an invalid
// edit kept at the Service's last good version.
func TestExplainShowsSourceProblemsAndLeftOutPorts(t *testing.T) {
	tp := testbed.New(t)
	pod := tp.NS(testbed.Pod)
	ln := echoTCP(t, tp, testbed.Pod, pod.IPv4.String()+":0")
	web := svc{name: "web", proto: "TCP", clusterIPs: []string{"10.96.0.10"}, port: 80,
		endpoints: []string{pod.IPv4.String()}, endpointPorts: []int{ln.Addr().(*net.TCPAddr).Port}}
	web2 := web
	web2.name, web2.clusterIPs = "web2", []string{"10.96.0.20"}
	px := startProxy(t, tp, web.yaml(), 1, "--proxy-port-range", "40000-40000")
	px.write("services.yaml", join(web.yaml(), web2.yaml()))
	explain := func(dst string) explained {
		t.Helper()
		js, err := tp.Exec(testbed.Node, uproxyBin, "explain", dst, "--metrics-address", px.metrics, "-o", "json")
		if err != nil {
			t.Fatalf("uproxy explain %s: %v: %s", dst, err, js)
		}
		var x explained
		if err := json.Unmarshal(js, &x); err != nil {
			t.Fatalf("decode explain -o json: %v\n%s", err, js)
		}
		return x
	}
	hasNote := func(x explained, want ...string) bool {
		for _, n := range x.Notes {
			if ok := func() bool {
				for _, w := range want {
					if !strings.Contains(n, w) {
						return false
					}
				}
				return true
			}(); ok {
				return true
			}
		}
		return false
	}
	testbed.Await(t, 20*time.Second, "explain of web2 naming it left out for want of a proxy port", func() bool {
		return hasNote(explain("10.96.0.20:80"), "left out of the last sync", "it/web2:p", "every TCP port of range 40000-40000 is in use")
	})
	var body struct{ LeftOut []string }
	if b, err := px.get("/debug/services"); err != nil || json.Unmarshal([]byte(b), &body) != nil || len(body.LeftOut) != 1 {
		t.Errorf("/debug/services leftOut: got %q (%v), want web2's port", body.LeftOut, err)
	}

	broken := web
	broken.port = 0
	px.write("services.yaml", join(broken.yaml(), web2.yaml()))
	testbed.Await(t, 20*time.Second, "explain of web naming its invalid edit", func() bool {
		return hasNote(explain("10.96.0.10:80"), "problem of the Service source", "Service it/web:", "spec.ports[0].port")
	})
	metrics, err := px.get("/metrics")
	if err != nil || !strings.Contains(metrics, "uproxy_source_problems 1") {
		t.Errorf("/metrics: want uproxy_source_problems 1 (%v)", err)
	}
	if x := explain("10.96.0.10:80"); len(x.Services) != 1 {
		t.Errorf("explain of web while its edit is invalid: got %d Service ports, want its last good version served", len(x.Services))
	}
}
