package bench

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"time"
)

// ReadReport decodes a Report written by WriteJSON (uproxy bench -o json).
func ReadReport(r io.Reader) (*Report, error) {
	var rep Report
	dec := json.NewDecoder(r)
	if err := dec.Decode(&rep); err != nil {
		return nil, fmt.Errorf("decode bench report: %w", err)
	}
	if rep.Started.IsZero() || len(rep.Paths) == 0 {
		return nil, fmt.Errorf("decode bench report: no start time or no paths: not the output of uproxy bench -o json")
	}
	return &rep, nil
}

// column is one column of a Markdown table: its heading and its cell for one
// path's result ("" where the path has no such figure).
type column struct {
	head string
	cell func(PathResult) string
}

// workloadColumns are the columns a workload's table may have, in order. A
// table shows those that at least one path fills, so a workload added to the
// bench renders without a change here.
func workloadColumns(wr WorkloadResult) []column {
	lat := func(f func(*Quantiles) string) func(PathResult) string {
		return func(pr PathResult) string {
			if pr.Latency == nil {
				return ""
			}
			return f(pr.Latency)
		}
	}
	opt := func(f func(PathResult) *float64, render func(*float64) string) func(PathResult) string {
		return func(pr PathResult) string {
			if f(pr) == nil {
				return ""
			}
			return render(f(pr))
		}
	}
	idle := func(f func(*IdleResult) string) func(PathResult) string {
		return func(pr PathResult) string {
			if pr.Idle == nil {
				return ""
			}
			return f(pr.Idle)
		}
	}
	cpu := wr.CPUUnit
	if cpu == "" {
		cpu = "CPU"
	}
	return []column{
		{wr.Unit, func(pr PathResult) string {
			if pr.Value == nil && pr.Idle != nil {
				return "< noise"
			}
			return opt(func(p PathResult) *float64 { return p.Value }, num)(pr)
		}},
		{"×direct", opt(func(p PathResult) *float64 { return p.VsDirect }, ratio)},
		{"×best peer", opt(func(p PathResult) *float64 { return p.VsBestPeer }, ratio)},
		{"p50 µs", lat(func(q *Quantiles) string { return f1(q.P50) })},
		{"+p50 µs", lat(func(q *Quantiles) string {
			if q.AddedP50 == nil {
				return ""
			}
			return signed(q.AddedP50)
		})},
		{"p90 µs", lat(func(q *Quantiles) string { return f1(q.P90) })},
		{"p99 µs", lat(func(q *Quantiles) string { return f1(q.P99) })},
		{"p99.9 µs", lat(func(q *Quantiles) string { return f1(q.P999) })},
		{"proxy " + cpu, opt(func(p PathResult) *float64 { return p.ProxyCPU }, num)},
		{"proxy CPU ×best peer", opt(func(p PathResult) *float64 { return p.ProxyCPUVsBestPeer }, ratio)},
		{"client " + cpu, opt(func(p PathResult) *float64 { return p.ClientCPU }, num)},
		{"backend " + cpu, opt(func(p PathResult) *float64 { return p.BackendCPU }, num)},
		{"machine " + cpu, opt(func(p PathResult) *float64 { return p.MachineCPU }, num)},
		{"client share", opt(func(p PathResult) *float64 { return p.ClientCPUShare }, pct)},
		{"busy CPUs proxy/machine", func(pr PathResult) string {
			if b := busy(pr); b != "-" {
				return b
			}
			return ""
		}},
		{"TCP segments/" + perUnit(cpu), opt(func(p PathResult) *float64 { return p.Segments }, num)},
		{"node's TCP segments/" + perUnit(cpu), opt(func(p PathResult) *float64 { return p.NodeSegments }, num)},
		{"heap KiB/conn", idle(func(i *IdleResult) string {
			switch {
			case i.HeapKiBPerConn != nil:
				return num(i.HeapKiBPerConn)
			case i.Collected:
				return "< noise"
			}
			return ""
		})},
		{"RSS before MiB", idle(func(i *IdleResult) string { return fmt.Sprintf("%.1f", float64(i.RSSBefore)/(1<<20)) })},
		{"RSS after MiB", idle(func(i *IdleResult) string { return fmt.Sprintf("%.1f", float64(i.RSSAfter)/(1<<20)) })},
		{"errors", func(pr PathResult) string {
			if len(pr.Rounds) == 0 && pr.Value == nil && pr.Idle == nil {
				return ""
			}
			s := fmt.Sprint(pr.Errors)
			if pr.Lost > 0 {
				s += fmt.Sprintf(" (%d lost)", pr.Lost)
			}
			return s
		}},
	}
}

