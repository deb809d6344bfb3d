package socket

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// run is a test's run of datagrams: n of size bytes, then one of last bytes, each
// starting with its index so that a lost, merged or reordered one shows.
func run(n, size, last int) [][]byte {
	var out [][]byte
	for i := range n + 1 {
		d := make([]byte, size)
		if i == n {
			d = d[:last]
		}
		for j := range d {
			d[j] = byte(i + j)
		}
		binary.BigEndian.PutUint16(d, uint16(i))
		out = append(out, d)
	}
	return out
}

// sendSegmented sends datagrams (all of the first one's size but the last) with
// one segmented send, as a QUIC stack does, on c to to (zero for a connected c).
func sendSegmented(t testing.TB, c *net.UDPConn, to netip.AddrPort, datagrams [][]byte) {
	t.Helper()
	b := bytes.Join(datagrams, nil)
	oob := appendSegment(nil, len(datagrams[0]))
	var err error
	if to.IsValid() {
		_, _, err = c.WriteMsgUDPAddrPort(b, oob, to)
	} else {
		_, _, err = c.WriteMsgUDP(b, oob, nil)
	}
	if err != nil {
		t.Fatalf("segmented send of %d datagrams: %v", len(datagrams), err)
	}
}

// receiveRun reads want's count of datagrams from c, reports the first that
// differs from want, and returns where they came from.
func receiveRun(c *net.UDPConn, want [][]byte) (netip.AddrPort, error) {
	buf := make([]byte, maxDatagram)
	var from netip.AddrPort
	for i, w := range want {
		c.SetReadDeadline(time.Now().Add(awaitTimeout))
		n, src, err := c.ReadFromUDPAddrPort(buf)
		if err != nil {
			return from, fmt.Errorf("datagram %d of %d: %w", i, len(want), err)
		}
		from = src
		if !bytes.Equal(buf[:n], w) {
			got := -1
			if n >= 2 {
				got = int(binary.BigEndian.Uint16(buf))
			}
			return from, fmt.Errorf("datagram %d of %d: got %d bytes starting with index %d, want %d bytes", i, len(want), n, got, len(w))
		}
	}
	return from, nil
}

// The kernel hands a GRO-enabled socket a segmented run as one read, and the
// batch reader reports the size of its datagrams; a single datagram carries none.
func TestBatchReaderReportsCoalescedRuns(t *testing.T) {
	t.Parallel()
	rx := listenUDP(t, "127.0.0.1")
	fd, err := takeFD(rx)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	enableGRO(fd)
	if v, err := unix.GetsockoptInt(fd, unix.SOL_UDP, unix.UDP_GRO); err != nil || v != 1 {
		t.Fatalf("UDP_GRO after enableGRO: got %d, %v; want 1", v, err)
	}
	var addr netip.AddrPort
	if sa, err := unix.Getsockname(fd); err == nil {
		addr = netip.AddrPortFrom(netip.AddrFrom4(sa.(*unix.SockaddrInet4).Addr), uint16(sa.(*unix.SockaddrInet4).Port))
	} else {
		t.Fatal(err)
	}
	tx := listenUDP(t, "127.0.0.1")
	datagrams := run(20, 1200, 300)
	for _, r := range []*batchReader{newBatchReader(true), newBatchReader(false)} {
		sendSegmented(t, tx, addr, datagrams)
		if _, err := tx.WriteToUDPAddrPort([]byte("alone"), addr); err != nil {
			t.Fatal(err)
		}
		var reads []int
		var sizes []int
		deadline := time.Now().Add(awaitTimeout)
		for len(reads) < 2 && time.Now().Before(deadline) {
			r.begin()
			for r.read(fd) {
				if r.errno != nil {
					t.Fatal(r.errno)
				}
				for i := range r.n {
					reads = append(reads, len(r.datagram(i)))
					if r.withAddrs {
						_, _, size := r.source(i)
						sizes = append(sizes, size)
					} else {
						sizes = append(sizes, r.segmentSize(i))
					}
				}
			}
		}
		total := 20*1200 + 300
		if len(reads) != 2 || reads[0] != total || sizes[0] != 1200 || reads[1] != len("alone") || sizes[1] != 0 {
			t.Errorf("withAddrs %v: got reads of %v bytes with segment sizes %v; want [%d 5] and [1200 0]", r.withAddrs, reads, sizes, total)
		}
	}
}

