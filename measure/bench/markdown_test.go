package bench

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

// A report goes through its JSON and comes out as Markdown with the run's
// date, machine and command, and a table for every workload it holds, one the
// renderer has never heard of included, with only the columns its paths fill.
func TestMarkdownRendersEveryWorkloadFromJSON(t *testing.T) {
	rep := &Report{
		Started:  time.Date(2026, 11, 28, 1, 2, 3, 0, time.UTC),
		Seconds:  42,
		Command:  "uproxy bench --quick=true --output=json",
		Machine:  Machine{CPUs: 2, CPUModel: "Test CPU @ 2.0GHz", Kernel: "6.1.0", GoVersion: "go1.26.8", LoadBefore: "0.50 0.40 0.30", LoadAfter: "1.50 1.00 0.70"},
		Settings: Settings{Rounds: 2, DurationSeconds: 0.5, IdleConns: 1000, UDPClients: 4, ConnClients: 4, SyncSizes: []int{1000}},
		Paths: []PathStatus{
			{Name: Direct, Available: true, Version: "kernel forwarding"},
			{Name: Userspace, Available: true, Version: "uproxy dev"},
			{Name: HAProxy, Available: false, Reason: "haproxy not installed"},
		},
		Workloads: []WorkloadResult{
			{Name: "server-closes-first", Title: "Short connections the server closes", Unit: "conn/s", HigherIsBetter: true,
				Results: []PathResult{
					{Path: Direct, Value: ptr(900), Rounds: []Round{{Value: 900}}},
					{Path: Userspace, Value: ptr(600), VsDirect: ptr(0.667), Rounds: []Round{{Value: 600}}, Errors: 2, Lost: 1},
					{Path: HAProxy, Skipped: "path unavailable"},
					{Path: LoHAProxy, Skipped: "path unavailable"},
				}},
			{Name: Idle, Title: "Idle connections", Unit: "KiB/conn",
				Results: []PathResult{
					{Path: Direct, Skipped: "no proxy process: the kernel holds the state"},
					{Path: Userspace, Value: ptr(0.7), Idle: &IdleResult{Conns: 1000, Collected: true, RSSBefore: 40 << 20, RSSAfter: 41 << 20, HeapKiBPerConn: ptr(0.68)}},
				}},
		},
		Control: []ControlEntry{{Path: NFTables, Result: &ControlResult{Syncs: []SyncResult{{Ports: 1000, SyncSeconds: 0.056, Syncs: 1, ToTrafficSeconds: 0.2}}}}},
	}
	var js bytes.Buffer
	if err := rep.WriteJSON(&js); err != nil {
		t.Fatal(err)
	}
	back, err := ReadReport(&js)
	if err != nil {
		t.Fatal(err)
	}
	var md bytes.Buffer
	if err := back.WriteMarkdown(&md); err != nil {
		t.Fatal(err)
	}
	out := md.String()
	first, _, _ := strings.Cut(out, "\n")
	if !strings.HasPrefix(first, "# ") || !strings.Contains(first, "(for ") {
		t.Errorf("first line %q: want a title naming its reader, \"# Title (for ...)\"", first)
	}
	for _, want := range []string{
		"2026-11-28T01:02:03Z",
		"Test CPU @ 2.0GHz, 2 CPUs, kernel 6.1.0",
		"0.50 0.40 0.30 at the start, 1.50 1.00 0.70 at the end",
		"`uproxy bench --quick=true --output=json`",
		"| haproxy |  | unavailable: haproxy not installed |",
		"## Short connections the server closes",
		"| path | conn/s | ×direct | errors |",
		"| userspace | 600.0 | 0.67 | 2 (1 lost) |",
		"| haproxy | n/a | - | - |",
		"- haproxy, lo-haproxy: n/a: path unavailable",
		"| path | KiB/conn | heap KiB/conn | RSS before MiB | RSS after MiB | errors |",
		"| userspace | 0.700 | 0.680 | 40.0 | 41.0 | 0 |",
		"| nftables | 1000 | 56.0 | 1 | 200.0 |",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("the page lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "p50 µs") {
		t.Errorf("the page has latency columns although no path has latencies:\n%s", out)
	}
}

// A file that is not a bench report is refused rather than rendered empty.
func TestReadReportRefusesOtherJSON(t *testing.T) {
	for _, in := range []string{`{}`, `{"started":"2026-11-28T00:00:00Z"}`, `not json`} {
		if _, err := ReadReport(strings.NewReader(in)); err == nil {
			t.Errorf("ReadReport(%s): no error, want one", in)
		}
	}
}
