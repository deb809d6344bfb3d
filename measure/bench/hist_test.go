package bench

import (
	"math"
	"strings"
	"testing"
	"time"
)

func TestHistogramQuantiles(t *testing.T) {
	tests := []struct {
		name   string
		values func(h *Histogram)
		q      float64
		want   time.Duration
	}{
		{"empty", func(h *Histogram) {}, 0.5, 0},
		{"one value", func(h *Histogram) { h.Record(37 * time.Microsecond) }, 0.99, 37 * time.Microsecond},
		{"small exact", func(h *Histogram) {
			for i := 1; i <= 10; i++ {
				h.Record(time.Duration(i))
			}
		}, 0.5, 5},
		{"uniform 1..1000µs p50", uniform(1000), 0.5, 500 * time.Microsecond},
		{"uniform 1..1000µs p90", uniform(1000), 0.9, 900 * time.Microsecond},
		{"uniform 1..1000µs p99", uniform(1000), 0.99, 990 * time.Microsecond},
		{"uniform 1..1000µs p99.9", uniform(1000), 0.999, 999 * time.Microsecond},
		{"max", uniform(1000), 1, 1000 * time.Microsecond},
		{"negative counts as zero", func(h *Histogram) { h.Record(-time.Second) }, 0.5, 0},
		{"beyond the last bucket", func(h *Histogram) { h.Record(time.Hour) }, 0.5, time.Hour},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var h Histogram
			tt.values(&h)
			got := h.Quantile(tt.q)
			// Buckets are at most 1/64 of their values wide.
			if diff := math.Abs(float64(got - tt.want)); diff > float64(tt.want)/64+0.5 {
				t.Errorf("Quantile(%v): got %v, want %v within 1.6%%", tt.q, got, tt.want)
			}
		})
	}
}

func uniform(n int) func(h *Histogram) {
	return func(h *Histogram) {
		for i := 1; i <= n; i++ {
			h.Record(time.Duration(i) * time.Microsecond)
		}
	}
}

func TestHistogramMergeAndCDF(t *testing.T) {
	var a, b Histogram
	uniform(500)(&a)
	for i := 501; i <= 1000; i++ {
		b.Record(time.Duration(i) * time.Microsecond)
	}
	a.Merge(&b)
	if a.Count() != 1000 {
		t.Errorf("Count after merge: got %d, want 1000", a.Count())
	}
	if got, want := a.Mean(), 500500*time.Nanosecond; got != want {
		t.Errorf("Mean: got %v, want %v", got, want)
	}
	cdf := a.CDF()
	if len(cdf) == 0 || cdf[len(cdf)-1].Fraction != 1 {
		t.Fatalf("CDF: got %v, want it to end at fraction 1", cdf)
	}
	for i := 1; i < len(cdf); i++ {
		if cdf[i].Micros <= cdf[i-1].Micros || cdf[i].Fraction < cdf[i-1].Fraction {
			t.Fatalf("CDF point %d (%v) does not follow %v", i, cdf[i], cdf[i-1])
		}
	}
}

func TestBucketsMonotonic(t *testing.T) {
	prev := -1
	for ns := uint64(0); ns < 1<<24; ns += 1 + ns/200 {
		b := bucketOf(ns)
		if b < prev {
			t.Fatalf("bucketOf(%d) = %d, below bucketOf of a smaller value (%d)", ns, b, prev)
		}
		if mid := bucketMid(b); math.Abs(mid-float64(ns)) > float64(ns)/64+1 {
			t.Fatalf("bucketMid(bucketOf(%d)) = %v, more than 1/64 away", ns, mid)
		}
		prev = b
	}
}

func TestParseProcStat(t *testing.T) {
	// A command name with spaces and a parenthesis, as a process may choose.
	line := "4242 (nginx: worker (x)) S 4241 4241 4241 0 -1 4194624 120 0 0 0 250 75 0 0 20 0 1 0 1000 123456789 300 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n"
	st, err := parseProcStat([]byte(line))
	if err != nil {
		t.Fatal(err)
	}
	if st.ppid != 4241 {
		t.Errorf("ppid: got %d, want 4241", st.ppid)
	}
	if want := 3250 * time.Millisecond; st.cpu != want {
		t.Errorf("cpu: got %v, want %v (utime 250 + stime 75 ticks)", st.cpu, want)
	}
	if want := 300 * pageSize; st.rssByte != want {
		t.Errorf("rss: got %d, want %d", st.rssByte, want)
	}
	if _, err := parseProcStat([]byte("garbage")); err == nil {
		t.Errorf("parseProcStat(garbage): got no error")
	}
}