// WriteMarkdown writes the report as a Markdown page for docs/performance.md:
// when, where (CPU model, CPUs, kernel, load average) and with what command it
// ran, the paths, one table per workload the report holds (whatever its name:
// the columns are those its paths fill) and the control plane.
func (r *Report) WriteMarkdown(w io.Writer) error {
	var b strings.Builder
	m, s := r.Machine, r.Settings
	b.WriteString("# Performance (for people comparing uproxy's paths with each other and with HAProxy and nginx)\n\n")
	b.WriteString("Generated from one `uproxy bench -o json` run by `uproxy bench report`; do not edit by hand.\n" +
		"Regenerate with `make perf-doc` (root; `make bench-deps` installs the peers). Why the data path\n" +
		"is built as it is, with the experiments behind it: [decisions/](decisions/) and\n" +
		"[design/connection-lifecycle.md](design/connection-lifecycle.md).\n\n")
	fmt.Fprintf(&b, "- **When**: %s, %.0f s\n", r.Started.UTC().Format(time.RFC3339), r.Seconds)
	model := m.CPUModel
	if model == "" {
		model = "CPU model not recorded"
	}
	fmt.Fprintf(&b, "- **Machine**: %s, %d CPUs, kernel %s, %s\n", model, m.CPUs, m.Kernel, m.GoVersion)
	if m.LoadBefore != "" {
		fmt.Fprintf(&b, "- **Load average** (1, 5, 15 min): %s at the start, %s at the end", m.LoadBefore, orDash(m.LoadAfter))
		b.WriteString(" (the machine is shared: other jobs ran beside the bench)\n")
	}
	if r.Command != "" {
		fmt.Fprintf(&b, "- **Command**: `%s`\n", r.Command)
	}
	fmt.Fprintf(&b, "- **Settings**: %d rounds of %gs per workload and path, interleaved; %d idle connections; %d UDP clients, %d short-connection clients",
		s.Rounds, s.DurationSeconds, s.IdleConns, s.UDPClients, s.ConnClients)
	if len(s.SyncSizes) > 0 {
		fmt.Fprintf(&b, "; syncs of %s Service ports", joinInts(s.SyncSizes))
	}
	b.WriteString("\n")
	if s.IdleNote != "" {
		fmt.Fprintf(&b, "- **Idle connections**: %s\n", s.IdleNote)
	}
	if s.ProxyCPUs != "" {
		fmt.Fprintf(&b, "- **CPUs**: proxies on %s (the peers with one worker per CPU there), load generators and backends on %s\n", s.ProxyCPUs, s.LoadCPUs)
	}

	b.WriteString("\n## Paths\n\n| path | version | status |\n|---|---|---|\n")
	for _, p := range r.Paths {
		fmt.Fprintf(&b, "| %s | %s | %s |\n", p.Name, cell(p.Version), cell(p.status()))
	}

	for _, wr := range r.Workloads {
		writeWorkload(&b, wr)
	}
	if len(r.Control) > 0 {
		writeControl(&b, r.Control)
	}
	b.WriteString(readingTheTables)
	_, err := io.WriteString(w, b.String())
	return err
}

