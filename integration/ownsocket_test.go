package integration

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// proxyPortOf returns the proxy port /debug/services gives the Service port name.
func (p *proxy) proxyPortOf(name string) int {
	p.t.Helper()
	for _, st := range p.waitFor(func(s []serviceState) bool {
		for _, st := range s {
			if st.Name == name && st.ProxyPort != 0 {
				return true
			}
		}
		return false
	}, name+"'s proxy port") {
		if st.Name == name {
			return st.ProxyPort
		}
	}
	return 0
}

// sockets returns how many sockets uproxy has open (its other descriptors
// come and go with the syncs' commands).
func (p *proxy) sockets() int {
	p.t.Helper()
	inodes, _, err := testbed.ProcessSockets(p.cmd.Process.Pid)
	if err != nil {
		p.t.Fatalf("uproxy's sockets: %v", err)
	}
	return len(inodes)
}

// healthz fetches /healthz and returns its status code.
func (p *proxy) healthz() (int, error) {
	resp, err := p.client.Get("http://127.0.0.1:10256/healthz")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, nil
}

// curl makes one HTTP/1.0 request from role to addr, as curl would, and
// returns what came back before the end (or the error that ended it).
func curl(tp *testbed.Topology, role, addr string) (string, error) {
	c, err := tp.Dial(role, "tcp", addr)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, "GET / HTTP/1.0\r\nHost: "+addr+"\r\n\r\n"); err != nil {
		return "", err
	}
	b, err := io.ReadAll(c)
	return string(b), err
}

// TestOwnProxyPortEndpoint: a Service whose endpoint is its own proxy port,
// spelled as the node's address, and one curl-like connection
// to it. uproxy never dials itself: the client is refused after its attempts,
// uproxy's descriptors stay where they were, every such endpoint is logged
// once and counted (result own_socket), and /healthz and another Service
// answer all along.
func TestOwnProxyPortEndpoint(t *testing.T) {
	tp := testbed.New(t)
	pod, node := tp.NS(testbed.Pod), tp.NS(testbed.Node)
	web := namedTCP(t, tp, testbed.Pod, pod.IPv4.String()+":0", "web-1")
	webPort := web.Addr().(*net.TCPAddr).Port
	webSvc := svc{name: "web", proto: "TCP", clusterIPs: []string{"10.96.0.10"}, port: 80,
		endpoints: []string{pod.IPv4.String()}, endpointPorts: []int{webPort}}
	loop := svc{name: "loop", proto: "TCP", clusterIPs: []string{"10.96.0.11"}, port: 80,
		endpoints: []string{pod.IPv4.String()}, endpointPorts: []int{webPort}}
	// Should uproxy dial itself all the same, the loop ends at its share of
	// this limit rather than the machine's.
	px := runUproxy(t, tp, join(webSvc.yaml(), loop.yaml()), launch{want: 2,
		wrapper: []string{"prlimit", "--nofile=4096:4096", "--"},
		flags:   []string{"--rules", "iptables", "--shutdown-grace", "1s"}})
	pp := px.proxyPortOf("it/loop:p")

	// The node's address: a manifest's loopback endpoint is refused before
	// the data path sees it (the proxier's tests spell the proxy sockets
	// every other way).
	self := []string{node.IPv4.String()}
	loop.endpoints, loop.endpointPorts = self, []int{pp}
	px.write("services.yaml", join(webSvc.yaml(), loop.yaml()))
	px.waitFor(func(s []serviceState) bool {
		for _, st := range s {
			if st.Name == "it/loop:p" {
				return len(st.Endpoints) == 1 && st.Endpoints[0].Address == fmt.Sprintf("%s:%d", node.IPv4, pp)
			}
		}
		return false
	}, "the loop Service's endpoint on its own proxy port")
	before := px.sockets()

	// The connection, and meanwhile uproxy's descriptors, health and other Service.
	loopEndsAtOnce(t, tp, px, "10.96.0.11:80", "the Service whose endpoint is uproxy's own proxy port")
	if code, err := px.healthz(); err != nil || code != http.StatusOK {
		t.Errorf("/healthz after the connection: %d, %v; want 200", code, err)
	}
	if name, err := whoTCP(tp, testbed.Pod, "10.96.0.10:80"); err != nil || name != "web-1" {
		t.Errorf("the other Service after the connection: got %q, %v; want web-1", name, err)
	}

	// More connections: still refused, still logged once per endpoint.
	for range 3 {
		curl(tp, testbed.Pod, "10.96.0.11:80")
	}
	metrics, err := px.get("/metrics")
	if err != nil {
		t.Fatal(err)
	}
	for _, ip := range self {
		ep := fmt.Sprintf("%s:%d", ip, pp)
		series := fmt.Sprintf(`uproxy_dial_attempts_total{endpoint="%s",result="own_socket",service="it/loop:p"}`, ep)
		if !strings.Contains(metrics, series) {
			t.Errorf("/metrics lacks %s", series)
		}
		if n := strings.Count(px.logText(), `"Endpoint not dialed: it is one of uproxy's own proxy sockets, or the portals steer it to one`+"; counted as a failed dial, retries go to other endpoints\" err=\"dial tcp "+ep+":"); n != 1 {
			t.Errorf("log lines about endpoint %s: got %d, want 1", ep, n)
		}
	}
	if got := px.sockets(); got > before+2 {
		t.Errorf("uproxy's sockets after the connections: %d, want about the %d before", got, before)
	}
}

