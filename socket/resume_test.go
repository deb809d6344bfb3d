package socket

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/record"
	"github.com/uproxy/uproxy/socket/handover"
	"github.com/uproxy/uproxy/test/testbed"
)

// handoverBatch is the decision record's batch: 64 connections, one batch in
// flight.
const handoverBatch = 64

// handoverLink is a handover connection within the process: the old proxy's
// end sends, the new proxy's receives.
type handoverLink struct {
	sender, receiver *handover.Conn
}

// newHandoverLink connects the two ends over an abstract unix socket, as two
// processes would (the peer check needs root: the caller says testbed.Root).
func newHandoverLink(t testing.TB) handoverLink {
	t.Helper()
	name := fmt.Sprintf("@uproxy-socket-test-%d-%s", os.Getpid(), strings.ReplaceAll(t.Name(), "/", "-"))
	ln, err := handover.Listen(name)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan *handover.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			t.Error(err)
		}
		accepted <- c
	}()
	receiver, err := handover.Dial(name)
	if err != nil {
		t.Fatal(err)
	}
	sender := <-accepted
	if sender == nil {
		t.FailNow()
	}
	t.Cleanup(func() { sender.Close(); receiver.Close() })
	return handoverLink{sender: sender, receiver: receiver}
}

// handOver moves every established connection of from to to through link,
// as a successor takes them: up to batch at a time are detached, sent, resumed
// and acknowledged before the next, and the old proxy closes its copies of a
// batch's descriptors only once it is acknowledged. It returns how many moved,
// and how many of their directions held bytes in a pipe or in user space.
func handOver(t testing.TB, from, to *TCPProxy, link handoverLink, batch int) (moved, held int) {
	return handOverTimed(t, from, to, link, batch, nil)
}

// handOverTimed is handOver, appending to pauses how long each batch took,
// from the call to Detach to the acknowledgement: the longest a connection
// of the batch went unserved.
func handOverTimed(t testing.TB, from, to *TCPProxy, link handoverLink, batch int, pauses *[]time.Duration) (moved, held int) {
	t.Helper()
	for {
		began := time.Now()
		states, err := from.Detach(batch)
		if err != nil {
			t.Fatalf("Detach: %v", err)
		}
		if len(states) == 0 {
			return moved, held
		}
		for i := range states {
			for _, ds := range []*directionState{&states[i].up, &states[i].down} {
				if ds.pipeN > 0 || len(ds.pending) > 0 {
					held++
				}
			}
		}
		sends, err := SessionItems(states)
		if err != nil {
			t.Fatalf("SessionItems: %v", err)
		}
		for _, items := range sends {
			resumed := make(chan error, 1)
			go func() { resumed <- receiveAndResume(link.receiver, to) }()
			if err := link.sender.Send(items); err != nil {
				t.Fatalf("send a batch: %v", err)
			}
			if err := <-resumed; err != nil {
				t.Fatalf("receive and resume a batch: %v", err)
			}
			if ack, err := link.sender.Receive(); err != nil || len(ack) != 1 || string(ack[0].Meta) != "resumed" {
				t.Fatalf("the acknowledgement: got %v, %v, want one item %q", ack, err, "resumed")
			}
		}
		if pauses != nil {
			*pauses = append(*pauses, time.Since(began))
		}
		for i := range states {
			states[i].Close()
		}
		moved += len(states)
	}
}

// receiveAndResume is the successor's side of one batch.
func receiveAndResume(c *handover.Conn, to *TCPProxy) error {
	items, err := c.Receive()
	if err != nil {
		return err
	}
	states, err := SessionStates(items)
	if err != nil {
		return err
	}
	if err := to.Resume(states); err != nil {
		return err
	}
	return c.Send([]handover.Item{{FD: -1, Meta: []byte("resumed")}})
}

// streamWord is word i (bytes 8i to 8i+7) of stream k: every word of every
// stream differs, so a byte lost, duplicated or moved shows where it happened.
func streamWord(k int, i int64) uint64 {
	return uint64(k)<<48 ^ uint64(i)*0x9e3779b97f4a7c15
}

