package integration

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// takeOverServices are a TCP and a UDP Service of one ClusterIP, a NodePort
// for the TCP one, with backends in the pod.
func takeOverServices(t *testing.T, tp *testbed.Topology) string {
	pod := tp.NS(testbed.Pod)
	ln := echoTCP(t, tp, testbed.Pod, pod.IPv4.String()+":0")
	pc := namedUDP(t, tp, testbed.Pod, pod.IPv4.String()+":0", "dns")
	return svc{name: "web", proto: "TCP", clusterIPs: []string{"10.96.0.10"}, port: 80, nodePort: 30080,
		endpoints: []string{pod.IPv4.String()}, endpointPorts: []int{ln.Addr().(*net.TCPAddr).Port}}.yaml() +
		"---\n" + svc{name: "dns", proto: "UDP", clusterIPs: []string{"10.96.0.11"}, port: 53,
		endpoints: []string{pod.IPv4.String()}, endpointPorts: []int{pc.LocalAddr().(*net.UDPAddr).Port}}.yaml()
}

// clientLoad is a loop of short TCP connections through a ClusterIP, one
// every few milliseconds, and a loop of UDP exchanges: what a restart must not
// interrupt.
type clientLoad struct {
	stop chan struct{}
	wg   sync.WaitGroup

	mu                   sync.Mutex
	tcpOK, udpOK, udpBad int
	tcpFailures          []string
}

func startClientLoad(t *testing.T, tp *testbed.Topology) *clientLoad {
	l := &clientLoad{stop: make(chan struct{})}
	l.wg.Go(func() {
		for {
			select {
			case <-l.stop:
				return
			default:
			}
			start := time.Now()
			err := dialRoundTrip(tp, testbed.Pod, "10.96.0.10:80", 512)
			l.mu.Lock()
			if err != nil {
				l.tcpFailures = append(l.tcpFailures, fmt.Sprintf("%s: %v", start.Format("15:04:05.000"), err))
			} else {
				l.tcpOK++
			}
			l.mu.Unlock()
			time.Sleep(3 * time.Millisecond)
		}
	})
	l.wg.Go(func() {
		c, err := tp.Dial(testbed.Pod, "udp", "10.96.0.11:53")
		if err != nil {
			t.Errorf("UDP client: %v", err)
			return
		}
		defer c.Close()
		buf := make([]byte, 512)
		for i := 0; ; i++ {
			select {
			case <-l.stop:
				return
			default:
			}
			msg := fmt.Sprintf("q%d", i)
			c.SetDeadline(time.Now().Add(500 * time.Millisecond))
			_, err := c.Write([]byte(msg))
			n := 0
			// Answers to queries that timed out may come first (held in a
			// socket while no uproxy read it): they are skipped.
			for err == nil {
				if n, err = c.Read(buf); err == nil && string(buf[:n]) == "dns:"+msg {
					break
				}
			}
			l.mu.Lock()
			if err == nil && string(buf[:n]) == "dns:"+msg {
				l.udpOK++
			} else {
				l.udpBad++
			}
			l.mu.Unlock()
			time.Sleep(10 * time.Millisecond)
		}
	})
	return l
}

func (l *clientLoad) counts() (tcpOK, udpOK int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.tcpOK, l.udpOK
}

// end stops the load and returns the failed TCP connections.
func (l *clientLoad) end() []string {
	close(l.stop)
	l.wg.Wait()
	return l.tcpFailures
}

// proxyPorts maps each Service port of /debug/services to its proxy port.
func proxyPorts(states []serviceState) map[string]int {
	m := map[string]int{}
	for _, s := range states {
		m[s.Name] = s.ProxyPort
	}
	return m
}

