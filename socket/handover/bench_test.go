package handover_test

// The benchmarks of the handover designs for established connections. A
// connection is what the userspace mode's relay holds for one: the client's
// socket, the endpoint's socket and two splice pipes (a pipe is two
// descriptors, so six descriptors). Three processes take part: this one is the
// world (clients and endpoints, and the load), a child "old" relays every
// connection through its pipes on an epoll set until it hands them to a
// child "new", which registers them in its own epoll set and relays on.

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/socket/handover"
	"github.com/uproxy/uproxy/test/testbed"
)

const (
	nextEnv   = "UPROXY_HANDOVER_NEXT"   // the old relay's listener, for the new one
	designEnv = "UPROXY_HANDOVER_DESIGN" // S, or B:k
	pipesEnv  = "UPROXY_HANDOVER_PIPES"  // "0": connections without pipes
)

// monotonic is CLOCK_MONOTONIC in nanoseconds: one clock for every process of
// the machine, so a pause begun in one process ends in another.
func monotonic() int64 {
	var ts unix.Timespec
	unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return ts.Nano()
}

// relayConn is one relayed connection: a and b the sockets, up (a to b) and
// down (b to a) the pipes, each [read end, write end].
type relayConn struct {
	id       uint32
	a, b     int
	up, down [2]int
}

func (c *relayConn) fds() []int {
	if c.up[0] < 0 {
		return []int{c.a, c.b}
	}
	return []int{c.a, c.b, c.up[0], c.up[1], c.down[0], c.down[1]}
}

// relay moves bytes of its connections through their pipes: one goroutine
// waiting in epoll_wait, level-triggered. mu guards byFD against the
// goroutine that hands connections over or takes them.
type relay struct {
	ep   int
	mu   sync.Mutex
	byFD []*relayConn
}

func newRelay() (*relay, error) {
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, err
	}
	r := &relay{ep: ep, byFD: make([]*relayConn, 1<<16)}
	go r.serve()
	return r, nil
}

// add registers c; the caller holds mu.
func (r *relay) add(c *relayConn) error {
	for _, fd := range []int{c.a, c.b} {
		for fd >= len(r.byFD) {
			r.byFD = append(r.byFD, make([]*relayConn, len(r.byFD))...)
		}
		r.byFD[fd] = c
		if err := unix.EpollCtl(r.ep, unix.EPOLL_CTL_ADD, fd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(fd)}); err != nil {
			return fmt.Errorf("epoll_ctl add %d: %w", fd, err)
		}
	}
	// Bytes left in a pipe go on at once.
	r.move(c, c.a)
	r.move(c, c.b)
	return nil
}

// remove quiesces c: no event of its sockets reaches this relay after it
// returns. The caller holds mu.
func (r *relay) remove(c *relayConn) {
	for _, fd := range []int{c.a, c.b} {
		unix.EpollCtl(r.ep, unix.EPOLL_CTL_DEL, fd, nil)
		r.byFD[fd] = nil
	}
}

func (r *relay) serve() {
	events := make([]unix.EpollEvent, 256)
	for {
		n, err := unix.EpollWait(r.ep, events, -1)
		if err != nil {
			if errors.Is(err, unix.EINTR) {
				continue
			}
			return
		}
		r.mu.Lock()
		for _, ev := range events[:n] {
			fd := int(ev.Fd)
			if c := r.byFD[fd]; c != nil {
				r.move(c, fd)
			}
		}
		r.mu.Unlock()
	}
}

var scratch = make([]byte, 64<<10) // for connections without pipes; one relay goroutine uses it

// move relays what waits on src, one of c's sockets.
func (r *relay) move(c *relayConn, src int) {
	dst, p := c.b, c.up
	if src == c.b {
		dst, p = c.a, c.down
	}
	if p[0] < 0 {
		n, err := unix.Read(src, scratch)
		if err == nil && n > 0 {
			unix.Write(dst, scratch[:n])
		}
		if n == 0 && err == nil {
			r.remove(c) // ended
		}
		return
	}
	n, err := unix.Splice(src, nil, p[1], nil, 64<<10, unix.SPLICE_F_NONBLOCK|unix.SPLICE_F_MOVE)
	if n == 0 && err == nil {
		r.remove(c)
		return
	}
	unix.Splice(p[0], nil, dst, nil, 64<<10, unix.SPLICE_F_NONBLOCK|unix.SPLICE_F_MOVE)
}

