package main

import (
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/testbed"
)

// listenAs listens on the abstract unix socket name with effective uid uid,
// as another user's process would: credentials are a thread's, so only a
// locked thread of this process changes, and it ends with the goroutine.
func listenAs(t *testing.T, name string, uid int) net.Listener {
	t.Helper()
	type result struct {
		ln  net.Listener
		err error
	}
	done := make(chan result)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread exits with the goroutine
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, ^uintptr(0), uintptr(uid), ^uintptr(0)); e != 0 {
			done <- result{err: e}
			return
		}
		ln, err := net.Listen("unix", name)
		done <- result{ln, err}
	}()
	r := <-done
	if r.err != nil {
		t.Fatalf("listen on %s as uid %d: %v", name, uid, r.err)
	}
	t.Cleanup(func() { r.ln.Close() })
	return r.ln
}

// Any process may bind an abstract name: a lock's name held by a process that
// is not root is said to be no uproxy's, naming the process and its uid, and
// cleanup goes on (a start is still refused: it cannot take the name).
func TestRulesLockNameTakenByAnotherUser(t *testing.T) {
	testbed.Needs(t, testbed.Root)
	prefix := fmt.Sprintf("Q%d", os.Getpid()%100000)
	listenAs(t, "@uproxy-rules-"+prefix, 65534)
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