// A uproxy started beside a running one of the same flags takes over from it
// (both portal backends): the second starts, the first exits 0 within its
// grace, no short TCP connection through the Service fails or is refused
// during the whole sequence, UDP goes on being answered, the proxy ports stay
// and the second answers on the same metrics and healthz addresses.
func TestTakeOverUnderLoad(t *testing.T) {
	for _, backend := range []string{"nftables", "iptables"} {
		t.Run(backend, func(t *testing.T) {
			tp := testbed.New(t)
			manifests := takeOverServices(t, tp)
			flags := []string{"--rules", backend, "--shutdown-grace", "2s", "--debug-handlers"}
			a := runUproxy(t, tp, manifests, launch{want: 2, flags: flags})
			before := proxyPorts(a.waitFor(func([]serviceState) bool { return true }, "A's state"))

			load := startClientLoad(t, tp)
			testbed.Await(t, 10*time.Second, "traffic through the first uproxy", func() bool {
				tcp, udp := load.counts()
				return tcp >= 20 && udp >= 5
			})

			b := runUproxy(t, tp, manifests, launch{want: 2, dir: a.dir, flags: flags})
			if code := a.awaitExit(10 * time.Second); code != 0 {
				t.Errorf("the first uproxy exited %d after the takeover, want 0", code)
			}
			if !a.logContains("Handed over to the successor and exited") {
				t.Errorf("the first uproxy's log has no line of the handover:\n%s", tail(a.logText(), 20))
			}
			tcp0, udp0 := load.counts()
			testbed.Await(t, 10*time.Second, "traffic through the second uproxy alone", func() bool {
				tcp, udp := load.counts()
				return tcp >= tcp0+50 && udp >= udp0+10
			})
			testbed.Await(t, 10*time.Second, "the second uproxy's line of the takeover", func() bool {
				return b.logContains("Took over from the uproxy that ran")
			})
			for _, p := range []*proxy{a, b} {
				for _, line := range strings.Split(p.logText(), "\n") {
					if strings.Contains(line, "Took over from") || strings.Contains(line, "Handed over to") {
						t.Log(line)
					}
				}
			}
			failures := load.end()
			if len(failures) > 0 {
				t.Errorf("%d short TCP connections failed during the takeover, want none; the first: %s", len(failures), strings.Join(failures[:min(5, len(failures))], "; "))
			}

			after := proxyPorts(b.waitFor(func([]serviceState) bool { return true }, "B's state"))
			for name, pp := range before {
				if after[name] != pp {
					t.Errorf("proxy port of %s: %d before the takeover, %d after, want the same", name, pp, after[name])
				}
			}
			if out, err := b.get("/metrics"); err != nil || !strings.Contains(out, `uproxy_handover_total{result="done",role="to"} 1`) {
				t.Errorf("the second uproxy's metrics (%v) lack uproxy_handover_total{role=\"to\",result=\"done\"} 1", err)
			}
			c := *b.client
			resp, err := c.Get("http://127.0.0.1:10256/healthz")
			if err != nil {
				t.Fatalf("healthz of the second uproxy: %v", err)
			}
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Errorf("healthz of the second uproxy: %d, want 200", resp.StatusCode)
			}
			// The NodePort's hold moved with the rest: the second uproxy
			// never found it taken.
			if err := dialRoundTrip(tp, testbed.Pod, tp.NS(testbed.Node).IPv4.String()+":30080", 512); err != nil {
				t.Errorf("the NodePort through the second uproxy: %v", err)
			}
			if b.logContains("NodePort not served") {
				t.Errorf("the second uproxy found the NodePort taken:\n%s", tail(b.logText(), 20))
			}
		})
	}
}

// A successor of another mode is refused by the running uproxy in one line
// naming what differs; it exits 1 and the running one serves on.
func TestTakeOverRefusedForAnotherMode(t *testing.T) {
	tp := testbed.New(t)
	manifests := takeOverServices(t, tp)
	a := runUproxy(t, tp, manifests, launch{want: 2, flags: []string{"--rules", "nftables"}})
	cmd := exec.Command("ip", "netns", "exec", tp.NS(testbed.Node).Name, uproxyBin,
		"--proxy-mode", "iptables", "--services", a.dir, "--conntrack-max-per-core", "0",
		"--metrics-bind-address", "127.0.0.1:10249", "--healthz-bind-address", "127.0.0.1:10256")
	out, err := cmd.CombinedOutput()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 1 {
		t.Fatalf("a successor of another mode: %v, want exit 1; output:\n%s", err, out)
	}
	if want := "its --proxy-mode is iptables, the running uproxy's userspace"; !strings.Contains(string(out), want) {
		t.Errorf("the refused successor's output lacks %q:\n%s", want, out)
	}
	if !a.running() {
		t.Fatalf("the running uproxy exited after refusing a successor")
	}
	if !a.logContains("Refused a successor") {
		t.Errorf("the running uproxy's log has no line of the refusal")
	}
	if out, err := a.get("/metrics"); err != nil || !strings.Contains(out, `uproxy_handover_refusals_total{reason="another_uproxy",role="from"} 1`) {
		t.Errorf("the running uproxy's metrics (%v) lack uproxy_handover_refusals_total{role=\"from\",reason=\"another_uproxy\"} 1", err)
	}
	if out, err := a.get("/debug/events?kind=handover&outcome=refused"); err != nil || !strings.Contains(out, "another_uproxy: process") {
		t.Errorf("the running uproxy's /debug/events has no refused handover (%v):\n%s", err, out)
	}
	if err := dialRoundTrip(tp, testbed.Pod, "10.96.0.10:80", 512); err != nil {
		t.Errorf("the Service after the refusal: %v", err)
	}
}

