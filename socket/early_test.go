package socket

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/test/testbed"
)

// segment is one TCP segment seen on lo.
type segment struct {
	src, dst netip.AddrPort
	flags    byte
	payload  int
}

const (
	tcpFIN = 0x01
	tcpSYN = 0x02
	tcpRST = 0x04
	tcpACK = 0x10
)

// captureLo records every IPv4 TCP segment that lo delivers until the test
// ends or stop is called, which returns them in order (those delivered before
// the call, read or still queued). It needs root (a packet
// socket), in the test's own network namespace.
func captureLo(t *testing.T) (stop func() []segment) {
	t.Helper()
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		t.Fatal(err)
	}
	proto := int(htons(unix.ETH_P_IP))
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, proto)
	if err != nil {
		t.Fatalf("packet socket: %v", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_IP), Ifindex: lo.Attrs().Index}); err != nil {
		unix.Close(fd)
		t.Fatalf("bind packet socket to lo: %v", err)
	}
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Usec: 50000})
	var (
		mu       sync.Mutex
		segs     []segment
		stopping bool
		done     = make(chan struct{})
	)
	go func() {
		defer close(done)
		buf := make([]byte, 65536)
		for {
			mu.Lock()
			quit := stopping
			mu.Unlock()
			// Once stopped, what is queued still counts: every segment of
			// interest was delivered before stop, but maybe not read yet.
			flags := 0
			if quit {
				flags = unix.MSG_DONTWAIT
			}
			n, from, err := unix.Recvfrom(fd, buf, flags)
			if err != nil {
				if quit {
					return
				}
				continue
			}
			// lo shows each packet going out and coming in: the second is kept.
			if ll, ok := from.(*unix.SockaddrLinklayer); !ok || ll.Pkttype == unix.PACKET_OUTGOING {
				continue
			}
			if s, ok := parseTCP(buf[:n]); ok {
				mu.Lock()
				segs = append(segs, s)
				mu.Unlock()
			}
		}
	}()
	var once sync.Once
	stop = func() []segment {
		once.Do(func() {
			mu.Lock()
			stopping = true
			mu.Unlock()
			<-done
			unix.Close(fd)
		})
		mu.Lock()
		defer mu.Unlock()
		return segs
	}
	t.Cleanup(func() { stop() })
	return stop
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// parseTCP reads an IPv4 packet carrying TCP.
func parseTCP(b []byte) (segment, bool) {
	if len(b) < 20 || b[0]>>4 != 4 || b[9] != unix.IPPROTO_TCP {
		return segment{}, false
	}
	ihl := int(b[0]&0xf) * 4
	total := int(binary.BigEndian.Uint16(b[2:4]))
	if len(b) < ihl+20 || total > len(b) {
		return segment{}, false
	}
	tcp := b[ihl:]
	doff := int(tcp[12]>>4) * 4
	src := netip.AddrPortFrom(netip.AddrFrom4([4]byte(b[12:16])), binary.BigEndian.Uint16(tcp[0:2]))
	dst := netip.AddrPortFrom(netip.AddrFrom4([4]byte(b[16:20])), binary.BigEndian.Uint16(tcp[2:4]))
	return segment{src: src, dst: dst, flags: tcp[13], payload: total - ihl - doff}, true
}

func (s segment) String() string {
	var f []string
	for _, n := range []struct {
		bit  byte
		name string
	}{{tcpSYN, "SYN"}, {tcpFIN, "FIN"}, {tcpRST, "RST"}, {tcpACK, "ACK"}} {
		if s.flags&n.bit != 0 {
			f = append(f, n.name)
		}
	}
	return s.src.String() + ">" + s.dst.String() + " " + strings.Join(f, ",") + " " + strconv.Itoa(s.payload)
}

// between returns the segments from src's port to dst's, in order.
func between(segs []segment, src, dst uint16) []segment {
	var out []segment
	for _, s := range segs {
		if s.src.Port() == src && s.dst.Port() == dst {
			out = append(out, s)
		}
	}
	return out
}

