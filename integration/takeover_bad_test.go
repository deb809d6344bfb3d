package integration

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// Handovers that go wrong halfway. In each, every connection is served by
// exactly one process, and each process says what happened in one line.

// A successor SIGKILLed after it got the listening sockets, before it
// served: the running uproxy serves on as if nothing had happened (its
// established connections untouched, new ones accepted), and a later
// successor takes over from it cleanly.
func TestTakeOverSuccessorKilledHalfway(t *testing.T) {
	tp, manifests, flags, a, lines := behindFillers(t, 200, 10, 1)
	b := runUproxy(t, tp, manifests, launch{dir: a.dir, flags: flags, noWait: true})
	if !<-signalAtLine(a, "Handed the listening sockets to a successor", b, syscall.SIGKILL) {
		t.Fatalf("the first uproxy never handed its sockets:\n%s", tail(a.logText(), 20))
	}
	b.awaitExit(10 * time.Second)
	testbed.Await(t, 10*time.Second, "the first uproxy's line of the successor gone", func() bool {
		return a.logContains("The successor went away before it served; serving on as before")
	})
	if b.logContains("Took over from") {
		t.Fatalf("the successor served before it was killed: the test missed its window\n%s", tail(b.logText(), 20))
	}
	lines.awaitEach(10, "lines through the first uproxy after the successor died")
	if err := lineRoundTrip(tp, "10.96.0.12:80"); err != nil {
		t.Errorf("a new connection after the successor died: %v", err)
	}
	if !a.running() {
		t.Fatal("the first uproxy exited after its successor died halfway")
	}

	c := runUproxy(t, tp, manifests, launch{want: fillerPorts + 1, dir: a.dir, flags: flags})
	if code := a.awaitExit(30 * time.Second); code != 0 {
		t.Errorf("the first uproxy exited %d after the second successor took over, want 0", code)
	}
	lines.awaitEach(20, "lines through the last successor")
	for _, f := range lines.end() {
		t.Error(f)
	}
	if !c.saidCount("resumed", 11) {
		t.Errorf("the last successor did not resume the 11 connections:\n%s", tail(c.logText(), 20))
	}
}

// The running uproxy SIGKILLed halfway, after it handed its listening
// sockets and before its successor served: the successor takes the free
// rules lock itself, says so, and serves new connections; the connections
// the killed one relayed end with it (it served each, and nobody else).
func TestTakeOverPredecessorKilledHalfway(t *testing.T) {
	tp, manifests, flags, a, lines := behindFillers(t, 200, 5, 0)
	killed := signalAtLine(a, "Handed the listening sockets to a successor", a, syscall.SIGKILL)
	b := runUproxy(t, tp, manifests, launch{want: fillerPorts + 1, dir: a.dir, flags: flags})
	if !<-killed {
		t.Fatalf("the first uproxy never handed its sockets:\n%s", tail(a.logText(), 20))
	}
	testbed.Await(t, 20*time.Second, "the successor's line of the lock taken", func() bool {
		return b.logContains("The rules lock did not come from the uproxy taken over; taking it")
	})
	if err := lineRoundTrip(tp, "10.96.0.12:80"); err != nil {
		t.Errorf("a new connection through the successor: %v", err)
	}
	if !b.running() {
		t.Fatal("the successor exited")
	}
	failures := lines.end()
	if len(failures) != 5 {
		t.Errorf("%d of the killed uproxy's 5 connections failed, want all 5 (it alone served them): %v", len(failures), failures)
	}
}

