package bench

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// backendEnv marks a child process as the backend servers. The benchmark starts
// its own executable (the uproxy binary, or a test binary) in the backend
// namespace with it set, so the backends' CPU is counted apart from the load
// generators' and the proxies'.
const backendEnv = "UPROXY_BENCH_BACKEND"

func init() {
	if os.Getenv(backendEnv) != "1" {
		return
	}
	if err := serveBackend(os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "bench backend:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// backendPorts are the ports the backend servers listen on, on every address
// of the backend namespace.
type backendPorts struct {
	Echo  uint16 `json:"echo"`  // TCP: writes back what it reads
	Echo2 uint16 `json:"echo2"` // TCP: the same, a second endpoint for two-endpoint Services
	Bulk  uint16 `json:"bulk"`  // TCP: writes until the client closes
	UDP   uint16 `json:"udp"`   // UDP: sends every datagram back
	TagA  uint16 `json:"tagA"`  // TCP: answers the first byte with 'a', then closes
	TagB  uint16 `json:"tagB"`  // TCP: the same with 'b'
	// Close answers a request of reqSize bytes with replySize bytes and
	// closes: the server's FIN comes first, as from an HTTP/1.1 server after a
	// "Connection: close" reply.
	Close uint16 `json:"close"`
	// Reply answers every request of reqSize bytes with replySize bytes and
	// closes only once the client has gone.
	Reply uint16 `json:"reply"`
}

// serveBackend listens, reports the ports as one JSON line on out, and serves
// until in reaches EOF: the parent's end of the pipe closes when the parent
// exits, however it exits.
func serveBackend(in io.Reader, out io.Writer) error {
	lc := net.ListenConfig{KeepAlive: -1}
	ctx := context.Background()
	listen := func(serve func(net.Conn)) (uint16, error) {
		ln, err := lc.Listen(ctx, "tcp4", ":0")
		if err != nil {
			return 0, err
		}
		go acceptLoop(ln, serve)
		return uint16(ln.Addr().(*net.TCPAddr).Port), nil
	}
	var ports backendPorts
	var err error
	if ports.Echo, err = listen(serveEcho); err != nil {
		return err
	}
	if ports.Echo2, err = listen(serveEcho); err != nil {
		return err
	}
	if ports.Bulk, err = listen(serveBulk); err != nil {
		return err
	}
	if ports.TagA, err = listen(serveTag('a')); err != nil {
		return err
	}
	if ports.TagB, err = listen(serveTag('b')); err != nil {
		return err
	}
	if ports.Close, err = listen(serveClose); err != nil {
		return err
	}
	if ports.Reply, err = listen(serveReply); err != nil {
		return err
	}
	pc, err := net.ListenUDP("udp4", &net.UDPAddr{})
	if err != nil {
		return err
	}
	ports.UDP = uint16(pc.LocalAddr().(*net.UDPAddr).Port)
	// Two readers keep up with several concurrent clients on two cores.
	for range 2 {
		go serveUDPEcho(pc)
	}
	if err := json.NewEncoder(out).Encode(ports); err != nil {
		return err
	}
	io.Copy(io.Discard, in)
	return nil
}

func acceptLoop(ln net.Listener, serve func(net.Conn)) {
	for {
		c, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				continue
			}
			// EMFILE and friends: back off instead of spinning.
			time.Sleep(10 * time.Millisecond)
			continue
		}
		go serve(c)
	}
}

