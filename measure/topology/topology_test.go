package topology

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// requireNamespaces is testbed.Needs(t, testbed.Netns), which these tests
// cannot call: testbed imports this package.
func requireNamespaces(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: this test needs network namespaces")
	}
	if err := Available(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
}

func netnsList(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("ip", "netns", "list").CombinedOutput()
	if err != nil {
		t.Fatalf("ip netns list: %v: %s", err, out)
	}
	return string(out)
}

// The bench owns its topology without a testing.TB: Close must leave nothing behind,
// and a second Close must be harmless.
func TestCloseRemovesEveryNamespace(t *testing.T) {
	requireNamespaces(t)
	tp, err := Build(WithIPv6())
	if err != nil {
		t.Fatalf("Build: %v", err)
	}
	var names []string
	for _, r := range []string{Node, Pod, External} {
		names = append(names, tp.NS(r).Name)
	}
	var ln net.Listener
	if err := tp.Run(External, func() (err error) { ln, err = net.Listen("tcp", ":0"); return err }); err != nil {
		t.Fatalf("listen in %s: %v", External, err)
	}
	defer ln.Close()
	to := netip.AddrPortFrom(tp.NS(External).IPv4, uint16(ln.Addr().(*net.TCPAddr).Port))
	if c, err := tp.Dial(Pod, "tcp", to.String()); err != nil {
		t.Errorf("pod to external through the node: %v", err)
	} else {
		c.Close()
	}
	if err := tp.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	list := netnsList(t)
	for _, n := range names {
		if strings.Contains(list, n) {
			t.Errorf("namespace %s still exists after Close", n)
		}
	}
	if err := tp.Close(); err != nil {
		t.Errorf("second Close: got %v, want nil", err)
	}
}

// A Build that fails halfway removes the namespaces it made, and only those.
func TestFailedBuildRemovesWhatItMade(t *testing.T) {
	requireNamespaces(t)
	// Take the pod namespace's name of the next topology, so Build fails after it
	// made the node's.
	id := fmt.Sprintf("tb-%d-%s-%d", os.Getpid(), runSignature, topologySeq.Load()+1)
	taken := id + "-" + Pod
	if err := run("ip", "netns", "add", taken); err != nil {
		t.Fatalf("setup: %v", err)
	}
	t.Cleanup(func() { run("ip", "netns", "del", taken) })

	tp, err := Build()
	if err == nil {
		tp.Close()
		t.Fatalf("Build with the pod's name taken: got no error, want one")
	}
	if !strings.Contains(err.Error(), taken) {
		t.Errorf("error: got %q, want it to name %s", err, taken)
	}
	list := netnsList(t)
	if strings.Contains(list, id+"-"+Node) {
		t.Errorf("namespace %s-%s left behind by the failed Build", id, Node)
	}
	if !strings.Contains(list, taken) {
		t.Errorf("namespace %s, not Build's, was removed", taken)
	}
}

// Namespaces left by a process that is gone (killed before its Close ran) are
// deleted by the next sweep; those of a live process, and those not named as
// Build names them, stay.
func TestSweepDeletesDeadProcessesNamespaces(t *testing.T) {
	requireNamespaces(t)
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	dead := fmt.Sprintf("tb-%d-%s-1-%s", gone.Process.Pid, runSignature, Node)
	live := fmt.Sprintf("tb-%d-%s-0-%s", os.Getppid(), runSignature, Node)
	other := "tb-x-" + runSignature
	for _, n := range []string{dead, live, other} {
		if err := run("ip", "netns", "add", n); err != nil {
			t.Fatalf("setup: %v", err)
		}
		t.Cleanup(func() { run("ip", "netns", "del", n) })
	}
	sweepDead()
	list := netnsList(t)
	if strings.Contains(list, dead) {
		t.Errorf("namespace %s of exited process %d still exists after the sweep", dead, gone.Process.Pid)
	}
	for _, n := range []string{live, other} {
		if !strings.Contains(list, n) {
			t.Errorf("namespace %s was deleted by the sweep, want it kept", n)
		}
	}
}

func TestTopologyPID(t *testing.T) {
	for _, tc := range []struct {
		name string
		pid  int
		ok   bool
	}{
		{"tb-25647-234893-1-node", 25647, true},
		{"tb-1-a-2", 1, true},
		{"tb--1-x", 0, false},
		{"tb-x-1", 0, false},
		{"tb-12", 0, false},
		{"cni-1234-5", 0, false},
		{"tb-0-a", 0, false},
	} {
		pid, ok := topologyPID(tc.name)
		if pid != tc.pid || ok != tc.ok {
			t.Errorf("topologyPID(%q) = %d, %v, want %d, %v", tc.name, pid, ok, tc.pid, tc.ok)
		}
	}
}