func writeWorkload(b *strings.Builder, wr WorkloadResult) {
	fmt.Fprintf(b, "\n## %s\n\n", wr.Title)
	if wr.Note != "" {
		fmt.Fprintf(b, "%s\n\n", wr.Note)
	}
	fmt.Fprintf(b, "Workload `%s`; %s, ", wr.Name, wr.Unit)
	if wr.HigherIsBetter {
		b.WriteString("higher is better.\n\n")
	} else {
		b.WriteString("lower is better.\n\n")
	}
	var cols []column
	for _, c := range workloadColumns(wr) {
		for _, pr := range wr.Results {
			if pr.Skipped == "" && pr.Error == "" && c.cell(pr) != "" {
				cols = append(cols, c)
				break
			}
		}
	}
	b.WriteString("| path |")
	for _, c := range cols {
		fmt.Fprintf(b, " %s |", c.head)
	}
	b.WriteString("\n|---|" + strings.Repeat("---:|", len(cols)) + "\n")
	var notes []note
	for _, pr := range wr.Results {
		fmt.Fprintf(b, "| %s |", pr.Path)
		if pr.Skipped != "" || pr.Error != "" {
			mark, msg := "n/a", pr.Skipped
			if pr.Error != "" {
				mark, msg = "FAILED", pr.Error
			}
			for i := range cols {
				if i == 0 {
					fmt.Fprintf(b, " %s |", mark)
				} else {
					b.WriteString(" - |")
				}
			}
			b.WriteString("\n")
			notes = append(notes, note{pr.Path, fmt.Sprintf("%s: %s", mark, msg)})
			continue
		}
		for _, c := range cols {
			fmt.Fprintf(b, " %s |", orDash(c.cell(pr)))
		}
		b.WriteString("\n")
		if pr.Idle != nil && pr.Idle.Note != "" {
			notes = append(notes, note{pr.Path, pr.Idle.Note})
		}
	}
	writeNotes(b, notes)
}

