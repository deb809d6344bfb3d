package integration

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// BenchmarkTakeOver measures a real takeover between two uproxy processes
// (nftables portals) at 1,000 and 10,000 Service ports with 10 and 1,000
// established connections, each echoing a line every 20 ms through one of
// the Service ports: how long the successor took (its start to serving,
// with its first sync over every port), how long the connections' handover
// took, the longest a batch of connections was away from every event loop
// (the old process's measure: detach to the successor's acknowledgement),
// the longest echo a client saw during the takeover (and, to read it by, in
// 3 s of the same load just before), and the peak resident
// memory of each process. Run with -benchtime 1x: each iteration builds
// its own namespaces.
//
//	go test -run '^$' -bench '^BenchmarkTakeOver$' -benchtime 1x -count 3 ./integration
func BenchmarkTakeOver(b *testing.B) {
	for _, ports := range []int{1000, 10000} {
		for _, conns := range []int{10, 1000} {
			b.Run(fmt.Sprintf("ports=%d/conns=%d", ports, conns), func(b *testing.B) {
				for range b.N {
					benchTakeOver(b, ports, conns)
				}
			})
		}
	}
}

func benchTakeOver(b *testing.B, ports, conns int) {
	b.StopTimer()
	tp := testbed.New(b)
	port := lineEndpoint(b, tp, 0)
	manifests := withFillers(tp, port, ports-1)
	flags := []string{"--rules", "nftables", "--shutdown-grace", "5s", "--after-handover", "exit", "-v", "0"}
	old := runUproxy(b, tp, manifests, launch{want: ports, flags: flags})

	// The longest echo is kept apart for 3 s of the same load before the
	// takeover (steady) and for the takeover.
	var handing, steady atomic.Bool
	var maxEcho, maxSteady atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var failed atomic.Int64
	for k := range conns {
		c, err := tp.Dial(testbed.Pod, "tcp", "10.96.0.12:80")
		if err != nil {
			b.Fatalf("connection %d: %v", k, err)
		}
		wg.Go(func() {
			defer c.Close()
			r := bufio.NewReader(c)
			tick := time.NewTicker(20 * time.Millisecond)
			defer tick.Stop()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				case <-tick.C:
				}
				msg := fmt.Sprintf("c%d %d\n", k, i)
				sent := time.Now()
				c.SetDeadline(sent.Add(30 * time.Second))
				if _, err := io.WriteString(c, msg); err != nil {
					failed.Add(1)
					return
				}
				if got, err := r.ReadString('\n'); err != nil || got != msg {
					failed.Add(1)
					return
				}
				d := int64(time.Since(sent))
				switch {
				case handing.Load():
					storeMax(&maxEcho, d)
				case steady.Load():
					storeMax(&maxSteady, d)
				}
			}
		})
	}
	time.Sleep(500 * time.Millisecond)
	steady.Store(true)
	time.Sleep(3 * time.Second)
	steady.Store(false)

	var peakOld, peakNew atomic.Int64
	var succ *proxy
	sampling := make(chan struct{})
	go func() {
		defer close(sampling)
		for {
			peakOld.Store(max(peakOld.Load(), rssBytes(old.cmd.Process.Pid)))
			if succ != nil {
				peakNew.Store(max(peakNew.Load(), rssBytes(succ.cmd.Process.Pid)))
			}
			select {
			case <-old.exited:
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
	}()
	handing.Store(true)
	start := time.Now()
	b.StartTimer()
	succ = runUproxy(b, tp, manifests, launch{dir: old.dir, flags: flags, noWait: true})
	old.awaitExit(2 * time.Minute)
	b.StopTimer()
	whole := time.Since(start)
	<-sampling
	time.Sleep(200 * time.Millisecond)
	handing.Store(false)
	close(stop)
	wg.Wait()
	if n := failed.Load(); n > 0 {
		b.Errorf("%d of %d connections failed during the takeover", n, conns)
	}
	testbed.Await(b, time.Minute, "the successor's line of the takeover", func() bool {
		return succ.logContains("Took over from the uproxy that ran")
	})
	took := logDuration(b, succ.logText(), "Took over from the uproxy that ran", "took")
	handed := logDuration(b, old.logText(), "Handed the established connections", "took")
	pause := logDuration(b, old.logText(), "Handed the established connections", "longestPause")
	b.ReportMetric(whole.Seconds(), "whole-s")
	b.ReportMetric(took.Seconds(), "takeover-s")
	b.ReportMetric(float64(handed)/1e6, "connections-ms")
	b.ReportMetric(float64(pause)/1e6, "longest-pause-ms")
	b.ReportMetric(float64(maxEcho.Load())/1e6, "max-echo-ms")
	b.ReportMetric(float64(maxSteady.Load())/1e6, "steady-max-echo-ms")
	b.ReportMetric(float64(peakOld.Load())/(1<<20), "old-rss-MiB")
	b.ReportMetric(float64(peakNew.Load())/(1<<20), "new-rss-MiB")
}

// storeMax raises m to d.
func storeMax(m *atomic.Int64, d int64) {
	for {
		v := m.Load()
		if d <= v || m.CompareAndSwap(v, d) {
			return
		}
	}
}

// rssBytes is process pid's resident memory (0 once it is gone).
func rssBytes(pid int) int64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for line := range strings.Lines(string(data)) {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			return kb << 10
		}
	}
	return 0
}

// logDuration reads the duration key of the log line containing what.
func logDuration(b *testing.B, log, what, key string) time.Duration {
	b.Helper()
	re := regexp.MustCompile(`\b` + key + `="?([0-9.]+[a-zµ]+)"?`)
	for line := range strings.Lines(log) {
		if !strings.Contains(line, what) {
			continue
		}
		if m := re.FindStringSubmatch(line); m != nil {
			d, err := time.ParseDuration(m[1])
			if err == nil {
				return d
			}
		}
	}
	b.Errorf("no %s in the line %q:\n%s", key, what, tail(log, 10))
	return 0
}
