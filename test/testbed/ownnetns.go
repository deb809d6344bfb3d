package testbed

import (
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
)

// ownNetnsEnv names the test that a child process of InOwnNetns runs.
const ownNetnsEnv = "UPROXY_TESTBED_OWN_NETNS"

// InOwnNetns runs the calling test again, alone, in a child process in a new
// network namespace (unshare --net) that goes away with the process. A test
// there may change what a topology's namespaces share with the rest of its
// process: sysctls such as the ephemeral port range, addresses on lo, and the
// namespace of every thread, the event loops' included. It returns true in the
// child, where the test goes on from the call. In the parent it waits for the
// child, reports its output, fails t if the child did not pass, and returns
// false. Only a top-level test can be run so. Without root or unshare it skips,
// or fails when CI=true.
func InOwnNetns(t *testing.T) bool {
	t.Helper()
	if os.Getenv(ownNetnsEnv) == t.Name() {
		return true
	}
	if strings.Contains(t.Name(), "/") {
		t.Fatalf("InOwnNetns: %s is a subtest; only a top-level test can run in a process of its own", t.Name())
	}
	Needs(t, Netns, Commands("unshare"))
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(t.Context(), unshare, "--net", os.Args[0],
		"-test.run=^"+regexp.QuoteMeta(t.Name())+"$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), ownNetnsEnv+"="+t.Name())
	out, err := cmd.CombinedOutput()
	t.Logf("in a network namespace of its own:\n%s", out)
	if err != nil {
		t.Fatalf("%s in a network namespace of its own: %v", t.Name(), err)
	}
	if !strings.Contains(string(out), "--- PASS: "+t.Name()+" ") {
		t.Fatalf("%s in a network namespace of its own did not pass (skipped, or no test ran)", t.Name())
	}
	return false
}
