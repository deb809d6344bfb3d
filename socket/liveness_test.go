package socket

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/record"
	"github.com/uproxy/uproxy/socket/poll/polltest"
	"github.com/uproxy/uproxy/test/testbed"
)

// sockopts is what a socket says of its options: TCP_NODELAY, and keepalive off
// or its idle time and interval in seconds.
type sockopts struct {
	noDelay        bool
	keepAlive      bool
	idle, interval int
}

func sockoptsOf(t *testing.T, fd int) sockopts {
	t.Helper()
	noDelay, err0 := unix.GetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY)
	on, err1 := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_KEEPALIVE)
	idle, err2 := unix.GetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_KEEPIDLE)
	interval, err3 := unix.GetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_KEEPINTVL)
	if err := errors.Join(err0, err1, err2, err3); err != nil {
		t.Fatalf("read the options of socket %d: %v", fd, err)
	}
	o := sockopts{noDelay: noDelay != 0, keepAlive: on != 0}
	if o.keepAlive {
		o.idle, o.interval = idle, interval
	}
	return o
}

// sessionSockets returns the client and backend descriptors of p's one open
// connection, read on its loop.
func sessionSockets(t *testing.T, p *TCPProxy) (client, backend int) {
	t.Helper()
	p.mu.Lock()
	var s *tcpSession
	for c := range p.conns {
		s = c
	}
	p.mu.Unlock()
	if s == nil {
		t.Fatal("no open connection")
	}
	if err := s.l.PostWait(func() { client, backend = s.client.fd, s.backend.fd }); err != nil {
		t.Fatal(err)
	}
	return client, backend
}

// Both sockets of a connection carry TCP_NODELAY and the keepalive of
// TCPProxy.KeepAlive: the client's inherited from the listener - even when it
// connected before Serve began - and the backend's set once the connection has
// been open for KeepAlive by the loop's clock, not before (see keepAliveDue);
// the backend's TCP_NODELAY comes with its second write (see nagleState), which
// the second round trip makes.
func TestTCPProxyKeepAliveOnBothSockets(t *testing.T) {
	t.Parallel()
	noDelay := sockopts{noDelay: true}
	tests := []struct {
		name      string
		keepAlive time.Duration
		// due is when the backend socket should have its options.
		due  time.Duration
		want sockopts
	}{
		{name: "default", due: 15 * time.Second, want: sockopts{noDelay: true, keepAlive: true, idle: 15, interval: 15}},
		{name: "30s", keepAlive: 30 * time.Second, due: 30 * time.Second, want: sockopts{noDelay: true, keepAlive: true, idle: 30, interval: 30}},
		{name: "rounded up to whole seconds", keepAlive: 1500 * time.Millisecond, due: 2 * time.Second, want: sockopts{noDelay: true, keepAlive: true, idle: 2, interval: 2}},
		{name: "kernel's bound", keepAlive: 100 * time.Hour, due: 32767 * time.Second, want: sockopts{noDelay: true, keepAlive: true, idle: 32767, interval: 32767}},
		{name: "off", keepAlive: -1, due: 24 * time.Hour, want: noDelay},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clock := polltest.NewClock()
			backend := startTCPServer(t, "127.0.0.2", echo)
			p := &TCPProxy{Service: "ns/svc:tcp", Picker: newCyclePicker(backend.addr), KeepAlive: tt.keepAlive, Loops: newLoops(t, 1, clock)}
			ln, err := p.Listen(context.Background(), "tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			// The client's connection waits in the accept queue before Serve.
			c := dialProxy(t, ln.Addr().(*net.TCPAddr).AddrPort())
			go p.Serve(ln)
			defer func() {
				// The session ends on the client's FIN; Shutdown waits for it, so its
				// sockets are closed before the loops are.
				c.Close()
				ctx, cancel := context.WithTimeout(context.Background(), awaitTimeout)
				defer cancel()
				if err := p.Shutdown(ctx); err != nil {
					t.Errorf("Shutdown: got %v, want nil", err)
				}
			}()
			for _, msg := range []string{"ping", "ping again"} {
				if got, err := roundTrip(c, []byte(msg)); err != nil || string(got) != msg {
					t.Fatalf("round trip: got %q, %v", got, err)
				}
			}
			clientFD, backendFD := sessionSockets(t, p)
			if got := sockoptsOf(t, clientFD); got != tt.want {
				t.Errorf("client socket: got %+v, want %+v", got, tt.want)
			}
			if got := sockoptsOf(t, backendFD); got != noDelay {
				t.Errorf("backend socket at once: got %+v, want %+v", got, noDelay)
			}
			clock.Advance(tt.due - time.Nanosecond)
			if got := sockoptsOf(t, backendFD); got != noDelay {
				t.Errorf("backend socket just before %v: got %+v, want %+v", tt.due, got, noDelay)
			}
			clock.Advance(time.Nanosecond)
			if got := sockoptsOf(t, backendFD); got != tt.want {
				t.Errorf("backend socket at %v: got %+v, want %+v", tt.due, got, tt.want)
			}
			// The connection still works, and its timer is done.
			if got, err := roundTrip(c, []byte("pong")); err != nil || string(got) != "pong" {
				t.Fatalf("round trip after %v: got %q, %v", tt.due, got, err)
			}
		})
	}
}