// Runs a client or an endpoint sends segmented (as QUIC stacks do) reach the
// other side through the proxy as the same datagrams, each whole and in order,
// whatever the Service socket's bind; the proxy's sockets ask for coalesced runs.
func TestUDPProxyKeepsDatagramsOfCoalescedRuns(t *testing.T) {
	t.Parallel()
	tests := append([]udpBind{{"IPv4 address", "udp4", "127.0.0.1", "127.0.0.1"}}, wildcardBinds...)
	up := run(30, 1000, 17)   // client to endpoint
	down := run(100, 600, 99) // endpoint to client: more than one segmented send may carry
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// The endpoint echoes a first datagram, then checks the client's run
			// and answers with its own.
			backend := listenUDP(t, "127.0.0.2")
			checked := make(chan error, 1)
			var wg sync.WaitGroup
			wg.Go(func() {
				buf := make([]byte, 64)
				n, from, err := backend.ReadFromUDPAddrPort(buf)
				if err != nil {
					return
				}
				backend.WriteToUDPAddrPort(buf[:n], from)
				from, err = receiveRun(backend, up)
				checked <- err
				if err == nil {
					sendSegmented(t, backend, from, down)
				}
			})
			t.Cleanup(func() { backend.Close(); wg.Wait() })

			p := &UDPProxy{Service: "ns/quic:udp", Picker: newCyclePicker(udpAddr(backend)), Timeout: time.Hour}
			client, _ := dialUDPProxyAt(t, p, tt.network, tt.bind, tt.dst)

			// Once a datagram has made the round trip, the proxy is serving.
			if _, err := client.Write([]byte("ping")); err != nil {
				t.Fatal(err)
			}
			if _, err := receiveRun(client, [][]byte{[]byte("ping")}); err != nil {
				t.Fatalf("first round trip: %v", err)
			}
			sendSegmented(t, client, netip.AddrPort{}, up)
			if err := <-checked; err != nil {
				t.Fatalf("endpoint received the client's run: %v", err)
			}
			if _, err := receiveRun(client, down); err != nil {
				t.Fatalf("client received the endpoint's run: %v", err)
			}
			// The client's entry has a socket that asks for coalesced runs, and
			// neither direction had to fall back to one send per datagram.
			p.init() // for the race detector: Serve made p.l under the same Once
			err := p.l.PostWait(func() {
				for _, c := range p.clients {
					if v, err := unix.GetsockoptInt(c.fd, unix.SOL_UDP, unix.UDP_GRO); err != nil || v != 1 {
						t.Errorf("endpoint socket's UDP_GRO: got %d, %v; want 1", v, err)
					}
					if c.noSegmentsUp || c.noSegmentsDown {
						t.Errorf("segmented sends refused: up %v, down %v", c.noSegmentsUp, c.noSegmentsDown)
					}
				}
			})
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}

// When the kernel refuses to cut a run (a device that cannot checksum the
// pieces), sendRun sends its datagrams one by one and remembers to.
func TestSendRunFallsBackToOneSendPerDatagram(t *testing.T) {
	t.Parallel()
	rx := listenUDP(t, "127.0.0.1")
	tx := listenUDP(t, "127.0.0.1")
	fd, err := takeFD(tx)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	// UDP_NO_CHECK6_TX-like refusals are not available for IPv4 on loopback, so
	// the socket turns off checksums, which segmentation refuses (EINVAL).
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_NO_CHECK, 1); err != nil {
		t.Fatal(err)
	}
	datagrams := run(5, 500, 20)
	to := &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}, Port: int(udpAddr(rx).Port())}
	var scratch [controlSpace]byte
	noSegments := false
	if err := sendRun(fd, bytes.Join(datagrams, nil), 500, to, nil, scratch[:], &noSegments); err != nil {
		t.Fatalf("sendRun: %v", err)
	}
	if !noSegments {
		t.Errorf("noSegments after a refused segmented send: got false, want true")
	}
	if _, err := receiveRun(rx, datagrams); err != nil {
		t.Fatal(err)
	}
}

// Each datagram's control-message room holds the larger pktinfo and a segment size.
func TestControlSpaceHoldsPktinfoAndSegmentSize(t *testing.T) {
	t.Parallel()
	for _, size := range []int{unix.SizeofInet4Pktinfo, unix.SizeofInet6Pktinfo} {
		if need := unix.CmsgSpace(size) + segmentSpace; need > controlSpace {
			t.Errorf("a %d-byte pktinfo and a segment size need %d bytes, controlSpace is %d", size, need, controlSpace)
		}
	}
}
