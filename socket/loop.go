package socket

import (
	"container/heap"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

// The data path (TCP connections and UDP flows) runs on event loops rather than on
// goroutines per connection. Each loop is one goroutine, blocked in epoll_wait on
// its own epoll set (its thread blocks with it, as in any system call): it accepts,
// dials without blocking, moves bytes and runs the timers of the connections it
// accepted. A connection then costs no goroutine, no stack and no scheduler round
// trip per readiness event, and none of the setup Go's net package does per socket
// (local and peer address lookups, its own poller registration, keepalive and
// TCP_NODELAY per socket).
//
// Sockets are registered edge-triggered for input and output at once, so nothing
// is ever re-armed; a handler remembers which side is readable or writable until a
// call says otherwise (EAGAIN, or a short read). Listeners are registered in every
// loop with EPOLLEXCLUSIVE, level-triggered: whichever loop is idle takes the next
// connection, and a listener left with pending connections is reported again.

// handler is what a loop calls for an event on a descriptor it watches.
type handler interface {
	handle(l *loop, events uint32)
}

// watched is one registration of a descriptor: its handler and generation.
type watched struct {
	h   handler
	gen uint32
}

// timerTarget is told when its timer expires, on its loop's thread.
type timerTarget interface {
	expire(l *loop)
}

// timer is one pending expiry on a loop; index is its place in the loop's heap
// (-1 when not scheduled). It is embedded in what it times, so arming it allocates
// nothing.
type timer struct {
	when   int64 // monotonic nanoseconds, see loop.nanotime
	index  int
	target timerTarget
}

type timerHeap []*timer

func (h timerHeap) Len() int           { return len(h) }
func (h timerHeap) Less(i, j int) bool { return h[i].when < h[j].when }
func (h timerHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index, h[j].index = i, j
}
func (h *timerHeap) Push(x any) {
	t := x.(*timer)
	t.index = len(*h)
	*h = append(*h, t)
}
func (h *timerHeap) Pop() any {
	old := *h
	t := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	t.index = -1
	return t
}

// readBufSize is each loop's read buffer. A read that fills it marks a bulk
// transfer, which switches that direction to splice (see tcpDirection).
const readBufSize = 64 << 10

// loop is one event loop: an epoll set, the thread that waits on it, and the state
// only that thread touches.
type loop struct {
	epfd int
	// wake is an eventfd other goroutines write to after queueing work in posted.
	wake int

	mu     sync.Mutex
	posted []func(*loop)
	// woken is set by post while a wake-up is outstanding, sparing writes to wake.
	woken atomic.Bool

	// Loop-thread state below.
	handlers []watched // by descriptor
	// gen numbers registrations; each event carries its registration's, so an event
	// queued for a descriptor that was closed and whose number a new socket took
	// within the same batch is recognised as stale and dropped. (A stale output event
	// would otherwise pass for the new socket's completed connect.)
	gen    uint32
	timers timerHeap
	buf    []byte // shared read buffer of the TCP copy
	// UDP batch readers: Service sockets (with addresses) and client sockets.
	serviceReader, replyReader *batchReader
	base                       time.Time
	// Raw socket address of the last accept, reused to spare an allocation each.
	rsa    unix.RawSockaddrAny
	rsaLen uint32
	// Socket addresses of dials, reused for the same reason.
	sa4 unix.SockaddrInet4
	sa6 unix.SockaddrInet6
}

// nanotime is the loop's monotonic clock.
func (l *loop) nanotime() int64 { return int64(time.Since(l.base)) }

var loops struct {
	mu   sync.Mutex
	all  []*loop
	next atomic.Uint32
	// count is how many loops to start; 0 means automatic (see SetEventLoops).
	count int
}

// SetEventLoops sets how many event loops carry TCP and UDP traffic. It takes
// effect only before the first proxy serves. 0 means one per CPU Go schedules on
// but one, and at least one. A loop spends its idle time blocked in epoll_wait,
// holding a scheduler slot (P) that the runtime takes back only when no P is idle -
// and then on nearly every event, with its monitor thread polling every 20µs. So
// there is always one P more than loops (GOMAXPROCS is raised if need be), which
// also runs the control plane.
func SetEventLoops(n int) {
	loops.mu.Lock()
	loops.count = n
	loops.mu.Unlock()
}

// eventLoops starts the process's event loops on first use and returns them.
func eventLoops() ([]*loop, error) {
	loops.mu.Lock()
	defer loops.mu.Unlock()
	if loops.all != nil {
		return loops.all, nil
	}
	n := loops.count
	if n <= 0 {
		n = max(1, runtime.GOMAXPROCS(0)-1)
	}
	// All or none: a failure (out of descriptors, say) is not remembered, so a
	// later Serve tries again.
	all := make([]*loop, 0, n)
	for range n {
		l, err := newLoop()
		if err != nil {
			for _, l := range all {
				l.close()
			}
			return nil, fmt.Errorf("start event loops: %w", err)
		}
		all = append(all, l)
	}
	// Keep a P beyond the loops' (see SetEventLoops).
	if runtime.GOMAXPROCS(0) < n+1 {
		runtime.GOMAXPROCS(n + 1)
	}
	klog.V(1).InfoS("Starting event loops", "loops", n, "gomaxprocs", runtime.GOMAXPROCS(0))
	for _, l := range all {
		go l.run()
	}
	loops.all = all
	return all, nil
}

func newLoop() (*loop, error) {
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, os.NewSyscallError("epoll_create1", err)
	}
	wake, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		unix.Close(epfd)
		return nil, os.NewSyscallError("eventfd", err)
	}
	l := &loop{epfd: epfd, wake: wake, buf: make([]byte, readBufSize), base: time.Now(),
		serviceReader: newBatchReader(true), replyReader: newBatchReader(false)}
	ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(wake)}
	if err := unix.EpollCtl(epfd, unix.EPOLL_CTL_ADD, wake, &ev); err != nil {
		l.close()
		return nil, os.NewSyscallError("epoll_ctl", err)
	}
	return l, nil
}