// Two successors at once: they queue on the rules lock. The first hands
// over to the second as soon as it serves (the lock's queue moves with the
// lock), so the node ends with one uproxy, every established connection
// moved twice and none lost, and the two that handed over exit 0.
func TestTakeOverTwoSuccessorsAtOnce(t *testing.T) {
	tp := testbed.New(t)
	const ticks = 200
	port := lineEndpoint(t, tp, ticks)
	manifests := svc{name: "stream", proto: "TCP", clusterIPs: []string{"10.96.0.12"}, port: 80,
		endpoints: []string{tp.NS(testbed.Pod).IPv4.String()}, endpointPorts: []int{port}}.yaml()
	flags := []string{"--rules", "nftables", "--shutdown-grace", "1s", "--after-handover", "exit"}
	a := runUproxy(t, tp, manifests, launch{want: 1, flags: flags})
	lines := startLineConns(t, tp, "10.96.0.12:80", 10, 1, ticks)
	lines.awaitEach(3, "lines through the first uproxy")

	var wg sync.WaitGroup
	succ := make([]*proxy, 2)
	for i := range succ {
		// Both read the first one's manifests: two writing them at once
		// would race on the file.
		wg.Go(func() {
			succ[i] = runUproxy(t, tp, "", launch{source: []string{"--services", a.dir}, dir: a.dir, flags: flags, noWait: true})
		})
	}
	wg.Wait()
	if code := a.awaitExit(30 * time.Second); code != 0 {
		t.Errorf("the first uproxy exited %d, want 0", code)
	}
	var running []*proxy
	testbed.Await(t, 30*time.Second, "one uproxy left running", func() bool {
		running = slices.DeleteFunc(slices.Clone(succ), func(p *proxy) bool { return !p.running() })
		return len(running) == 1
	})
	last := running[0]
	first := succ[0]
	if first == last {
		first = succ[1]
	}
	if code := first.awaitExit(time.Second); code != 0 {
		t.Errorf("the successor that handed over exited %d, want 0:\n%s", code, tail(first.logText(), 20))
	}
	lines.awaitEach(20, "lines through the last uproxy")
	for _, f := range lines.end() {
		t.Error(f)
	}
	for _, p := range []*proxy{first, last} {
		if !p.logContains("Took over from the uproxy that ran") {
			t.Errorf("a successor did not take over:\n%s", tail(p.logText(), 20))
		}
	}
	if !strings.Contains(first.logText(), "Handed over to the successor and exited") {
		t.Errorf("the middle uproxy did not hand over:\n%s", tail(first.logText(), 20))
	}
	if !last.saidCount("resumed", 11) {
		t.Errorf("the last uproxy did not resume the 11 connections:\n%s", tail(last.logText(), 20))
	}
}

// lineRoundTrip sends one line to a lineEndpoint at addr on a connection of
// its own and reads it back.
func lineRoundTrip(tp *testbed.Topology, addr string) error {
	c, err := tp.Dial(testbed.Pod, "tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, "probe\n"); err != nil {
		return err
	}
	got, err := bufio.NewReader(c).ReadString('\n')
	if err != nil || got != "probe\n" {
		return fmt.Errorf("read %q, %v; want the line back", got, err)
	}
	return nil
}

// ClientIP affinity survives a handover, as kube-proxy's survives a restart
// of kube-proxy (its entries live in the kernel): a client stuck to an
// endpoint keeps it through the successor, whose own round robin, starting
// afresh, would give it the other one.
func TestTakeOverKeepsAffinity(t *testing.T) {
	for _, backend := range []string{"nftables", "iptables"} {
		t.Run(backend, func(t *testing.T) {
			tp := testbed.New(t)
			pod := tp.NS(testbed.Pod).IPv4.String()
			e1 := namedTCP(t, tp, testbed.Pod, pod+":0", "e1")
			e2 := namedTCP(t, tp, testbed.Pod, pod+":0", "e2")
			manifests := svc{name: "sticky", proto: "TCP", clusterIPs: []string{"10.96.0.11"}, port: 80, affinity: true,
				endpoints: []string{pod, pod}, endpointPorts: []int{e1.Addr().(*net.TCPAddr).Port, e2.Addr().(*net.TCPAddr).Port}}.yaml()
			flags := []string{"--rules", backend, "--after-handover", "exit"}
			a := runUproxy(t, tp, manifests, launch{want: 1, flags: flags})
			// The node, another client, takes the rotation's first endpoint.
			if _, err := whoTCP(tp, testbed.Node, "10.96.0.11:80"); err != nil {
				t.Fatal(err)
			}
			before, err := whoTCP(tp, testbed.Pod, "10.96.0.11:80")
			if err != nil {
				t.Fatal(err)
			}
			b := runUproxy(t, tp, manifests, launch{want: 1, dir: a.dir, flags: flags})
			if code := a.awaitExit(15 * time.Second); code != 0 {
				t.Errorf("the first uproxy exited %d, want 0", code)
			}
			for i := range 5 {
				after, err := whoTCP(tp, testbed.Pod, "10.96.0.11:80")
				if err != nil {
					t.Fatal(err)
				}
				if after != before {
					t.Errorf("connection %d after the handover: %s, want %s as before it", i, after, before)
				}
			}
			if !b.logContains("balancerMemories") {
				t.Errorf("the successor did not say what it recalled:\n%s", tail(b.logText(), 20))
			}
		})
	}
}