// A short exchange crosses the proxy in as few segments as the kernel allows:
// the request the client wrote before it was accepted goes to the backend with
// the last ACK of the handshake (no ACK alone before it), and a reply that came
// with the backend's FIN goes to the client with that FIN, in one segment. A
// client that writes nothing until the server speaks (a server-first protocol)
// has its dial's handshake completed at once, as before: the backend is not
// kept waiting for a request that will not come.
func TestShortExchangeSegments(t *testing.T) {
	if !testbed.InOwnNetns(t) {
		return
	}
	loUp(t)
	request, reply := bytes.Repeat([]byte("q"), 100), bytes.Repeat([]byte("r"), 150)

	t.Run("request first, server closes", func(t *testing.T) {
		backend := startTCPServer(t, "127.0.0.1", func(c *net.TCPConn) {
			if _, err := io.ReadFull(c, make([]byte, len(request))); err != nil {
				return
			}
			// The reply and the FIN in one segment, as a server that
			// closes after writing often sends them.
			raw, _ := c.SyscallConn()
			raw.Write(func(fd uintptr) bool {
				unix.Sendto(int(fd), reply, unix.MSG_MORE, nil)
				return true
			})
			c.CloseWrite()
			io.Copy(io.Discard, c)
		})
		rec := &recorder{}
		p := &TCPProxy{Service: "ns/segments:http", Picker: newCyclePicker(backend.addr), Observer: rec}
		proxy := startTCPProxy(t, p)
		stop := captureLo(t)
		// The request waits in the client's socket before the proxy accepts
		// it: the loop is held until it is there.
		loop := p.Loops.Loops()[0]
		hold := make(chan struct{})
		loop.Post(func() { <-hold })
		c := dialProxy(t, proxy)
		if _, err := c.Write(request); err != nil {
			t.Fatal(err)
		}
		awaitQueued(t, proxy, len(request))
		close(hold)
		got, err := io.ReadAll(c)
		if err != nil || !bytes.Equal(got, reply) {
			t.Fatalf("reply: got %d bytes, %v; want %d bytes, then EOF", len(got), err, len(reply))
		}
		c.Close()
		rec.awaitClosed(t, 1)
		segs := stop()
		dial := dialedFrom(t, segs, backend.addr.Port())
		toBackend := between(segs, dial, backend.addr.Port())
		if len(toBackend) < 2 || toBackend[0].flags&tcpSYN == 0 || toBackend[1].payload != len(request) {
			t.Errorf("proxy to backend: got %v; want the SYN, then the request with the handshake's last ACK", toBackend)
		}
		client := netip.MustParseAddrPort(c.LocalAddr().String()).Port()
		var replied []segment
		for _, s := range between(segs, proxy.Port(), client) {
			if s.payload > 0 || s.flags&tcpFIN != 0 {
				replied = append(replied, s)
			}
		}
		if len(replied) != 1 || replied[0].payload != len(reply) || replied[0].flags&tcpFIN == 0 {
			t.Errorf("proxy to client: got %v; want one segment with the whole reply and the FIN", replied)
		}
	})

	t.Run("server first", func(t *testing.T) {
		greeting := []byte("220 ready\r\n")
		backend := startTCPServer(t, "127.0.0.1", func(c *net.TCPConn) {
			c.Write(greeting)
			io.Copy(io.Discard, c)
		})
		rec := &recorder{}
		p := &TCPProxy{Service: "ns/segments:smtp", Picker: newCyclePicker(backend.addr), Observer: rec}
		proxy := startTCPProxy(t, p)
		stop := captureLo(t)
		c := dialProxy(t, proxy)
		got := make([]byte, len(greeting))
		if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, greeting) {
			t.Fatalf("greeting: got %q, %v", got, err)
		}
		c.Close()
		rec.awaitClosed(t, 1)
		segs := stop()
		dial := dialedFrom(t, segs, backend.addr.Port())
		toBackend := between(segs, dial, backend.addr.Port())
		if len(toBackend) < 2 || toBackend[1].flags != tcpACK || toBackend[1].payload != 0 {
			t.Errorf("proxy to backend: got %v; want the SYN, then the handshake's last ACK alone", toBackend)
		}
	})
}

// dialedFrom returns the port of the one connection made to port.
func dialedFrom(t *testing.T, segs []segment, port uint16) uint16 {
	t.Helper()
	for _, s := range segs {
		if s.dst.Port() == port && s.flags&tcpSYN != 0 {
			return s.src.Port()
		}
	}
	t.Fatalf("no SYN to port %d among %v", port, segs)
	return 0
}

// awaitQueued waits until a connection accepted by the listener on addr (not yet
// taken by accept) holds n bytes: the listener's queue is read from the kernel's
// socket table (ss).
func awaitQueued(t *testing.T, addr netip.AddrPort, n int) {
	t.Helper()
	testbed.Await(t, 5*time.Second, "the request in the accept queue", func() bool {
		return queuedTo(addr) >= n
	})
}

