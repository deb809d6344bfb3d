package app

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/test/testbed"
)

// Any process may bind an abstract name: a lock's name held by a process that
// is not root is said to be no uproxy's, naming the process and its uid, and
// cleanup goes on (a start is still refused: it cannot take the name).
func TestRulesLockNameTakenByAnotherUser(t *testing.T) {
	testbed.Needs(t, testbed.Root)
	prefix := fmt.Sprintf("Q%d", os.Getpid()%100000)
	testbed.ListenAs(t, "unix", "@uproxy-rules-"+prefix, 65534)
	_, err := lockRules(prefix)
	var held *rulesHeldError
	if !errors.As(err, &held) || !held.notUproxy {
		t.Fatalf("lock with the name taken by uid 65534: got %v, want a refusal saying it is no uproxy", err)
	}
	want := fmt.Sprintf("the lock of --chain-prefix %s, the abstract unix socket @uproxy-rules-%s, is held by process %d of uid 65534, which is not root and so no uproxy that programs rules", prefix, prefix, os.Getpid())
	if !strings.HasPrefix(err.Error(), want) {
		t.Errorf("got %q, want it to begin %q", err, want)
	}
}
