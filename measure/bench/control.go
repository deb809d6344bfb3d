package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"time"
)

// SyncResult is one full sync of many Service ports.
type SyncResult struct {
	// Ports is how many Service ports the sync added (beside the four the
	// benchmark always has).
	Ports int `json:"servicePorts"`
	// SyncSeconds is the time the proxy's syncs spent on the change, from
	// kubeproxy_sync_proxy_rules_duration_seconds; Syncs is how many there were.
	SyncSeconds float64 `json:"syncSeconds"`
	Syncs       uint64  `json:"syncs"`
	// ToTrafficSeconds runs from the manifest's rename to the first round trip
	// through the last of the new Services: decode, sync and rules together.
	ToTrafficSeconds float64 `json:"toTrafficSeconds"`
	// AddOneSyncSeconds is the sync time of adding one more Service port while
	// the Ports are programmed; EndpointSyncSeconds that of changing one
	// Service's endpoint then. Absent when the step did not finish (Error).
	AddOneSyncSeconds   *float64 `json:"addOneSyncSeconds,omitempty"`
	EndpointSyncSeconds *float64 `json:"endpointSyncSeconds,omitempty"`
	// FileEndpointSyncSeconds and FileAddOneSyncSeconds are the same changes
	// made in the file of the Ports, which is written anew whole: one
	// endpoint of one of its Services moved, then one Service more in it.
	FileEndpointSyncSeconds *float64 `json:"fileEndpointSyncSeconds,omitempty"`
	FileAddOneSyncSeconds   *float64 `json:"fileAddOneSyncSeconds,omitempty"`
	// HeapBytesPerPort is the growth of the live heap after a forced GC
	// (go_gc_heap_live_bytes) from before the Ports were added to when they
	// are programmed, per Service port; HeapBytes that live heap itself. A
	// few Service ports move the heap by less than its noise: only many
	// give a figure per port. HeapBytesPerPortAfterEdits is the growth
	// once the changes above are made too, per Service port (two more).
	HeapBytes                  int64    `json:"heapBytes,omitempty"`
	HeapBytesPerPort           *float64 `json:"heapBytesPerPort,omitempty"`
	HeapBytesPerPortAfterEdits *float64 `json:"heapBytesPerPortAfterEdits,omitempty"`
	// RemoveSyncSeconds is the sync time of removing them all again; absent
	// when the removal did not finish within the step's time limit (Error).
	RemoveSyncSeconds *float64 `json:"removeSyncSeconds,omitempty"`
	Error             string   `json:"error,omitempty"`
}

// ControlResult is the control-plane workload over one path.
type ControlResult struct {
	Syncs []SyncResult `json:"syncs"`
	// EndpointChangeMs are the times from rewriting a Service's endpoints to the
	// first new connection that reaches the new endpoint.
	EndpointChangeMs     []float64 `json:"endpointChangeMs"`
	EndpointChangeMedian float64   `json:"endpointChangeMedianMs"`
	EndpointChangeMax    float64   `json:"endpointChangeMaxMs"`
	// NotRun are the sizes the path could not take on this machine, with why.
	NotRun []NotRunSync `json:"notRun,omitempty"`
}

// NotRunSync is a sync size left out, and why.
type NotRunSync struct {
	Ports  int    `json:"ports"`
	Reason string `json:"reason"`
}

// socketHeadroom is what a userspace path's proxy needs in open files beside its
// proxy sockets: the benchmark's own Services' connections, the API and metrics
// servers, pipes.
const socketHeadroom = 1000

