package socket

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/socket/poll"
)

// Each benchmark runs the same traffic straight to the backend ("direct") and
// through a proxy ("proxied"); the difference is what the proxy costs. Client,
// proxy and backend share the process, so the CPU figures (getrusage of the whole
// process) are totals: subtract direct from proxied for the proxy's share, which
// includes the kernel's work for the extra loopback connection at both its ends.
// TCP benchmarks also run the proxy in a child process ("proxied-child") and
// report its own CPU time.

// processCPU returns the user plus system CPU time the process has used.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// childCPU returns the user plus system CPU time process pid has used, from
// /proc/pid/stat (in clock ticks of 10ms, fine over a benchmark's run).
func childCPU(b *testing.B, pid int) time.Duration {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		b.Fatal(err)
	}
	// Fields after the command name in parentheses start at field 3 (state);
	// utime and stime are fields 14 and 15.
	f := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		b.Fatalf("parse /proc/%d/stat: %v %v", pid, err1, err2)
	}
	const tick = 10 * time.Millisecond // USER_HZ is 100 on Linux
	return time.Duration(utime+stime) * tick
}

// benchTarget is where a benchmark connects, and how to read the CPU time of the
// proxy alone when it runs in its own process.
type benchTarget struct {
	addr     netip.AddrPort
	proxyCPU func() time.Duration // nil unless the proxy is a child process
	pid      int                  // the child's, when proxyCPU is set
}

// benchKeepAlive is the TCPProxy.KeepAlive of the benchmarks' proxies, in this
// process and in a child, to compare what keepalive costs per connection:
//
//	go test -run '^$' -bench TCPConnect ./socket/ -args -keepalive=-1s
var benchKeepAlive = flag.Duration("keepalive", 0, "TCPProxy.KeepAlive of the benchmarks' proxies (0: DefaultKeepAlive, negative: off)")

// benchNames are the sub-benchmarks of TCP benchmarks: straight to the backend,
// through an in-process proxy, and through a proxy in a child process (whose own
// CPU time is then reported as proxy-cpu-*).
var benchNames = []string{"direct", "proxied", "proxied-child"}

// benchTarget starts a backend serving handle on 127.0.0.2 and, as name asks, a
// proxy to it.
func startBenchTarget(b *testing.B, name string, handle func(*net.TCPConn)) benchTarget {
	backend := startTCPServer(b, "127.0.0.2", handle)
	switch name {
	case "proxied":
		p := &TCPProxy{Service: "bench/tcp:x", Picker: newCyclePicker(backend.addr), KeepAlive: *benchKeepAlive}
		return benchTarget{addr: startTCPProxy(b, p)}
	case "proxied-child":
		addr, cmd := startChildProcess(b, "SOCKET_TEST_PROXY_TO="+backend.addr.String(),
			"SOCKET_TEST_PROXY_KEEPALIVE="+benchKeepAlive.String())
		return benchTarget{addr: addr, proxyCPU: func() time.Duration { return childCPU(b, cmd.Process.Pid) }, pid: cmd.Process.Pid}
	}
	return benchTarget{addr: backend.addr}
}

// sink reads and discards everything with a large buffer, so the receiving side
// costs little next to the path under test.
func sink(c *net.TCPConn) {
	buf := make([]byte, 256<<10)
	for {
		if _, err := c.Read(buf); err != nil {
			return
		}
	}
}

func BenchmarkTCPThroughput(b *testing.B) {
	const chunk = 256 << 10
	for _, name := range benchNames {
		b.Run(name, func(b *testing.B) {
			target := startBenchTarget(b, name, sink)
			c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(target.addr))
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			buf := make([]byte, chunk)
			b.SetBytes(chunk)
			b.ReportAllocs()
			cpu := processCPU(b)
			var proxyCPU time.Duration
			if target.proxyCPU != nil {
				proxyCPU = target.proxyCPU()
			}
			for b.Loop() {
				if _, err := c.Write(buf); err != nil {
					b.Fatal(err)
				}
			}
			// Every byte has been consumed once the backend's EOF comes back.
			c.CloseWrite()
			if _, err := io.Copy(io.Discard, c); err != nil {
				b.Fatal(err)
			}
			b.StopTimer()
			gib := float64(b.N) * chunk / (1 << 30)
			b.ReportMetric((processCPU(b)-cpu).Seconds()/gib, "cpu-s/GiB")
			if target.proxyCPU != nil {
				b.ReportMetric((target.proxyCPU()-proxyCPU).Seconds()/gib, "proxy-cpu-s/GiB")
			}
		})
	}
}

