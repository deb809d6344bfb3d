package bench

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Workload names, as --workloads takes them.
const (
	Bulk        = "bulk"                     // TCP bulk throughput, one stream from the backend
	Connections = "connections"              // short connections: connect, 64-byte request and reply, close
	ServerClose = "connections-server-close" // short connections the backend closes first: 100-byte request, 150-byte reply, its FIN, then the client's
	ClientReset = "connections-reset"        // short connections the client resets (SO_LINGER 0) after a 100-byte request and 150-byte reply: no FIN either way
	Latency     = "latency"                  // 64-byte request/response on one persistent TCP connection
	UDP         = "udp"                      // 64-byte UDP request/response from several clients
	UDPRun      = "udp-run"                  // a 64-byte UDP request draws a run of 32 datagrams, sent segmented
	Idle        = "idle"                     // memory per idle proxied connection
	Control     = "control"                  // sync time at many Service ports, endpoint change to traffic
)

// Workloads lists every workload in the order they run and are reported.
var Workloads = []string{Bulk, Connections, ServerClose, ClientReset, Latency, UDP, UDPRun, Idle, Control}

// msgSize is the request and reply size of the small-message workloads.
const msgSize = 64

// workload is one of the measured kinds of traffic.
type workload struct {
	name  string
	title string
	// unit of Value, and whether more is better.
	unit         string
	higherBetter bool
	// cpuUnit names the per-work CPU figure; cpuScale converts CPU seconds per
	// unit of work into it.
	cpuUnit  string
	cpuScale float64
	// workers is how many load generators run at once.
	workers int
	// loop is one load generator; it runs on a thread in the client namespace.
	loop func(p *path, m *meter, g *generator) error
	// value turns a round's totals into Value; units into units of CPU work.
	value func(g *generator, seconds float64) float64
	units func(g *generator) float64
	// latency says Value comes with a latency distribution worth charting.
	latency bool
	// udp says the work is datagrams: the TCP segments of its rounds are not
	// its own, and are not reported.
	udp bool
	// skip says why the workload does not apply to p ("" when it does).
	skip func(p *path) string
}

var trafficWorkloads = map[string]*workload{
	Bulk: {
		name: Bulk, title: "TCP bulk throughput (1 stream, backend to client)",
		unit: "MB/s", higherBetter: true, cpuUnit: "CPU-s/GB", cpuScale: 1,
		workers: 1, loop: bulkLoop,
		value: func(g *generator, s float64) float64 { return float64(g.bytes) / 1e6 / s },
		units: func(g *generator) float64 { return float64(g.bytes) / 1e9 },
	},
	Connections: shortConnections(Connections, connectionsLoop),
	ServerClose: shortConnections(ServerClose, serverCloseLoop),
	ClientReset: shortConnections(ClientReset, clientResetLoop),
	Latency: {
		name: Latency, title: "TCP request/response latency (64 B, 1 persistent connection)",
		unit: "req/s", higherBetter: true, cpuUnit: "CPU-µs/req", cpuScale: 1e6,
		workers: 1, loop: latencyLoop, latency: true,
		value: func(g *generator, s float64) float64 { return float64(g.ops) / s },
		units: func(g *generator) float64 { return float64(g.ops) },
	},
	UDP: {
		name: UDP, title: clientTitles[UDP](4),
		unit: "req/s", higherBetter: true, cpuUnit: "CPU-µs/dgram", cpuScale: 1e6,
		workers: 4, loop: udpLoop, latency: true, udp: true,
		value: func(g *generator, s float64) float64 { return float64(g.ops) / s },
		units: func(g *generator) float64 { return 2 * float64(g.ops) },
		skip:  skipWithoutUDP,
	},
	UDPRun: {
		name: UDPRun, title: fmt.Sprintf("UDP runs (a 64 B request draws %d datagrams of %d B, sent segmented as QUIC servers do; 4 clients; CPU per datagram)", runCount, runSize),
		unit: "MB/s", higherBetter: true, cpuUnit: "CPU-µs/dgram", cpuScale: 1e6,
		workers: 4, loop: udpRunLoop, udp: true,
		value: func(g *generator, s float64) float64 { return float64(g.bytes) / 1e6 / s },
		units: func(g *generator) float64 { return (1 + runCount) * float64(g.ops) },
		skip:  skipWithoutUDP,
	},
}

// shortConnections is a short-connection workload of 4 clients (Config.ConnClients
// changes that), each opening a connection after the other with loop: its value
// is connections per second, its CPU per connection.
func shortConnections(name string, loop func(p *path, m *meter, g *generator) error) *workload {
	return &workload{
		name: name, title: clientTitles[name](4),
		unit: "conn/s", higherBetter: true, cpuUnit: "CPU-µs/conn", cpuScale: 1e6,
		workers: 4, loop: loop, latency: true,
		value: func(g *generator, s float64) float64 { return float64(g.ops) / s },
		units: func(g *generator) float64 { return float64(g.ops) },
	}
}

