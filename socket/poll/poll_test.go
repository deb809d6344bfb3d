package poll

import (
	"errors"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// awaitTimeout bounds every wait for a condition that normally holds within
// milliseconds; the margin is for slow machines and -race.
const awaitTimeout = 20 * time.Second

// newGroup starts a group for the test and closes it at the end.
func newGroup(t *testing.T, cfg Config) *Group {
	t.Helper()
	g, err := New(cfg)
	if err != nil {
		t.Fatalf("New(%+v): %v", cfg, err)
	}
	t.Cleanup(func() {
		if err := g.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return g
}

// socketPair returns the two ends of a non-blocking stream socket pair, closed at
// the end of the test unless the test closed them first.
func socketPair(t *testing.T) (int, int) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	return fds[0], fds[1]
}

type recordingHandler struct{ events []uint32 }

func (h *recordingHandler) Handle(ev uint32) { h.events = append(h.events, ev) }

// An event queued for a descriptor that was closed, and whose number a new
// registration took before the event was handled, must not reach the new
// registration's handler.
func TestDispatchDropsEventsOfAnEarlierRegistration(t *testing.T) {
	// A loop that does not run: the test waits and dispatches in its place.
	l, err := newLoop(realClock{base: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.release() })
	wait := func() []unix.EpollEvent {
		events := make([]unix.EpollEvent, 8)
		n, err := unix.EpollWait(l.epfd, events, int(awaitTimeout/time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		return events[:n]
	}

	a, aPeer := socketPair(t)
	old := &recordingHandler{}
	if err := l.Watch(a, old, unix.EPOLLIN|unix.EPOLLET); err != nil {
		t.Fatal(err)
	}
	unix.Write(aPeer, []byte("x"))
	stale := wait()
	if len(stale) != 1 || int(stale[0].Fd) != a {
		t.Fatalf("events after a write to the first socket: got %+v, want one for descriptor %d", stale, a)
	}
	// The first socket goes away before its event is handled; a new one takes its number.
	l.Forget(a)
	unix.Close(a)
	unix.Close(aPeer)
	c, bPeer := socketPair(t)
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
	current := &recordingHandler{}
	if err := l.Watch(b, current, unix.EPOLLIN|unix.EPOLLET); err != nil {
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

// handlerFunc adapts a function to Handler.
type handlerFunc func(uint32)

func (f handlerFunc) Handle(ev uint32) { f(ev) }

// A running loop calls the handler of a watched descriptor for each new edge, and
// no longer once the descriptor is unwatched.
func TestLoopCallsHandlerOfWatchedDescriptor(t *testing.T) {
	l := newGroup(t, Config{Loops: 1}).Next()
	a, peer := socketPair(t)
	defer unix.Close(a)
	defer unix.Close(peer)
	got := make(chan uint32, 16)
	h := handlerFunc(func(ev uint32) {
		// Edge-triggered: drain, so the next write is a new edge.
		unix.Read(a, make([]byte, 16))
		got <- ev
	})
	var err error
	if perr := l.PostWait(func() { err = l.Watch(a, h, unix.EPOLLIN|unix.EPOLLET) }); perr != nil || err != nil {
		t.Fatalf("Watch: got %v, %v; want nil", perr, err)
	}
	for i := range 3 {
		unix.Write(peer, []byte("x"))
		select {
		case ev := <-got:
			if ev&unix.EPOLLIN == 0 {
				t.Errorf("event %d: got %#x, want EPOLLIN", i, ev)
			}
		case <-time.After(awaitTimeout):
			t.Fatalf("event %d: none after %s", i, awaitTimeout)
		}
	}
	l.PostWait(func() { l.Unwatch(a) })
	unix.Write(peer, []byte("x"))
	// A posted function runs after the events that were pending when it was
	// posted; once it has run, an event for the write would have been handled.
	l.PostWait(func() {})
	if len(got) != 0 {
		t.Errorf("events after Unwatch: got %d, want none", len(got))
	}
}

// Functions posted from many goroutines run one at a time on the loop, each
// poster's in the order it posted them.
func TestPostRunsInOrderOnTheLoop(t *testing.T) {
	const posters, each = 8, 500
	l := newGroup(t, Config{Loops: 1}).Next()
	var ran [posters][]int // touched on the loop only: -race reports any other access
	var wg sync.WaitGroup
	for p := range posters {
		wg.Go(func() {
			for i := range each {
				if !l.Post(func() { ran[p] = append(ran[p], i) }) {
					t.Errorf("poster %d: Post %d on an open loop reported false", p, i)
					return
				}
			}
		})
	}
	wg.Wait()
	var got [posters][]int
	if err := l.PostWait(func() { got = ran }); err != nil {
		t.Fatalf("PostWait: %v", err)
	}
	for p := range posters {
		if len(got[p]) != each || !slices.IsSorted(got[p]) {
			t.Errorf("poster %d: ran %d functions (sorted: %v), want %d in order", p, len(got[p]), slices.IsSorted(got[p]), each)
		}
	}
}

// Everything posted before Close runs; nothing posted after it does.
func TestPostAndClose(t *testing.T) {
	g, err := New(Config{Loops: 2})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	ran, accepted := 0, 0
	for i := range 1000 {
		if g.Loops()[i%2].Post(func() { mu.Lock(); ran++; mu.Unlock() }) {
			accepted++
		}
	}
	if err := g.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	mu.Lock()
	if ran != accepted || accepted != 1000 {
		t.Errorf("before Close: %d posts accepted, %d ran; want 1000 and 1000", accepted, ran)
	}
	mu.Unlock()
	for _, l := range g.Loops() {
		if l.Post(func() { t.Error("a function posted after Close ran") }) {
			t.Error("Post after Close: got true, want false")
		}
		if err := l.PostWait(func() { t.Error("a function posted after Close ran") }); !errors.Is(err, ErrClosed) {
			t.Errorf("PostWait after Close: got %v, want ErrClosed", err)
		}
	}
	if err := g.Close(); err != nil {
		t.Errorf("second Close: got %v, want nil", err)
	}
}

// openDescriptors lists the process's open descriptors with what they are.
func openDescriptors(t *testing.T) map[string]string {
	t.Helper()
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	out := make(map[string]string)
	for _, e := range entries {
		if link, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil {
			out[e.Name()] = link
		}
	}
	return out
}

// loopGoroutines counts the goroutines running a loop.
func loopGoroutines() int {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	return strings.Count(string(buf), "poll.(*Loop).run(")
}

// Close releases every descriptor New opened and ends every loop goroutine, also
// with descriptors still watched and timers still armed.
func TestCloseReleasesEverything(t *testing.T) {
	const loops = 4
	before := openDescriptors(t)
	g, err := New(Config{Loops: loops})
	if err != nil {
		t.Fatal(err)
	}
	during := openDescriptors(t)
	var epolls, eventfds int
	for fd, link := range during {
		if _, ok := before[fd]; ok {
			continue
		}
		switch link {
		case "anon_inode:[eventpoll]":
			epolls++
		case "anon_inode:[eventfd]":
			eventfds++
		}
	}
	if epolls != loops || eventfds != loops {
		t.Errorf("descriptors New opened: %d epoll, %d eventfd; want %d of each", epolls, eventfds, loops)
	}
	for _, l := range g.Loops() {
		l.PostWait(func() {}) // the goroutine has started
	}
	if n := loopGoroutines(); n != loops {
		t.Errorf("loop goroutines: got %d, want %d", n, loops)
	}
	a, peer := socketPair(t)
	defer unix.Close(a)
	defer unix.Close(peer)
	for _, l := range g.Loops() {
		tm := NewTimer(expireFunc(func() { t.Error("a timer expired after Close") }))
		l.PostWait(func() {
			if err := l.Watch(a, handlerFunc(func(uint32) {}), unix.EPOLLIN); err != nil {
				t.Errorf("Watch: %v", err)
			}
			l.Schedule(&tm, time.Hour)
		})
	}

	if err := g.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	// Close returns once each goroutine is past its last use of the loop; it
	// may still be returning.
	for deadline := time.Now().Add(awaitTimeout); loopGoroutines() != 0; {
		if time.Now().After(deadline) {
			t.Fatalf("loop goroutines %s after Close: got %d, want none", awaitTimeout, loopGoroutines())
		}
		time.Sleep(time.Millisecond)
	}
	// The test's socket pair was opened after the first count, and stays open.
	after := openDescriptors(t)
	delete(after, strconv.Itoa(a))
	delete(after, strconv.Itoa(peer))
	for fd, link := range after {
		if before[fd] != link {
			t.Errorf("descriptor %s (%s) open after Close, was not before New", fd, link)
		}
	}
	if len(after) != len(before) {
		t.Errorf("descriptors after Close: got %d, want the %d from before New", len(after), len(before))
	}
}

// Rehandle moves a watched descriptor's events to another handler, without a
// new registration: the next event goes to the new handler only.
func TestRehandleMovesEvents(t *testing.T) {
	l := newGroup(t, Config{Loops: 1}).Next()
	a, peer := socketPair(t)
	defer unix.Close(a)
	defer unix.Close(peer)
	first, second := make(chan uint32, 16), make(chan uint32, 16)
	drainTo := func(ch chan uint32) Handler {
		return handlerFunc(func(ev uint32) {
			unix.Read(a, make([]byte, 16))
			ch <- ev
		})
	}
	var err error
	if perr := l.PostWait(func() { err = l.Watch(a, drainTo(first), unix.EPOLLIN|unix.EPOLLET) }); perr != nil || err != nil {
		t.Fatalf("Watch: got %v, %v; want nil", perr, err)
	}
	unix.Write(peer, []byte("x"))
	select {
	case <-first:
	case <-time.After(awaitTimeout):
		t.Fatalf("no event for the first handler after %s", awaitTimeout)
	}
	l.PostWait(func() { l.Rehandle(a, drainTo(second)) })
	unix.Write(peer, []byte("x"))
	select {
	case <-second:
	case <-time.After(awaitTimeout):
		t.Fatalf("no event for the new handler after %s", awaitTimeout)
	}
	if len(first) != 0 {
		t.Errorf("events to the first handler after Rehandle: got %d, want none", len(first))
	}
	l.PostWait(func() { l.Unwatch(a) })
}

// Round grows by one per return from epoll_wait: a level-triggered descriptor
// left readable is reported in every round, each one after the last; one that
// becomes readable again later is reported in a later round.
func TestRoundNumbersEachWakeUp(t *testing.T) {
	l := newGroup(t, Config{Loops: 1}).Next()
	a, peer := socketPair(t)
	defer unix.Close(a)
	defer unix.Close(peer)
	rounds := make(chan uint64, 16)
	calls := 0 // on the loop's goroutine
	h := handlerFunc(func(uint32) {
		rounds <- l.Round()
		if calls++; calls%3 == 0 {
			// Read what is queued: no longer readable.
			unix.Read(a, make([]byte, 16))
		}
	})
	var err error
	if perr := l.PostWait(func() { err = l.Watch(a, h, unix.EPOLLIN) }); perr != nil || err != nil {
		t.Fatalf("Watch: got %v, %v; want nil", perr, err)
	}
	// Level-triggered: once peer is closed, a stays readable (end of stream) and
	// the handler would run each round until the channel filled and blocked the
	// loop, and with it the group's Close. So a is unwatched first.
	defer l.PostWait(func() { l.Unwatch(a) })
	unix.Write(peer, []byte("x"))
	var got []uint64
	for range 3 {
		select {
		case r := <-rounds:
			got = append(got, r)
		case <-time.After(awaitTimeout):
			t.Fatalf("rounds so far %v: no more after %s", got, awaitTimeout)
		}
	}
	if got[0] == 0 || got[1] != got[0]+1 || got[2] != got[1]+1 {
		t.Fatalf("rounds of a descriptor left readable: got %v, want three in a row from 1 or more", got)
	}
	// The loop sleeps now; a posted function wakes it for a round of its own.
	var posted uint64
	l.PostWait(func() { posted = l.Round() })
	unix.Write(peer, []byte("y"))
	select {
	case r := <-rounds:
		if r <= posted || r <= got[2]+1 {
			t.Errorf("round of the next write: got %d, want after the posted function's %d", r, posted)
		}
	case <-time.After(awaitTimeout):
		t.Fatalf("no event for the second write after %s", awaitTimeout)
	}
}
