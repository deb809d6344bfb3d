package socket

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// Leak tests: after many connections ended every way a connection can end, the
// process holds exactly the descriptors and goroutines it held before, and no
// socket of it waits in CLOSE_WAIT (a peer's FIN that was never answered by a close).

// processDescriptors returns the number of the process's open descriptors.
func processDescriptors(t testing.TB) int {
	t.Helper()
	_, fds, err := testbed.ProcessSockets(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	return fds
}

// closeWaitSockets lists the process's TCP sockets in CLOSE_WAIT, as "local
// remote" address pairs in the kernel's hex.
func closeWaitSockets(t testing.TB) []string {
	t.Helper()
	out, err := testbed.CloseWaitSockets(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// awaitBaseline waits until the descriptor and goroutine counts are back to what
// they were, collecting garbage meanwhile: Go pools splice pipes and frees them
// (closing their descriptors) only through the garbage collector.
func awaitBaseline(t *testing.T, fds, goroutines int) {
	t.Helper()
	var gotFDs, gotG int
	deadline := time.Now().Add(awaitTimeout)
	for {
		runtime.GC()
		gotFDs = processDescriptors(t)
		gotG = runtime.NumGoroutine()
		if gotFDs <= fds && gotG <= goroutines {
			return
		}
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	buf := make([]byte, 1<<20)
	t.Fatalf("after %s: got %d descriptors and %d goroutines, want at most the baseline %d and %d\n%s",
		awaitTimeout, gotFDs, gotG, fds, goroutines, buf[:runtime.Stack(buf, true)])
}

// closePattern is one way a proxied connection ends.
type closePattern struct {
	name string
	// backend handles the backend's side (nil: the endpoints refuse or ignore).
	backend func(c *net.TCPConn)
	// endpoints replaces the backend (dial failures); dialTimeouts go with it.
	endpoints    func(t *testing.T) []netip.AddrPort
	dialTimeouts []time.Duration
	// dialHedge hedges the dials (see DialPolicy.Hedge).
	dialHedge time.Duration
	// client runs the client's side of one connection.
	client func(c *net.TCPConn) error
	// refused is set when the proxy resets every connection, which may reach
	// the client before its connect has returned.
	refused bool
}

var leakPayload = bytes.Repeat([]byte("0123456789abcdef"), 256) // 4 KiB

func readExactly(c net.Conn, want []byte) error {
	got, err := io.ReadAll(c)
	if err != nil {
		return fmt.Errorf("read: %w", err)
	}
	if !bytes.Equal(got, want) {
		return fmt.Errorf("read %d bytes, want the %d sent", len(got), len(want))
	}
	return nil
}

func closePatterns() []closePattern {
	return []closePattern{
		{
			name:    "client FIN",
			backend: echo,
			client: func(c *net.TCPConn) error {
				if _, err := c.Write(leakPayload); err != nil {
					return err
				}
				c.CloseWrite()
				return readExactly(c, leakPayload)
			},
		},
		{
			name: "backend FIN",
			backend: func(c *net.TCPConn) {
				c.Write(leakPayload)
				c.CloseWrite()
				io.Copy(io.Discard, c)
			},
			client: func(c *net.TCPConn) error { return readExactly(c, leakPayload) },
		},
		{
			name: "half-close both ways",
			backend: func(c *net.TCPConn) {
				var wg sync.WaitGroup
				wg.Go(func() { c.Write(leakPayload); c.CloseWrite() })
				io.Copy(io.Discard, c)
				wg.Wait()
			},
			client: func(c *net.TCPConn) error {
				if _, err := c.Write(leakPayload); err != nil {
					return err
				}
				c.CloseWrite()
				return readExactly(c, leakPayload)
			},
		},
		{
			name:    "client RST",
			backend: func(c *net.TCPConn) { io.Copy(io.Discard, c) },
			client: func(c *net.TCPConn) error {
				if _, err := c.Write(leakPayload); err != nil {
					return err
				}
				resetConn(c)
				return nil
			},
		},
		{
			name: "backend RST",
			backend: func(c *net.TCPConn) {
				io.ReadFull(c, make([]byte, 1))
				resetConn(c)
			},
			client: func(c *net.TCPConn) error {
				c.Write([]byte("x"))
				if _, err := c.Read(make([]byte, 1)); !isReset(err) {
					return fmt.Errorf("read: got %v, want ECONNRESET", err)
				}
				return nil
			},
		},
		{
			// A killed process's sockets are closed by the kernel, with an RST when
			// data sent to them is still unread: the backend closes while the client
			// is still sending, without reading what it sent.
			name: "backend killed mid-stream",
			backend: func(c *net.TCPConn) {
				io.ReadFull(c, make([]byte, 1))
				c.Write(leakPayload)
				c.Close()
			},
			client: func(c *net.TCPConn) error {
				var wg sync.WaitGroup
				wg.Go(func() {
					// Enough to be mid-stream when the backend dies, bounded so
					// that 32 clients do not spin on loopback writes.
					for range 16 {
						if _, err := c.Write(leakPayload); err != nil {
							return
						}
					}
				})
				_, err := io.Copy(io.Discard, c)
				c.Close()
				wg.Wait()
				if err != nil && !isReset(err) {
					return fmt.Errorf("read: got %v, want EOF or ECONNRESET", err)
				}
				return nil
			},
		},
		{
			// The hedge's loser, pending on an endpoint that never answers, is
			// closed when the hedge connects.
			name: "hedge wins over an unanswered dial",
			endpoints: func(t *testing.T) []netip.AddrPort {
				return []netip.AddrPort{unansweredAddr(t, "127.0.0.6"), startTCPServer(t, "127.0.0.7", echo).addr}
			},
			dialTimeouts: []time.Duration{time.Minute, time.Minute},
			dialHedge:    time.Microsecond,
			client:       echoRoundTrip,
		},
		{
			// Both endpoints answer and the hedge is due at once: often both
			// dials connect, and the loser is a connected socket that is reset.
			name: "hedge races between two answering endpoints",
			endpoints: func(t *testing.T) []netip.AddrPort {
				return []netip.AddrPort{startTCPServer(t, "127.0.0.8", echo).addr, startTCPServer(t, "127.0.0.9", echo).addr}
			},
			dialHedge: time.Nanosecond,
			client:    echoRoundTrip,
		},
		{
			name:    "dial refused",
			refused: true,
			endpoints: func(t *testing.T) []netip.AddrPort {
				return []netip.AddrPort{refusedAddr(t, "127.0.0.2"), refusedAddr(t, "127.0.0.3")}
			},
			client: func(c *net.TCPConn) error {
				if _, err := c.Read(make([]byte, 1)); !isReset(err) {
					return fmt.Errorf("read: got %v, want ECONNRESET", err)
				}
				return nil
			},
		},
		{
			name:    "dial timeout then refused",
			refused: true,
			endpoints: func(t *testing.T) []netip.AddrPort {
				return []netip.AddrPort{unansweredAddr(t, "127.0.0.4"), refusedAddr(t, "127.0.0.5")}
			},
			dialTimeouts: []time.Duration{5 * time.Millisecond, 5 * time.Millisecond},
			client: func(c *net.TCPConn) error {
				if _, err := c.Read(make([]byte, 1)); !isReset(err) {
					return fmt.Errorf("read: got %v, want ECONNRESET", err)
				}
				return nil
			},
		},
	}
}

// echoRoundTrip sends the payload to an echo backend, half-closes and reads it back.
func echoRoundTrip(c *net.TCPConn) error {
	if _, err := c.Write(leakPayload); err != nil {
		return err
	}
	c.CloseWrite()
	return readExactly(c, leakPayload)
}

func TestTCPProxyNoLeaksOverCloses(t *testing.T) {
	const total = 10000
	const concurrency = 32
	patterns := closePatterns()
	perPattern := total / len(patterns)

	type world struct {
		addr   netip.AddrPort
		proxy  *TCPProxy
		picker *cyclePicker
		rec    *recorder
	}
	// Every proxy on the same loop, as a proxier's.
	loops := newLoops(t, 1, nil)
	worlds := make([]world, len(patterns))
	for i, pt := range patterns {
		var eps []netip.AddrPort
		if pt.backend != nil {
			eps = []netip.AddrPort{startTCPServer(t, "127.0.0.2", pt.backend).addr}
		} else {
			eps = pt.endpoints(t)
		}
		w := world{picker: newCyclePicker(eps...), rec: &recorder{}}
		w.proxy = &TCPProxy{Service: "ns/leak:" + pt.name, Picker: w.picker, Observer: w.rec, DialTimeouts: pt.dialTimeouts, DialHedge: pt.dialHedge}
		w.proxy.Loops = loops
		w.addr = startTCPProxy(t, w.proxy)
		worlds[i] = w
	}
	// Warm up the runtime's lazily created state (poller, timers, splice pool
	// machinery) with one connection that ends cleanly, then take the baseline.
	c := dialProxy(t, worlds[0].addr)
	if err := patterns[0].client(c); err != nil {
		t.Fatalf("warm-up connection: %v", err)
	}
	c.Close()
	worlds[0].rec.awaitClosed(t, 1)
	fdBaseline := processDescriptors(t)
	awaitBaseline(t, fdBaseline, runtime.NumGoroutine())
	fdBaseline = processDescriptors(t)
	goroutineBaseline := runtime.NumGoroutine()

	for i, pt := range patterns {
		w := worlds[i]
		t.Run(pt.name, func(t *testing.T) {
			already, _, _ := w.rec.counts()
			jobs := make(chan int)
			errs := make(chan error, perPattern)
			var wg sync.WaitGroup
			for range concurrency {
				wg.Go(func() {
					for n := range jobs {
						c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(w.addr))
						if err != nil && pt.refused && isReset(err) {
							continue
						}
						if err != nil {
							errs <- fmt.Errorf("connection %d: dial: %w", n, err)
							continue
						}
						c.SetDeadline(time.Now().Add(awaitTimeout))
						if err := pt.client(c); err != nil {
							errs <- fmt.Errorf("connection %d: %w", n, err)
						}
						c.Close()
					}
				})
			}
			for n := range perPattern {
				jobs <- n
			}
			close(jobs)
			wg.Wait()
			close(errs)
			failures := 0
			for err := range errs {
				if failures++; failures <= 5 {
					t.Error(err)
				}
			}
			if failures > 5 {
				t.Errorf("... %d failed connections in all", failures)
			}
			w.rec.awaitClosed(t, already+perPattern)
			testbed.Await(t, awaitTimeout, "no open connection", func() bool { return w.proxy.Active() == 0 })
			if u := w.picker.unreleased(); len(u) != 0 {
				t.Errorf("Pick without Release: %v", u)
			}
			if pt.dialHedge > 0 {
				lost := 0
				for _, c := range w.rec.awaitClosed(t, already+perPattern)[already:] {
					for _, a := range c.Attempts {
						if a.Lost() {
							lost++
						}
					}
				}
				if lost == 0 {
					t.Errorf("no attempt of %d connections lost a hedge race, want some: the pattern did not test a loser's close", perPattern)
				}
				t.Logf("%d hedge losers closed over %d connections", lost, perPattern)
			}
		})
	}

	awaitBaseline(t, fdBaseline, goroutineBaseline)
	if cw := closeWaitSockets(t); len(cw) != 0 {
		t.Errorf("got %d sockets in CLOSE_WAIT (local remote, hex): %v, want none", len(cw), cw)
	}
}

func TestUDPProxyNoLeaksOverClientChurn(t *testing.T) {
	const clients = 2000
	const concurrency = 32
	live := startUDPEcho(t, "127.0.0.2")
	dead := deadUDPAddr(t, "127.0.0.3")
	picker := newCyclePicker(live, dead)
	rec := &recorder{}
	// A short expiry makes entries come and go while clients keep arriving; a small
	// table makes some clients find it full.
	p := &UDPProxy{Service: "ns/churn:udp", Picker: picker, Observer: rec, Timeout: 20 * time.Millisecond, MaxClients: 64}
	svc := startUDPProxy(t, p)

	fdBaseline := processDescriptors(t)
	goroutineBaseline := runtime.NumGoroutine()

	jobs := make(chan int)
	var answered, unanswered sync.Map
	var wg sync.WaitGroup
	for range concurrency {
		wg.Go(func() {
			buf := make([]byte, 64)
			for n := range jobs {
				c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
				if err != nil {
					t.Errorf("client %d: %v", n, err)
					continue
				}
				msg := fmt.Appendf(nil, "client %d", n)
				got := false
				// A datagram to the dead endpoint is lost and the entry ends on the
				// ICMP error; the client's next one picks again.
				for range 3 {
					c.WriteToUDPAddrPort(msg, svc)
					c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
					k, _, err := c.ReadFromUDPAddrPort(buf)
					if err == nil && bytes.Equal(buf[:k], msg) {
						got = true
						break
					}
				}
				if got {
					answered.Store(n, true)
				} else {
					unanswered.Store(n, true)
				}
				c.Close()
			}
		})
	}
	for n := range clients {
		jobs <- n
	}
	close(jobs)
	wg.Wait()

	nAnswered := 0
	answered.Range(func(any, any) bool { nAnswered++; return true })
	// Every client has three tries, alternating endpoints, so almost all are
	// answered; a full table or dropped datagrams may turn a few away.
	if nAnswered < clients/2 {
		t.Errorf("answered clients: got %d of %d, want most", nAnswered, clients)
	}
	testbed.Await(t, awaitTimeout, "the client table to empty", func() bool { return p.Clients() == 0 })
	opened, _, _ := rec.counts()
	testbed.Await(t, awaitTimeout, "a record for every client entry", func() bool {
		_, _, closed := rec.counts()
		return closed == opened
	})
	if u := picker.unreleased(); len(u) != 0 {
		t.Errorf("Pick without Release: %v", u)
	}
	awaitBaseline(t, fdBaseline, goroutineBaseline)
	t.Logf("%d clients, %d answered, %d entries opened", clients, nAnswered, opened)
}

// TestAwaitBaselineSeesALeak makes sure the leak check can fail: a descriptor
// kept open past the baseline is seen.
func TestAwaitBaselineSeesALeak(t *testing.T) {
	before := processDescriptors(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	if after := processDescriptors(t); after != before+1 {
		t.Errorf("descriptors with one more listener: got %d, want %d", after, before+1)
	}
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	c.Close() // the accepted side now holds an unanswered FIN
	testbed.Await(t, awaitTimeout, "the accepted socket in CLOSE_WAIT", func() bool { return len(closeWaitSockets(t)) == 1 })
	s.Close()
	if cw := closeWaitSockets(t); len(cw) != 0 {
		t.Errorf("after closing it: got %v in CLOSE_WAIT, want none", cw)
	}
}
