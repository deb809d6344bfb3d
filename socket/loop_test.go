package socket

import (
	"errors"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

type countingHandler struct{ events []uint32 }

func (h *countingHandler) handle(_ *loop, ev uint32) { h.events = append(h.events, ev) }

// An event queued for a descriptor that was closed, and whose number a new socket
// took before the event was handled, must not reach the new socket's handler.
func TestLoopDropsEventsOfAnEarlierRegistration(t *testing.T) {
	l, err := newLoop()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		unix.Close(l.epfd)
		unix.Close(l.wake)
	})
	pair := func() (int, int) {
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		return fds[0], fds[1]
	}
	wait := func() []unix.EpollEvent {
		events := make([]unix.EpollEvent, 8)
		n, err := unix.EpollWait(l.epfd, events, 1000)
		if err != nil {
			t.Fatal(err)
		}
		return events[:n]
	}

	a, aPeer := pair()
	old := &countingHandler{}
	if err := l.watch(a, old, unix.EPOLLIN|unix.EPOLLET); err != nil {
		t.Fatal(err)
	}
	unix.Write(aPeer, []byte("x"))
	stale := wait()
	if len(stale) != 1 || int(stale[0].Fd) != a {
		t.Fatalf("events after a write to the first socket: got %+v, want one for descriptor %d", stale, a)
	}
	// The first socket goes away before its event is handled; a new one takes its number.
	l.forget(a)
	unix.Close(a)
	unix.Close(aPeer)
	c, bPeer := pair()
	defer unix.Close(bPeer)
	// Usually the kernel hands out the freed number anyway; dup3 makes sure.
	b := a
	if c != b {
		if err := unix.Dup3(c, b, unix.O_CLOEXEC); err != nil {
			t.Fatal(err)
		}
		unix.Close(c)
	}
	defer unix.Close(b)
	current := &countingHandler{}
	if err := l.watch(b, current, unix.EPOLLIN|unix.EPOLLET); err != nil {
		t.Fatal(err)
	}

	l.dispatch(stale)
	if len(old.events) != 0 || len(current.events) != 0 {
		t.Fatalf("stale event: first handler got %v, new handler got %v; want neither called", old.events, current.events)
	}
	unix.Write(bPeer, []byte("y"))
	l.dispatch(wait())
	if len(current.events) != 1 || current.events[0]&unix.EPOLLIN == 0 {
		t.Errorf("event of the new socket: its handler got %v, want one input event", current.events)
	}
}

// Backend sockets carry the dial mark, which needs CAP_NET_ADMIN: without it
// SetDialMark refuses and leaves sockets unmarked.
func TestDialMark(t *testing.T) {
	defer SetDialMark(0)
	err := SetDialMark(0x2000)
	if os.Geteuid() != 0 {
		if !errors.Is(err, unix.EPERM) {
			t.Fatalf("SetDialMark without privilege: got %v, want EPERM", err)
		}
		return
	}
	if err != nil {
		t.Fatalf("SetDialMark as root: %v", err)
	}
	backend := startTCPServer(t, "127.0.0.2", echo)
	l, err := newLoop()
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(l.epfd)
	defer unix.Close(l.wake)
	for _, sotype := range []int{unix.SOCK_STREAM, unix.SOCK_DGRAM} {
		fd, err := l.dial(backend.addr, sotype)
		if err != nil {
			t.Fatal(err)
		}
		mark, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK)
		unix.Close(fd)
		if err != nil || mark != 0x2000 {
			t.Errorf("SO_MARK of a backend socket: got %#x, %v; want 0x2000", mark, err)
		}
	}
}
