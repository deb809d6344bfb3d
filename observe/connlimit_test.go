package observe

import (
	"bufio"
	"errors"
	"net"
	"net/http"
	"testing"
	"time"
)

// A server behind a cap of 2 holds at most two connections: while two idle
// ones are open a request waits unanswered in the listen queue, and it is
// answered once one of them closes. Closing the listener ends a waiting
// Accept.
func TestConnLimitHoldsBackConnectionsPastTheCap(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	limit := NewConnLimit(2)
	lln := limit.Listener(ln)
	srv := newHTTPServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("ok")) }))
	done := make(chan error, 1)
	go func() { done <- srv.Serve(lln) }()
	defer srv.Close()

	var idle []net.Conn
	for range 2 {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		idle = append(idle, c)
	}
	waitFor(t, "both idle connections accepted", func() bool { return len(limit.slots) == 2 })

	c, err := net.Dial("tcp", ln.Addr().String()) // the kernel completes the handshake
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	answered := make(chan string, 1)
	go func() {
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			answered <- err.Error()
			return
		}
		answered <- resp.Status
	}()
	select {
	case got := <-answered:
		t.Fatalf("a third connection past a cap of 2 was served: %s", got)
	case <-time.After(200 * time.Millisecond):
	}
	idle[0].Close()
	select {
	case got := <-answered:
		if got != "200 OK" {
			t.Errorf("the waiting request once a place was free: got %q, want 200 OK", got)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the waiting request was not served after an idle connection closed")
	}
	idle[1].Close()

	// A full cap, then Close: the Accept waiting for a place returns.
	for range 2 {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
	}
	waitFor(t, "the cap full again", func() bool { return len(limit.slots) == 2 })
	srv.Close()
	select {
	case err := <-done:
		if !errors.Is(err, http.ErrServerClosed) && !errors.Is(err, net.ErrClosed) {
			t.Errorf("Serve after Close: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return after Close while its Accept waited for a place")
	}
	if n := len(limit.slots); n != 0 {
		t.Errorf("places held after every connection closed: %d, want 0", n)
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}
