package ab

import (
	"context"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// echoIn serves Echo with delay in role's namespace and returns its address on
// that namespace's IPv4 address.
func echoIn(t *testing.T, tp *testbed.Topology, role string, delay time.Duration) string {
	t.Helper()
	ip := tp.NS(role).IPv4
	return serveEcho(t, tp.Listen(role, "tcp", net.JoinHostPort(ip.String(), "0")), delay)
}

// runIn runs the comparison from role's namespace: Run's goroutine is locked
// to a thread in that namespace, and it dials on that goroutine.
func runIn(t *testing.T, tp *testbed.Topology, role string, cfg Config) *Report {
	t.Helper()
	var rep *Report
	err := tp.Run(role, func() (err error) {
		rep, err = Run(context.Background(), cfg)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

// The client in the pod namespace, the servers on the external host, routed
// through the node: the 2ms server is found slower, and a port whose SYNs are
// dropped counts connect timeouts and stops the run instead of hanging it.
func TestRunAcrossNamespaces(t *testing.T) {
	tp := testbed.New(t)
	fast := echoIn(t, tp, testbed.External, 0)
	slow := echoIn(t, tp, testbed.External, 2*time.Millisecond)

	t.Run("a slower server", func(t *testing.T) {
		rep := runIn(t, tp, testbed.Pod, Config{A: fast, B: slow, Connections: 100, Seed: 1})
		requireClean(t, rep, 100, 1)
		r := row(t, rep, "connection", "p50")
		if r.Verdict != VerdictSlower || *r.CILow < 1000 {
			t.Errorf("connection p50: %q, B-A %.1fµs [%.1f, %.1f]; want %q above 1ms", r.Verdict, r.Diff, *r.CILow, *r.CIHigh, VerdictSlower)
		}
	})

	t.Run("dropped SYNs", func(t *testing.T) {
		black := net.JoinHostPort(tp.NS(testbed.External).IPv4.String(), "9")
		rule := []string{"INPUT", "-p", "tcp", "--dport", "9", "-j", "DROP"}
		if out, err := tp.Exec(testbed.External, append([]string{"iptables", "-w", "-A"}, rule...)...); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		t.Cleanup(func() { tp.Exec(testbed.External, append([]string{"iptables", "-w", "-D"}, rule...)...) })
		rep := runIn(t, tp, testbed.Pod, Config{A: fast, B: black, Connections: 1000, DialTimeout: 100 * time.Millisecond, MaxErrors: 3})
		if rep.B.Errors[ErrConnectTimeout] != 3 || rep.B.Failed != 3 {
			t.Errorf("B: %d failed, %v; want 3 connect timeouts", rep.B.Failed, rep.B.Errors)
		}
		if want := fmt.Sprintf("B (%s) failed 3 connections (connect timeout 3)", black); !strings.Contains(rep.Stopped, want) {
			t.Errorf("Stopped %q, want %q", rep.Stopped, want)
		}
		if rep.A.Failed != 0 || rep.A.Connections == 0 {
			t.Errorf("A: %d connections, %d failed; want some, none failed", rep.A.Connections, rep.A.Failed)
		}
	})
}
