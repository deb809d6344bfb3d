package socket

import (
	"net/netip"
	"time"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/socket/poll"
)

// The data path (TCP connections and UDP flows) runs on event loops (package poll)
// rather than on goroutines per connection. A loop accepts, dials without blocking,
// moves bytes and runs the timers of the connections it accepted. A connection
// then costs no goroutine, no stack and no scheduler round trip per readiness
// event, and none of the setup Go's net package does per socket (local and peer
// address lookups, its own poller registration, keepalive and TCP_NODELAY per
// socket). The owner of a proxy hands it the loops (TCPProxy.Loops, UDPProxy.Loops)
// and closes them once its proxies are closed.
//
// Sockets are registered edge-triggered for input and output at once, so nothing
// is ever re-armed; a handler remembers which side is readable or writable until a
// call says otherwise (EAGAIN, or a short read). Listeners are registered in every
// loop with EPOLLEXCLUSIVE, level-triggered: whichever loop is idle takes the next
// connection, and a listener left with pending connections is reported again.

// readBufSize is each loop's read buffer. A read that fills it marks a bulk
// transfer, which switches that direction to splice (see tcpDirection).
const readBufSize = 64 << 10

// loop is socket's share of one event loop: the state the protocol code keeps per
// loop, which every proxy on the loop shares and only the loop's goroutine touches.
type loop struct {
	*poll.Loop
	buf []byte // shared read buffer of the TCP copy
	// UDP batch readers: Service sockets (with addresses) and client sockets.
	serviceReader, replyReader *batchReader
	// oob is room for the control messages of a UDP send (gso.go).
	oob [controlSpace]byte
	// Raw socket address of the last accept, reused to spare an allocation each.
	rsa    unix.RawSockaddrAny
	rsaLen uint32
	// Socket addresses of dials, reused for the same reason.
	sa4 unix.SockaddrInet4
	sa6 unix.SockaddrInet6
	// tried holds the endpoints a dial excludes, for one Pick at a time.
	tried []netip.AddrPort
	// emptyAccepts counts the accept4 calls that found the queue empty (see
	// listenHandle.Handle); tests read it.
	emptyAccepts uint64
	// tcpInfo receives the head of a listener's TCP_INFO (acceptQueue).
	tcpInfo unix.TCPInfo
	// fdCeiling is the lowest descriptor number the data path may not keep
	// (reserve.go).
	fdCeiling int
}

// loopOf returns socket's state for pl, made on first use. It is looked up when a
// proxy places work on a loop, never per event.
func loopOf(pl *poll.Loop) *loop {
	return pl.Local(func() any { return newLoop(pl) }).(*loop)
}

func newLoop(pl *poll.Loop) *loop {
	return &loop{Loop: pl, buf: make([]byte, readBufSize),
		serviceReader: newBatchReader(true), replyReader: newBatchReader(false),
		fdCeiling: descriptorCeiling()}
}

// backoffWatch is a socket one loop watches that stops being watched for a while
// after a temporary error (out of descriptors, buffers or memory): the socket stays
// ready, and handling it at once would spin on the same error. Its owner embeds it,
// handles its events and is its timer's target; the owner's Expire calls resume.
type backoffWatch struct {
	fd      int
	events  uint32
	watched bool
	delay   time.Duration // the current backoff; reset (0) after a success
	t       poll.Timer
	// failures counts the backoffs since the last success, and shortSince
	// (loop.Now) is when the first of them began: what recovered reports.
	failures   int
	shortSince int64
}

func newBackoffWatch(fd int, events uint32, owner poll.TimerTarget) backoffWatch {
	return backoffWatch{fd: fd, events: events, t: poll.NewTimer(owner)}
}

// watch registers the socket with h, the owner.
func (w *backoffWatch) watch(l *loop, h poll.Handler) error {
	if err := l.Watch(w.fd, h, w.events); err != nil {
		return err
	}
	w.watched = true
	return nil
}

// unwatch takes the socket out of the epoll set (it stays open).
func (w *backoffWatch) unwatch(l *loop) {
	if w.watched {
		l.Unwatch(w.fd)
		w.watched = false
	}
}

// backoff stops watching for the next, doubled delay and returns the delay.
func (w *backoffWatch) backoff(l *loop) time.Duration {
	if w.failures == 0 {
		w.shortSince = l.Now()
	}
	w.failures++
	w.delay = nextBackoff(w.delay)
	w.unwatch(l)
	l.Schedule(&w.t, w.delay)
	return w.delay
}

// succeeded records a success (an accept, a read) and, when it ends a run of
// backoffs, returns how long they lasted, from the first, and how many there
// were, so that the owner logs the recovery once; ok is false otherwise.
func (w *backoffWatch) succeeded(l *loop) (backedOff time.Duration, failures int, ok bool) {
	w.delay = 0
	if w.failures == 0 {
		return 0, 0, false
	}
	backedOff, failures = time.Duration(l.Now()-w.shortSince), w.failures
	w.failures = 0
	return backedOff, failures, true
}

// resume ends a backoff: the socket is watched again, which reports it at once if
// it is ready (or, failing that, the backoff runs once more).
func (w *backoffWatch) resume(l *loop, h poll.Handler) {
	if w.watched {
		return
	}
	if w.watch(l, h) != nil {
		l.Schedule(&w.t, w.delay)
	}
}

// stop unwatches the socket and cancels any backoff.
func (w *backoffWatch) stop(l *loop) {
	w.unwatch(l)
	l.Cancel(&w.t)
}