// fillStream writes the bytes of stream k from offset off (a multiple of 8)
// into b (whose length is a multiple of 8).
func fillStream(b []byte, k int, off int64) {
	for j := 0; j < len(b); j += 8 {
		binary.LittleEndian.PutUint64(b[j:], streamWord(k, (off+int64(j))/8))
	}
}

// streamChecker checks that what is read is stream k, in order.
type streamChecker struct {
	k       int
	off     int64
	scratch []byte
}

func (c *streamChecker) check(b []byte) error {
	start := c.off &^ 7
	need := (c.off - start + int64(len(b)) + 7) &^ 7
	if int64(cap(c.scratch)) < need {
		c.scratch = make([]byte, need)
	}
	want := c.scratch[:need]
	fillStream(want, c.k, start)
	want = want[c.off-start : c.off-start+int64(len(b))]
	if !bytes.Equal(b, want) {
		i := 0
		for b[i] == want[i] {
			i++
		}
		return fmt.Errorf("stream %d: byte %d differs (got %#x, want %#x)", c.k, c.off+int64(i), b[i], want[i])
	}
	c.off += int64(len(b))
	return nil
}

// readStream reads stream k from c until it has read to, checking every byte.
func readStream(c io.Reader, chk *streamChecker, to int64) error {
	buf := make([]byte, 64<<10)
	for chk.off < to {
		n, err := c.Read(buf[:min(int64(len(buf)), to-chk.off)])
		if n > 0 {
			if err := chk.check(buf[:n]); err != nil {
				return err
			}
		}
		if err != nil {
			return fmt.Errorf("stream %d: read after %d bytes of %d: %w", chk.k, chk.off, to, err)
		}
	}
	return nil
}

// writeStream writes bytes from to to of stream k.
func writeStream(c io.Writer, k int, from, to int64) error {
	buf := make([]byte, 64<<10)
	for off := from; off < to; off += int64(len(buf)) {
		b := buf[:min(int64(len(buf)), to-off)]
		fillStream(b, k, off)
		if _, err := c.Write(b); err != nil {
			return fmt.Errorf("stream %d: write at %d: %w", k, off, err)
		}
	}
	return nil
}

// stallDeadline is a connection whose every read and write has awaitTimeout
// from its call, rather than from the dial: it fails a stream that stops
// moving, however long the stream runs.
type stallDeadline struct{ *net.TCPConn }

func (c stallDeadline) Read(b []byte) (int, error) {
	c.SetReadDeadline(time.Now().Add(awaitTimeout))
	return c.TCPConn.Read(b)
}

func (c stallDeadline) Write(b []byte) (int, error) {
	c.SetWriteDeadline(time.Now().Add(awaitTimeout))
	return c.TCPConn.Write(b)
}

// handoverWorld is an echo backend and two proxies of the same Service port,
// each on loops of its own: the old one, which clients connect to, and the new
// one, which resumes what the old one detaches.
type handoverWorld struct {
	backend              *tcpServer
	old, new             *TCPProxy
	oldPicker, newPicker *cyclePicker
	oldRec, newRec       *recorder
	addr                 netip.AddrPort // the old proxy's
	link                 handoverLink
}

// clientSndBuf, when not 0, is the send buffer of the old proxy's client
// sockets (given to its listener, which they inherit), so that what the
// clients do not read waits in the relay.
func newHandoverWorld(t testing.TB, oldLoops, clientSndBuf int, handle func(*net.TCPConn)) *handoverWorld {
	t.Helper()
	w := &handoverWorld{backend: startTCPServer(t, "127.0.0.2", handle), oldRec: &recorder{}, newRec: &recorder{}}
	w.oldPicker, w.newPicker = newCyclePicker(w.backend.addr), newCyclePicker(w.backend.addr)
	w.old = &TCPProxy{Service: "ns/svc:tcp", Picker: w.oldPicker, Observer: w.oldRec, Loops: newLoops(t, oldLoops, nil)}
	w.new = &TCPProxy{Service: "ns/svc:tcp", Picker: w.newPicker, Observer: w.newRec, Loops: newLoops(t, 2, nil)}
	w.addr = startTCPProxyBuffered(t, w.old, clientSndBuf)
	startTCPProxy(t, w.new)
	w.link = newHandoverLink(t)
	return w
}