// The metadata of a connection, on its first descriptor's item: id, when it
// was quiesced (monotonic), and whether it is the last of a batch the sender
// waits to see acknowledged.
const connMetaSize = 13

func connMeta(id uint32, quiesced int64, last bool) []byte {
	m := make([]byte, connMetaSize)
	binary.BigEndian.PutUint32(m, id)
	binary.BigEndian.PutUint64(m[4:], uint64(quiesced))
	if last {
		m[12] = 1
	}
	return m
}

var endMark = []byte("end")

// connsPerMessage is how many connections fill one SCM_RIGHTS message.
func connsPerMessage(fdsPer int) int { return handover.MaxFDs / fdsPer }

// sendConns sends conns in as many messages as their descriptors need, then
// closes this process's copies. The last connection is marked when ack is
// set.
func sendConns(c *handover.Conn, conns []*relayConn, quiesced int64, ack bool) error {
	if len(conns) == 0 {
		return nil
	}
	per := connsPerMessage(len(conns[0].fds()))
	items := make([]handover.Item, 0, handover.MaxFDs)
	for start := 0; start < len(conns); start += per {
		items = items[:0]
		chunk := conns[start:min(start+per, len(conns))]
		for i, rc := range chunk {
			last := ack && start+i == len(conns)-1
			for j, fd := range rc.fds() {
				var meta []byte
				if j == 0 {
					meta = connMeta(rc.id, quiesced, last)
				}
				items = append(items, handover.Item{FD: fd, Meta: meta})
			}
		}
		if err := c.Send(items); err != nil {
			return err
		}
		for _, rc := range chunk {
			for _, fd := range rc.fds() {
				unix.Close(fd)
			}
		}
	}
	return nil
}

// takeResult is what the receiving side reports of a handover.
type takeResult struct {
	Conns         int
	FirstQuiesced int64 // monotonic
	LastResumed   int64
	MaxPauseNs    int64
	P50PauseNs    int64
	P99PauseNs    int64
}

// takeConns receives connections into r until the end mark, acknowledging
// every batch whose last connection is marked.
func takeConns(c *handover.Conn, r *relay, fdsPer int) (takeResult, error) {
	var res takeResult
	var pauses []int64
	for {
		items, err := c.Receive()
		if err != nil {
			return res, err
		}
		if len(items) == 1 && items[0].FD < 0 && string(items[0].Meta) == string(endMark) {
			break
		}
		if len(items)%fdsPer != 0 {
			return res, fmt.Errorf("a message of %d descriptors, not connections of %d", len(items), fdsPer)
		}
		ackDue := false
		r.mu.Lock()
		for i := 0; i < len(items); i += fdsPer {
			m := items[i].Meta
			rc := &relayConn{id: binary.BigEndian.Uint32(m), a: items[i].FD, b: items[i+1].FD, up: [2]int{-1, -1}, down: [2]int{-1, -1}}
			if fdsPer == 6 {
				rc.up = [2]int{items[i+2].FD, items[i+3].FD}
				rc.down = [2]int{items[i+4].FD, items[i+5].FD}
			}
			if err := r.add(rc); err != nil {
				r.mu.Unlock()
				return res, err
			}
			resumed := monotonic()
			if q := int64(binary.BigEndian.Uint64(m[4:])); q > 0 {
				if res.FirstQuiesced == 0 || q < res.FirstQuiesced {
					res.FirstQuiesced = q
				}
				pauses = append(pauses, resumed-q)
				res.LastResumed = resumed
			}
			ackDue = ackDue || m[12] == 1
			res.Conns++
		}
		r.mu.Unlock()
		if ackDue {
			if err := c.Send([]handover.Item{{FD: -1, Meta: []byte("ack")}}); err != nil {
				return res, err
			}
		}
	}
	if len(pauses) > 0 {
		slices.Sort(pauses)
		res.MaxPauseNs = pauses[len(pauses)-1]
		res.P50PauseNs = pauses[len(pauses)/2]
		res.P99PauseNs = pauses[len(pauses)*99/100]
	}
	return res, nil
}

