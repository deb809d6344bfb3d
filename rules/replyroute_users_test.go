package rules

import (
	"fmt"
	"net"
	"os"
	"runtime"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/testbed"
)

// A reply route's user is a root process's socket: any process may bind an
// abstract name, and one that is not root (no portals) keeps no route.
func TestReplyRouteUsersAreRoots(t *testing.T) {
	testbed.Needs(t, testbed.Root)
	root := fmt.Sprintf("RT%d", os.Getpid()%100000)
	squat := fmt.Sprintf("SQ%d", os.Getpid()%100000)
	ln, err := net.Listen("unix", replyRouteUser+root)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	done := make(chan error)
	var other net.Listener
	go func() {
		runtime.LockOSThread() // never unlocked: the thread exits with the goroutine
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, ^uintptr(0), 65534, ^uintptr(0)); e != 0 {
			done <- e
			return
		}
		other, err = net.Listen("unix", replyRouteUser+squat)
		done <- err
	}()
	if err := <-done; err != nil {
		t.Fatalf("listen as uid 65534: %v", err)
	}
	defer other.Close()
	users, err := replyRouteUsers("")
	if err != nil {
		t.Fatal(err)
	}
	var prefixes []string
	for _, u := range users {
		prefixes = append(prefixes, u.prefix)
	}
	if !slices.Contains(prefixes, root) || slices.Contains(prefixes, squat) {
		t.Errorf("got users %q, want %s (root's) and not %s (uid 65534's)", prefixes, root, squat)
	}
}