// --take-over=false keeps the refusal of a second uproxy.
func TestTakeOverFalseRefusesAsBefore(t *testing.T) {
	tp := testbed.New(t)
	manifests := takeOverServices(t, tp)
	a := runUproxy(t, tp, manifests, launch{want: 2, flags: []string{"--rules", "iptables"}})
	cmd := exec.Command("ip", "netns", "exec", tp.NS(testbed.Node).Name, uproxyBin,
		"--rules", "iptables", "--services", a.dir, "--conntrack-max-per-core", "0", "--take-over=false",
		"--metrics-bind-address", "127.0.0.1:10249", "--healthz-bind-address", "127.0.0.1:10256")
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Fatalf("a second uproxy with --take-over=false: exit 0, want a refusal; output:\n%s", out)
	}
	if want := "127.0.0.1:10249: bind: address already in use"; !strings.Contains(string(out), want) {
		t.Errorf("the second uproxy's output lacks %q:\n%s", want, out)
	}
	if !a.running() || a.logContains("Handed") {
		t.Errorf("the first uproxy handed over or exited")
	}
	if err := dialRoundTrip(tp, testbed.Pod, "10.96.0.10:80", 512); err != nil {
		t.Errorf("the Service after the refusal: %v", err)
	}
}

// A kernel mode takes over too: the HTTP listeners and the rules lock move,
// and the first uproxy exits 0 leaving the rules to the second.
func TestTakeOverKernelMode(t *testing.T) {
	tp := testbed.New(t)
	manifests := takeOverServices(t, tp)
	flags := []string{"--proxy-mode", "iptables", "--debug-handlers"}
	a := runUproxy(t, tp, manifests, launch{want: -1, flags: flags})
	b := runUproxy(t, tp, manifests, launch{want: -1, dir: a.dir, flags: flags})
	if code := a.awaitExit(10 * time.Second); code != 0 {
		t.Errorf("the first uproxy exited %d after the takeover, want 0", code)
	}
	testbed.Await(t, 10*time.Second, "the second uproxy's line of the takeover", func() bool {
		return b.logContains("Took over from the uproxy that ran")
	})
	// The lock is the second uproxy's now, and says so.
	out, _ := exec.Command("ip", "netns", "exec", tp.NS(testbed.Node).Name, uproxyBin, "cleanup").CombinedOutput()
	if want := fmt.Sprintf("another uproxy (process %d)", b.cmd.Process.Pid); !strings.Contains(string(out), want) {
		t.Errorf("uproxy cleanup after the takeover: want a refusal naming %q, got:\n%s", want, out)
	}
	if !b.running() {
		t.Fatalf("the second uproxy exited after a cleanup was refused")
	}
	if a.logContains("Removed the mode's rules") {
		t.Errorf("the first uproxy removed its rules on its way out")
	}
	if err := dialRoundTrip(tp, testbed.Pod, "10.96.0.10:80", 512); err != nil {
		t.Errorf("the Service after the takeover: %v", err)
	}
}

// lineEndpoint serves a TCP endpoint in the pod that echoes each line; a
// connection whose client asks "ticks" and then half-closes is sent ticks
// lines ("t0", "t1", ...) one every 50 ms after the client's FIN, then the
// endpoint's own.
func lineEndpoint(t testing.TB, tp *testbed.Topology, ticks int) int {
	return lineEndpointAt(t, tp, tp.NS(testbed.Pod).IPv4.String(), ticks)
}

// lineEndpointAt is lineEndpoint on address ip of the pod.
func lineEndpointAt(t testing.TB, tp *testbed.Topology, ip string, ticks int) int {
	ln := tp.Listen(testbed.Pod, "tcp", net.JoinHostPort(ip, "0"))
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				ticking := false
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						break
					}
					if line == "ticks\n" {
						ticking = true
						continue
					}
					if _, err := io.WriteString(c, line); err != nil {
						return
					}
				}
				if !ticking {
					return
				}
				for i := range ticks {
					if _, err := fmt.Fprintf(c, "t%d\n", i); err != nil {
						return
					}
					time.Sleep(50 * time.Millisecond)
				}
			}()
		}
	}()
	return ln.Addr().(*net.TCPAddr).Port
}