// benchRole is the old or the new relay of BenchmarkHandover, or its echoing
// endpoint.
func benchRole(role, addr string) error {
	if role == "bench-echo" {
		return echo()
	}
	fdsPer := 6
	if os.Getenv(pipesEnv) == "0" {
		fdsPer = 2
	}
	r, err := newRelay()
	if err != nil {
		return err
	}
	stdin := bufio.NewReader(os.Stdin)
	out := json.NewEncoder(os.Stdout)
	c, err := handover.Dial(addr)
	if err != nil {
		return err
	}
	if role == "bench-new" {
		res, err := takeConns(c, r, fdsPer)
		if err != nil {
			return err
		}
		out.Encode(res)
		io.Copy(io.Discard, stdin) // relay on until the world is done
		return nil
	}

	// The old relay: take the world's connections, then hand them over.
	if _, err := takeConns(c, r, fdsPer); err != nil {
		return err
	}
	c.Close()
	ln, err := handover.Listen(os.Getenv(nextEnv))
	if err != nil {
		return err
	}
	fmt.Println("ready")
	next, err := ln.Accept()
	if err != nil {
		return err
	}
	if line, err := stdin.ReadString('\n'); err != nil || line != "go\n" {
		return fmt.Errorf("want go, got %q (%v)", line, err)
	}
	var conns []*relayConn
	r.mu.Lock()
	for fd, rc := range r.byFD {
		if rc != nil && rc.a == fd {
			conns = append(conns, rc)
		}
	}
	r.mu.Unlock()
	slices.SortFunc(conns, func(x, y *relayConn) int { return int(x.id) - int(y.id) })
	k := len(conns) // stop the world: one batch
	if d := os.Getenv(designEnv); strings.HasPrefix(d, "B:") {
		if k, err = strconv.Atoi(d[2:]); err != nil {
			return err
		}
	}
	start := monotonic()
	for i := 0; i < len(conns); i += k {
		batch := conns[i:min(i+k, len(conns))]
		r.mu.Lock()
		for _, rc := range batch {
			r.remove(rc)
		}
		r.mu.Unlock()
		if err := sendConns(next, batch, monotonic(), true); err != nil {
			return err
		}
		// The others keep flowing here until the successor has this batch.
		if items, err := next.Receive(); err != nil || len(items) != 1 || string(items[0].Meta) != "ack" {
			return fmt.Errorf("acknowledgement: %v", err)
		}
	}
	if err := next.Send([]handover.Item{{FD: -1, Meta: endMark}}); err != nil {
		return err
	}
	out.Encode(map[string]int64{"SentNs": monotonic() - start})
	io.Copy(io.Discard, stdin)
	return nil
}

// echo is the endpoint of every relayed connection: it prints its port, then
// echoes what each connection sends, until its standard input closes.
func echo() error {
	ln, sa, err := listenTCP()
	if err != nil {
		return err
	}
	unix.SetNonblock(ln, true)
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return err
	}
	if err := unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, ln, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(ln)}); err != nil {
		return err
	}
	fmt.Println(sa.(*unix.SockaddrInet4).Port)
	go func() {
		io.Copy(io.Discard, os.Stdin)
		os.Exit(0)
	}()
	events := make([]unix.EpollEvent, 256)
	buf := make([]byte, 4096)
	for {
		n, err := unix.EpollWait(ep, events, -1)
		if err != nil {
			continue
		}
		for _, ev := range events[:n] {
			fd := int(ev.Fd)
			if fd == ln {
				for {
					c, _, err := unix.Accept4(ln, unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK)
					if err != nil {
						break
					}
					unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, c, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(c)})
				}
				continue
			}
			m, err := unix.Read(fd, buf)
			if err != nil {
				continue
			}
			if m == 0 {
				unix.EpollCtl(ep, unix.EPOLL_CTL_DEL, fd, nil)
				unix.Close(fd)
				continue
			}
			unix.Write(fd, buf[:m])
		}
	}
}

// world is the clients of the relayed connections, and the load on them:
// every connection sends a 16-byte message (its send time and id) every
// interval, the endpoint echoes it, and the client records how long the round
// trip took.
type world struct {
	ep      int
	clients []int
	// maxRTT is the longest round trip (ns) seen since it was last reset,
	// replies the count of replies.
	maxRTT  atomic.Int64
	replies atomic.Int64
	// lastReply[id] is when (monotonic) connection id last had a reply.
	lastReply []atomic.Int64
	stop      chan struct{}
}