// replyOnce reads one 64-byte request, writes it back and closes.
func replyOnce(c *net.TCPConn) {
	buf := make([]byte, 64)
	if _, err := io.ReadFull(c, buf); err == nil {
		c.Write(buf)
	}
}

// shortConnections makes b.N connections with dial, each a 64-byte request
// answered by 64 bytes and the backend's close (replyOnce), and returns how
// long they took.
func shortConnections(b *testing.B, dial func() (net.Conn, error)) time.Duration {
	req, resp := make([]byte, 64), make([]byte, 65)
	start := time.Now()
	for b.Loop() {
		c, err := dial()
		if err != nil {
			b.Fatal(err)
		}
		if _, err := c.Write(req); err != nil {
			b.Fatal(err)
		}
		if n, err := io.ReadFull(c, resp); err != io.ErrUnexpectedEOF || n != 64 {
			b.Fatalf("reply: got %d bytes, %v, want 64 then EOF", n, err)
		}
		c.Close()
	}
	return time.Since(start)
}

func BenchmarkTCPConnect(b *testing.B) {
	for _, name := range benchNames {
		b.Run(name, func(b *testing.B) {
			target := startBenchTarget(b, name, replyOnce)
			addr := net.TCPAddrFromAddrPort(target.addr)
			b.ReportAllocs()
			cpu := processCPU(b)
			var proxyCPU time.Duration
			if target.proxyCPU != nil {
				proxyCPU = target.proxyCPU()
			}
			elapsed := shortConnections(b, func() (net.Conn, error) { return net.DialTCP("tcp", nil, addr) })
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "conns/s")
			b.ReportMetric(float64((processCPU(b)-cpu).Microseconds())/float64(b.N), "cpu-us/conn")
			if target.proxyCPU != nil {
				b.ReportMetric(float64((target.proxyCPU()-proxyCPU).Microseconds())/float64(b.N), "proxy-cpu-us/conn")
			}
		})
	}
}

func BenchmarkUDPRoundTrip(b *testing.B) {
	backend := startUDPEcho(b, "127.0.0.2")
	p := &UDPProxy{Service: "bench/udp:x", Picker: newCyclePicker(backend), Timeout: time.Hour}
	targets := map[string]netip.AddrPort{"direct": backend, "proxied": startUDPProxy(b, p)}
	for _, name := range []string{"direct", "proxied"} {
		b.Run(name, func(b *testing.B) {
			c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(targets[name]))
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			msg := make([]byte, 64)
			buf := make([]byte, 2048)
			b.ReportAllocs()
			cpu := processCPU(b)
			for b.Loop() {
				if _, err := c.Write(msg); err != nil {
					b.Fatal(err)
				}
				if _, err := c.Read(buf); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64((processCPU(b)-cpu).Nanoseconds())/float64(b.N), "cpu-ns/op")
		})
	}
}