// startTCPProxyBuffered is startTCPProxy with the listener's SO_SNDBUF set to
// sndBuf (unless 0) before it listens.
func startTCPProxyBuffered(t testing.TB, p *TCPProxy, sndBuf int) netip.AddrPort {
	t.Helper()
	if sndBuf == 0 {
		return startTCPProxy(t, p)
	}
	ln, err := p.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	rc, err := ln.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var serr error
	rc.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUF, sndBuf) })
	if serr != nil {
		t.Fatal(serr)
	}
	return serveTCPProxy(t, p, ln)
}

// dialSmallWindow connects to addr with a receive buffer of rcvBuf, set
// before the connect (SO_RCVBUF), so that the window stays that small.
func dialSmallWindow(t testing.TB, addr netip.AddrPort, rcvBuf int) *net.TCPConn {
	t.Helper()
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		var err error
		if cerr := rc.Control(func(fd uintptr) { err = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, rcvBuf) }); cerr != nil {
			return cerr
		}
		return err
	}}
	c, err := d.Dial("tcp", addr.String())
	if err != nil {
		t.Fatalf("dial proxy %s: %v", addr, err)
	}
	t.Cleanup(func() { c.Close() })
	return c.(*net.TCPConn)
}

// checkBalanced fails unless every Pick or Acquire of both proxies' pickers
// was released: the balancers' active counts came back to zero.
func (w *handoverWorld) checkBalanced(t *testing.T) {
	t.Helper()
	if u := w.oldPicker.unreleased(); len(u) != 0 {
		t.Errorf("old picker: got active counts %v, want none", u)
	}
	if u := w.newPicker.unreleased(); len(u) != 0 {
		t.Errorf("new picker: got active counts %v, want none", u)
	}
}

// TestResumeMidTransfer: 200 connections, each half way through 4 MiB each
// way through an echo backend (so that bytes sit in every buffer: the
// client's, the relay's pipes, the backend's), are detached in batches of 64,
// carried through a handover connection and resumed by another proxy; every
// stream then arrives complete and in order, each connection's end is
// reported once, by the new proxy, with the bytes of its whole life, and both
// pickers' active counts come back to zero. A state that left out a pipe or
// the bytes of a short write, or wrote them after newer ones, fails the
// stream check at the byte concerned (when the relay held some at the
// detach: logged); byte counters not carried fail the records.
func TestResumeMidTransfer(t *testing.T) {
	testbed.Needs(t, testbed.Root)
	const conns, size, half = 200, 4 << 20, 2 << 20
	w := newHandoverWorld(t, 2, 64<<10, echo)

	gate := make(chan struct{})
	var midway sync.WaitGroup
	errs := make(chan error, 2*conns)
	var done sync.WaitGroup
	for k := range conns {
		// A small receive window, set before the handshake announces one,
		// keeps the echo that the client does not read yet in the relay
		// rather than in the client's socket.
		c := dialSmallWindow(t, w.addr, 32<<10)
		c.SetDeadline(time.Now().Add(2 * time.Minute))
		midway.Add(1)
		done.Add(2)
		go func() {
			defer done.Done()
			err := writeStream(c, k, 0, half)
			if err == nil {
				<-gate
				err = writeStream(c, k, half, size)
			}
			if err == nil {
				err = c.CloseWrite()
			}
			if err != nil {
				errs <- err
			}
		}()
		go func() {
			defer done.Done()
			chk := &streamChecker{k: k}
			// Read only an eighth before the handover: the rest of the
			// first half waits in the buffers on the way back.
			err := readStream(c, chk, size/8)
			midway.Done()
			if err == nil {
				err = readStream(c, chk, size)
			}
			if err == nil {
				if n, rerr := c.Read(make([]byte, 1)); n != 0 || rerr != io.EOF {
					err = fmt.Errorf("stream %d after its end: got %d bytes, %v, want EOF", k, n, rerr)
				}
			}
			if err != nil {
				errs <- err
			}
		}()
	}
	midway.Wait()
	handoverStart := time.Now()
	moved, held := handOver(t, w.old, w.new, w.link, handoverBatch)
	if moved != conns {
		t.Fatalf("handed over %d connections, want %d", moved, conns)
	}
	// How many held bytes in the relay when detached depends on the
	// kernel's buffers (loopback lets a socket take far more than its
	// SO_RCVBUF): TestResumePipeBytesFirst makes sure of the case.
	t.Logf("%d directions of the %d connections held bytes in a pipe or a buffer when detached", held, conns)
	if n := w.old.Active(); n != 0 {
		t.Errorf("old proxy after the handover: got %d active connections, want 0", n)
	}
	if n := w.new.Active(); n != conns {
		t.Errorf("new proxy after the handover: got %d active connections, want %d", n, conns)
	}
	close(gate)
	done.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}

	closed := w.newRec.awaitClosed(t, conns)
	for _, c := range closed {
		if c.Err != nil || c.BytesIn != size || c.BytesOut != size || c.Endpoint != w.backend.addr || !c.Start.Before(handoverStart) {
			t.Errorf("a resumed connection's record: got err %v, bytes in %d, out %d, endpoint %v, start %v; want nil, %d, %d, %v, before %v",
				c.Err, c.BytesIn, c.BytesOut, c.Endpoint, c.Start, size, size, w.backend.addr, handoverStart)
			break
		}
	}
	if opened, _, closed := w.newRec.counts(); opened != conns || closed != conns {
		t.Errorf("new proxy's observer: got %d opened, %d closed, want %d each", opened, closed, conns)
	}
	if _, _, closed := w.oldRec.counts(); closed != 0 {
		t.Errorf("old proxy's observer: got %d connections ended, want 0 (the new proxy reports them)", closed)
	}
	w.checkBalanced(t)
}

