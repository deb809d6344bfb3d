package rules

import (
	"fmt"
	"net"
	"os"
	"slices"
	"testing"

	"github.com/uproxy/uproxy/test/testbed"
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
	testbed.ListenAs(t, "unix", replyRouteUser+squat, 65534)
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
