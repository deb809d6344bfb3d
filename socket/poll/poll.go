// Package poll runs event loops: each is one goroutine waiting in epoll_wait on its
// own epoll set, calling a Handler for each event on a descriptor it watches and a
// TimerTarget for each Timer that expires.
//
// Usage:
//
//	g, err := poll.New(poll.Config{Loops: 2})
//	if err != nil { ... }
//	defer g.Close() // once nothing uses the loops any more
//	l := g.Next()
//	l.Post(func() {
//		// On l's goroutine: the only one that touches what l watches.
//		err := l.Watch(fd, handler, unix.EPOLLIN|unix.EPOLLET)
//		...
//		l.Schedule(&timer, time.Second) // timer made by NewTimer(target)
//	})
//
// Costs are part of the contract. A loop costs one goroutine (its thread blocks in
// epoll_wait with it), an epoll descriptor and an eventfd. An event costs no
// allocation and no system call of its own: it is one interface call to its
// descriptor's Handler, after a check that it belongs to the descriptor's current
// registration. A Timer lives inside what it times, so arming, moving or cancelling
// it allocates nothing. A wake-up reads the monotonic clock once, and the timers'
// clock twice more while timers are armed. A Post costs one eventfd write, and
// none while an earlier wake-up is still pending. Every 5ms a busy loop passes
// through the Go scheduler (see yieldEvery).
//
// Everything a Loop does with descriptors and timers happens on its goroutine:
// Watch, Rehandle, Unwatch, Forget, Schedule and Cancel are called there (from a Handler, a
// TimerTarget or a posted function), and only Post, PostWait, Now and Local from
// anywhere.
package poll

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// ErrClosed is returned by PostWait on a loop whose group is closed.
var ErrClosed = errors.New("event loops closed")

// Handler is told about the events (EPOLLIN, EPOLLOUT, ...) of a descriptor that a
// loop watches, on the loop's goroutine.
type Handler interface {
	Handle(events uint32)
}

// watched is one registration of a descriptor: its handler and generation.
type watched struct {
	h   Handler
	gen uint32
}

// Loop is one event loop: an epoll set and the goroutine that waits on it.
type Loop struct {
	epfd int
	// wake is an eventfd written to after queueing work in posted, or when a
	// manual clock moves.
	wake  int
	clock Clock
	// manual is set when clock moves only when told (see Clock.OnAdvance): then
	// epoll_wait waits for no timer, only for events and wake-ups.
	manual bool
	// base is the origin of the yield clock, which is real time whatever clock
	// the timers follow.
	base time.Time
	// local is what the layer above keeps with the loop (see Local).
	local atomic.Pointer[localValue]
	// stopped is closed when the goroutine has returned.
	stopped chan struct{}

	// mu guards the fields below. Once closed, stays closed.
	mu     sync.Mutex
	posted []func()
	// woken is set while a write to wake is outstanding, sparing further ones.
	woken  bool
	closed bool

	// Loop goroutine state below.
	handlers []watched // by descriptor
	// gen numbers registrations; each event carries its registration's, so an event
	// queued for a descriptor that was closed and whose number a new registration
	// took within the same batch is recognised as stale and dropped. (A stale output
	// event would otherwise pass, say, for a new socket's completed connect.)
	gen    uint32
	timers timerHeap
	// round counts the returns from epoll_wait (see Round).
	round uint64
}

type localValue struct{ v any }

// newLoop opens a loop's descriptors; run starts it.
func newLoop(clock Clock) (*Loop, error) {
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, os.NewSyscallError("epoll_create1", err)
	}
	wake, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		unix.Close(epfd)
		return nil, os.NewSyscallError("eventfd", err)
	}
	l := &Loop{epfd: epfd, wake: wake, clock: clock, base: time.Now(), stopped: make(chan struct{})}
	ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(wake)}
	if err := unix.EpollCtl(epfd, unix.EPOLL_CTL_ADD, wake, &ev); err != nil {
		l.release()
		return nil, os.NewSyscallError("epoll_ctl", err)
	}
	return l, nil
}

// release closes the loop's descriptors; its goroutine must not run.
func (l *Loop) release() error {
	return errors.Join(closeFD("epoll", l.epfd), closeFD("eventfd", l.wake))
}

func closeFD(what string, fd int) error {
	if err := unix.Close(fd); err != nil {
		return fmt.Errorf("close %s descriptor %d: %w", what, fd, os.NewSyscallError("close", err))
	}
	return nil
}

// Now returns the time of the loop's clock, in nanoseconds: what Schedule measures
// delays from.
func (l *Loop) Now() int64 { return l.clock.Now() }

// Local returns the value that the layer above keeps with the loop, made by init
// on first use; concurrent first calls agree on one value. It is how state meant
// to be shared by everything on one loop (socket's read buffer, say) is found from
// the loop, once, when work is placed on it.
func (l *Loop) Local(init func() any) any {
	if v := l.local.Load(); v != nil {
		return v.v
	}
	l.local.CompareAndSwap(nil, &localValue{init()})
	return l.local.Load().v
}