// TestResumeHalfClosed: a connection whose client has half-closed (its FIN
// passed on to the backend) is handed over while the backend still sends;
// after the handover the backend's bytes still arrive, then its EOF, and the
// record shows the client's bytes once. A state that lost the half-close
// would leave the up direction waiting to read the client again.
func TestResumeHalfClosed(t *testing.T) {
	testbed.Needs(t, testbed.Root)
	gotEOF := make(chan struct{})
	gate := make(chan struct{})
	request, reply := []byte("the whole request"), []byte("the reply, after the handover")
	w := newHandoverWorld(t, 1, 0, func(c *net.TCPConn) {
		if b, err := io.ReadAll(c); err != nil || !bytes.Equal(b, request) {
			t.Errorf("backend: got %q, %v, want %q and EOF", b, err, request)
		}
		close(gotEOF)
		<-gate
		c.Write(reply)
		c.CloseWrite()
	})
	c := dialProxy(t, w.addr)
	c.Write(request)
	c.CloseWrite()
	<-gotEOF

	states, err := w.old.Detach(handoverBatch)
	if err != nil || len(states) != 1 {
		t.Fatalf("Detach: got %d states, %v, want 1", len(states), err)
	}
	if st := &states[0]; !st.up.done || !st.backendFinSent || st.down.eof {
		t.Fatalf("the detached state: got up done %v, backend shut %v, down ended %v; want true, true, false",
			st.up.done, st.backendFinSent, st.down.eof)
	}
	moveStates(t, w, states)
	close(gate)
	if b, err := io.ReadAll(c); err != nil || !bytes.Equal(b, reply) {
		t.Fatalf("client after the handover: got %q, %v, want %q and EOF", b, err, reply)
	}
	c.Close()
	rec := w.newRec.awaitClosed(t, 1)[0]
	if rec.Err != nil || rec.BytesIn != int64(len(request)) || rec.BytesOut != int64(len(reply)) {
		t.Errorf("record: got err %v, bytes in %d, out %d; want nil, %d, %d", rec.Err, rec.BytesIn, rec.BytesOut, len(request), len(reply))
	}
	w.checkBalanced(t)
}

// moveStates sends states through w's link to the new proxy, and closes the
// old copies once resumed.
func moveStates(t *testing.T, w *handoverWorld, states []SessionState) {
	t.Helper()
	sends, err := SessionItems(states)
	if err != nil {
		t.Fatal(err)
	}
	for _, items := range sends {
		resumed := make(chan error, 1)
		go func() { resumed <- receiveAndResume(w.link.receiver, w.new) }()
		if err := w.link.sender.Send(items); err != nil {
			t.Fatal(err)
		}
		if err := <-resumed; err != nil {
			t.Fatal(err)
		}
		if _, err := w.link.sender.Receive(); err != nil {
			t.Fatal(err)
		}
	}
	for i := range states {
		states[i].Close()
	}
}