// queuedTo returns the bytes waiting in the connections to addr (an IPv4
// listener's), as /proc/net/tcp lists them: established, or closed by their
// client (CLOSE_WAIT).
func queuedTo(addr netip.AddrPort) int {
	table, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		return 0
	}
	a := addr.Addr().As4()
	local := fmt.Sprintf("%08X:%04X", binary.LittleEndian.Uint32(a[:]), addr.Port())
	total := 0
	for _, line := range strings.Split(string(table), "\n")[1:] {
		f := strings.Fields(line)
		// sl local_address rem_address st tx_queue:rx_queue ...
		if len(f) < 5 || f[1] != local || (f[3] != "01" && f[3] != "08") {
			continue
		}
		_, rx, _ := strings.Cut(f[4], ":")
		if n, err := strconv.ParseUint(rx, 16, 32); err == nil {
			total += int(n)
		}
	}
	return total
}

// What a client does before the proxy accepts it is read early and kept: a
// request and its FIN both reach the backend (the FIN after the request), a
// request larger than an early read arrives whole, and a client that reset
// its connection before a byte is recorded as reset, with no backend dialed
// for it. (One that wrote first has its bytes passed on, then its reset, as
// when it resets later.)
func TestTCPProxyClientBeforeAccept(t *testing.T) {
	t.Parallel()
	backend := startTCPServer(t, "127.0.0.1", func(c *net.TCPConn) {
		b, err := io.ReadAll(c)
		if err != nil {
			return
		}
		c.Write([]byte(strconv.Itoa(len(b)) + " " + string(b[:min(len(b), 8)])))
	})
	rec := &recorder{}
	p := &TCPProxy{Service: "ns/early:tcp", Picker: newCyclePicker(backend.addr), Observer: rec}
	proxy := startTCPProxy(t, p)
	loop := p.Loops.Loops()[0]
	// before holds the proxy's only loop while f acts on a new connection,
	// until its bytes (at least queued) wait in the proxy's accept queue.
	before := func(t *testing.T, f func(c *net.TCPConn), queued int) *net.TCPConn {
		hold := make(chan struct{})
		loop.Post(func() { <-hold })
		defer close(hold)
		c := dialProxy(t, proxy)
		f(c)
		if queued > 0 {
			awaitQueued(t, proxy, queued)
		}
		return c
	}
	closed := 0

	t.Run("request and FIN", func(t *testing.T) {
		c := before(t, func(c *net.TCPConn) {
			c.Write([]byte("question"))
			c.CloseWrite()
		}, len("question"))
		b, err := io.ReadAll(c)
		if err != nil || string(b) != "8 question" {
			t.Errorf("reply: got %q, %v; want %q then EOF", b, err, "8 question")
		}
		closed++
		if got := rec.awaitClosed(t, closed)[closed-1]; got.Err != nil || got.BytesIn != 8 {
			t.Errorf("record: got error %v, %d bytes in; want none, 8", got.Err, got.BytesIn)
		}
	})

	t.Run("more than an early read", func(t *testing.T) {
		big := bytes.Repeat([]byte("0123456789abcdef"), 3*earlyReadSize/16)
		c := before(t, func(c *net.TCPConn) {
			c.Write(big)
			c.CloseWrite()
		}, len(big))
		b, err := io.ReadAll(c)
		if want := strconv.Itoa(len(big)) + " 01234567"; err != nil || string(b) != want {
			t.Errorf("reply: got %q, %v; want %q then EOF", b, err, want)
		}
		closed++
		rec.awaitClosed(t, closed)
	})

	t.Run("reset", func(t *testing.T) {
		_, attempts, _ := rec.counts()
		before(t, func(c *net.TCPConn) { resetConn(c) }, 0)
		closed++
		got := rec.awaitClosed(t, closed)[closed-1]
		if !isReset(got.Err) || len(got.Attempts) != 0 {
			t.Errorf("record: got error %v, %d attempts; want the client's reset, no attempt", got.Err, len(got.Attempts))
		}
		if _, now, _ := rec.counts(); now != attempts {
			t.Errorf("attempts: %d more after a client reset before its accept; want none", now-attempts)
		}
	})
}

// A listener whose clients never write first stops reading early after
// earlyGiveUp connections in a row, looks again every earlyRetry, and reads
// early on every connection again once one had something.
func TestEarlyReadsGiveUp(t *testing.T) {
	t.Parallel()
	var e earlyReads
	for i := range earlyGiveUp {
		if !e.due() {
			t.Fatalf("connection %d: not read early; want read (fewer than %d misses)", i, earlyGiveUp)
		}
		e.found(false)
	}
	reads := 0
	for range 3 * earlyRetry {
		if e.due() {
			reads++
			e.found(false)
		}
	}
	if reads != 3 {
		t.Errorf("after %d misses, %d connections: %d read early; want 3 (one in %d)", earlyGiveUp, 3*earlyRetry, reads, earlyRetry)
	}
	for !e.due() {
	}
	e.found(true)
	for i := range 2 * earlyRetry {
		if !e.due() {
			t.Fatalf("connection %d after a find: not read early; want read", i)
		}
	}
}