// clientTitles title the workloads whose number of clients Config sets.
var clientTitles = map[string]func(clients int) string{
	Connections: func(n int) string {
		return fmt.Sprintf("Short connections (connect, 64 B request, 64 B reply, close; %d clients)", n)
	},
	ServerClose: func(n int) string {
		return fmt.Sprintf("Short connections, server closes first (connect, %d B request, %d B reply, backend's FIN, client's; %d clients)", reqSize, replySize, n)
	},
	ClientReset: func(n int) string {
		return fmt.Sprintf("Short connections, client resets (connect, %d B request, %d B reply, client's RST, no FIN; %d clients)", reqSize, replySize, n)
	},
	UDP: func(n int) string {
		return fmt.Sprintf("UDP request/response (64 B, %d clients; CPU per datagram, 2 per exchange)", n)
	},
}

func skipWithoutUDP(p *path) string {
	if !p.udp.IsValid() {
		return p.noUDP
	}
	return ""
}

// meter tells the generators when to count (the measurement window, after a
// warm-up) and when to stop.
type meter struct {
	on       atomic.Bool
	stop     atomic.Bool
	deadline time.Time // an I/O deadline that outlasts the trial, so a stall ends it
}

// generator is one load generator's tally. Only its goroutine writes it until
// the trial has joined every generator.
type generator struct {
	ops, bytes, errs, lost uint64
	hist                   Histogram
}

// exchanged counts an exchange that began at start, and its time, if it ended
// inside the measurement window.
func (g *generator) exchanged(m *meter, start time.Time) {
	if m.on.Load() {
		g.ops++
		g.hist.Record(time.Since(start))
	}
}

// failed counts an error and says whether the generator should give up: a path
// that fails this often is broken, and its numbers would mean nothing.
func (g *generator) failed(err error) error {
	g.errs++
	if g.errs > 1000 {
		return fmt.Errorf("more than 1000 errors, last: %w", err)
	}
	time.Sleep(time.Millisecond)
	return nil
}

func bulkLoop(p *path, m *meter, g *generator) error {
	c, err := dialer.Dial("tcp", p.bulk.String())
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(m.deadline)
	buf := make([]byte, bulkChunk)
	for !m.stop.Load() {
		n, err := c.Read(buf)
		if err != nil {
			return fmt.Errorf("bulk read: %w", err)
		}
		if m.on.Load() {
			g.bytes += uint64(n)
		}
	}
	return nil
}

func connectionsLoop(p *path, m *meter, g *generator) error {
	var req, resp [msgSize]byte
	return shortConnLoop(p.echo, m, g, func(c *net.TCPConn) error {
		if _, err := c.Write(req[:]); err != nil {
			return err
		}
		_, err := io.ReadFull(c, resp[:])
		return err
	})
}

// serverCloseLoop sends a request and reads the reply up to the backend's
// FIN; then the client closes (its FIN comes second).
func serverCloseLoop(p *path, m *meter, g *generator) error {
	var req [reqSize]byte
	var resp [replySize + 1]byte
	return shortConnLoop(p.close, m, g, func(c *net.TCPConn) error {
		if _, err := c.Write(req[:]); err != nil {
			return err
		}
		n, err := io.ReadFull(c, resp[:])
		if err == io.ErrUnexpectedEOF && n == replySize {
			return nil
		}
		if err == nil {
			err = errors.New("no FIN after it")
		}
		return fmt.Errorf("reply of %d bytes, want %d and the server's FIN: %w", n, replySize, err)
	})
}

// clientResetLoop sends a request, reads the reply and resets the connection
// (SO_LINGER 0): neither side sends a FIN.
func clientResetLoop(p *path, m *meter, g *generator) error {
	var req [reqSize]byte
	var resp [replySize]byte
	return shortConnLoop(p.reply, m, g, func(c *net.TCPConn) error {
		if _, err := c.Write(req[:]); err != nil {
			return err
		}
		if _, err := io.ReadFull(c, resp[:]); err != nil {
			return err
		}
		return c.SetLinger(0)
	})
}

// shortConnLoop opens a connection to addr, runs exchange on it and closes
// it, over and over; a connection counts once its exchange succeeded.
func shortConnLoop(addr netip.AddrPort, m *meter, g *generator, exchange func(*net.TCPConn) error) error {
	to := addr.String()
	for !m.stop.Load() {
		start := time.Now()
		err := func() error {
			c, err := dialer.Dial("tcp", to)
			if err != nil {
				return err
			}
			defer c.Close()
			c.SetDeadline(m.deadline)
			return exchange(c.(*net.TCPConn))
		}()
		if err != nil {
			if ferr := g.failed(err); ferr != nil {
				return ferr
			}
			continue
		}
		g.exchanged(m, start)
	}
	return nil
}