// The backend socket is given TCP_NODELAY just before its second write, not at
// dial: its first write cannot be held back by Nagle's algorithm (nothing is in
// flight before it), so a connection that writes its request once spares the
// call, and every write after the first goes out at once as before.
func TestTCPProxyNoDelayBeforeSecondWrite(t *testing.T) {
	backend := startTCPServer(t, "127.0.0.2", echo)
	p := &TCPProxy{Service: "ns/svc:tcp", Picker: newCyclePicker(backend.addr), KeepAlive: -1, Loops: newLoops(t, 1, nil)}
	c := dialProxy(t, startTCPProxy(t, p))
	for i, want := range []bool{false, true, true} {
		msg := fmt.Sprintf("request %d", i+1)
		if got, err := roundTrip(c, []byte(msg)); err != nil || string(got) != msg {
			t.Fatalf("round trip %d: got %q, %v", i+1, got, err)
		}
		_, backendFD := sessionSockets(t, p)
		if got := sockoptsOf(t, backendFD).noDelay; got != want {
			t.Errorf("backend socket after %d writes: TCP_NODELAY %v, want %v", i+1, got, want)
		}
	}
}

// The backend socket's keepalive, set once the connection has been open for
// KeepAlive, probes at once a backend that has been silent since: one that
// vanished without a FIN is found as soon as the options are set, and both
// sockets are freed.
func TestTCPProxyKeepAliveFindsAVanishedBackend(t *testing.T) {
	testbed.Needs(t, testbed.Root) // vanish
	served := make(chan *net.TCPConn, 1)
	backend := startTCPServer(t, "127.0.0.2", func(c *net.TCPConn) {
		buf := make([]byte, 4)
		if _, err := io.ReadFull(c, buf); err == nil {
			c.Write(buf)
		}
		served <- c
		<-t.Context().Done() // the test vanishes c
	})
	rec := &recorder{}
	p := &TCPProxy{Service: "ns/svc:tcp", Picker: newCyclePicker(backend.addr), Observer: rec, KeepAlive: time.Second}
	c := dialProxy(t, startTCPProxy(t, p))
	if got, err := roundTrip(c, []byte("ping")); err != nil || string(got) != "ping" {
		t.Fatalf("round trip: got %q, %v", got, err)
	}
	vanish(t, <-served)
	closed := rec.awaitClosed(t, 1)[0]
	if !errors.Is(closed.Err, unix.ECONNRESET) {
		t.Errorf("record of the vanished backend's connection: got err %v, want the reset its probe drew", closed.Err)
	}
	if _, err := c.Read(make([]byte, 1)); !isReset(err) {
		t.Errorf("client once the backend is found gone: got %v, want a reset", err)
	}
}

// vanish closes c without a FIN or a reset, as when the client's machine dies:
// in TCP repair mode (CAP_NET_ADMIN) close sends nothing. A later segment from
// the proxy finds no socket and draws a reset.
func vanish(t *testing.T, c *net.TCPConn) {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var serr error
	rc.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_REPAIR, 1) })
	if errors.Is(serr, unix.EPERM) { // root, without CAP_NET_ADMIN
		testbed.Skip(t, "a client that vanishes without a FIN needs TCP_REPAIR (CAP_NET_ADMIN)")
	} else if serr != nil {
		t.Fatalf("TCP_REPAIR: %v", serr)
	}
	c.Close()
}

