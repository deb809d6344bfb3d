package socket

import (
	"context"
	"net"
	"runtime"
	"sync/atomic"
	"testing"
	"time"
)

// Start serves proxy sockets without a goroutine each: many Service ports
// served add no goroutine, each one still proxies, and done comes once per
// socket, with nil, when the proxies close.
func TestStartServesWithoutAGoroutineEach(t *testing.T) {
	const n = 50
	backend := startTCPServer(t, "127.0.0.1", echo).addr
	loops := newLoops(t, 1, nil)
	// Settle what the loops and the backend started.
	time.Sleep(50 * time.Millisecond)
	before := runtime.NumGoroutine()

	var dones atomic.Int32
	doneErrs := make(chan error, 2*n)
	done := func(err error) { dones.Add(1); doneErrs <- err }
	var tcps []*TCPProxy
	var udps []*UDPProxy
	var addrs []string
	for range n {
		p := &TCPProxy{Service: "ns/svc:tcp", Picker: newCyclePicker(backend), Loops: loops}
		ln, err := p.Listen(context.Background(), "tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addrs = append(addrs, ln.Addr().String())
		if err := p.Start(ln, done); err != nil {
			t.Fatalf("Start: %v", err)
		}
		tcps = append(tcps, p)
		u := &UDPProxy{Service: "ns/svc:udp", Picker: newCyclePicker(backend), Loops: loops, Timeout: time.Minute}
		conn, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
		if err != nil {
			t.Fatal(err)
		}
		if err := u.Start(conn, done); err != nil {
			t.Fatalf("Start (UDP): %v", err)
		}
		udps = append(udps, u)
	}
	if grown := runtime.NumGoroutine() - before; grown >= n {
		t.Errorf("%d TCP and %d UDP sockets served: %d more goroutines, want fewer than %d", n, n, grown, n)
	}
	for _, a := range []string{addrs[0], addrs[n-1]} {
		c, err := net.DialTimeout("tcp", a, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write([]byte("ping")); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 4)
		if _, err := c.Read(buf); err != nil || string(buf) != "ping" {
			t.Errorf("through %s: got %q, %v; want the echo", a, buf, err)
		}
		c.Close()
	}
	if got := dones.Load(); got != 0 {
		t.Fatalf("done called %d times while serving, want never", got)
	}
	for i := range n {
		if err := tcps[i].Close(); err != nil {
			t.Error(err)
		}
		if err := udps[i].Close(); err != nil {
			t.Error(err)
		}
	}
	for range 2 * n {
		select {
		case err := <-doneErrs:
			if err != nil {
				t.Errorf("done after Close: got %v, want nil", err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("done called %d times, want %d", dones.Load(), 2*n)
		}
	}
	time.Sleep(50 * time.Millisecond)
	if got := dones.Load(); got != 2*n {
		t.Errorf("done called %d times, want once per socket (%d)", got, 2*n)
	}

	// A proxy already closed serves nothing, and says so through done.
	closed := &TCPProxy{Service: "ns/closed:tcp", Picker: newCyclePicker(backend), Loops: loops}
	closed.Close()
	ln, err := closed.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	if err := closed.Start(ln, func(err error) { errc <- err }); err != nil {
		t.Fatalf("Start on a closed proxy: %v, want nil (as Serve)", err)
	}
	select {
	case err := <-errc:
		if err != nil {
			t.Errorf("done of a closed proxy: got %v, want nil", err)
		}
	case <-time.After(5 * time.Second):
		t.Error("done of a closed proxy never called")
	}
}
