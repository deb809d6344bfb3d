package observe

import (
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/klog/v2"
)

// HTTP servers' share of the descriptors. The metrics address, /healthz and
// the Services' health check ports listen on the network (/healthz on every
// address by default), and an HTTP server takes a descriptor for every
// connection it accepts. Without a cap, a client holding idle connections to
// them would take the descriptors the data path leaves to the control plane,
// and with them the source's watch, the syncs and every Service. A ConnLimit
// caps the connections of the listeners it wraps (the program gives the
// metrics address one, and /healthz with the health check ports another):
// past the cap, Accept waits for a connection to end and new ones wait in the
// kernel's listen queue, which takes no descriptor of the process.

// Timeouts of every HTTP server: a connection that has not sent its request
// headers within httpHeaderTimeout, or sits idle between requests for
// httpIdleTimeout, is closed, so a held connection frees its place.
const (
	httpHeaderTimeout = 10 * time.Second
	httpIdleTimeout   = 90 * time.Second
)

// ConnLimit caps the connections a set of listeners hold open together. The
// zero value and nil cap nothing.
type ConnLimit struct {
	slots    chan struct{}
	lastFull atomic.Int64 // unix nanoseconds of the last "at the cap" log line
}

// NewConnLimit returns a cap of n connections (at least 1).
func NewConnLimit(n int) *ConnLimit {
	return &ConnLimit{slots: make(chan struct{}, max(n, 1))}
}

// Listener returns ln with its accepted connections counted against c.
func (c *ConnLimit) Listener(ln net.Listener) net.Listener {
	if c == nil || c.slots == nil {
		return ln
	}
	return &limitedListener{Listener: ln, c: c, closed: make(chan struct{})}
}

// atCap logs, at most once a minute, that the cap holds back connections.
func (c *ConnLimit) atCap(addr net.Addr) {
	now := time.Now().UnixNano()
	last := c.lastFull.Load()
	if now-last < int64(time.Minute) || !c.lastFull.CompareAndSwap(last, now) {
		return
	}
	klog.InfoS("HTTP connections at their cap; new ones wait in the listen queue until one ends",
		"cap", cap(c.slots), "address", addr.String())
}

type limitedListener struct {
	net.Listener
	c         *ConnLimit
	closeOnce sync.Once
	closed    chan struct{}
}

func (l *limitedListener) Accept() (net.Conn, error) {
	select {
	case l.c.slots <- struct{}{}:
	default:
		l.c.atCap(l.Addr())
		select {
		case l.c.slots <- struct{}{}:
		case <-l.closed:
			return nil, net.ErrClosed
		}
	}
	conn, err := l.Listener.Accept()
	if err != nil {
		<-l.c.slots
		return nil, err
	}
	return &limitedConn{Conn: conn, release: sync.OnceFunc(func() { <-l.c.slots })}, nil
}

func (l *limitedListener) Close() error {
	l.closeOnce.Do(func() { close(l.closed) })
	return l.Listener.Close()
}

// limitedConn gives its place back when it is closed, once however often.
type limitedConn struct {
	net.Conn
	release func()
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.release()
	return err
}

// httpErrorLog sends the HTTP servers' own messages (accept errors, bad
// requests) to uproxy's log, at the error level.
var httpErrorLog = klog.NewStandardLogger("ERROR")

// newHTTPServer is an HTTP server of h with the timeouts above.
func newHTTPServer(h http.Handler) *http.Server {
	return &http.Server{Handler: h, ReadHeaderTimeout: httpHeaderTimeout, IdleTimeout: httpIdleTimeout, ErrorLog: httpErrorLog}
}
