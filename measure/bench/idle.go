package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"time"
)

// The idle workload holds connections open through a proxy and reads what the
// proxy's memory grew by. A reading is only as good as what else moves
// memory, and a Go process moves it a lot: freed heap pages stay resident
// until its scavenger returns them, so new connections may fill pages the
// process already had (RSS does not grow) or the scavenger may return pages
// meanwhile (RSS shrinks). Hence, for uproxy, every reading follows a garbage
// collection that returns freed memory to the kernel (its /debug/memory?gc=1),
// and for every proxy each side is read twice: the larger change between two
// readings with nothing changed is the noise, and a growth not well above it
// is reported as such, never as a figure.

// IdleResult is what n idle proxied connections cost the proxy.
type IdleResult struct {
	Conns int `json:"connections"`
	// Sockets is how many more sockets the proxy's processes held with the
	// connections open than before them: two per connection (the client's
	// and the backend's side) when the proxy holds every one.
	Sockets int `json:"sockets"`
	// Sessions is the proxy's own count of the connections it holds, where it
	// has one (uproxy: the active connections of the Service in
	// /debug/services).
	Sessions *int `json:"sessions,omitempty"`
	// Collected is true when the proxy collected its garbage and returned the
	// freed memory to the kernel before each reading (uproxy).
	Collected bool `json:"collected"`
	// RSSBefore and RSSAfter are the proxy's resident memory before the
	// connections and with them (the second of each pair of readings).
	RSSBefore int64 `json:"rssBeforeBytes"`
	RSSAfter  int64 `json:"rssAfterBytes"`
	// KiBPerConn is the growth of resident memory per connection; absent when
	// it was not above the noise (Note says so).
	KiBPerConn *float64 `json:"kibPerConnection,omitempty"`
	// RSSNoiseKiB is the noise the growth was judged against, per connection:
	// the larger change between two readings with nothing changed, at least a
	// page.
	RSSNoiseKiB float64 `json:"rssNoiseKibPerConnection"`
	// HeapBefore, HeapAfter and HeapKiBPerConn are the same for the live heap
	// after a collection, where the proxy reports it (uproxy); HeapNoiseKiB
	// likewise.
	HeapBefore     int64    `json:"heapBeforeBytes,omitempty"`
	HeapAfter      int64    `json:"heapAfterBytes,omitempty"`
	HeapKiBPerConn *float64 `json:"heapKibPerConnection,omitempty"`
	HeapNoiseKiB   float64  `json:"heapNoiseKibPerConnection,omitempty"`
	// HeapRoomKiB is the room the heap's spans had free before the
	// connections (in use, less allocated), per connection: objects made then
	// can fill it without a new resident page, so resident memory may grow by
	// up to that much less than the heap.
	HeapRoomKiB float64 `json:"heapRoomKibPerConnection,omitempty"`
	// Note says why a figure is absent.
	Note string `json:"note,omitempty"`
}

// aboveNoise is how many times the noise a growth must be to be a figure.
const aboveNoise = 2

// growth judges two pairs of readings of one quantity (before, after) over n
// connections: the growth per connection in KiB when it is above aboveNoise
// times the noise, else nil; and the noise per connection in KiB, the larger
// change within a pair, at least minNoise bytes.
func growth(before, after [2]int64, n int, minNoise int64) (perConn *float64, noiseKiB float64) {
	noise := max(abs(before[1]-before[0]), abs(after[1]-after[0]), minNoise)
	noiseKiB = float64(noise) / 1024 / float64(n)
	d := after[1] - before[1]
	if d <= aboveNoise*noise {
		return nil, noiseKiB
	}
	v := float64(d) / 1024 / float64(n)
	return &v, noiseKiB
}

func abs(v int64) int64 {
	if v < 0 {
		return -v
	}
	return v
}

// memoryReading is one reading of a proxy's memory.
type memoryReading struct {
	// heap is what is allocated, inuse the spans that hold it.
	rss, heap, inuse int64
	collected        bool
}

