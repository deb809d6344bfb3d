package integration

import (
	"fmt"
	"net"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// inAPod is the wrapper that runs uproxy as the kubelet runs a container:
// with KUBERNETES_SERVICE_HOST in its environment.
var inAPod = []string{"env", "KUBERNETES_SERVICE_HOST=10.96.0.1"}

// In a pod (--after-handover auto), the uproxy taken over from does not
// exit: a DaemonSet's container that exits is restarted, and the restarted
// uproxy would take back over from its successor. It holds no socket, the
// connections go on through the successor, and a SIGTERM (the old pod's
// deletion) ends it with 0.
func TestTakeOverWaitsInAPod(t *testing.T) {
	for _, holder := range []bool{false, true} {
		t.Run(fmt.Sprintf("crash-holder=%v", holder), func(t *testing.T) {
			takeOverWaitsInAPod(t, holder)
		})
	}
}

// takeOverWaitsInAPod is TestTakeOverWaitsInAPod, with or without
// --crash-holder: a holder taken over from keeps no copy of a proxy socket
// either.
func takeOverWaitsInAPod(t *testing.T, holder bool) {
	tp := testbed.New(t)
	const ticks = 80 // 4 s
	port := lineEndpoint(t, tp, ticks)
	manifests := svc{name: "stream", proto: "TCP", clusterIPs: []string{"10.96.0.12"}, port: 80,
		endpoints: []string{tp.NS(testbed.Pod).IPv4.String()}, endpointPorts: []int{port}}.yaml()
	flags := []string{"--rules", "nftables", "--shutdown-grace", "1s"}
	if holder {
		flags = append(flags, "--crash-holder")
	}
	a := runUproxy(t, tp, manifests, launch{want: 1, flags: flags, wrapper: inAPod})
	lines := startLineConns(t, tp, "10.96.0.12:80", 10, 1, ticks)
	testbed.Await(t, 10*time.Second, "lines through the first uproxy", func() bool {
		return slices.Min(lines.progress()) >= 3
	})

	b := runUproxy(t, tp, manifests, launch{want: 1, dir: a.dir, flags: flags, wrapper: inAPod})
	testbed.Await(t, 10*time.Second, "the first uproxy waiting after the handover", func() bool {
		return a.logContains("waiting for SIGTERM")
	})
	// Past the first uproxy's grace: it has drained, and waits.
	lines.awaitEach(30, "lines through the second uproxy")
	if !a.running() {
		t.Fatalf("the first uproxy exited after the handover (code %d), want it waiting for SIGTERM", a.cmd.ProcessState.ExitCode())
	}
	pids := []int{a.cmd.Process.Pid}
	if holder {
		server := childOf(t, a.cmd.Process.Pid)
		if server == 0 {
			t.Fatal("the first holder has no server")
		}
		pids = append(pids, server)
	}
	for _, pid := range pids {
		// The sock_diag socket that ends TIME_WAITs may stay, and the
		// holder's socketpair with its server: they hold no address.
		kinds, err := testbed.SocketKinds(pid)
		if err != nil {
			t.Fatal(err)
		}
		kinds = slices.DeleteFunc(kinds, func(k string) bool {
			return strings.HasPrefix(k, "netlink ") || (holder && strings.HasPrefix(k, "unix ") && !strings.Contains(k, "@"))
		})
		if len(kinds) != 0 {
			t.Errorf("process %d of the first uproxy holds sockets after the handover, want none: %v", pid, kinds)
		}
	}
	// Among them the name that says the prefix uses the shared reply route,
	// which the successor says from its first write.
	testbed.Await(t, 5*time.Second, "the second uproxy saying it uses the reply route", func() bool {
		pid := b.cmd.Process.Pid
		if holder {
			pid = childOf(t, pid)
		}
		kinds, _ := testbed.SocketKinds(pid)
		return slices.Contains(kinds, "unix @uproxy-reply-route-UPROXY")
	})
	a.signal(syscall.SIGTERM)
	if code := a.awaitExit(5 * time.Second); code != 0 {
		t.Errorf("the first uproxy exited %d on SIGTERM after the handover, want 0", code)
	}
	lines.awaitEach(5, "lines through the second uproxy after the first exited")
	for _, f := range lines.end() {
		t.Error(f)
	}
	if !b.saidCount("resumed", 11) {
		t.Errorf("the second uproxy did not say it resumed 11 connections:\n%s", tail(b.logText(), 20))
	}
}

// A SIGTERM that reaches the uproxy taken over from after its successor has
// its sockets but before it serves (a DaemonSet deletes the old pod as soon
// as the new one runs) waits for the successor, and the established
// connections still go to it, rather than being drained and reset at the
// end of --shutdown-grace. The successor's first sync, over 3,000 Services,
// keeps the window open long enough to land in.
func TestTakeOverSIGTERMDuringHandover(t *testing.T) {
	tp, manifests, flags, a, lines := behindFillers(t, 80, 10, 1)

	// The old pod's deletion: SIGTERM as soon as the successor has the sockets.
	signalled := signalAtLine(a, "Handed the listening sockets to a successor", a, syscall.SIGTERM)
	b := runUproxy(t, tp, manifests, launch{want: fillerPorts + 1, dir: a.dir, flags: flags})
	if !<-signalled {
		t.Fatalf("the first uproxy never said it handed its sockets:\n%s", tail(a.logText(), 20))
	}
	if code := a.awaitExit(20 * time.Second); code != 0 {
		t.Errorf("the first uproxy exited %d, want 0", code)
	}
	if !a.logContains("Terminating during a handover") {
		t.Fatalf("the SIGTERM came after the successor served: the test missed its window\n%s", tail(a.logText(), 20))
	}
	if !a.logContains("Handed over to the successor and exited") {
		t.Errorf("the first uproxy did not hand over after its SIGTERM:\n%s", tail(a.logText(), 20))
	}
	// Past the first uproxy's grace: a drain would have reset them by now.
	lines.awaitEach(30, "lines through the second uproxy")
	for _, f := range lines.end() {
		t.Error(f)
	}
	if !b.saidCount("resumed", 11) {
		t.Errorf("the second uproxy did not say it resumed 11 connections:\n%s", tail(b.logText(), 20))
	}
}

// The UDP clients' entries move with the handover: each client keeps its
// endpoint (the successor's round robin, which starts afresh, would give
// some of them the other one), and the successor says how many it resumed.
func TestTakeOverHandsUDPClients(t *testing.T) {
	for _, backend := range []string{"nftables", "iptables"} {
		t.Run(backend, func(t *testing.T) {
			tp := testbed.New(t)
			pod := tp.NS(testbed.Pod).IPv4.String()
			e1 := namedUDP(t, tp, testbed.Pod, pod+":0", "e1")
			e2 := namedUDP(t, tp, testbed.Pod, pod+":0", "e2")
			manifests := svc{name: "dns", proto: "UDP", clusterIPs: []string{"10.96.0.13"}, port: 53,
				endpoints: []string{pod, pod}, endpointPorts: []int{e1.LocalAddr().(*net.UDPAddr).Port, e2.LocalAddr().(*net.UDPAddr).Port}}.yaml()
			flags := []string{"--rules", backend, "--udp-timeout", "1m", "--after-handover", "exit"}
			a := runUproxy(t, tp, manifests, launch{want: 1, flags: flags})

			ask := func(c net.Conn, msg string) (string, error) {
				c.SetDeadline(time.Now().Add(3 * time.Second))
				if _, err := c.Write([]byte(msg)); err != nil {
					return "", err
				}
				buf := make([]byte, 100)
				n, err := c.Read(buf)
				if err != nil {
					return "", err
				}
				name, rest, _ := strings.Cut(string(buf[:n]), ":")
				if rest != msg {
					return "", fmt.Errorf("answer %q to %q", buf[:n], msg)
				}
				return name, nil
			}
			// A client first that does not come back: the first uproxy's
			// round robin is one ahead of a fresh one's from then on.
			const clients = 10
			var conns []net.Conn
			var before []string
			for i := range clients + 1 {
				c, err := tp.Dial(testbed.Pod, "udp", "10.96.0.13:53")
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				name, err := ask(c, fmt.Sprintf("q%d", i))
				if err != nil {
					t.Fatalf("client %d through the first uproxy: %v", i, err)
				}
				if i > 0 {
					conns, before = append(conns, c), append(before, name)
				}
			}
			b := runUproxy(t, tp, manifests, launch{want: 1, dir: a.dir, flags: flags})
			if code := a.awaitExit(15 * time.Second); code != 0 {
				t.Errorf("the first uproxy exited %d, want 0", code)
			}
			for i, c := range conns {
				name, err := ask(c, fmt.Sprintf("again%d", i))
				if err != nil {
					t.Fatalf("client %d through the second uproxy: %v", i, err)
				}
				if name != before[i] {
					t.Errorf("client %d: endpoint %s before the handover, %s after, want the same", i, before[i], name)
				}
			}
			if !b.saidCount("udpClients", 11) {
				t.Errorf("the second uproxy did not say it resumed 11 UDP clients:\n%s", tail(b.logText(), 20))
			}
			if out, err := b.get("/metrics"); err != nil || !strings.Contains(out, `uproxy_handover_connections_total{result="udp_resumed",role="to"} 11`) {
				t.Errorf("the second uproxy's metrics (%v) lack uproxy_handover_connections_total{role=\"to\",result=\"udp_resumed\"} 11", err)
			}
		})
	}
}

// withFillers is the manifests of a Service "stream" at 10.96.0.12:80 on the
// pod's port, and of n more on the same endpoint: a first sync over them
// takes long enough for a test to act between a successor getting the
// sockets and serving on them.
func withFillers(tp *testbed.Topology, port, n int) string {
	pod := tp.NS(testbed.Pod).IPv4.String()
	var m strings.Builder
	m.WriteString(svc{name: "stream", proto: "TCP", clusterIPs: []string{"10.96.0.12"}, port: 80,
		endpoints: []string{pod}, endpointPorts: []int{port}}.yaml())
	for i := range n {
		m.WriteString("---\n")
		m.WriteString(svc{name: fmt.Sprintf("filler-%d", i), proto: "TCP", clusterIPs: []string{fmt.Sprintf("10.97.%d.%d", i/250, i%250+1)},
			port: 80, endpoints: []string{pod}, endpointPorts: []int{port}}.yaml())
	}
	return m.String()
}

// signalAtLine sends sig to target as soon as watched logs line (within a
// minute); the channel says whether it did.
func signalAtLine(watched *proxy, line string, target *proxy, sig syscall.Signal) <-chan bool {
	done := make(chan bool, 1)
	go func() {
		deadline := time.Now().Add(time.Minute)
		for time.Now().Before(deadline) {
			if watched.logContains(line) {
				target.cmd.Process.Signal(sig)
				done <- true
				return
			}
			time.Sleep(2 * time.Millisecond)
		}
		done <- false
	}()
	return done
}

// fillerPorts is how many Service ports behindFillers adds beside "stream".
const fillerPorts = 3000

// behindFillers starts the handover tests whose successor must take a while
// to serve: a lineEndpoint of ticks, "stream" and fillerPorts more Service
// ports (withFillers), a first uproxy serving them, and long (halfClosed of
// them half-closed) line connections through "stream" that have each
// echoed 3 lines.
func behindFillers(t *testing.T, ticks, long, halfClosed int) (tp *testbed.Topology, manifests string, flags []string, a *proxy, lines *lineConns) {
	t.Helper()
	tp = testbed.New(t)
	manifests = withFillers(tp, lineEndpoint(t, tp, ticks), fillerPorts)
	flags = []string{"--rules", "nftables", "--shutdown-grace", "1s", "--after-handover", "exit"}
	a = runUproxy(t, tp, manifests, launch{want: fillerPorts + 1, flags: flags})
	lines = startLineConns(t, tp, "10.96.0.12:80", long, halfClosed, ticks)
	lines.awaitEach(3, "lines through the first uproxy")
	return tp, manifests, flags, a, lines
}