// lineConns are long-lived connections through a Service to lineEndpoint:
// each exchanges a line every 50 ms and checks its echo; and half-closed
// ones, each receiving the endpoint's ticks after its client's FIN, then the
// endpoint's end.
type lineConns struct {
	t    *testing.T
	stop chan struct{}
	wg   sync.WaitGroup

	mu       sync.Mutex
	echoed   []int
	failures []string
}

func startLineConns(t *testing.T, tp *testbed.Topology, addr string, long, halfClosed, ticks int) *lineConns {
	t.Helper()
	l := &lineConns{t: t, stop: make(chan struct{}), echoed: make([]int, long)}
	t.Cleanup(l.halt)
	for k := range long {
		c, err := tp.Dial(testbed.Pod, "tcp", addr)
		if err != nil {
			t.Fatalf("long-lived connection %d: %v", k, err)
		}
		l.wg.Go(func() {
			defer c.Close()
			r := bufio.NewReader(c)
			for i := 0; ; i++ {
				select {
				case <-l.stop:
					return
				default:
				}
				msg := fmt.Sprintf("c%d line %d\n", k, i)
				c.SetDeadline(time.Now().Add(5 * time.Second))
				if _, err := io.WriteString(c, msg); err != nil {
					l.fail("long-lived connection %d, line %d: write: %v", k, i, err)
					return
				}
				got, err := r.ReadString('\n')
				if err != nil || got != msg {
					l.fail("long-lived connection %d, line %d: read %q, %v; want %q", k, i, got, err, msg)
					return
				}
				l.mu.Lock()
				l.echoed[k]++
				l.mu.Unlock()
				time.Sleep(50 * time.Millisecond)
			}
		})
	}
	for k := range halfClosed {
		c, err := tp.Dial(testbed.Pod, "tcp", addr)
		if err != nil {
			t.Fatalf("half-closed connection %d: %v", k, err)
		}
		l.wg.Go(func() {
			defer c.Close()
			c.SetDeadline(time.Now().Add(30 * time.Second))
			if _, err := io.WriteString(c, "ticks\n"); err != nil {
				l.fail("half-closed connection %d: write: %v", k, err)
				return
			}
			if err := c.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
				l.fail("half-closed connection %d: CloseWrite: %v", k, err)
				return
			}
			r := bufio.NewReader(c)
			for i := range ticks {
				got, err := r.ReadString('\n')
				if want := fmt.Sprintf("t%d\n", i); err != nil || got != want {
					l.fail("half-closed connection %d, tick %d: read %q, %v; want %q", k, i, got, err, want)
					return
				}
			}
			if rest, err := r.ReadString('\n'); err != io.EOF || rest != "" {
				l.fail("half-closed connection %d after its ticks: read %q, %v; want the endpoint's end", k, rest, err)
			}
		})
	}
	return l
}

func (l *lineConns) fail(f string, args ...any) {
	l.mu.Lock()
	l.failures = append(l.failures, fmt.Sprintf(f, args...))
	l.mu.Unlock()
}

// progress is how many lines each long-lived connection has had echoed.
func (l *lineConns) progress() []int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.echoed)
}

// awaitEach waits until every long-lived connection has had n more lines
// echoed than now.
func (l *lineConns) awaitEach(n int, what string) {
	l.t.Helper()
	at := l.progress()
	testbed.Await(l.t, 10*time.Second, what, func() bool {
		now := l.progress()
		for k := range now {
			if now[k] < at[k]+n {
				return false
			}
		}
		return true
	})
}

func (l *lineConns) halt() {
	select {
	case <-l.stop:
	default:
		close(l.stop)
	}
	l.wg.Wait()
}

// end stops the long-lived connections, waits for the half-closed ones to
// finish, and returns what failed.
func (l *lineConns) end() []string {
	l.halt()
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.failures
}

