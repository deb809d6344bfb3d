package socket

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"
)

// Retry strategies under faults. These report what a client pays, not CPU:
//
//	go test -run '^$' -bench 'BenchmarkConnectOneBlackholed|BenchmarkDialsUnderFailure' -benchtime 600x ./socket/
//
// The blackholed endpoint is a listener whose accept queue is full: the kernel
// drops the SYNs sent to it, as a dead node or a DROP rule would, and a dial
// ends only by its timeout.

// greet writes one byte to each connection, so a client knows it reached a
// backend, then waits for the client to close.
func greet(c *net.TCPConn) {
	c.Write([]byte{'!'})
	io.Copy(io.Discard, c)
}

// rotatingPicker offers each new connection the next endpoint in turn, and its
// retries the endpoints after that one: exactly one connection in three starts
// on any given endpoint. (A round robin whose retries advance the rotation
// offers an endpoint first to every other connection while it fails.)
type rotatingPicker struct {
	*cyclePicker
	n int
}

func (p *rotatingPicker) Pick(client netip.Addr, tried []netip.AddrPort) (netip.AddrPort, error) {
	if len(tried) == 0 {
		p.mu.Lock()
		p.next = p.n % len(p.eps)
		p.n++
		p.mu.Unlock()
	}
	return p.cyclePicker.Pick(client, tried)
}

// BenchmarkConnectOneBlackholed: three endpoints, one of them blackholed, the
// default dial timeouts (250ms, 500ms, 1s, 2s). One connection in three is
// offered the blackholed endpoint first. Sequential retries make
// them wait for its dial timeout; hedged dials (--dial-hedge 30ms) only for the
// hedge's delay. Reported: the latency from connect to the backend's first byte,
// p50, p90 and p99 (p90 and p99 fall among the connections offered the
// blackholed endpoint first), and dials per connection.
func BenchmarkConnectOneBlackholed(b *testing.B) {
	for _, bc := range []struct {
		name  string
		hedge time.Duration
	}{
		{"sequential", 0},
		{"hedged-30ms", 30 * time.Millisecond},
	} {
		b.Run(bc.name, func(b *testing.B) {
			eps := []netip.AddrPort{
				startTCPServer(b, "127.0.0.2", greet).addr,
				startTCPServer(b, "127.0.0.3", greet).addr,
				unansweredAddr(b, "127.0.0.4"),
			}
			rec := &recorder{}
			p := &TCPProxy{Service: "bench/blackholed:" + bc.name, Picker: &rotatingPicker{cyclePicker: newCyclePicker(eps...)}, Observer: rec, DialHedge: bc.hedge}
			addr := startTCPProxy(b, p)
			lat := make([]time.Duration, 0, b.N)
			buf := make([]byte, 1)
			b.ResetTimer()
			for i := range b.N {
				start := time.Now()
				c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(addr))
				if err != nil {
					b.Fatalf("connection %d: %v", i, err)
				}
				c.SetDeadline(time.Now().Add(awaitTimeout))
				if _, err := io.ReadFull(c, buf); err != nil {
					b.Fatalf("connection %d: read: %v", i, err)
				}
				lat = append(lat, time.Since(start))
				c.Close()
			}
			b.StopTimer()
			closed := rec.awaitClosed(b, b.N)
			dials := 0
			for _, c := range closed {
				dials += len(c.Attempts)
			}
			reportLatency(b, lat)
			b.ReportMetric(float64(dials)/float64(b.N), "dials/conn")
		})
	}
}

// reportLatency reports the p50, p90 and p99 of lat in milliseconds.
func reportLatency(b *testing.B, lat []time.Duration) {
	slices.Sort(lat)
	q := func(f float64) float64 {
		return float64(lat[min(len(lat)-1, int(f*float64(len(lat))))]) / float64(time.Millisecond)
	}
	b.ReportMetric(q(0.50), "p50-ms")
	b.ReportMetric(q(0.90), "p90-ms")
	b.ReportMetric(q(0.99), "p99-ms")
	b.ReportMetric(0, "ns/op") // wall time per connection says nothing here
}

// BenchmarkDialsUnderFailure: every endpoint refuses (100% failure), four dial
// attempts per connection. Without a budget every connection makes all four;
// with one, the retries settle at the budget's share of the connections.
// Reported: dials per connection, and the share of connections the budget
// refused a retry.
func BenchmarkDialsUnderFailure(b *testing.B) {
	for _, budget := range []float64{0, 10, 20} {
		name := "no-budget"
		if budget > 0 {
			name = fmt.Sprintf("budget-%v%%", budget)
		}
		b.Run(name, func(b *testing.B) {
			eps := []netip.AddrPort{refusedAddr(b, "127.0.0.2"), refusedAddr(b, "127.0.0.3"), refusedAddr(b, "127.0.0.4")}
			rec := &recorder{}
			p := &TCPProxy{Service: "bench/refused:" + name, Picker: newCyclePicker(eps...), Observer: rec, RetryBudget: budget,
				DialTimeouts: slices.Repeat([]time.Duration{time.Second}, 4)}
			addr := startTCPProxy(b, p)
			b.ResetTimer()
			for i := range b.N {
				if err := connectAndRead(addr); !isReset(err) {
					b.Fatalf("connection %d: got %v, want ECONNRESET", i, err)
				}
			}
			b.StopTimer()
			closed := rec.awaitClosed(b, b.N)
			dials, refused := 0, 0
			for _, c := range closed {
				dials += len(c.Attempts)
				if c.RetryRefused {
					refused++
				}
			}
			b.ReportMetric(float64(dials)/float64(b.N), "dials/conn")
			b.ReportMetric(100*float64(refused)/float64(b.N), "%refused")
		})
	}
}