// serveEcho writes back every read. A plain read/write loop, not io.Copy, which
// would splice through a pipe: two more syscalls per small message.
func serveEcho(c net.Conn) {
	defer c.Close()
	buf := make([]byte, 2048)
	for {
		n, err := c.Read(buf)
		if n > 0 {
			if _, werr := c.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// bulkChunk is the size of each write of the bulk server and read of the bulk
// client.
const bulkChunk = 256 << 10

func serveBulk(c net.Conn) {
	defer c.Close()
	buf := make([]byte, bulkChunk)
	for {
		if _, err := c.Write(buf); err != nil {
			return
		}
	}
}

// The HTTP-sized exchange of the short-connection workloads whose server
// closes first or whose client resets: a request about the size of a small
// HTTP/1.1 GET, a reply about the size of its headers and a short body.
const (
	reqSize   = 100
	replySize = 150
)

// serveClose reads one request, writes the reply and closes: its FIN follows
// the reply, before the client's.
func serveClose(c net.Conn) {
	defer c.Close()
	var buf [reqSize]byte
	if _, err := io.ReadFull(c, buf[:]); err != nil {
		return
	}
	var reply [replySize]byte
	c.Write(reply[:])
}

// serveReply answers each request with a reply until the client ends the
// connection (with a FIN or a reset); it never closes first.
func serveReply(c net.Conn) {
	defer c.Close()
	var buf [reqSize]byte
	var reply [replySize]byte
	for {
		if _, err := io.ReadFull(c, buf[:]); err != nil {
			return
		}
		if _, err := c.Write(reply[:]); err != nil {
			return
		}
	}
}

func serveTag(tag byte) func(net.Conn) {
	return func(c net.Conn) {
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		var b [1]byte
		if _, err := c.Read(b[:]); err != nil {
			return
		}
		c.Write([]byte{tag})
	}
}

func serveUDPEcho(pc *net.UDPConn) {
	buf := make([]byte, 64<<10)
	run := make([]byte, runCount*runSize)
	seg := segmentMessage(runSize)
	for {
		n, from, err := pc.ReadFromUDPAddrPort(buf)
		if err != nil {
			if ne, ok := err.(net.Error); ok && !ne.Timeout() {
				return
			}
			continue
		}
		if n == msgSize && buf[0] == runRequest {
			// Every datagram of the run starts with the request's sequence number.
			for i := range runCount {
				copy(run[i*runSize:], buf[8:16])
			}
			pc.WriteMsgUDPAddrPort(run, seg, from)
			continue
		}
		pc.WriteToUDPAddrPort(buf[:n], from)
	}
}

// The UDP run workload: a request whose first byte is runRequest (the
// request/response workload's start with a sequence number's high byte, 0) draws
// runCount datagrams of runSize bytes, sent with one segmented send.
const (
	runRequest = 'R'
	runCount   = 32
	runSize    = 1200
)

// segmentMessage is the control message of a send that the kernel cuts into
// datagrams of size bytes (UDP_SEGMENT).
func segmentMessage(size int) []byte {
	oob := make([]byte, unix.CmsgSpace(2))
	h := (*unix.Cmsghdr)(unsafe.Pointer(&oob[0]))
	h.Level, h.Type = unix.SOL_UDP, unix.UDP_SEGMENT
	h.SetLen(unix.CmsgLen(2))
	binary.NativeEndian.PutUint16(oob[unix.CmsgLen(0):], uint16(size))
	return oob
}

// startBackend runs the backend servers in the backend namespace and learns
// their ports.
func (w *world) startBackend(exe string) error {
	stdinR, stdinW, err := os.Pipe()
	if err != nil {
		return err
	}
	stdoutR, stdoutW, err := os.Pipe()
	if err != nil {
		return err
	}
	p, err := w.start("backend", backendRole, false, []string{backendEnv + "=1"}, stdinR, stdoutW, exe)
	stdinR.Close()
	stdoutW.Close()
	if err != nil {
		stdinW.Close()
		stdoutR.Close()
		return err
	}
	// Closing our end of stdin is how the backend learns to exit.
	w.t.Cleanup(func() { stdinW.Close() })
	w.backend = p
	lines := make(chan error, 1)
	go func() {
		line, err := bufio.NewReader(stdoutR).ReadBytes('\n')
		if err == nil {
			err = json.Unmarshal(line, &w.ports)
		}
		lines <- err
		stdoutR.Close()
	}()
	select {
	case err := <-lines:
		if err != nil {
			return fmt.Errorf("backend ports: %w: %s", err, p.logTail())
		}
	case <-time.After(10 * time.Second):
		return fmt.Errorf("backend did not report its ports within 10s: %s", p.logTail())
	}
	return nil
}

func (w *world) backendAddr(port uint16) netip.AddrPort {
	return netip.AddrPortFrom(w.ip.backend, port)
}