func (w *world) serve() {
	events := make([]unix.EpollEvent, 256)
	buf := make([]byte, 4096)
	for {
		n, err := unix.EpollWait(w.ep, events, 100)
		select {
		case <-w.stop:
			return
		default:
		}
		if err != nil {
			continue
		}
		for _, ev := range events[:n] {
			fd := int(ev.Fd)
			m, err := unix.Read(fd, buf)
			if err != nil || m <= 0 {
				continue
			}
			now := monotonic()
			for off := 0; off+16 <= m; off += 16 {
				sent := int64(binary.BigEndian.Uint64(buf[off:]))
				id := binary.BigEndian.Uint64(buf[off+8:])
				if rtt := now - sent; rtt > w.maxRTT.Load() {
					w.maxRTT.Store(rtt)
				}
				w.replies.Add(1)
				if id < uint64(len(w.lastReply)) {
					w.lastReply[id].Store(now)
				}
			}
		}
	}
}

// load sends each connection's message once per interval, spread evenly.
func (w *world) load(interval time.Duration) {
	const ticks = 20
	t := time.NewTicker(interval / ticks)
	defer t.Stop()
	msg := make([]byte, 16)
	for tick := 0; ; tick++ {
		select {
		case <-w.stop:
			return
		case <-t.C:
		}
		for id := tick % ticks; id < len(w.clients); id += ticks {
			binary.BigEndian.PutUint64(msg, uint64(monotonic()))
			binary.BigEndian.PutUint64(msg[8:], uint64(id))
			unix.Write(w.clients[id], msg)
		}
	}
}

func listenTCP() (fd int, sa unix.Sockaddr, err error) {
	fd, err = unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, nil, err
	}
	if err = unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err == nil {
		err = unix.Listen(fd, 4096)
	}
	if err == nil {
		sa, err = unix.Getsockname(fd)
	}
	return fd, sa, err
}

// connectPair returns a connected client socket and the listener's end of it.
func connectPair(ln int, sa unix.Sockaddr) (client, server int, err error) {
	client, err = unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, -1, err
	}
	if err = unix.Connect(client, sa); err != nil {
		unix.Close(client)
		return -1, -1, err
	}
	server, _, err = unix.Accept4(ln, unix.SOCK_CLOEXEC)
	if err != nil {
		unix.Close(client)
	}
	return client, server, err
}

// rssKB is VmRSS of process pid, in kB.
func rssKB(pid int) int64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(data), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			n, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			return n
		}
	}
	return 0
}

// BenchmarkHandover hands over established connections from one relay
// process to another, under load, by design: S stops every connection, sends
// them all and the successor resumes them; B:k quiesces, sends and resumes k
// at a time while the others flow in the old process, the next batch after
// the successor acknowledged the last. Metrics: handover-ms from the first
// quiesce to the last resumption, maxpause-ms (and p99) the longest any one
// connection was in neither epoll set, rtt-ms the longest round trip a
// client saw from the start of the handover to a second after, and the peak
// RSS of each relay process. Run it with -benchtime=1x; each run sets up its
// own world of connections.
func BenchmarkHandover(b *testing.B) {
	testbed.Needs(b, testbed.Root)
	// A process here may hold at most 20,000 descriptors (the hard
	// RLIMIT_NOFILE, which no process may raise without CAP_SYS_RESOURCE),
	// so a relay holds at most 3,000 connections with pipes (six descriptors
	// each) and 9,900 without (two).
	sizes := []struct {
		conns int
		pipes bool
	}{{10, true}, {1000, true}, {3000, true}, {1000, false}, {9900, false}}
	for _, size := range sizes {
		for _, design := range []string{"S", "B:64", "B:253", "B:1024"} {
			if design != "S" {
				if k, _ := strconv.Atoi(design[2:]); k >= size.conns {
					continue // the same as S
				}
			}
			fds := 2
			if size.pipes {
				fds = 6
			}
			name := fmt.Sprintf("conns=%d/fds=%d/design=%s", size.conns, fds, strings.ReplaceAll(design, ":", ""))
			b.Run(name, func(b *testing.B) {
				for range b.N {
					benchHandover(b, size.conns, design, size.pipes)
				}
			})
		}
	}
}