// A client that vanished without a FIN is found out by the keepalive probes of
// its idle connection, and both sockets are freed; without keepalive nothing
// would ever tell the proxy.
func TestTCPProxyKeepAliveFindsAVanishedClient(t *testing.T) {
	testbed.Needs(t, testbed.Root) // vanish
	backend := startTCPServer(t, "127.0.0.2", echo)
	rec := &recorder{}
	p := &TCPProxy{Service: "ns/svc:tcp", Picker: newCyclePicker(backend.addr), Observer: rec, KeepAlive: time.Second}
	c := dialProxy(t, startTCPProxy(t, p))
	if got, err := roundTrip(c, []byte("ping")); err != nil || string(got) != "ping" {
		t.Fatalf("round trip: got %q, %v", got, err)
	}
	vanish(t, c)
	closed := rec.awaitClosed(t, 1)[0]
	if !errors.Is(closed.Err, unix.ECONNRESET) {
		t.Errorf("record of the vanished client's connection: got err %v, want the reset its probe drew", closed.Err)
	}
	if n := p.Active(); n != 0 {
		t.Errorf("Active once the client is found gone: got %d, want 0", n)
	}
}

// idleStep moves the loop's clock on by advance, then (exchange) makes a round
// trip; open says whether the connection lives after the move.
type idleStep struct {
	advance  time.Duration
	exchange bool
	open     bool
}

// A connection closes once no byte has moved either way for the idle timeout by
// the loop's clock, not before; a byte either way starts the idle time again.
// Both sides get a reset, and the record says why.
func TestTCPIdleTimeoutFollowsTheLoopClock(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		idle  time.Duration
		steps []idleStep
	}{
		{name: "10s", idle: 10 * time.Second, steps: []idleStep{
			{advance: 9 * time.Second, exchange: true, open: true}, // 9s: used again
			{advance: time.Second, open: true},                     // 10s: idle for 1s only
			{advance: 9*time.Second - time.Nanosecond, open: true}, // just before 19s
			{advance: time.Nanosecond, open: false},                // 19s: idle for the timeout
		}},
		{name: "none", steps: []idleStep{
			{advance: 24 * time.Hour, open: true},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clock := polltest.NewClock()
			loops := newLoops(t, 1, clock)
			backendEnd := make(chan error, 1)
			backend := startTCPServer(t, "127.0.0.2", func(c *net.TCPConn) {
				_, err := io.Copy(c, c)
				backendEnd <- err
			})
			rec := &recorder{}
			p := &TCPProxy{Service: "ns/svc:tcp", Picker: newCyclePicker(backend.addr), Observer: rec, Loops: loops, IdleTimeout: tt.idle}
			c := dialProxy(t, startTCPProxy(t, p))
			exchange := func(msg string) {
				t.Helper()
				if got, err := roundTrip(c, []byte(msg)); err != nil || string(got) != msg {
					t.Fatalf("round trip %q: got %q, %v", msg, got, err)
				}
				// The handler that moved the reply has noted it once the loop
				// has moved on to a posted function.
				loops.Next().PostWait(func() {})
			}
			exchange("first")
			var now time.Duration
			for _, st := range tt.steps {
				clock.Advance(st.advance)
				now += st.advance
				if open := p.Active() == 1; open != st.open {
					t.Fatalf("connection open at %v: got %v, want %v", now, open, st.open)
				}
				if st.exchange {
					exchange("again")
				}
			}
			if tt.steps[len(tt.steps)-1].open {
				return
			}
			if _, err := c.Read(make([]byte, 1)); !isReset(err) {
				t.Errorf("client after the idle timeout: got %v, want a reset", err)
			}
			select {
			case err := <-backendEnd:
				if !isReset(err) {
					t.Errorf("backend after the idle timeout: got %v, want a reset", err)
				}
			case <-time.After(awaitTimeout):
				t.Error("backend connection still open after the idle timeout")
			}
			got := rec.awaitClosed(t, 1)[0]
			if !errors.Is(got.Err, record.ErrIdle) || !got.IdledOut() || got.BytesIn != 10 || got.BytesOut != 10 {
				t.Errorf("record: got err %v, %d bytes in, %d out; want record.ErrIdle, 10, 10", got.Err, got.BytesIn, got.BytesOut)
			}
		})
	}
}