// TestServiceAddressEndpointsWithoutDialMark: with --dial-mark-bit -1 the
// proxy's dials pass through the portals like anyone's, so two Services whose
// endpoints are each other's ClusterIP would pass one connection back and
// forth until the descriptors ran out. uproxy dials neither: the connection
// ends at once, its sockets stay where they were, and both endpoints are
// counted as own_socket.
func TestServiceAddressEndpointsWithoutDialMark(t *testing.T) {
	tp := testbed.New(t)
	a := svc{name: "a", proto: "TCP", clusterIPs: []string{"10.96.0.11"}, port: 80,
		endpoints: []string{"10.96.0.12"}, endpointPorts: []int{80}}
	b := svc{name: "b", proto: "TCP", clusterIPs: []string{"10.96.0.12"}, port: 80,
		endpoints: []string{"10.96.0.11"}, endpointPorts: []int{80}}
	px := runUproxy(t, tp, join(a.yaml(), b.yaml()), launch{want: 2,
		wrapper: []string{"prlimit", "--nofile=4096:4096", "--"},
		flags:   []string{"--rules", "iptables", "--dial-mark-bit", "-1", "--shutdown-grace", "1s"}})
	loopEndsAtOnce(t, tp, px, "10.96.0.11:80", "a Service whose endpoint is another Service's ClusterIP")
	metrics, err := px.get("/metrics")
	if err != nil {
		t.Fatal(err)
	}
	series := `uproxy_dial_attempts_total{endpoint="10.96.0.12:80",result="own_socket",service="it/a:p"}`
	if !strings.Contains(metrics, series) {
		t.Errorf("/metrics lacks %s", series)
	}
	if n := strings.Count(metrics, `uproxy_dial_attempts_total{endpoint="10.96.0.11:80",result="success"`); n != 0 {
		t.Errorf("/metrics: it/b:p dialed it/a:p's ClusterIP:\n%s", metrics)
	}
}