// runControl times changes endpoint changes of one Service, then syncs of
// sizes Service ports (two endpoints each), each added, then changed by one
// more Service port and by one endpoint, and removed again. Every step waits at most
// limit (plus a little per Service port); a step that does not finish ends the
// workload with the results so far, since the proxy is still busy with it.
func runControl(ctx context.Context, p *path, sizes []int, changes int, limit time.Duration) (*ControlResult, error) {
	c := p.ctl
	res := &ControlResult{}
	for range changes {
		d, err := c.endpointChange(ctx, c.tag^('a'^'b'), limit)
		if err != nil {
			return res, fmt.Errorf("endpoint change over %s: %w", p.name, err)
		}
		res.EndpointChangeMs = append(res.EndpointChangeMs, float64(d)/1e6)
	}
	if len(res.EndpointChangeMs) > 0 {
		s := slices.Clone(res.EndpointChangeMs)
		slices.Sort(s)
		res.EndpointChangeMedian = s[len(s)/2]
		res.EndpointChangeMax = s[len(s)-1]
	}
	for i, n := range sizes {
		if p.proxy != nil && n+socketHeadroom > p.w.fileLimit {
			// The userspace mode opens a proxy socket per Service port: this
			// many cannot be had, and the step would only time out.
			for _, m := range sizes[i:] {
				res.NotRun = append(res.NotRun, NotRunSync{Ports: m, Reason: fmt.Sprintf(
					"the userspace mode needs a proxy socket per Service port, and the open-file limit is %d (raising it needs CAP_SYS_RESOURCE)", p.w.fileLimit)})
			}
			break
		}
		sr, err := c.scaleSync(ctx, n, limit+time.Duration(n)*time.Millisecond)
		if sr != nil {
			res.Syncs = append(res.Syncs, *sr)
		}
		if err != nil {
			return res, fmt.Errorf("%d Service ports over %s: %w", n, p.name, err)
		}
	}
	return res, nil
}

func (c *uproxyCtl) scaleSync(ctx context.Context, n int, limit time.Duration) (*SyncResult, error) {
	eps := []netip.AddrPort{c.w.backendAddr(c.w.ports.Echo), c.w.backendAddr(c.w.ports.Echo2)}
	// moved is the Service whose second endpoint the file's edit moves.
	moved := n / 2
	scaleFile := func(services int, move bool) []byte {
		var b bytes.Buffer
		b.Grow(services * 1000)
		for i := range services {
			e := eps
			if move && i == moved {
				e = []netip.AddrPort{eps[0], c.w.backendAddr(c.w.ports.TagA)}
			}
			writeService(&b, fmt.Sprintf("scale-%d", i), "TCP", scaleVIP(i), e...)
		}
		return b.Bytes()
	}
	heap0, err := c.liveHeap()
	if err != nil {
		return nil, err
	}
	sum0, count0, err := c.syncMetric()
	if err != nil {
		return nil, err
	}
	start := time.Now()
	if err := c.writeFile("scale.yaml", scaleFile(n, false)); err != nil {
		return nil, err
	}
	if err := c.w.waitTraffic(ctx, c.p, limit, target{"tcp", scaleVIP(n - 1)}); err != nil {
		return nil, fmt.Errorf("adding them: %w", err)
	}
	toTraffic := time.Since(start)
	sum1, count1, err := c.waitSynced(ctx, count0, limit)
	if err != nil {
		return nil, fmt.Errorf("adding them: %w", err)
	}
	res := &SyncResult{Ports: n, SyncSeconds: sum1 - sum0, Syncs: count1 - count0, ToTrafficSeconds: toTraffic.Seconds()}
	heap1, err := c.liveHeap()
	if err != nil {
		return res, err
	}
	res.HeapBytes, res.HeapBytesPerPort = heap1, ptr(float64(heap1-heap0)/float64(n))

	// One more Service port, then one endpoint of another, with n programmed.
	var b bytes.Buffer
	// Address n goes to the Service added to the file below.
	writeService(&b, "scale-extra", "TCP", scaleVIP(n+1), eps...)
	if err := c.writeFile("extra.yaml", b.Bytes()); err != nil {
		return res, err
	}
	if err := c.w.waitTraffic(ctx, c.p, limit, target{"tcp", scaleVIP(n + 1)}); err != nil {
		return res, fmt.Errorf("adding one more: %w", err)
	}
	sum2, count2, err := c.waitSynced(ctx, count1, limit)
	if err != nil {
		return res, fmt.Errorf("adding one more: %w", err)
	}
	res.AddOneSyncSeconds = ptr(sum2 - sum1)
	if _, err := c.endpointChange(ctx, c.tag^('a'^'b'), limit); err != nil {
		return res, fmt.Errorf("changing an endpoint: %w", err)
	}
	sum3, count3, err := c.waitSynced(ctx, count2, limit)
	if err != nil {
		return res, fmt.Errorf("changing an endpoint: %w", err)
	}
	res.EndpointSyncSeconds = ptr(sum3 - sum2)

	// The same two changes in the file of the n: rewritten whole, as an
	// editor or a deploy tool writes it.
	if err := c.writeFile("scale.yaml", scaleFile(n, true)); err != nil {
		return res, err
	}
	sum4, count4, err := c.waitSynced(ctx, count3, limit)
	if err != nil {
		return res, fmt.Errorf("moving an endpoint in the file: %w", err)
	}
	res.FileEndpointSyncSeconds = ptr(sum4 - sum3)
	if err := c.writeFile("scale.yaml", scaleFile(n+1, true)); err != nil {
		return res, err
	}
	if err := c.w.waitTraffic(ctx, c.p, limit, target{"tcp", scaleVIP(n)}); err != nil {
		return res, fmt.Errorf("adding one more to the file: %w", err)
	}
	sum5, count5, err := c.waitSynced(ctx, count4, limit)
	if err != nil {
		return res, fmt.Errorf("adding one more to the file: %w", err)
	}
	res.FileAddOneSyncSeconds = ptr(sum5 - sum4)
	heap2, err := c.liveHeap()
	if err != nil {
		return res, err
	}
	res.HeapBytesPerPortAfterEdits = ptr(float64(heap2-heap0) / float64(n+2))

	for _, f := range []string{"scale.yaml", "extra.yaml"} {
		if err := os.Remove(filepath.Join(c.dir, f)); err != nil {
			return res, err
		}
	}
	sum6, _, err := c.waitSynced(ctx, count5, limit)
	if err != nil {
		res.Error = fmt.Sprintf("removing them: %v", err)
		return res, errors.New(res.Error)
	}
	res.RemoveSyncSeconds = ptr(sum6 - sum5)
	return res, nil
}