func latencyLoop(p *path, m *meter, g *generator) error {
	var req, resp [msgSize]byte
	var c net.Conn
	defer func() {
		if c != nil {
			c.Close()
		}
	}()
	for !m.stop.Load() {
		if c == nil {
			var err error
			if c, err = dialer.Dial("tcp", p.echo.String()); err != nil {
				if ferr := g.failed(err); ferr != nil {
					return ferr
				}
				continue
			}
			c.SetDeadline(m.deadline)
		}
		start := time.Now()
		_, err := c.Write(req[:])
		if err == nil {
			_, err = io.ReadFull(c, resp[:])
		}
		if err != nil {
			c.Close()
			c = nil
			if ferr := g.failed(err); ferr != nil {
				return ferr
			}
			continue
		}
		g.exchanged(m, start)
	}
	return nil
}

// udpTimeout is how long a UDP client waits for a reply before counting the
// exchange lost.
const udpTimeout = 200 * time.Millisecond

func udpLoop(p *path, m *meter, g *generator) error {
	c, err := dialer.Dial("udp", p.udp.String())
	if err != nil {
		return err
	}
	defer c.Close()
	var req, resp [msgSize]byte
	for seq := uint64(1); !m.stop.Load(); seq++ {
		binary.BigEndian.PutUint64(req[:], seq)
		start := time.Now()
		if _, err := c.Write(req[:]); err != nil {
			if ferr := g.failed(err); ferr != nil {
				return ferr
			}
			continue
		}
		c.SetReadDeadline(start.Add(udpTimeout))
		// A late reply to an exchange already counted lost is read and dropped.
		for {
			n, err := c.Read(resp[:])
			if err != nil {
				if ferr := udpReadFailed(err, m, g); ferr != nil {
					return ferr
				}
				break
			}
			if n == msgSize && binary.BigEndian.Uint64(resp[:]) == seq {
				g.exchanged(m, start)
				break
			}
		}
	}
	return nil
}

// udpReadFailed counts a failed read of a UDP reply: past its deadline the
// exchange is lost (counted inside the window), any other error is an error. It
// returns the error that ends the generator, if any.
func udpReadFailed(err error, m *meter, g *generator) error {
	if errors.Is(err, os.ErrDeadlineExceeded) {
		if m.on.Load() {
			g.lost++
		}
		return nil
	}
	return g.failed(err)
}

// udpRunLoop asks for runs (see serveUDPEcho) one at a time and checks that every
// datagram of each arrives whole: a run with a datagram missing after
// udpTimeout counts as lost.
func udpRunLoop(p *path, m *meter, g *generator) error {
	c, err := dialer.Dial("udp", p.udp.String())
	if err != nil {
		return err
	}
	defer c.Close()
	var req [msgSize]byte
	req[0] = runRequest
	resp := make([]byte, 2048)
	for seq := uint64(1); !m.stop.Load(); seq++ {
		binary.BigEndian.PutUint64(req[8:], seq)
		if _, err := c.Write(req[:]); err != nil {
			if ferr := g.failed(err); ferr != nil {
				return ferr
			}
			continue
		}
		c.SetReadDeadline(time.Now().Add(udpTimeout))
		got := 0
		for got < runCount {
			n, err := c.Read(resp)
			if err != nil {
				if ferr := udpReadFailed(err, m, g); ferr != nil {
					return ferr
				}
				break
			}
			// Datagrams of an earlier run counted lost are read and dropped.
			if n == runSize && binary.BigEndian.Uint64(resp) == seq {
				got++
			}
		}
		if got == runCount && m.on.Load() {
			g.ops++
			g.bytes += runCount * runSize
		}
	}
	return nil
}

// sample is the CPU (and memory) of everything that works during a trial.
type sample struct {
	proxy, backend  usage
	client, machine time.Duration
	segments, node  uint64
	hasProxy        bool
	// at is when the machine's counters were read: the busy CPUs divide by the
	// time between two samples' readings, not by the measurement window, which
	// the reading of the second sample outlasts.
	at time.Time
}

func takeSample(p *path) (sample, error) {
	var s sample
	var err error
	// First, as the measurement window opens and first after it closes, like
	// the CPU figures that follow: the reading enters each namespace.
	if s.segments, s.node, err = p.w.segmentsSent(); err != nil {
		return s, err
	}
	if p.proxy != nil {
		s.hasProxy = true
		if s.proxy, err = treeUsage(p.proxy.pid); err != nil {
			return s, fmt.Errorf("proxy usage: %w", err)
		}
	}
	if s.backend, err = treeUsage(p.w.backend.pid); err != nil {
		return s, fmt.Errorf("backend usage: %w", err)
	}
	self, err := readProcStat(os.Getpid())
	if err != nil {
		return s, err
	}
	s.client = self.cpu
	if s.machine, err = machineBusy(); err != nil {
		return s, err
	}
	s.at = time.Now()
	return s, nil
}