// TestControlPlaneKeepsItsReserve: with every descriptor of the data path's
// share taken by held connections, the rest of uproxy keeps its reserve:
// /healthz and /metrics answer, and a Service added to the manifests gets its
// proxy port, while the connections beyond the share are reset at once.
func TestControlPlaneKeepsItsReserve(t *testing.T) {
	tp := testbed.New(t)
	pod := tp.NS(testbed.Pod)
	// Answers with its name, then echoes until the client closes: it holds.
	hold := namedTCP(t, tp, testbed.Pod, pod.IPv4.String()+":0", "hold-1")
	holdSvc := svc{name: "hold", proto: "TCP", clusterIPs: []string{"10.96.0.10"}, port: 80,
		endpoints: []string{pod.IPv4.String()}, endpointPorts: []int{hold.Addr().(*net.TCPAddr).Port}}
	const limit = 300 // a reserve of 75
	px := runUproxy(t, tp, holdSvc.yaml(), launch{want: 1,
		wrapper: []string{"prlimit", fmt.Sprintf("--nofile=%d:%d", limit, limit), "--"},
		flags:   []string{"--rules", "iptables", "--shutdown-grace", "1s"}})
	if want := fmt.Sprintf(`"Open file limit (RLIMIT_NOFILE)" soft="%d" hard="%d" reservedForControlPlane=75`, limit, limit); !strings.Contains(px.logText(), want) {
		t.Errorf("log lacks %s", want)
	}

	// Every connection the data path can hold, and more.
	var mu sync.Mutex
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	served, refused := 0, 0
	var wg sync.WaitGroup
	for range limit / 2 {
		wg.Go(func() {
			c, err := tp.Dial(testbed.Pod, "tcp", "10.96.0.10:80")
			if err == nil {
				c.SetDeadline(time.Now().Add(5 * time.Second))
				var line [7]byte
				if _, err = io.ReadFull(c, line[:]); err == nil {
					c.SetDeadline(time.Time{})
					mu.Lock()
					held = append(held, c)
					served++
					mu.Unlock()
					return
				}
				c.Close()
			}
			mu.Lock()
			refused++
			mu.Unlock()
		})
	}
	wg.Wait()
	if refused == 0 {
		t.Fatalf("%d connections held under a limit of %d: want the data path's share used up", served, limit)
	}
	if !strings.Contains(px.logText(), "kept for the control plane") {
		t.Errorf("log does not say the descriptors beyond the data path's share are kept for the control plane")
	}

	// The control plane, with the share used up and the connections held.
	for i := range 5 {
		if code, err := px.healthz(); err != nil || code != http.StatusOK {
			t.Errorf("/healthz %d with the data path's share used up: %d, %v; want 200", i, code, err)
		}
		if _, err := px.get("/metrics"); err != nil {
			t.Errorf("/metrics %d with the data path's share used up: %v", i, err)
		}
	}
	late := svc{name: "late", proto: "TCP", clusterIPs: []string{"10.96.0.12"}, port: 80,
		endpoints: []string{pod.IPv4.String()}, endpointPorts: []int{hold.Addr().(*net.TCPAddr).Port}}
	px.write("services.yaml", join(holdSvc.yaml(), late.yaml()))
	px.proxyPortOf("it/late:p")
	t.Logf("%d connections held, %d refused, under a limit of %d", served, refused, limit)

	// Load drops: the data path serves again.
	mu.Lock()
	for _, c := range held {
		c.Close()
	}
	held = nil
	mu.Unlock()
	testbed.Await(t, 20*time.Second, "a connection served once the others closed", func() bool {
		name, err := whoTCP(tp, testbed.Pod, "10.96.0.12:80")
		return err == nil && name == "hold-1"
	})
}

// loopEndsAtOnce makes one curl-like connection to addr, a Service whose
// endpoints lead back into uproxy (what), and checks that it ends at once
// with nothing served while uproxy's sockets stay within a few of where they
// were: uproxy did not pass it to itself.
func loopEndsAtOnce(t *testing.T, tp *testbed.Topology, px *proxy, addr, what string) {
	t.Helper()
	before := px.sockets()
	done := make(chan error, 1)
	go func() {
		got, err := curl(tp, testbed.Pod, addr)
		if err == nil && got != "" {
			err = fmt.Errorf("got %q, want nothing", got)
		}
		done <- err
	}()
	most := before
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		most = max(most, px.sockets())
	}
	select {
	case err := <-done:
		if isTimeout(err) || err != nil && strings.Contains(err.Error(), "got ") {
			t.Errorf("curl of %s: %v; want it reset (or closed) at once, with nothing served", what, err)
		}
	case <-time.After(10 * time.Second):
		t.Errorf("curl of %s: no end within 10s", what)
	}
	if most > before+6 {
		t.Errorf("uproxy's sockets during one connection to %s: up to %d from %d; want a few at most (it dialed itself)", what, most, before)
	}
}