// awaitPipeBytes waits until a connection of p holds bytes in its down
// pipe: the backend sends, the client does not read.
func awaitPipeBytes(t *testing.T, p *TCPProxy) {
	t.Helper()
	testbed.Await(t, awaitTimeout, "bytes in a relay's pipe", func() bool {
		return holding(p, func(s *tcpSession) bool { return s.down.pipe != nil && s.down.pipe.n > 0 }) > 0
	})
}

// holding returns how many open connections of p hold satisfy held, looked
// at on their loops.
func holding(p *TCPProxy, held func(*tcpSession) bool) int {
	// The maps init makes are read on the loops below: init (a sync.Once)
	// orders their making before this goroutine's posts, which Serve's
	// goroutine alone did not.
	p.init()
	n := 0
	for _, pl := range p.Loops.Loops() {
		pl.PostWait(func() {
			p.mu.Lock()
			defer p.mu.Unlock()
			for s := range p.conns {
				if s.l.Loop == pl && s.state == open && held(s) {
					n++
				}
			}
		})
	}
	return n
}

// TestResumePipeBytesFirst: the backend sends 8 MiB that the client does not
// read, so the relay's pipe holds some when the connection is detached; that
// pipe travels with it, and after the handover the client reads the whole
// stream in order: the pipe's bytes first, then what waited in the backend's
// socket. Dropping the pipe, or flushing it after reading on, fails the
// stream check at the first byte concerned.
func TestResumePipeBytesFirst(t *testing.T) {
	testbed.Needs(t, testbed.Root)
	const size = 8 << 20
	w := newHandoverWorld(t, 1, 0, func(c *net.TCPConn) {
		if err := writeStream(c, 7, 0, size); err != nil {
			t.Errorf("backend: %v", err)
		}
		c.CloseWrite()
		io.Copy(io.Discard, c)
	})
	c := dialProxy(t, w.addr)
	awaitPipeBytes(t, w.old)
	states, err := w.old.Detach(handoverBatch)
	if err != nil || len(states) != 1 {
		t.Fatalf("Detach: got %d states, %v, want 1", len(states), err)
	}
	if st := &states[0]; st.down.pipeR < 0 || st.down.pipeN == 0 || st.NumFDs() != 3 {
		t.Fatalf("the detached state: got a down pipe %d with %d bytes, %d descriptors; want one with bytes, 3",
			st.down.pipeR, st.down.pipeN, st.NumFDs())
	}
	inFlight := states[0].InFlight()
	moveStates(t, w, states)
	if err := readStream(c, &streamChecker{k: 7}, size); err != nil {
		t.Fatalf("client after the handover (%d bytes were in the pipe): %v", inFlight, err)
	}
	c.CloseWrite()
	if n, err := c.Read(make([]byte, 1)); n != 0 || err != io.EOF {
		t.Fatalf("client after the stream: got %d bytes, %v, want EOF", n, err)
	}
	c.Close()
	if rec := w.newRec.awaitClosed(t, 1)[0]; rec.Err != nil || rec.BytesOut != size {
		t.Errorf("record: got err %v, bytes out %d; want nil, %d", rec.Err, rec.BytesOut, size)
	}
	w.checkBalanced(t)
}