// A takeover hands the established TCP connections over: 20 long-lived
// connections exchanging a line every 50 ms go on through the successor with
// every line echoed, in order, and 2 connections their clients half-closed
// go on receiving what the endpoint sends, then its end. With
// --shutdown-grace 1s, a first uproxy that drained them instead would reset
// every one a second after the successor got the lock.
func TestTakeOverHandsConnections(t *testing.T) {
	for _, c := range []struct{ backend, family string }{{"nftables", "IPv4"}, {"iptables", "IPv4"}, {"nftables", "IPv6"}, {"iptables", "IPv6"}} {
		backend := c.backend
		t.Run(c.backend+"/"+c.family, func(t *testing.T) {
			tp := testbed.New(t, testbed.WithIPv6())
			const ticks = 120 // 6 s
			ep, clusterIP := tp.NS(testbed.Pod).IPv4.String(), "10.96.0.12"
			if c.family == "IPv6" {
				ep, clusterIP = tp.NS(testbed.Pod).IPv6.String(), "fd00:96::12"
			}
			port := lineEndpointAt(t, tp, ep, ticks)
			manifests := svc{name: "stream", proto: "TCP", clusterIPs: []string{clusterIP}, port: 80, family: c.family,
				endpoints: []string{ep}, endpointPorts: []int{port}}.yaml()
			flags := []string{"--rules", backend, "--shutdown-grace", "1s"}
			a := runUproxy(t, tp, manifests, launch{want: 1, flags: flags})

			lines := startLineConns(t, tp, net.JoinHostPort(clusterIP, "80"), 20, 2, ticks)
			testbed.Await(t, 10*time.Second, "lines through the first uproxy", func() bool {
				return slices.Min(lines.progress()) >= 5
			})

			b := runUproxy(t, tp, manifests, launch{want: 1, dir: a.dir, flags: flags})
			if code := a.awaitExit(10 * time.Second); code != 0 {
				t.Errorf("the first uproxy exited %d after the takeover, want 0", code)
			}
			// Well past the first uproxy's grace: each connection goes on.
			lines.awaitEach(30, "lines through the second uproxy")
			failures := lines.end()
			for _, p := range []*proxy{a, b} {
				for _, line := range strings.Split(p.logText(), "\n") {
					if strings.Contains(line, "established connections") || strings.Contains(line, "Handed over to") {
						t.Log(line)
					}
				}
			}
			for _, f := range failures {
				t.Error(f)
			}
			if !b.saidCount("resumed", 22) {
				t.Errorf("the second uproxy did not say it resumed 22 connections:\n%s", tail(b.logText(), 20))
			}
			metrics, err := b.get("/metrics")
			if err != nil {
				t.Fatal(err)
			}
			for _, want := range []string{`uproxy_handover_connections_total{result="resumed",role="to"} 22`,
				`uproxy_handover_duration_seconds_count{role="to"} 1`} {
				if !strings.Contains(metrics, want) {
					t.Errorf("the second uproxy's metrics lack %s", want)
				}
			}
			events, err := b.get("/debug/events?kind=handover&outcome=done")
			if err != nil || !strings.Contains(events, "22 connections resumed") {
				t.Errorf("the second uproxy's /debug/events has no handover with 22 connections resumed (%v):\n%s", err, events)
			}
		})
	}
}

// In the nftables mode the loopback NodePorts are served by a relay in user
// space; a takeover hands its sockets over too, so a loop of connections to
// 127.0.0.1:NODEPORT from the node meets no refusal, and the successor never
// finds the ports taken.
func TestTakeOverKernelModeRelay(t *testing.T) {
	tp := testbed.New(t)
	manifests := takeOverServices(t, tp)
	flags := []string{"--proxy-mode", "nftables", "--after-handover", "exit"}
	a := runUproxy(t, tp, manifests, launch{want: -1, flags: flags})
	testbed.AwaitNoError(t, 10*time.Second, "the loopback NodePort through the first uproxy", func() error {
		return dialRoundTrip(tp, testbed.Node, "127.0.0.1:30080", 64)
	})
	stop := make(chan struct{})
	var failures []string
	var n int
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			n++
			if err := dialRoundTrip(tp, testbed.Node, "127.0.0.1:30080", 64); err != nil {
				failures = append(failures, fmt.Sprintf("%s: %v", time.Now().Format("15:04:05.000"), err))
			}
			time.Sleep(3 * time.Millisecond)
		}
	}()
	b := runUproxy(t, tp, manifests, launch{want: -1, dir: a.dir, flags: flags})
	if code := a.awaitExit(15 * time.Second); code != 0 {
		t.Errorf("the first uproxy exited %d, want 0", code)
	}
	time.Sleep(time.Second)
	close(stop)
	<-done
	if len(failures) > 0 {
		t.Errorf("%d of %d connections to 127.0.0.1:30080 failed during the takeover, want none; the first: %s", len(failures), n, strings.Join(failures[:min(5, len(failures))], "; "))
	}
	if b.logContains("Localhost NodePorts: some are not served") {
		t.Errorf("the successor found a loopback NodePort taken:\n%s", tail(b.logText(), 20))
	}
}

// saidCount reports whether the log has key=n, as klog writes a number
// (key=n, or "key"=n in some forms).
func (p *proxy) saidCount(key string, n int) bool {
	return p.logContains(fmt.Sprintf("%s=%d", key, n)) || p.logContains(fmt.Sprintf("%q=%d", key, n))
}