// Post runs f on the loop's goroutine soon. It is how other goroutines reach what
// the loop owns. It reports false, and f never runs, when the loop's group is
// closed; f runs if it reports true, even if Close follows at once.
func (l *Loop) Post(f func()) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return false
	}
	l.posted = append(l.posted, f)
	l.wakeLocked()
	return true
}

// PostWait runs f on the loop's goroutine and waits until it has run. It returns
// ErrClosed, f not having run, when the loop's group is closed. It must not be
// called on a loop's goroutine.
func (l *Loop) PostWait(f func()) error {
	done := make(chan struct{})
	if !l.Post(func() {
		f()
		close(done)
	}) {
		return ErrClosed
	}
	<-done
	return nil
}

// wakeLocked makes the loop's epoll_wait return, unless a wake-up is pending
// already. The write happens under mu so that it never reaches a descriptor that
// Close released (and whose number may have been reused since).
func (l *Loop) wakeLocked() {
	if l.woken {
		return
	}
	l.woken = true
	one := [8]byte{1} // any non-zero count will do, whatever the byte order
	unix.Write(l.wake, one[:])
}

// stop makes the loop return once it has run everything posted so far; no Post
// is accepted after it.
func (l *Loop) stop() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.closed {
		l.closed = true
		l.wakeLocked()
	}
}

// Watch registers fd with h for events (EPOLLIN, EPOLLOUT, EPOLLET, ...) until
// Unwatch, or Forget and a close of fd.
func (l *Loop) Watch(fd int, h Handler, events uint32) error {
	l.gen++
	ev := unix.EpollEvent{Events: events, Fd: int32(fd), Pad: int32(l.gen)}
	if err := unix.EpollCtl(l.epfd, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
		return os.NewSyscallError("epoll_ctl", err)
	}
	if fd >= len(l.handlers) {
		grown := make([]watched, max(fd+1, 2*len(l.handlers), 1024))
		copy(grown, l.handlers)
		l.handlers = grown
	}
	l.handlers[fd] = watched{h: h, gen: l.gen}
	return nil
}

// Rehandle sends fd's events to h from now on, keeping its registration: no
// system call, and an event already queued for fd goes to h too. fd must be
// watched.
func (l *Loop) Rehandle(fd int, h Handler) {
	l.handlers[fd].h = h
}

// Unwatch removes fd from the epoll set without closing it.
func (l *Loop) Unwatch(fd int) {
	unix.EpollCtl(l.epfd, unix.EPOLL_CTL_DEL, fd, nil)
	l.Forget(fd)
}

// Round numbers the batch of events (and the timers after it) that the loop is
// handling: it grows by one each time epoll_wait returns, from 1. A handler
// that sees the round after the one it last ran in knows its descriptor was
// reported again at once: level-triggered, that means it is still ready.
// Called on the loop's goroutine.
func (l *Loop) Round() uint64 { return l.round }

// Forget drops fd's handler without a system call, for a descriptor the caller
// closes next: closing it removes it from the epoll set. A stale event for the same
// number later in the batch finds no handler, or one of another generation.
func (l *Loop) Forget(fd int) {
	if fd >= 0 && fd < len(l.handlers) {
		l.handlers[fd] = watched{}
	}
}

// yieldEvery is how often a busy loop passes through the scheduler. A goroutine
// that runs on without ever being rescheduled is taken for a runaway one: every
// 10ms the runtime's monitor preempts it and takes its P back out of a system
// call, and after each such retake the monitor polls again every 20µs. Yielding
// now and then avoids both, for a few microseconds every few milliseconds.
const yieldEvery = 5 * time.Millisecond

func (l *Loop) run() {
	defer close(l.stopped)
	events := make([]unix.EpollEvent, 256)
	var lastYield time.Duration
	for {
		if now := time.Since(l.base); now-lastYield > yieldEvery {
			runtime.Gosched()
			lastYield = now
		}
		n, err := unix.EpollWait(l.epfd, events, l.waitMillis())
		if err != nil {
			if err == unix.EINTR {
				continue
			}
			// Only a broken epoll descriptor fails here; nothing could be served.
			panic(fmt.Sprintf("epoll_wait: %v", err))
		}
		l.round++
		if !l.dispatch(events[:n]) {
			return
		}
		l.runTimers()
	}
}

// dispatch hands each event to the handler of its descriptor's current
// registration; events of an earlier registration are dropped. It reports false
// when the loop is to stop.
func (l *Loop) dispatch(events []unix.EpollEvent) bool {
	for i := range events {
		ev := &events[i]
		fd := int(ev.Fd)
		if fd == l.wake {
			if !l.runPosted() {
				return false
			}
			continue
		}
		if fd < len(l.handlers) {
			if w := l.handlers[fd]; w.h != nil && w.gen == uint32(ev.Pad) {
				w.h.Handle(ev.Events)
			}
		}
	}
	return true
}

// runPosted runs what was posted; it reports false once the loop is closed, after
// running everything posted before.
func (l *Loop) runPosted() bool {
	var b [8]byte
	unix.Read(l.wake, b[:])
	l.mu.Lock()
	l.woken = false
	work := l.posted
	l.posted = nil
	closed := l.closed
	l.mu.Unlock()
	for _, f := range work {
		f()
	}
	return !closed
}