// BenchmarkUDPRun is bulk UDP as a QUIC server sends it: each request draws a
// run of 32 datagrams of 1200 bytes, which the endpoint sends with one segmented
// send. Through the proxy the run is read coalesced and sent on the same way
// ("proxied"), or, with coalescing off as before it existed, read and sent a
// datagram at a time ("proxied-one-by-one"). CPU is the whole process's, per
// datagram; subtract "direct" for the proxy's share.
func BenchmarkUDPRun(b *testing.B) {
	const count, size = 32, 1200
	backend := listenUDP(b, "127.0.0.2")
	go func() {
		payload := make([]byte, count*size)
		oob := appendSegment(nil, size)
		buf := make([]byte, 64)
		for {
			_, from, err := backend.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			backend.WriteMsgUDPAddrPort(payload, oob, from)
		}
	}()
	for _, name := range []string{"direct", "proxied", "proxied-one-by-one"} {
		b.Run(name, func(b *testing.B) {
			target := udpAddr(backend)
			if name != "direct" {
				coalesce = name == "proxied"
				defer func() { coalesce = true }()
				target = startUDPProxy(b, &UDPProxy{Service: "bench/quic:x", Picker: newCyclePicker(target), Timeout: time.Hour})
			}
			c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(target))
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			c.SetReadBuffer(4 << 20)
			buf := make([]byte, 2048)
			b.SetBytes(count * size)
			cpu := processCPU(b)
			for b.Loop() {
				if _, err := c.Write([]byte("more")); err != nil {
					b.Fatal(err)
				}
				for i := range count {
					c.SetReadDeadline(time.Now().Add(awaitTimeout))
					if n, err := c.Read(buf); err != nil || n != size {
						b.Fatalf("datagram %d of the run: got %d bytes, %v; want %d", i, n, err, size)
					}
				}
			}
			b.ReportMetric(float64((processCPU(b)-cpu).Nanoseconds())/float64(b.N*count), "cpu-ns/datagram")
		})
	}
}

// BenchmarkKeepAliveOptions is what a short connection spares now that its
// backend socket gets its keepalive options only once it has been open for
// KeepAlive (see keepAliveDue): the three calls, on a socket not yet connected
// ("at-dial", where they were made) - against what that costs instead, arming
// and cancelling the session's timer on its loop ("timer").
func BenchmarkKeepAliveOptions(b *testing.B) {
	b.Run("at-dial", func(b *testing.B) {
		fd := benchSocket(b)
		for b.Loop() {
			if err := setKeepAlive(fd, 15); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("timer", func(b *testing.B) {
		loops := newLoops(b, 1, nil)
		s := &tcpSession{l: loopOf(loops.Next())}
		s.timer = poll.NewTimer(s)
		// Other connections' timers, as on a busy loop.
		others := make([]tcpSession, 1000)
		err := s.l.PostWait(func() {
			for i := range others {
				o := &others[i]
				o.timer = poll.NewTimer(o)
				s.l.Schedule(&o.timer, time.Hour+time.Duration(i))
			}
			for b.Loop() {
				s.l.Schedule(&s.timer, DefaultKeepAlive)
				s.l.Cancel(&s.timer)
			}
			for i := range others {
				s.l.Cancel(&others[i].timer)
			}
		})
		if err != nil {
			b.Fatal(err)
		}
	})
}

// BenchmarkEmptyAccept is what listenHandle.Handle spares by never looking for
// more connections than are queued: an accept4 on a non-blocking listener
// whose queue is empty, against getppid, a system call that does nothing, and
// the getsockopt TCP_INFO that reads the queue's length.
// The kernel allocates the new socket's inode and file before it looks at the
// queue, and frees them again when it finds it empty.
func BenchmarkEmptyAccept(b *testing.B) {
	b.Run("accept4-empty", func(b *testing.B) {
		fd := benchListener(b)
		for b.Loop() {
			if _, _, err := unix.Accept4(fd, unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC); err != unix.EAGAIN {
				b.Fatalf("accept4 on an empty queue: got %v, want EAGAIN", err)
			}
		}
	})
	b.Run("getppid", func(b *testing.B) {
		for b.Loop() {
			unix.Getppid()
		}
	})
	// What listenHandle.Handle asks instead, after an event that took its
	// whole budget: the length of the accept queue.
	b.Run("accept-queue", func(b *testing.B) {
		fd := benchListener(b)
		l := &loop{}
		for b.Loop() {
			if n := l.acceptQueue(fd); n != 0 {
				b.Fatalf("accept queue of an idle listener: got %d, want 0", n)
			}
		}
	})
}

// benchListener opens a non-blocking TCP socket listening on 127.0.0.1, with
// nothing queued, closed when b ends.
func benchListener(b *testing.B) int {
	b.Helper()
	fd := benchSocket(b)
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		b.Fatal(err)
	}
	if err := unix.Listen(fd, 16); err != nil {
		b.Fatal(err)
	}
	return fd
}

// benchSocket opens a non-blocking TCP socket, closed when b ends.
func benchSocket(b *testing.B) int {
	b.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { unix.Close(fd) })
	return fd
}