// readMemory reads p's proxy: uproxy through /debug/memory?gc=1 (a collection
// first), any other process tree from /proc.
func (p *path) readMemory() (memoryReading, error) {
	if p.uproxy == nil {
		u, err := treeUsage(p.proxy.pid)
		return memoryReading{rss: u.rss}, err
	}
	resp, err := p.uproxy.http.Get("http://" + p.uproxy.metrics + "/debug/memory?gc=1")
	if err != nil {
		return memoryReading{}, err
	}
	defer resp.Body.Close()
	var m struct {
		Collected      bool  `json:"collected"`
		HeapAllocBytes int64 `json:"heapAllocBytes"`
		HeapInuseBytes int64 `json:"heapInuseBytes"`
		RSSBytes       int64 `json:"rssBytes"`
	}
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		return memoryReading{}, fmt.Errorf("/debug/memory: %s: %s", resp.Status, strings.TrimSpace(string(b)))
	}
	if err := json.NewDecoder(resp.Body).Decode(&m); err != nil {
		return memoryReading{}, fmt.Errorf("/debug/memory: %w", err)
	}
	if !m.Collected || m.RSSBytes <= 0 {
		return memoryReading{}, fmt.Errorf("/debug/memory?gc=1: collected %v, RSS %d: want a collection and the RSS", m.Collected, m.RSSBytes)
	}
	return memoryReading{rss: m.RSSBytes, heap: m.HeapAllocBytes, inuse: m.HeapInuseBytes, collected: true}, nil
}

// readMemoryTwice reads p's proxy twice, readingGap apart: the pair's change
// is noise.
func (p *path) readMemoryTwice(ctx context.Context) ([2]memoryReading, error) {
	var r [2]memoryReading
	var err error
	if r[0], err = p.readMemory(); err != nil {
		return r, err
	}
	if !sleepCtx(ctx, readingGap) {
		return r, ctx.Err()
	}
	r[1], err = p.readMemory()
	return r, err
}

// readingGap separates the two readings of a pair.
const readingGap = 100 * time.Millisecond