func TestParseMachineBusy(t *testing.T) {
	tests := []struct {
		name, stat string
		want       time.Duration
		wantErr    bool
	}{
		// user nice system idle iowait irq softirq steal guest guest_nice
		{"busy excludes idle, iowait and guest", "cpu  100 5 50 1000 30 2 8 1 40 0\ncpu0 1 2 3\n", 166 * 10 * time.Millisecond, false},
		{"not the total line", "cpu0 1 2 3 4 5 6 7 8\n", 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseMachineBusy([]byte(tt.stat))
			if (err != nil) != tt.wantErr || got != tt.want {
				t.Errorf("got %v (%v), want %v (error %v)", got, err, tt.want, tt.wantErr)
			}
		})
	}
}

func TestParseOutSegs(t *testing.T) {
	snmp := "Ip: Forwarding DefaultTTL\nIp: 1 64\n" +
		"Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails EstabResets CurrEstab InSegs OutSegs RetransSegs InErrs OutRsts InCsumErrors\n" +
		"Tcp: 1 200 120000 -1 40 38 2 1 3 1000 987654321012 0 0 5 0\n" +
		"Udp: InDatagrams\nUdp: 7\n"
	if got, err := parseOutSegs([]byte(snmp)); err != nil || got != 987654321012 {
		t.Errorf("got %d (%v), want 987654321012", got, err)
	}
	for _, bad := range []string{"Udp: InDatagrams\nUdp: 7\n", "Tcp: InSegs\nTcp: 5\n", "Tcp: OutSegs\nTcp: x\n"} {
		if got, err := parseOutSegs([]byte(bad)); err == nil {
			t.Errorf("parseOutSegs(%q) = %d, want an error", bad, got)
		}
	}
}

func TestParseSyncMetric(t *testing.T) {
	body := `# HELP kubeproxy_sync_proxy_rules_duration_seconds How long one sync took.
# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram
kubeproxy_sync_proxy_rules_duration_seconds_bucket{le="0.001"} 0
kubeproxy_sync_proxy_rules_duration_seconds_sum 1.25
kubeproxy_sync_proxy_rules_duration_seconds_count 7
kubeproxy_sync_proxy_rules_last_timestamp_seconds 1.7e+09
`
	sum, count, err := parseSyncMetric(strings.NewReader(body))
	if err != nil || sum != 1.25 || count != 7 {
		t.Errorf("got sum %v count %d (%v), want 1.25 and 7", sum, count, err)
	}
	if _, _, err := parseSyncMetric(strings.NewReader("other_metric 1\n")); err == nil {
		t.Errorf("without the histogram: got no error")
	}
}

func TestParseGauge(t *testing.T) {
	body := `# HELP go_gc_heap_live_bytes Heap memory occupied by live objects that were marked by the previous GC.
# TYPE go_gc_heap_live_bytes gauge
go_gc_heap_live_bytes_other 5
go_gc_heap_live_bytes 1.2345e+06
`
	if got, err := parseGauge(strings.NewReader(body), "go_gc_heap_live_bytes"); err != nil || got != 1234500 {
		t.Errorf("got %d (%v), want 1234500", got, err)
	}
	if _, err := parseGauge(strings.NewReader("other_metric 1\n"), "go_gc_heap_live_bytes"); err == nil {
		t.Errorf("without the gauge: got no error")
	}
}