// TestDetachBusyLoop: the old proxy runs on one loop, kept busy by the bulk
// transfers of the very connections it hands over (each client writes
// without pause until the handover is done, and reads the echo all along);
// every connection is handed over, every stream arrives whole and ends on
// the new proxy with its every byte counted: none is lost, or served by
// both.
func TestDetachBusyLoop(t *testing.T) {
	testbed.Needs(t, testbed.Root)
	const conns, chunk = 32, 64 << 10
	w := newHandoverWorld(t, 1, 0, echo)
	errs := make(chan error, 2*conns)
	written, read := make([]int64, conns), make([]int64, conns)
	stop := make(chan struct{})
	var done sync.WaitGroup
	started := make(chan struct{}, conns)
	for k := range conns {
		// The streams run for as long as the handover takes, which a loaded
		// machine (CI's race detector) stretches past any fixed deadline: a
		// stream fails when it stalls, not when it is slow.
		c := stallDeadline{dialProxy(t, w.addr)}
		done.Add(2)
		go func() {
			defer done.Done()
			var off int64
			var err error
			for err == nil {
				select {
				case <-stop:
					written[k] = off
					if err = c.CloseWrite(); err != nil {
						errs <- err
					}
					return
				default:
				}
				err = writeStream(c, k, off, off+chunk)
				off += chunk
			}
			errs <- err
		}()
		go func() {
			defer done.Done()
			chk := &streamChecker{k: k}
			err := readStream(c, chk, chunk)
			started <- struct{}{}
			if err == nil {
				err = readStream(c, chk, 1<<62)
			}
			// The end of the stream is checked below, against what was written.
			if !errors.Is(err, io.EOF) {
				errs <- err
			}
			read[k] = chk.off
			c.Close()
		}()
	}
	for range conns {
		<-started
	}
	began := time.Now()
	moved, _ := handOver(t, w.old, w.new, w.link, handoverBatch)
	t.Logf("handed over %d busy connections in %v", moved, time.Since(began))
	close(stop)
	done.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if moved != conns {
		t.Errorf("handed over %d connections, want %d", moved, conns)
	}
	for k := range conns {
		if read[k] != written[k] {
			t.Errorf("stream %d: read %d bytes back before its end, want the %d written", k, read[k], written[k])
		}
	}
	closed := w.newRec.awaitClosed(t, conns)
	var in, want int64
	for _, c := range closed {
		in += c.BytesIn
	}
	for _, n := range written {
		want += n
	}
	if in != want {
		t.Errorf("bytes from the clients in the new proxy's records: got %d, want %d (all written)", in, want)
	}
	if _, _, n := w.oldRec.counts(); n != 0 {
		t.Errorf("old proxy's observer: got %d connections ended, want 0", n)
	}
	w.checkBalanced(t)
}

// TestDetachSkipsDialing: a connection still dialing (its endpoint never
// answers) is not detached: it stays the old proxy's, which resets it at
// the end of its grace; the one beside it, open, is detached and relays on
// through the new proxy. A Detach that took sessions by their presence alone
// would hand over a connection without a backend socket.
func TestDetachSkipsDialing(t *testing.T) {
	testbed.Needs(t, testbed.Root)
	echoAddr := startTCPServer(t, "127.0.0.2", echo).addr
	blackhole := unansweredAddr(t, "127.0.0.3")
	oldPicker := newCyclePicker(blackhole, echoAddr)
	old := &TCPProxy{Service: "ns/svc:tcp", Picker: oldPicker, Loops: newLoops(t, 1, nil),
		DialTimeouts: []time.Duration{time.Minute}}
	newRec := &recorder{}
	newP := &TCPProxy{Service: "ns/svc:tcp", Picker: newCyclePicker(echoAddr), Observer: newRec, Loops: newLoops(t, 1, nil)}
	startTCPProxy(t, newP)
	ln, err := old.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().(*net.TCPAddr).AddrPort()
	go old.Serve(ln)

	dialing := dialProxy(t, addr)
	testbed.Await(t, awaitTimeout, "the first connection dialing", func() bool { return old.Active() == 1 })
	open := dialProxy(t, addr)
	if got, err := roundTrip(open, []byte("before")); err != nil || string(got) != "before" {
		t.Fatalf("round trip before: got %q, %v", got, err)
	}
	states, err := old.Detach(handoverBatch)
	if err != nil || len(states) != 1 || states[0].Endpoint() != echoAddr {
		t.Fatalf("Detach: got %d states, %v; want 1, to %v", len(states), err, echoAddr)
	}
	if n := old.Active(); n != 1 {
		t.Errorf("old proxy after Detach: got %d active connections, want 1 (the one dialing)", n)
	}
	moveStates(t, &handoverWorld{new: newP, link: newHandoverLink(t)}, states)
	if got, err := roundTrip(open, []byte("after")); err != nil || string(got) != "after" {
		t.Fatalf("round trip after: got %q, %v", got, err)
	}
	open.Close()
	newRec.awaitClosed(t, 1)

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var expired *ShutdownExpiredError
	if err := old.Shutdown(ctx); !errors.As(err, &expired) || expired.Reset != 1 {
		t.Errorf("old proxy's Shutdown: got %v, want the one dialing connection reset", err)
	}
	dialing.Close()
}

