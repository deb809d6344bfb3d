package socket

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// What accepting (and reading a UDP Service socket) does after each error: only a
// broken socket stops it.
func TestActionAfter(t *testing.T) {
	t.Parallel()
	names := map[errAction]string{retryNow: "retry now", backOff: "back off", giveUp: "give up"}
	tests := []struct {
		err  error
		want errAction
	}{
		{syscall.EINTR, retryNow},
		// A connection aborted before it was accepted, and the network errors
		// accept(2) passes on from the connection it was about to return.
		{syscall.ECONNABORTED, retryNow},
		{syscall.ENETDOWN, retryNow},
		{syscall.EPROTO, retryNow},
		{syscall.ENOPROTOOPT, retryNow},
		{syscall.EHOSTDOWN, retryNow},
		{syscall.ENONET, retryNow},
		{syscall.EHOSTUNREACH, retryNow},
		{syscall.EOPNOTSUPP, retryNow},
		{syscall.ENETUNREACH, retryNow},
		// A UDP socket's report of an ICMP error to an earlier datagram.
		{syscall.ECONNREFUSED, retryNow},
		{os.NewSyscallError("accept4", syscall.ECONNABORTED), retryNow},
		// Shortages.
		{syscall.EMFILE, backOff},
		{syscall.ENFILE, backOff},
		{syscall.ENOBUFS, backOff},
		{syscall.ENOMEM, backOff},
		{os.NewSyscallError("recvmmsg", syscall.ENOBUFS), backOff},
		// The socket itself: shut down, closed under the loop, not a socket.
		{syscall.EINVAL, giveUp},
		{syscall.EBADF, giveUp},
		{syscall.ENOTSOCK, giveUp},
		{errors.New("something else"), giveUp},
	}
	for _, tt := range tests {
		if got := actionAfter(tt.err); got != tt.want {
			t.Errorf("actionAfter(%v): got %s, want %s", tt.err, names[got], names[tt.want])
		}
	}
}

// listenerFDs returns the descriptors of p's listening sockets.
func listenerFDs(p *TCPProxy) []int {
	p.mu.Lock()
	defer p.mu.Unlock()
	var fds []int
	for _, tl := range p.listeners {
		fds = append(fds, tl.fd)
	}
	return fds
}

// A listener whose socket fails for good (here shut down under the proxy, so
// accept says EINVAL) ends its Serve with the error; the proxy serves another
// listener, and the connections the dead one accepted carry on.
func TestTCPProxyServesAgainAfterItsListenerDies(t *testing.T) {
	backend := startTCPServer(t, "127.0.0.2", echo)
	p := &TCPProxy{Service: "ns/svc:tcp", Picker: newCyclePicker(backend.addr), Loops: newLoops(t, 2, nil)}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := p.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
	})
	serve := func() (netip.AddrPort, chan error) {
		ln, err := p.Listen(context.Background(), "tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		served := make(chan error, 1)
		go func() { served <- p.Serve(ln) }()
		return ln.Addr().(*net.TCPAddr).AddrPort(), served
	}
	first, served := serve()
	held := dialProxy(t, first)
	if got, err := roundTrip(held, []byte("before")); err != nil || string(got) != "before" {
		t.Fatalf("round trip before the listener dies: got %q, %v", got, err)
	}
	fds := listenerFDs(p)
	if len(fds) != 1 {
		t.Fatalf("listeners: got %d, want 1", len(fds))
	}
	if err := unix.Shutdown(fds[0], unix.SHUT_RD); err != nil {
		t.Fatalf("shutdown the listening socket: %v", err)
	}
	select {
	case err := <-served:
		if !errors.Is(err, syscall.EINVAL) {
			t.Errorf("Serve after its socket was shut down: got %v, want an accept error EINVAL", err)
		}
	case <-time.After(awaitTimeout):
		t.Fatal("Serve still running after its socket was shut down")
	}
	if err := connectAndRead(first); err == nil {
		t.Errorf("connect to the dead listener %s: got a connection, want it refused", first)
	}

	second, _ := serve()
	c := dialProxy(t, second)
	if got, err := roundTrip(c, []byte("after")); err != nil || string(got) != "after" {
		t.Errorf("round trip through the new listener: got %q, %v", got, err)
	}
	if got, err := roundTrip(held, []byte("still")); err != nil || string(got) != "still" {
		t.Errorf("round trip on the connection the dead listener accepted: got %q, %v", got, err)
	}
	if n := p.Active(); n != 2 {
		t.Errorf("Active: got %d, want 2, the held connection and the new one", n)
	}
}