func benchHandover(b *testing.B, conns int, design string, pipes bool) {
	raiseNoFile(b, 20000)
	pipesVal := "1"
	if !pipes {
		pipesVal = "0"
	}
	setupAddr := fmt.Sprintf("@uproxy-handover-bench-%d-setup", os.Getpid())
	nextAddr := fmt.Sprintf("@uproxy-handover-bench-%d-next", os.Getpid())
	start := func(role, addr string) (*exec.Cmd, io.WriteCloser, *bufio.Reader) {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), roleEnv+"="+role, addrEnv+"="+addr, nextEnv+"="+nextAddr, designEnv+"="+design, pipesEnv+"="+pipesVal)
		cmd.Stderr = os.Stderr
		in, _ := cmd.StdinPipe()
		out, _ := cmd.StdoutPipe()
		if err := cmd.Start(); err != nil {
			b.Fatal(err)
		}
		return cmd, in, bufio.NewReader(out)
	}
	echoCmd, echoIn, echoOut := start("bench-echo", "")
	defer func() { echoIn.Close(); echoCmd.Wait() }()
	line, err := echoOut.ReadString('\n')
	if err != nil {
		b.Fatalf("echo: %v", err)
	}
	port, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil {
		b.Fatalf("echo: %q", line)
	}
	saB := &unix.SockaddrInet4{Port: port, Addr: [4]byte{127, 0, 0, 1}}
	lnA, saA, err := listenTCP() // the proxy port
	if err != nil {
		b.Fatal(err)
	}
	defer unix.Close(lnA)
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		b.Fatal(err)
	}
	w := &world{ep: ep, lastReply: make([]atomic.Int64, conns), stop: make(chan struct{})}
	defer func() {
		for _, fd := range w.clients {
			unix.Close(fd)
		}
		unix.Close(ep)
	}()

	// The old relay takes the proxy's sides of the connections from this
	// process as they are made, so that this one holds only the clients.
	setup, err := handover.Listen(setupAddr)
	if err != nil {
		b.Fatal(err)
	}
	defer setup.Close()
	oldCmd, oldIn, oldOut := start("bench-old", setupAddr)
	defer func() { oldIn.Close(); oldCmd.Wait() }()
	c, err := setup.Accept()
	if err != nil {
		b.Fatal(err)
	}
	var chunk []*relayConn
	for id := range conns {
		client, a, err := connectPair(lnA, saA)
		if err != nil {
			b.Fatalf("connection %d: %v", id, err)
		}
		bfd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			b.Fatalf("connection %d: %v", id, err)
		}
		if err := unix.Connect(bfd, saB); err != nil {
			b.Fatalf("connection %d: %v", id, err)
		}
		rc := &relayConn{id: uint32(id), a: a, b: bfd, up: [2]int{-1, -1}, down: [2]int{-1, -1}}
		// O_NONBLOCK is the open file's, so it travels with the descriptors.
		unix.SetNonblock(a, true)
		unix.SetNonblock(bfd, true)
		if pipes {
			unix.Pipe2(rc.up[:], unix.O_CLOEXEC|unix.O_NONBLOCK)
			unix.Pipe2(rc.down[:], unix.O_CLOEXEC|unix.O_NONBLOCK)
		}
		w.clients = append(w.clients, client)
		unix.SetNonblock(client, true)
		unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, client, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(client)})
		chunk = append(chunk, rc)
		if len(chunk) == connsPerMessage(len(rc.fds())) || id == conns-1 {
			if err := sendConns(c, chunk, 0, false); err != nil {
				b.Fatal(err)
			}
			chunk = chunk[:0]
		}
	}
	if err := c.Send([]handover.Item{{FD: -1, Meta: endMark}}); err != nil {
		b.Fatal(err)
	}
	c.Close()
	if line, err := oldOut.ReadString('\n'); err != nil || line != "ready\n" {
		b.Fatalf("old relay: got %q (%v), want ready", line, err)
	}
	newCmd, newIn, newOut := start("bench-new", nextAddr)
	defer func() { newIn.Close(); newCmd.Wait() }()

	go w.serve()
	go w.load(100 * time.Millisecond)
	defer close(w.stop)
	time.Sleep(time.Second) // every connection has exchanged messages in the old relay
	rttBefore := w.maxRTT.Load()

	var peakOld, peakNew atomic.Int64
	sampling := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			peakOld.Store(max(peakOld.Load(), rssKB(oldCmd.Process.Pid)))
			peakNew.Store(max(peakNew.Load(), rssKB(newCmd.Process.Pid)))
			select {
			case <-sampling:
				return
			case <-time.After(5 * time.Millisecond):
			}
		}
	}()
	w.maxRTT.Store(0)
	fmt.Fprintln(oldIn, "go")
	var took takeResult
	if err := json.NewDecoder(newOut).Decode(&took); err != nil {
		b.Fatalf("new relay's result: %v", err)
	}
	var sent struct{ SentNs int64 }
	if err := json.NewDecoder(oldOut).Decode(&sent); err != nil {
		b.Fatalf("old relay's result: %v", err)
	}
	handoverEnd := monotonic()
	if took.Conns != conns {
		b.Fatalf("the new relay took %d connections, want %d", took.Conns, conns)
	}
	// Every connection goes on in the new relay: each has a reply sent after
	// the handover ended, within a deadline that only a lost one misses.
	stale := 0
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		stale = 0
		for id := range w.lastReply {
			if w.lastReply[id].Load() < handoverEnd {
				stale++
			}
		}
		if stale == 0 || time.Now().After(deadline) {
			break
		}
	}
	close(sampling)
	<-sampled
	if stale > 0 {
		b.Errorf("%d of %d connections had no reply in the 30s after the handover", stale, conns)
	}
	b.ReportMetric(float64(took.LastResumed-took.FirstQuiesced)/1e6, "handover-ms")
	b.ReportMetric(float64(took.MaxPauseNs)/1e6, "maxpause-ms")
	b.ReportMetric(float64(took.P99PauseNs)/1e6, "p99pause-ms")
	b.ReportMetric(float64(w.maxRTT.Load())/1e6, "rtt-ms")
	b.ReportMetric(float64(rttBefore)/1e6, "rtt-before-ms")
	b.ReportMetric(float64(peakOld.Load())/1024, "old-rss-MB")
	b.ReportMetric(float64(peakNew.Load())/1024, "new-rss-MB")
	b.ReportMetric(load1(), "load1")
}