// TestSessionStateEncoding: a state survives its encoding, items and
// decoding whole; a truncated or altered encoding is refused and its
// descriptors closed, never half taken. (Not parallel: it checks that
// descriptors were closed by their numbers, which a test running beside it
// could take again.)
func TestSessionStateEncoding(t *testing.T) {
	st := SessionState{
		client: 100, backend: 101,
		up:             directionState{pending: []byte("held back"), pipeR: -1, pipeW: -1, eof: true, bytes: 12},
		down:           directionState{pipeR: 102, pipeW: 103, pipeN: 4096, splice: true, bytes: 1 << 40},
		clientAddr:     netip.MustParseAddrPort("[2001:db8::1]:40000"),
		endpoint:       netip.MustParseAddrPort("10.0.0.1:8080"),
		fromClient:     true,
		backendFinSent: true,
		backendNagle:   noDelayDue,
		start:          time.Unix(1700000000, 123456789),
		idleFor:        3 * time.Second,
		keepAliveIn:    time.Second,
		attempts: []record.Attempt{
			{Endpoint: netip.MustParseAddrPort("10.0.0.2:8080"), Start: time.Unix(1700000000, 0), Duration: time.Millisecond,
				Err: errors.New("dial tcp 10.0.0.2:8080: connect: connection refused")},
			{Endpoint: netip.MustParseAddrPort("10.0.0.3:8080"), Start: time.Unix(1700000000, 1), Err: record.ErrHedgeLost, Source: record.SourceClient},
			{Endpoint: netip.MustParseAddrPort("10.0.0.1:8080"), Start: time.Unix(1700000000, 5), Duration: 2 * time.Millisecond},
		},
	}
	sends, err := SessionItems([]SessionState{st})
	if err != nil || len(sends) != 1 || len(sends[0]) != 3 {
		t.Fatalf("SessionItems: got %v, %v; want one batch of 3 items", sends, err)
	}
	items := sends[0]
	if items[0].FD != 100 || items[1].FD != 101 || items[2].FD != 102 {
		t.Fatalf("descriptors: got %d %d %d, want 100 101 102", items[0].FD, items[1].FD, items[2].FD)
	}
	got, err := SessionStates(items)
	if err != nil || len(got) != 1 {
		t.Fatalf("SessionStates: got %d, %v", len(got), err)
	}
	want := st
	want.down.pipeW = -1 // the write end stays behind
	g := got[0]
	if g.attempts[1].Err != record.ErrHedgeLost {
		t.Errorf("a lost hedge's error: got %v, want record.ErrHedgeLost itself", g.attempts[1].Err)
	}
	// The others' errors come as their text.
	for i, a := range g.attempts {
		if fmt.Sprint(a.Err) != fmt.Sprint(want.attempts[i].Err) {
			t.Errorf("attempt %d's error: got %v, want %v", i, a.Err, want.attempts[i].Err)
		}
		g.attempts[i].Err = want.attempts[i].Err
	}
	if fmt.Sprintf("%+v", g) != fmt.Sprintf("%+v", want) {
		t.Errorf("decoded:\n got %+v\nwant %+v", g, want)
	}

	meta := items[0].Meta
	for name, bad := range map[string][]byte{
		"truncated":       meta[:len(meta)-1],
		"another version": append([]byte{2}, meta[1:]...),
		"trailing bytes":  append(append([]byte(nil), meta...), 0),
	} {
		fds := make([]int, 0, 4)
		for range 2 {
			var p [2]int
			if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
				t.Fatal(err)
			}
			fds = append(fds, p[:]...)
		}
		_, err := SessionStates([]handover.Item{{FD: fds[0], Meta: bad}, {FD: fds[1]}, {FD: fds[2]}})
		if err == nil {
			t.Errorf("%s: SessionStates got nil error", name)
		}
		for _, fd := range fds[:3] {
			if _, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err == nil {
				t.Errorf("%s: descriptor %d still open after the refusal", name, fd)
				unix.Close(fd)
			}
		}
		unix.Close(fds[3])
	}
}