func writeControl(b *strings.Builder, control []ControlEntry) {
	b.WriteString("\n## Control plane\n\n" +
		"Sync time from `kubeproxy_sync_proxy_rules_duration_seconds`, in ms; \"to traffic\" runs from the\n" +
		"manifest's rename to the first round trip through the last new Service. \"+1 Service\" and \"1 endpoint\"\n" +
		"come in a small file of their own; \"file:\" the same change made in the file of all the Service ports,\n" +
		"written anew whole. Heap: growth of the live heap after a forced GC per Service port, with them\n" +
		"programmed and after the edits.\n\n")
	b.WriteString("| path | Service ports | sync ms | syncs | to traffic ms | +1 Service ms | 1 endpoint ms | file: 1 endpoint ms | file: +1 Service ms | removal ms | heap KiB/port | after edits |\n")
	b.WriteString("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	var notes []note
	for _, c := range control {
		switch {
		case c.Error != "":
			notes = append(notes, note{c.Path, fmt.Sprintf("FAILED: %s", c.Error)})
		case c.Skipped != "":
			notes = append(notes, note{c.Path, fmt.Sprintf("n/a: %s", c.Skipped)})
		}
		if c.Result == nil {
			continue
		}
		for _, s := range c.Result.Syncs {
			cells := []string{fmt.Sprintf("%.1f", s.SyncSeconds*1e3), fmt.Sprint(s.Syncs), fmt.Sprintf("%.1f", s.ToTrafficSeconds*1e3),
				msOrNotDone(s.AddOneSyncSeconds), msOrNotDone(s.EndpointSyncSeconds), msOrNotDone(s.FileEndpointSyncSeconds),
				msOrNotDone(s.FileAddOneSyncSeconds), msOrNotDone(s.RemoveSyncSeconds), kibOrNotDone(s.HeapBytesPerPort), kibOrNotDone(s.HeapBytesPerPortAfterEdits)}
			if c.Path == KubeProxyLayout {
				// nft -f alone: no traffic, no file, no removal, no process.
				for _, i := range []int{2, 5, 6, 7, 8, 9} {
					cells[i] = "-"
				}
			}
			fmt.Fprintf(b, "| %s | %d | %s |\n", c.Path, s.Ports, strings.Join(cells, " | "))
			if s.Error != "" {
				notes = append(notes, note{c.Path, fmt.Sprintf("%d Service ports: %s", s.Ports, s.Error)})
			}
		}
		for _, nr := range c.Result.NotRun {
			notes = append(notes, note{c.Path, fmt.Sprintf("%d Service ports: not run: %s", nr.Ports, nr.Reason)})
		}
		if len(c.Result.EndpointChangeMs) > 0 {
			notes = append(notes, note{c.Path, fmt.Sprintf("endpoint change to traffic: median %.1f ms, max %.1f ms over %d changes",
				c.Result.EndpointChangeMedian, c.Result.EndpointChangeMax, len(c.Result.EndpointChangeMs))})
		}
	}
	writeNotes(b, notes)
}

// note is what a table says below it of one path.
type note struct{ path, text string }

// writeNotes lists the notes below a table, one line per text naming every
// path it is about, in the order they came.
func writeNotes(b *strings.Builder, notes []note) {
	if len(notes) == 0 {
		return
	}
	var texts []string
	paths := map[string][]string{}
	for _, n := range notes {
		if _, seen := paths[n.text]; !seen {
			texts = append(texts, n.text)
		}
		paths[n.text] = append(paths[n.text], n.path)
	}
	b.WriteString("\n")
	for _, t := range texts {
		fmt.Fprintf(b, "- %s: %s\n", strings.Join(paths[t], ", "), cell(t))
	}
}

// readingTheTables explains the columns; it says nothing of one run's figures.
const readingTheTables = `
## Reading the tables

- **Paths.** ` + "`direct`" + ` goes straight to a backend; ` + "`userspace`" + ` through the userspace mode's
  ClusterIP portal (iptables portals), ` + "`userspace-nft`" + ` the same with nftables portals
  (dialing endpoints from the client pod's address, the default), ` + "`userspace-nft-node`" + `
  the same dialing from the node's address (` + "`--preserve-client-address=false`" + `);
  ` + "`iptables`" + `, ` + "`nftables`" + `, ` + "`ipvs`" + ` through the kernel modes; ` + "`haproxy`" + ` (tcp mode,
  forced splice) and ` + "`nginx`" + ` (` + "`stream`" + `, ` + "`proxy_half_close on`" + `) are the peers on the node.
  The peers have no Service address: the client dials their port on the node's address, so no
  portal rule acts on their packets (the REDIRECT, the marks of dials from the client's address
  and of their replies, the policy route), where uproxy's userspace paths pay for each.
  The ` + "`lo-`" + ` paths run client, proxy and backends in one namespace on 127.0.0.1, each proxy
  dialed on its own port (uproxy with ` + "`--rules none`" + `); each path is compared with the direct
  path and the peers of its own topology.
- **Rates** (MB/s, conn/s, req/s) are work per second of the measurement window, the median over
  rounds. ×direct and ×best peer divide by the direct path's figure and by the better of HAProxy
  and nginx.
- **Latency** is one exchange (a whole short connection, or one request/response) from the load
  generator's histogram over every round; +p50 is the p50 added over the direct path.
- **CPU per unit of work**: user plus system time from ` + "`/proc`" + `, divided by the work done, for the
  proxy's process tree, the load generators (client), the backend servers and the whole machine.
  System time includes the kernel's TCP/IP and netfilter work inside the proxy's system calls, so
  it is the stable figure on a busy machine and the one to compare. The kernel modes have no proxy
  process: compare their machine column.
- **Busy CPUs** (proxy/machine) are averaged over the windows: a rate measured with CPUs to spare
  and a one-thread proxy short of 1 was bounded by waiting, not by CPU.
- **Idle connections**: growth of the proxy's RSS (and, for uproxy, of its live heap) per idle
  proxied connection, with the connections held and counted. uproxy collects its garbage and
  returns the freed memory before each reading (` + "`/debug/memory?gc=1`" + `). Each side is read twice;
  a growth not above twice the larger change between two such readings is no figure ("< noise").
- **Control plane**: through manifests, times include the file source's 100 ms debounce.
  ` + "`kube-proxy-layout`" + ` is kube-proxy's nftables layout (a chain per Service port and per endpoint)
  rendered by the bench and loaded with ` + "`nft -f`" + `: the rule layer's time alone.
- The machine's speed moves from run to run on a shared machine: compare ratios within one run,
  not absolute figures across runs.
`

// cell makes text safe inside a Markdown table cell: one line, no bar.
func cell(s string) string {
	s = strings.ReplaceAll(s, "\n", " ")
	return strings.ReplaceAll(s, "|", "\\|")
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func joinInts(v []int) string {
	s := make([]string, len(v))
	for i, n := range v {
		s[i] = fmt.Sprint(n)
	}
	return strings.Join(s, ", ")
}

// perUnit is the unit of work of a CPU unit ("CPU-µs/conn": conn).
func perUnit(cpuUnit string) string {
	if _, unit, ok := strings.Cut(cpuUnit, "/"); ok {
		return unit
	}
	return "unit"
}