// load1 is the machine's load average over the last minute.
func load1() float64 {
	data, _ := os.ReadFile("/proc/loadavg")
	f, _ := strconv.ParseFloat(strings.Fields(string(data) + " 0")[0], 64)
	return f
}

// BenchmarkTransfer moves descriptors (pipe read ends) to a receiver in this
// process, batches of MaxFDs: by SCM_RIGHTS over a handover connection, or by
// pidfd_getfd (Pull) with the numbers alone. An op is one descriptor, its
// transfer and the close of the received copy.
func BenchmarkTransfer(b *testing.B) {
	testbed.Needs(b, testbed.Root)
	raiseNoFile(b, 20000)
	fds := make([]int, handover.MaxFDs)
	for i := range fds {
		var p [2]int
		if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
			b.Fatal(err)
		}
		fds[i] = p[0]
		defer unix.Close(p[0])
		defer unix.Close(p[1])
	}
	b.Run("how=scm-rights", func(b *testing.B) {
		sender, receiver := pair(b)
		items := make([]handover.Item, len(fds))
		for i, fd := range fds {
			items[i] = handover.Item{FD: fd, Meta: []byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}}
		}
		batches := (b.N + len(fds) - 1) / len(fds)
		errc := make(chan error, 1)
		go func() {
			for range batches {
				if err := sender.Send(items); err != nil {
					errc <- err
					return
				}
			}
			errc <- nil
		}()
		for range batches {
			got, err := receiver.Receive()
			if err != nil {
				b.Fatal(err)
			}
			for _, it := range got {
				unix.Close(it.FD)
			}
		}
		if err := <-errc; err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(load1(), "load1")
	})
	b.Run("how=pidfd-getfd", func(b *testing.B) {
		batches := (b.N + len(fds) - 1) / len(fds)
		for range batches {
			got, err := handover.Pull(os.Getpid(), fds)
			if err != nil {
				b.Fatal(err)
			}
			for _, fd := range got {
				unix.Close(fd)
			}
		}
		b.ReportMetric(load1(), "load1")
	})
}