// BenchmarkHandover: the handover of conns established, idle connections
// from one proxy to another in this process, in batches of 64 through a
// handover connection (detach, encode, send, receive, decode, resume,
// acknowledge), back and forth. ns/op is the whole handover; pause-ns/batch
// the mean of each batch's, from its Detach to its acknowledgement (what a
// connection of the batch waits), and max-pause-ns the longest. Needs root
// (the handover's peer check).
//
//	go test -run '^$' -bench '^BenchmarkHandover$' -benchtime 20x ./socket
func BenchmarkHandover(b *testing.B) {
	testbed.Needs(b, testbed.Root)
	for _, conns := range []int{10, 1000} {
		b.Run(fmt.Sprintf("conns=%d", conns), func(b *testing.B) {
			w := newHandoverWorld(b, 1, 0, echo)
			for range conns {
				c := dialProxy(b, w.addr)
				if _, err := roundTrip(c, []byte{1}); err != nil {
					b.Fatal(err)
				}
			}
			from, to := w.old, w.new
			var pauses []time.Duration
			for b.Loop() {
				if moved, _ := handOverTimed(b, from, to, w.link, handoverBatch, &pauses); moved != conns {
					b.Fatalf("handed over %d connections, want %d", moved, conns)
				}
				from, to = to, from
			}
			var sum, longest time.Duration
			for _, p := range pauses {
				sum += p
				longest = max(longest, p)
			}
			b.ReportMetric(float64(sum.Nanoseconds())/float64(len(pauses)), "pause-ns/batch")
			b.ReportMetric(float64(longest.Nanoseconds()), "max-pause-ns")
		})
	}
}

// TestResumeFailureResets: a state that cannot be resumed - here its pipe
// holds other than its state says - is reset, both sockets, and counted in
// a *ResumeError; nothing of it stays open, and the new proxy neither
// counts it nor reports it. (In this process alone: no handover, no root.)
// A Resume that skipped the check would relay a stream with bytes missing;
// one that closed rather than reset would end the client's stream as if
// complete.
func TestResumeFailureResets(t *testing.T) {
	backend := startTCPServer(t, "127.0.0.2", func(c *net.TCPConn) {
		writeStream(c, 3, 0, 8<<20)
		io.Copy(io.Discard, c)
	})
	old := &TCPProxy{Service: "ns/svc:tcp", Picker: newCyclePicker(backend.addr), Loops: newLoops(t, 1, nil)}
	addr := startTCPProxy(t, old)
	newPicker, newRec := newCyclePicker(backend.addr), &recorder{}
	newP := &TCPProxy{Service: "ns/svc:tcp", Picker: newPicker, Observer: newRec, Loops: newLoops(t, 1, nil)}
	startTCPProxy(t, newP)
	c := dialProxy(t, addr)
	awaitPipeBytes(t, old)
	states, err := old.Detach(handoverBatch)
	if err != nil || len(states) != 1 || states[0].down.pipeN == 0 {
		t.Fatalf("Detach: got %d states, %v, want 1 with bytes in its down pipe", len(states), err)
	}
	states[0].down.pipeN++
	var rerr *ResumeError
	if err := newP.Resume(states); !errors.As(err, &rerr) || rerr.Reset != 1 {
		t.Fatalf("Resume: got %v, want a *ResumeError with 1 reset", err)
	}
	if st := &states[0]; st.client != -1 || st.backend != -1 || st.down.pipeR != -1 || st.down.pipeW != -1 {
		t.Errorf("the state after the failure: got descriptors %d %d %d %d, want all -1 (closed)",
			st.client, st.backend, st.down.pipeR, st.down.pipeW)
	}
	if _, err := io.Copy(io.Discard, c); !isReset(err) {
		t.Errorf("client after the failed resume: got %v, want ECONNRESET", err)
	}
	if n := newP.Active(); n != 0 {
		t.Errorf("new proxy: got %d active connections, want 0", n)
	}
	if opened, _, closed := newRec.counts(); opened != 0 || closed != 0 {
		t.Errorf("new proxy's observer: got %d opened, %d closed, want none", opened, closed)
	}
	if u := newPicker.unreleased(); len(u) != 0 {
		t.Errorf("new picker: got active counts %v, want none", u)
	}
}