// Round is one measurement of one workload over one path.
type Round struct {
	Value   float64 `json:"value"`
	Ops     uint64  `json:"ops"`
	Bytes   uint64  `json:"bytes,omitempty"`
	Seconds float64 `json:"seconds"`
	// CPU seconds spent during the window by the proxy process tree (absent when
	// the kernel does the work), the load generators (this process), the backend
	// servers, and the whole machine.
	ProxyCPU   *float64 `json:"proxyCPUSeconds,omitempty"`
	ClientCPU  float64  `json:"clientCPUSeconds"`
	BackendCPU float64  `json:"backendCPUSeconds"`
	MachineCPU float64  `json:"machineCPUSeconds"`
	// Segments is the TCP segments sent during the window in every namespace
	// of the path's topology: the client's, the proxy's and the backends'.
	Segments uint64 `json:"tcpSegments,omitempty"`
	// NodeSegments is the node namespace's part of Segments, outside a
	// loopback topology: the proxy's own segments.
	NodeSegments *uint64 `json:"nodeTCPSegments,omitempty"`
	Errors       uint64  `json:"errors,omitempty"`
	Lost         uint64  `json:"lost,omitempty"`
	// LoadAverage is the machine's 1-minute load average as the round began
	// (/proc/loadavg): on a shared machine, what else ran meanwhile.
	LoadAverage float64 `json:"loadAverage"`

	units float64
	hist  *Histogram
	// sampled is the time between the round's two samples (see sample.at).
	sampled float64
}

// runTrial runs wl's generators over p for warmup+d and measures the window d.
func runTrial(ctx context.Context, p *path, wl *workload, warmup, d time.Duration) (*Round, error) {
	m := &meter{deadline: time.Now().Add(warmup + d + 10*time.Second)}
	load := oneMinuteLoad()
	gens := make([]*generator, wl.workers)
	errc := make(chan error, wl.workers)
	var wg sync.WaitGroup
	for i := range gens {
		g := &generator{}
		gens[i] = g
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := p.w.inClient(func() error { return wl.loop(p, m, g) }); err != nil {
				errc <- err
				m.stop.Store(true)
			}
		}()
	}
	finish := func() error {
		m.stop.Store(true)
		wg.Wait()
		select {
		case err := <-errc:
			return fmt.Errorf("%s over %s: %w", wl.name, p.name, err)
		default:
			return nil
		}
	}
	if !sleepCtx(ctx, warmup) {
		finish()
		return nil, ctx.Err()
	}
	s0, err := takeSample(p)
	if err != nil {
		finish()
		return nil, err
	}
	m.on.Store(true)
	start := time.Now()
	ok := sleepCtx(ctx, d)
	m.on.Store(false)
	elapsed := time.Since(start)
	s1, serr := takeSample(p)
	if err := finish(); err != nil {
		return nil, err
	}
	if !ok {
		return nil, ctx.Err()
	}
	if serr != nil {
		return nil, serr
	}
	total := &generator{}
	for _, g := range gens {
		total.ops += g.ops
		total.bytes += g.bytes
		total.errs += g.errs
		total.lost += g.lost
		total.hist.Merge(&g.hist)
	}
	secs := elapsed.Seconds()
	r := &Round{
		Value:       wl.value(total, secs),
		Ops:         total.ops,
		Bytes:       total.bytes,
		Seconds:     secs,
		ClientCPU:   (s1.client - s0.client).Seconds(),
		BackendCPU:  (s1.backend.cpu - s0.backend.cpu).Seconds(),
		MachineCPU:  (s1.machine - s0.machine).Seconds(),
		Errors:      total.errs,
		Lost:        total.lost,
		LoadAverage: load,
		units:       wl.units(total),
		sampled:     s1.at.Sub(s0.at).Seconds(),
	}
	if s0.hasProxy {
		v := (s1.proxy.cpu - s0.proxy.cpu).Seconds()
		r.ProxyCPU = &v
	}
	if !wl.udp {
		r.Segments = s1.segments - s0.segments
		if !p.w.loopback {
			n := s1.node - s0.node
			r.NodeSegments = &n
		}
	}
	if wl.latency {
		r.hist = &total.hist
	}
	return r, nil
}

// sleepCtx sleeps d and reports false when ctx ended first.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// oneMinuteLoad returns the 1-minute load average (the first figure of
// loadAverage), 0 when it cannot be read.
func oneMinuteLoad() float64 {
	f, _, _ := strings.Cut(loadAverage(), " ")
	v, _ := strconv.ParseFloat(f, 64)
	return v
}