// sessions is uproxy's own count of the connections it holds to the echo
// Service: the active connections of its endpoints in /debug/services.
func (c *uproxyCtl) sessions() (int, error) {
	resp, err := c.http.Get("http://" + c.metrics + "/debug/services?service=bench/echo:p")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	var body struct {
		Services []struct {
			Endpoints []struct {
				Active int `json:"activeConnections"`
			} `json:"endpoints"`
		} `json:"services"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return 0, fmt.Errorf("/debug/services: %w", err)
	}
	n := 0
	for _, s := range body.Services {
		for _, e := range s.Endpoints {
			n += e.Active
		}
	}
	return n, nil
}

// runIdle opens n connections through p, each with one round trip so both legs
// exist, checks that the proxy holds them all, reads its memory before and
// with them, and closes them.
func runIdle(ctx context.Context, p *path, n int) (*IdleResult, error) {
	socketsBefore := settledSockets(ctx, p.proxy.pid)
	before, err := p.readMemoryTwice(ctx)
	if err != nil {
		return nil, err
	}
	const openers = 8
	conns := make([][]net.Conn, openers)
	defer func() {
		for _, cs := range conns {
			for _, c := range cs {
				c.Close()
			}
		}
	}()
	var wg sync.WaitGroup
	errc := make(chan error, openers)
	for i := range openers {
		share := n / openers
		if i < n%openers {
			share++
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := p.w.inClient(func() error {
				b := []byte{'i'}
				for range share {
					if ctx.Err() != nil {
						return ctx.Err()
					}
					c, err := dialer.Dial("tcp", p.echo.String())
					if err != nil {
						return err
					}
					conns[i] = append(conns[i], c)
					c.SetDeadline(time.Now().Add(10 * time.Second))
					if _, err := c.Write(b); err != nil {
						return err
					}
					if _, err := io.ReadFull(c, b); err != nil {
						return err
					}
				}
				return nil
			})
			if err != nil {
				errc <- err
			}
		}()
	}
	wg.Wait()
	select {
	case err := <-errc:
		return nil, fmt.Errorf("idle connections over %s: %w; proxy log: %s", p.name, err, p.proxy.logTail())
	default:
	}
	// A socket of the proxy's own (one a previous workload left lingering)
	// may close meanwhile: a few fewer than two per connection still hold them.
	ir := &IdleResult{Conns: n, Sockets: treeSockets(p.proxy.pid) - socketsBefore}
	if slack := max(2, n/50); ir.Sockets < 2*n-slack {
		return nil, fmt.Errorf("idle connections over %s: the proxy holds %d more sockets with the %d connections open, want 2 per connection", p.name, ir.Sockets, n)
	}
	if p.uproxy != nil {
		s, err := p.uproxy.sessions()
		if err != nil {
			return nil, err
		}
		if ir.Sessions = &s; s != n {
			return nil, fmt.Errorf("idle connections over %s: uproxy counts %d active connections, want the %d held", p.name, s, n)
		}
	}
	after, err := p.readMemoryTwice(ctx)
	if err != nil {
		return nil, err
	}
	ir.Collected = after[1].collected
	ir.RSSBefore, ir.RSSAfter = before[1].rss, after[1].rss
	ir.KiBPerConn, ir.RSSNoiseKiB = growth([2]int64{before[0].rss, before[1].rss}, [2]int64{after[0].rss, after[1].rss}, n, pageSize)
	if ir.Collected {
		ir.HeapBefore, ir.HeapAfter = before[1].heap, after[1].heap
		ir.HeapKiBPerConn, ir.HeapNoiseKiB = growth([2]int64{before[0].heap, before[1].heap}, [2]int64{after[0].heap, after[1].heap}, n, pageSize)
		ir.HeapRoomKiB = float64(max(0, before[1].inuse-before[1].heap)) / 1024 / float64(n)
	}
	var notes []string
	if ir.KiBPerConn == nil {
		notes = append(notes, fmt.Sprintf("RSS grew %+.3f KiB per connection, not above %d× its noise of %.3f KiB per connection",
			float64(ir.RSSAfter-ir.RSSBefore)/1024/float64(n), aboveNoise, ir.RSSNoiseKiB))
	}
	if ir.Collected && ir.HeapKiBPerConn == nil {
		notes = append(notes, fmt.Sprintf("the heap grew %+.3f KiB per connection, not above %d× its noise of %.3f KiB per connection",
			float64(ir.HeapAfter-ir.HeapBefore)/1024/float64(n), aboveNoise, ir.HeapNoiseKiB))
	}
	if notes != nil {
		ir.Note = strings.Join(notes, "; ") + ": hold more connections (--idle-connections)"
	}
	return ir, nil
}

// treeSockets counts the sockets open in pid's process tree.
// settledSockets returns treeSockets(pid) once it has stayed the same for
// 200 ms, or after 5 s: the short-connection workloads before this one leave
// the proxy's sockets closing for a moment, and a baseline read among them
// would count their closing against the connections held.
func settledSockets(ctx context.Context, pid int) int {
	n, since := treeSockets(pid), time.Now()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline) && time.Since(since) < 200*time.Millisecond; {
		if !sleepCtx(ctx, 20*time.Millisecond) {
			break
		}
		if m := treeSockets(pid); m != n {
			n, since = m, time.Now()
		}
	}
	return n
}

func treeSockets(pid int) int {
	n := 0
	for _, p := range processTree(pid) {
		dir := fmt.Sprintf("/proc/%d/fd", p)
		ents, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		for _, e := range ents {
			if target, err := os.Readlink(dir + "/" + e.Name()); err == nil && strings.HasPrefix(target, "socket:") {
				n++
			}
		}
	}
	return n
}