// TestSummarizeBusyCPUs checks the busy figures: CPU seconds over the time
// between the rounds' samples, all rounds together, and no proxy figure for a
// path without a proxy.
func TestSummarizeBusyCPUs(t *testing.T) {
	wl := &workload{name: Connections, higherBetter: true, cpuScale: 1e6}
	paths := []*path{{name: Direct}, {name: Userspace}}
	results := map[string]*PathResult{
		Direct: {Path: Direct, Rounds: []Round{
			{Value: 10, Seconds: 1.9, sampled: 2, MachineCPU: 3, units: 20},
			{Value: 12, Seconds: 1.9, sampled: 2, MachineCPU: 3.4, units: 24},
		}},
		Userspace: {Path: Userspace, Rounds: []Round{
			{Value: 8, Seconds: 1.9, sampled: 2, MachineCPU: 3.2, ProxyCPU: ptr(1.0), units: 16},
			{Value: 9, Seconds: 0.9, sampled: 1, MachineCPU: 1.6, ProxyCPU: ptr(0.2), units: 9},
		}},
	}
	wr := summarize(wl, paths, results)
	direct, userspace := wr.Results[0], wr.Results[1]
	if direct.ProxyBusy != nil {
		t.Errorf("direct: proxy busy %v, want none (no proxy process)", *direct.ProxyBusy)
	}
	for _, c := range []struct {
		name string
		got  *float64
		want float64
	}{
		{"direct machine", direct.MachineBusy, 1.6},
		{"userspace machine", userspace.MachineBusy, 1.6},
		{"userspace proxy", userspace.ProxyBusy, 0.4},
	} {
		if c.got == nil || math.Abs(*c.got-c.want) > 1e-9 {
			t.Errorf("%s busy CPUs: got %v, want %v", c.name, c.got, c.want)
		}
	}
	if got, want := busy(userspace), "0.40/1.60"; got != want {
		t.Errorf("busy column: got %q, want %q", got, want)
	}
	if got, want := busy(direct), "-/1.60"; got != want {
		t.Errorf("busy column of direct: got %q, want %q", got, want)
	}
}

func TestRatios(t *testing.T) {
	wr := WorkloadResult{HigherIsBetter: true, Results: []PathResult{
		{Path: Direct, Value: ptr(1000), Latency: &Quantiles{P50: 20}},
		{Path: Userspace, Value: ptr(600), ProxyCPU: ptr(50), Latency: &Quantiles{P50: 35}},
		{Path: HAProxy, Value: ptr(500), ProxyCPU: ptr(80)},
		{Path: Nginx, Value: ptr(400), ProxyCPU: ptr(100)},
		{Path: IPTables, Skipped: "unavailable"},
	}}
	ratios(&wr, true)
	tests := []struct {
		name      string
		got, want *float64
	}{
		{"userspace vs direct", wr.Results[1].VsDirect, ptr(0.6)},
		{"userspace vs best peer (HAProxy's value)", wr.Results[1].VsBestPeer, ptr(1.2)},
		{"userspace CPU vs best peer (HAProxy's CPU)", wr.Results[1].ProxyCPUVsBestPeer, ptr(0.625)},
		{"nginx vs best peer", wr.Results[3].VsBestPeer, ptr(0.8)},
		{"userspace added p50", wr.Results[1].Latency.AddedP50, ptr(15)},
		{"skipped path has no ratio", wr.Results[4].VsDirect, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			switch {
			case tt.want == nil && tt.got != nil:
				t.Errorf("got %v, want none", *tt.got)
			case tt.want != nil && (tt.got == nil || math.Abs(*tt.got-*tt.want) > 1e-9):
				t.Errorf("got %v, want %v", fmtPtr(tt.got), *tt.want)
			}
		})
	}
}

func fmtPtr(v *float64) any {
	if v == nil {
		return "none"
	}
	return *v
}

// A userspace path is not sent syncs bigger than its open-file limit allows (a
// proxy socket per Service port): they are reported as not run, with why, instead
// of timing out.
func TestControlSkipsSizesBeyondTheFileLimit(t *testing.T) {
	p := &path{name: Userspace, proxy: &process{}, w: &world{fileLimit: 5000}, ctl: &uproxyCtl{}}
	res, err := runControl(t.Context(), p, []int{10000, 50000}, 0, time.Second)
	if err != nil {
		t.Fatalf("runControl: %v", err)
	}
	if len(res.Syncs) != 0 || len(res.NotRun) != 2 || res.NotRun[0].Ports != 10000 || res.NotRun[1].Ports != 50000 ||
		!strings.Contains(res.NotRun[0].Reason, "open-file limit is 5000") {
		t.Errorf("got syncs %+v, not run %+v; want both sizes not run, naming the limit of 5000", res.Syncs, res.NotRun)
	}
	rep := Report{Control: []ControlEntry{{Path: Userspace, Result: res}}}
	var b strings.Builder
	if err := rep.WriteTable(&b); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "userspace: 50000 Service ports: not run: the userspace mode needs a proxy socket per Service port") {
		t.Errorf("table does not say why 50000 Service ports were not run:\n%s", b.String())
	}
}