// waitSynced waits until the sync count passes count.
func (c *uproxyCtl) waitSynced(ctx context.Context, count uint64, timeout time.Duration) (float64, uint64, error) {
	deadline := time.Now().Add(timeout)
	for {
		sum, n, err := c.syncMetric()
		if err == nil && n > count {
			return sum, n, nil
		}
		if !c.p.running() {
			return 0, 0, c.w.exited(c.p)
		}
		if time.Now().After(deadline) {
			return 0, 0, fmt.Errorf("no sync within %v (metric error: %v)", timeout, err)
		}
		if !sleepCtx(ctx, 10*time.Millisecond) {
			return 0, 0, ctx.Err()
		}
	}
}

// endpointChange points the flip Service at the backend answering tag and
// returns the time until a new connection gets that answer.
func (c *uproxyCtl) endpointChange(ctx context.Context, tag byte, limit time.Duration) (time.Duration, error) {
	start := time.Now()
	if err := c.writeBase(tag); err != nil {
		return 0, err
	}
	c.tag = tag
	deadline := start.Add(limit)
	for {
		got, err := c.ask(flipVIP)
		if err == nil && got == tag {
			return time.Since(start), nil
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("still answered %q (%v) %v after the change to %q", got, err, limit, tag)
		}
		if !sleepCtx(ctx, time.Millisecond) {
			return 0, ctx.Err()
		}
	}
}

// ask sends one byte to a tag server and returns its answer.
func (c *uproxyCtl) ask(to netip.AddrPort) (byte, error) {
	var b [1]byte
	err := c.w.inClient(func() error {
		conn, err := dialer.Dial("tcp", to.String())
		if err != nil {
			return err
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(time.Second))
		if _, err := conn.Write([]byte{'?'}); err != nil {
			return err
		}
		_, err = io.ReadFull(conn, b[:])
		return err
	})
	return b[0], err
}
