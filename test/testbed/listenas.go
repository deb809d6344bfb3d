package testbed

import (
	"net"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"
)

// ListenAs listens on address (network "unix": a path, or an abstract name
// beginning with '@') with effective uid uid, as another user's process
// would, and closes the listener when the test ends. Credentials are a
// thread's: only a locked thread of this process changes, and it exits with
// its goroutine. Needs Root.
func ListenAs(t testing.TB, network, address string, uid int) net.Listener {
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
		ln, err := net.Listen(network, address)
		done <- result{ln, err}
	}()
	r := <-done
	if r.err != nil {
		t.Fatalf("listen on %s as uid %d: %v", address, uid, r.err)
	}
	t.Cleanup(func() { r.ln.Close() })
	return r.ln
}
