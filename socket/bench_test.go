package socket

import (
	"io"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"
)

// Each benchmark runs the same traffic twice: straight to the backend ("direct") and
// through a proxy ("proxied"); the difference is what the proxy costs. Client,
// proxy and backend share the process, so the CPU figures (getrusage of the whole
// process) are totals: subtract direct from proxied for the proxy's share.

// processCPU returns the user plus system CPU time the process has used.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// benchTargets starts a backend serving handle on 127.0.0.2 and a proxy to it, and
// returns both addresses by name.
func benchTargets(b *testing.B, handle func(*net.TCPConn)) map[string]netip.AddrPort {
	backend := startTCPServer(b, "127.0.0.2", handle)
	p := &TCPProxy{Service: "bench/tcp:x", Picker: newCyclePicker(backend.addr)}
	return map[string]netip.AddrPort{"direct": backend.addr, "proxied": startTCPProxy(b, p)}
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
	for _, name := range []string{"direct", "proxied"} {
		b.Run(name, func(b *testing.B) {
			addr := benchTargets(b, sink)[name]
			c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(addr))
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			buf := make([]byte, chunk)
			b.SetBytes(chunk)
			b.ReportAllocs()
			cpu := processCPU(b)
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

func BenchmarkTCPConnect(b *testing.B) {
	for _, name := range []string{"direct", "proxied"} {
		b.Run(name, func(b *testing.B) {
			addr := net.TCPAddrFromAddrPort(benchTargets(b, replyOnce)[name])
			req := make([]byte, 64)
			resp := make([]byte, 65)
			b.ReportAllocs()
			cpu := processCPU(b)
			start := time.Now()
			for b.Loop() {
				c, err := net.DialTCP("tcp", nil, addr)
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
			elapsed := time.Since(start)
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "conns/s")
			b.ReportMetric(float64((processCPU(b)-cpu).Microseconds())/float64(b.N), "cpu-us/conn")
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