// close releases the descriptors of a loop that never ran.
func (l *loop) close() {
	unix.Close(l.epfd)
	unix.Close(l.wake)
}

// post runs f on the loop's thread soon. It is how other goroutines reach state the
// loop owns.
func (l *loop) post(f func(*loop)) {
	l.mu.Lock()
	l.posted = append(l.posted, f)
	l.mu.Unlock()
	if l.woken.CompareAndSwap(false, true) {
		one := [8]byte{1}
		unix.Write(l.wake, one[:])
	}
}

// postWait runs f on the loop's thread and waits until it has run.
func (l *loop) postWait(f func(*loop)) {
	done := make(chan struct{})
	l.post(func(l *loop) {
		f(l)
		close(done)
	})
	<-done
}

// watch registers fd with h for events.
func (l *loop) watch(fd int, h handler, events uint32) error {
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

// unwatch removes fd from the epoll set without closing it.
func (l *loop) unwatch(fd int) {
	unix.EpollCtl(l.epfd, unix.EPOLL_CTL_DEL, fd, nil)
	l.forget(fd)
}

// forget drops fd's handler; closing fd (which the caller does next) removes it
// from the epoll set. A stale event for the same number later in the batch finds
// no handler, or one of another generation.
func (l *loop) forget(fd int) {
	if fd < len(l.handlers) {
		l.handlers[fd] = watched{}
	}
}

// armed reports whether t is in the loop's heap.
func (l *loop) armed(t *timer) bool {
	return t.index >= 0 && t.index < len(l.timers) && l.timers[t.index] == t
}

// schedule arms t to expire after d, replacing any earlier schedule.
func (l *loop) schedule(t *timer, d time.Duration) {
	t.when = l.nanotime() + int64(d)
	if l.armed(t) {
		heap.Fix(&l.timers, t.index)
		return
	}
	heap.Push(&l.timers, t)
}

// cancel disarms t if it is armed.
func (l *loop) cancel(t *timer) {
	if l.armed(t) {
		heap.Remove(&l.timers, t.index)
	}
	t.index = -1
}

// backoffWatch is a socket one loop watches that stops being watched for a while
// after a temporary error (out of descriptors, buffers or memory): the socket stays
// ready, and handling it at once would spin on the same error. Its owner embeds it,
// handles its events and is its timer's target; the owner's expire calls resume.
type backoffWatch struct {
	fd      int
	events  uint32
	watched bool
	delay   time.Duration // the current backoff; reset (0) after a success
	t       timer
}

func newBackoffWatch(fd int, events uint32, owner timerTarget) backoffWatch {
	return backoffWatch{fd: fd, events: events, t: timer{index: -1, target: owner}}
}

// watch registers the socket with h, the owner.
func (w *backoffWatch) watch(l *loop, h handler) error {
	if err := l.watch(w.fd, h, w.events); err != nil {
		return err
	}
	w.watched = true
	return nil
}

// unwatch takes the socket out of the epoll set (it stays open).
func (w *backoffWatch) unwatch(l *loop) {
	if w.watched {
		l.unwatch(w.fd)
		w.watched = false
	}
}

// backoff stops watching for the next, doubled delay, counts it in AcceptBackoffs
// and returns the delay.
func (w *backoffWatch) backoff(l *loop) time.Duration {
	w.delay = nextBackoff(w.delay)
	acceptBackoffs.Add(1)
	w.unwatch(l)
	l.schedule(&w.t, w.delay)
	return w.delay
}

// resume ends a backoff: the socket is watched again, which reports it at once if
// it is ready (or, failing that, the backoff runs once more).
func (w *backoffWatch) resume(l *loop, h handler) {
	if w.watched {
		return
	}
	if w.watch(l, h) != nil {
		l.schedule(&w.t, w.delay)
	}
}

// stop unwatches the socket and cancels any backoff.
func (w *backoffWatch) stop(l *loop) {
	w.unwatch(l)
	l.cancel(&w.t)
}

// waitMillis is epoll_wait's timeout: until the next timer, rounded up, or forever.
func (l *loop) waitMillis() int {
	if len(l.timers) == 0 {
		return -1
	}
	d := l.timers[0].when - l.nanotime()
	if d <= 0 {
		return 0
	}
	return int((d + int64(time.Millisecond) - 1) / int64(time.Millisecond))
}

// yieldEvery is how often a busy loop passes through the scheduler. A goroutine
// that runs on without ever being rescheduled is taken for a runaway one: every
// 10ms the runtime's monitor preempts it and takes its P back out of a system
// call, and after each such retake the monitor polls again every 20µs. Yielding
// now and then avoids both, for a few microseconds every few milliseconds.
const yieldEvery = 5 * time.Millisecond

func (l *loop) run() {
	events := make([]unix.EpollEvent, 256)
	var lastYield int64
	for {
		if now := l.nanotime(); now-lastYield > int64(yieldEvery) {
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
		l.dispatch(events[:n])
		l.runTimers()
	}
}

// dispatch hands each event to the handler of its descriptor's current
// registration; events of an earlier registration are dropped.
func (l *loop) dispatch(events []unix.EpollEvent) {
	for i := range events {
		ev := &events[i]
		fd := int(ev.Fd)
		if fd == l.wake {
			l.runPosted()
			continue
		}
		if fd < len(l.handlers) {
			if w := l.handlers[fd]; w.h != nil && w.gen == uint32(ev.Pad) {
				w.h.handle(l, ev.Events)
			}
		}
	}
}

func (l *loop) runPosted() {
	var b [8]byte
	unix.Read(l.wake, b[:])
	l.woken.Store(false)
	l.mu.Lock()
	work := l.posted
	l.posted = nil
	l.mu.Unlock()
	for _, f := range work {
		f(l)
	}
}

func (l *loop) runTimers() {
	if len(l.timers) == 0 {
		return
	}
	now := l.nanotime()
	for len(l.timers) > 0 && l.timers[0].when <= now {
		t := heap.Pop(&l.timers).(*timer)
		t.target.expire(l)
	}
}

// pickLoop spreads new work over the loops.
func pickLoop(all []*loop) *loop {
	return all[int(loops.next.Add(1))%len(all)]
}
