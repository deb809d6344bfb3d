package bench

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
)

// Report is the outcome of a Run.
type Report struct {
	Started time.Time `json:"started"`
	Seconds float64   `json:"seconds"`
	// Command is the command line that made the report, set by its caller.
	Command   string           `json:"command,omitempty"`
	Machine   Machine          `json:"machine"`
	Settings  Settings         `json:"settings"`
	Paths     []PathStatus     `json:"paths"`
	Workloads []WorkloadResult `json:"workloads"`
	Control   []ControlEntry   `json:"control,omitempty"`
}

// Machine describes where the run happened.
type Machine struct {
	CPUs      int    `json:"cpus"`
	CPUModel  string `json:"cpuModel,omitempty"`
	Kernel    string `json:"kernel"`
	GoVersion string `json:"go"`
	// LoadBefore and LoadAfter are the 1-, 5- and 15-minute load averages
	// when the run began and ended: the machine may be shared.
	LoadBefore string `json:"loadBefore,omitempty"`
	LoadAfter  string `json:"loadAfter,omitempty"`
}

// Settings are the resolved Config.
type Settings struct {
	Quick           bool    `json:"quick"`
	DurationSeconds float64 `json:"durationSeconds"`
	Rounds          int     `json:"rounds"`
	IdleConns       int     `json:"idleConnections"`
	IdleNote        string  `json:"idleNote,omitempty"`
	SyncSizes       []int   `json:"syncSizes"`
	EndpointChanges int     `json:"endpointChanges"`
	UDPClients      int     `json:"udpClients"`
	ConnClients     int     `json:"connectionClients"`
	// ProxyCPUs are the CPUs the proxies were given (--proxy-cpus) and
	// LoadCPUs those the load generators and backends ran on; empty when every
	// process shared every CPU.
	ProxyCPUs string `json:"proxyCPUs,omitempty"`
	LoadCPUs  string `json:"loadCPUs,omitempty"`
}

// PathStatus says whether a path ran. Unavailable paths carry the Reason (a
// missing prerequisite); available paths that failed to start carry Error.
type PathStatus struct {
	Name      string `json:"name"`
	Available bool   `json:"available"`
	Reason    string `json:"reason,omitempty"`
	Error     string `json:"error,omitempty"`
	Version   string `json:"version,omitempty"`
	// ProxyCPUs is the CPU list the kernel let the path's proxy process run on,
	// read from /proc once it ran; set only with Settings.ProxyCPUs.
	ProxyCPUs string `json:"proxyCPUs,omitempty"`
}

// WorkloadResult is one workload over every path that ran.
type WorkloadResult struct {
	Name           string       `json:"name"`
	Title          string       `json:"title"`
	Unit           string       `json:"unit"`
	HigherIsBetter bool         `json:"higherIsBetter"`
	CPUUnit        string       `json:"cpuUnit,omitempty"`
	Note           string       `json:"note,omitempty"`
	Results        []PathResult `json:"results"`
}

// PathResult is one workload over one path. Figures a path does not have
// (proxy CPU of the direct path, say) are absent.
type PathResult struct {
	Path    string `json:"path"`
	Skipped string `json:"skipped,omitempty"` // why the workload does not apply
	Error   string `json:"error,omitempty"`
	// Value is the median over rounds, in the workload's Unit.
	Value      *float64   `json:"value,omitempty"`
	VsDirect   *float64   `json:"vsDirect,omitempty"`
	VsBestPeer *float64   `json:"vsBestPeer,omitempty"`
	Latency    *Quantiles `json:"latency,omitempty"`
	// CPU per unit of work (CPUUnit), over all rounds: the proxy process tree,
	// the load generators, the backend servers, the whole machine.
	ProxyCPU           *float64 `json:"proxyCPU,omitempty"`
	ProxyCPUVsBestPeer *float64 `json:"proxyCPUVsBestPeer,omitempty"`
	ClientCPU          *float64 `json:"clientCPU,omitempty"`
	BackendCPU         *float64 `json:"backendCPU,omitempty"`
	MachineCPU         *float64 `json:"machineCPU,omitempty"`
	// ClientCPUShare is the load generators' share of the machine's CPU time.
	ClientCPUShare *float64 `json:"clientCPUShare,omitempty"`
	// CPUs kept busy on average over the measurement windows, by the proxy
	// process tree and by the whole machine. Beside Machine.CPUs they tell what
	// bounded a rate: the machine (every CPU busy), the proxy (a proxy with one
	// thread near 1), or neither - then time went to waiting, as when a proxy
	// serializes work that several workers would overlap.
	ProxyBusy *float64 `json:"proxyBusyCPUs,omitempty"`
	// Segments is the TCP segments sent per unit of work (CPUUnit's) in every
	// namespace of the path's topology, the client's and the backends' as well
	// as the proxy's: what the path costs the network stack, whoever pays.
	Segments *float64 `json:"tcpSegments,omitempty"`
	// NodeSegments is the part of Segments sent in the node namespace, on a
	// topology of three namespaces: the proxy's own segments (none where the
	// kernel forwards).
	NodeSegments *float64    `json:"nodeTCPSegments,omitempty"`
	MachineBusy  *float64    `json:"machineBusyCPUs,omitempty"`
	Errors       uint64      `json:"errors,omitempty"`
	Lost         uint64      `json:"lost,omitempty"`
	Rounds       []Round     `json:"rounds,omitempty"`
	Idle         *IdleResult `json:"idle,omitempty"`
	// CDF is the latency distribution, for charts.
	CDF []CDFPoint `json:"cdf,omitempty"`
}

// Quantiles are latency quantiles in microseconds, over every round's requests.
type Quantiles struct {
	P50  float64 `json:"p50us"`
	P90  float64 `json:"p90us"`
	P99  float64 `json:"p99us"`
	P999 float64 `json:"p999us"`
	Mean float64 `json:"meanus"`
	// AddedP50 is P50 minus the direct path's P50.
	AddedP50 *float64 `json:"addedP50us,omitempty"`
}

// ControlEntry is the control-plane workload over one path.
type ControlEntry struct {
	Path    string         `json:"path"`
	Skipped string         `json:"skipped,omitempty"`
	Error   string         `json:"error,omitempty"`
	Result  *ControlResult `json:"result,omitempty"`
}

// Failed lists what went wrong: paths that did not start, workloads that
// failed on a path.
func (r *Report) Failed() []string {
	var out []string
	for _, p := range r.Paths {
		if p.Error != "" {
			out = append(out, fmt.Sprintf("path %s: %s", p.Name, p.Error))
		}
	}
	for _, w := range r.Workloads {
		for _, pr := range w.Results {
			if pr.Error != "" {
				out = append(out, fmt.Sprintf("%s over %s: %s", w.Name, pr.Path, pr.Error))
			}
		}
	}
	for _, c := range r.Control {
		if c.Error != "" {
			out = append(out, fmt.Sprintf("control over %s: %s", c.Path, c.Error))
		}
	}
	return out
}

// summarize turns rounds into a WorkloadResult: medians, CPU per unit over all
// rounds, merged latency histograms, ratios.
func summarize(wl *workload, paths []*path, results map[string]*PathResult) WorkloadResult {
	wr := WorkloadResult{Name: wl.name, Title: wl.title, Unit: wl.unit, HigherIsBetter: wl.higherBetter, CPUUnit: wl.cpuUnit}
	for _, p := range paths {
		r := results[p.name]
		if len(r.Rounds) > 0 && r.Error == "" {
			var vals []float64
			var units, proxy, client, backend, machine, secs, segments, node float64
			hasNode := false
			hasProxy := false
			var h Histogram
			for _, rd := range r.Rounds {
				vals = append(vals, rd.Value)
				units += rd.units
				client += rd.ClientCPU
				backend += rd.BackendCPU
				machine += rd.MachineCPU
				segments += float64(rd.Segments)
				if rd.NodeSegments != nil {
					hasNode = true
					node += float64(*rd.NodeSegments)
				}
				secs += rd.sampled
				if rd.ProxyCPU != nil {
					hasProxy = true
					proxy += *rd.ProxyCPU
				}
				r.Errors += rd.Errors
				r.Lost += rd.Lost
				if rd.hist != nil {
					h.Merge(rd.hist)
				}
			}
			slices.Sort(vals)
			r.Value = ptr(vals[len(vals)/2])
			if units > 0 {
				per := func(cpu float64) *float64 { return ptr(cpu / units * wl.cpuScale) }
				if hasProxy {
					r.ProxyCPU = per(proxy)
				}
				r.ClientCPU, r.BackendCPU, r.MachineCPU = per(client), per(backend), per(machine)
				if segments > 0 {
					r.Segments = ptr(segments / units)
					if hasNode {
						r.NodeSegments = ptr(node / units)
					}
				}
			}
			if machine > 0 {
				r.ClientCPUShare = ptr(client / machine)
			}
			if secs > 0 {
				r.MachineBusy = ptr(machine / secs)
				if hasProxy {
					r.ProxyBusy = ptr(proxy / secs)
				}
			}
			if h.Count() > 0 {
				us := func(q float64) float64 { return float64(h.Quantile(q)) / 1e3 }
				r.Latency = &Quantiles{P50: us(0.5), P90: us(0.9), P99: us(0.99), P999: us(0.999), Mean: float64(h.Mean()) / 1e3}
				r.CDF = h.CDF()
			}
		}
		wr.Results = append(wr.Results, *r)
	}
	ratios(&wr, true)
	return wr
}

// ratios fills VsDirect, VsBestPeer, ProxyCPUVsBestPeer and AddedP50. The best
// peer is the best of HAProxy and nginx on each figure separately. A path is
// compared with the direct path and the peers of its own topology.
func ratios(wr *WorkloadResult, withDirect bool) {
	find := func(name string) *PathResult {
		for i := range wr.Results {
			if wr.Results[i].Path == name {
				return &wr.Results[i]
			}
		}
		return nil
	}
	better := func(a, b float64, higher bool) bool {
		if higher {
			return a > b
		}
		return a < b
	}
	for i := range wr.Results {
		r := &wr.Results[i]
		if r.Value == nil {
			continue
		}
		topo := topologyOf(r.Path)
		var bestVal, bestCPU *float64
		for _, name := range peers {
			pr := find(topo + name)
			if pr == nil {
				continue
			}
			if pr.Value != nil && (bestVal == nil || better(*pr.Value, *bestVal, wr.HigherIsBetter)) {
				bestVal = pr.Value
			}
			if pr.ProxyCPU != nil && (bestCPU == nil || *pr.ProxyCPU < *bestCPU) {
				bestCPU = pr.ProxyCPU
			}
		}
		direct := find(topo + Direct)
		if withDirect && direct != nil && direct.Value != nil && *direct.Value != 0 {
			r.VsDirect = ptr(*r.Value / *direct.Value)
		}
		if bestVal != nil && *bestVal != 0 {
			r.VsBestPeer = ptr(*r.Value / *bestVal)
		}
		if bestCPU != nil && r.ProxyCPU != nil && *bestCPU != 0 {
			r.ProxyCPUVsBestPeer = ptr(*r.ProxyCPU / *bestCPU)
		}
		if r.Latency != nil && direct != nil && direct.Latency != nil {
			r.Latency.AddedP50 = ptr(r.Latency.P50 - direct.Latency.P50)
		}
	}
}

// status is "ok", or why the path did not run.
func (p PathStatus) status() string {
	switch {
	case !p.Available:
		return "unavailable: " + p.Reason
	case p.Error != "":
		return "FAILED: " + p.Error
	}
	return "ok"
}

// WriteJSON writes the report as indented JSON.
func (r *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// WriteTable writes the report as aligned text tables, one per workload.
func (r *Report) WriteTable(w io.Writer) error {
	var b strings.Builder
	s := r.Settings
	fmt.Fprintf(&b, "uproxy bench: %d CPUs, kernel %s, %s; %d rounds of %gs per workload and path (interleaved), took %.0fs\n\n",
		r.Machine.CPUs, r.Machine.Kernel, r.Machine.GoVersion, s.Rounds, s.DurationSeconds, r.Seconds)
	if s.ProxyCPUs != "" {
		fmt.Fprintf(&b, "proxies on CPUs %s (one worker per CPU for the peers); load generators and backends on CPUs %s\n\n", s.ProxyCPUs, s.LoadCPUs)
	}
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "path\tversion\tstatus")
	for _, p := range r.Paths {
		fmt.Fprintf(tw, "%s\t%s\t%s\n", p.Name, p.Version, oneLine(p.status()))
	}
	tw.Flush()

	for _, wr := range r.Workloads {
		fmt.Fprintf(&b, "\n%s\n", wr.Title)
		if wr.Note != "" {
			fmt.Fprintf(&b, "(%s)\n", wr.Note)
		}
		var notes []string
		tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight)
		lat := slices.ContainsFunc(wr.Results, func(p PathResult) bool { return p.Latency != nil })
		head := []string{"path", wr.Unit, "×direct", "×best peer"}
		if lat {
			head = append(head, "p50 µs", "+p50", "p90", "p99", "p99.9")
		}
		if wr.CPUUnit != "" {
			head = append(head, "proxy "+wr.CPUUnit, "×best peer", "client", "backend", "machine", "client share", "busy CPUs", "TCP segs", "node's")
		}
		if wr.Name == Idle {
			head = append(head, "heap KiB/conn", "RSS before MiB", "RSS after MiB")
		}
		head = append(head, "errors")
		fmt.Fprintln(tw, strings.Join(head, "\t")+"\t")
		for _, pr := range wr.Results {
			if pr.Skipped != "" || pr.Error != "" {
				// A message in a cell would widen its column: it goes below the table.
				mark, msg := "n/a", pr.Skipped
				if pr.Error != "" {
					mark, msg = "FAILED", oneLine(pr.Error)
				}
				cells := []string{pr.Path, mark}
				for len(cells) < len(head) {
					cells = append(cells, "-")
				}
				fmt.Fprintln(tw, strings.Join(cells, "\t")+"\t")
				notes = append(notes, fmt.Sprintf("  %s: %s: %s\n", pr.Path, mark, msg))
				continue
			}
			value := num(pr.Value)
			if pr.Idle != nil && pr.Value == nil {
				value = "< noise"
			}
			if pr.Idle != nil && pr.Idle.Note != "" {
				notes = append(notes, fmt.Sprintf("  %s: %s\n", pr.Path, pr.Idle.Note))
			}
			row := []string{pr.Path, value, ratio(pr.VsDirect), ratio(pr.VsBestPeer)}
			if lat {
				if l := pr.Latency; l != nil {
					row = append(row, f1(l.P50), signed(l.AddedP50), f1(l.P90), f1(l.P99), f1(l.P999))
				} else {
					row = append(row, "-", "-", "-", "-", "-")
				}
			}
			if wr.CPUUnit != "" {
				row = append(row, num(pr.ProxyCPU), ratio(pr.ProxyCPUVsBestPeer), num(pr.ClientCPU), num(pr.BackendCPU), num(pr.MachineCPU), pct(pr.ClientCPUShare), busy(pr), num(pr.Segments), num(pr.NodeSegments))
			}
			if wr.Name == Idle && pr.Idle != nil {
				heap := "-"
				switch {
				case pr.Idle.HeapKiBPerConn != nil:
					heap = num(pr.Idle.HeapKiBPerConn)
				case pr.Idle.Collected:
					heap = "< noise"
				}
				row = append(row, heap, fmt.Sprintf("%.1f", float64(pr.Idle.RSSBefore)/(1<<20)), fmt.Sprintf("%.1f", float64(pr.Idle.RSSAfter)/(1<<20)))
			}
			errs := fmt.Sprint(pr.Errors)
			if pr.Lost > 0 {
				errs += fmt.Sprintf(" (%d lost)", pr.Lost)
			}
			row = append(row, errs)
			fmt.Fprintln(tw, strings.Join(row, "\t")+"\t")
		}
		tw.Flush()
		for _, n := range notes {
			b.WriteString(n)
		}
	}

	if len(r.Control) > 0 {
		b.WriteString("\nControl plane (sync time from kubeproxy_sync_proxy_rules_duration_seconds; to traffic: manifest rename to first round trip through the last new Service)\n")
		tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "path\tService ports\tsync ms\tsyncs\tto traffic ms\t+1 Service ms\t1 endpoint ms\tfile: 1 endpoint ms\tfile: +1 Service ms\tremoval sync ms\theap KiB/port\tafter edits\t")
		var changes []string
		for _, c := range r.Control {
			if c.Result == nil {
				continue
			}
			for _, s := range c.Result.Syncs {
				toTraffic, removal := fmt.Sprintf("%.1f", s.ToTrafficSeconds*1e3), msOrNotDone(s.RemoveSyncSeconds)
				fileEndpoint, fileAdd := msOrNotDone(s.FileEndpointSyncSeconds), msOrNotDone(s.FileAddOneSyncSeconds)
				heap, heapEdits := kibOrNotDone(s.HeapBytesPerPort), kibOrNotDone(s.HeapBytesPerPortAfterEdits)
				if c.Path == KubeProxyLayout {
					// nft -f alone: no traffic, no removal, no file, no process
					toTraffic, removal, fileEndpoint, fileAdd, heap, heapEdits = "-", "-", "-", "-", "-", "-"
				}
				fmt.Fprintf(tw, "%s\t%d\t%.1f\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n", c.Path, s.Ports, s.SyncSeconds*1e3, s.Syncs, toTraffic,
					msOrNotDone(s.AddOneSyncSeconds), msOrNotDone(s.EndpointSyncSeconds), fileEndpoint, fileAdd, removal, heap, heapEdits)
			}
			for _, nr := range c.Result.NotRun {
				changes = append(changes, fmt.Sprintf("  %s: %d Service ports: not run: %s", c.Path, nr.Ports, nr.Reason))
			}
			if len(c.Result.EndpointChangeMs) > 0 {
				changes = append(changes, fmt.Sprintf("  %s: endpoint change to traffic: median %.1f ms, max %.1f ms over %d changes",
					c.Path, c.Result.EndpointChangeMedian, c.Result.EndpointChangeMax, len(c.Result.EndpointChangeMs)))
			}
		}
		tw.Flush()
		for _, l := range changes {
			b.WriteString(l + "\n")
		}
		for _, c := range r.Control {
			switch {
			case c.Error != "":
				fmt.Fprintf(&b, "  %s: FAILED: %s\n", c.Path, oneLine(c.Error))
			case c.Skipped != "":
				fmt.Fprintf(&b, "  %s: n/a: %s\n", c.Path, c.Skipped)
			}
		}
	}
	b.WriteString("\n×direct and ×best peer divide the figure by the direct path's and by the better of HAProxy and nginx\n" +
		"of the same topology: the lo- paths run on 127.0.0.1 in one namespace, each proxy dialed on its own port.\n" +
		"CPU columns are CPU time per unit of work: the proxy's process tree, the load generators (client),\n" +
		"the backend servers, and the whole machine (which alone sees kernel-mode proxying); client share is\n" +
		"the load generators' part of the machine's CPU. Busy CPUs are proxy/machine, averaged over the windows:\n" +
		"a rate measured with CPUs to spare and a proxy short of 1 (one thread) was bounded by waiting, not by CPU.\n" +
		"TCP segs are the TCP segments sent per unit of work in all of the topology's namespaces (client, proxy, backends);\n" +
		"node's, the part the node namespace sent: the proxy's own (none when the kernel forwards; - on loopback).\n" +
		"+p50 is p50 minus direct's. Control-plane times through manifests include the file source's 100 ms\n" +
		"debounce. kube-proxy-layout is kube-proxy's nftables layout (a chain per Service port and per\n" +
		"endpoint) rendered by this benchmark and loaded by nft -f in a namespace of its own: the rule layer's\n" +
		"time alone. +1 Service and 1 endpoint come in a small file of their own; file: the same in the file\n" +
		"of the Service ports, written anew whole. Heap: growth of the live heap after a forced GC\n" +
		"(go_gc_heap_live_bytes) per Service port, with them programmed and after the edits.\n")
	_, err := io.WriteString(w, b.String())
	return err
}

func oneLine(s string) string {
	s = strings.ReplaceAll(s, "\n", " | ")
	if len(s) > 300 {
		s = s[:300] + "…"
	}
	return s
}

func num(v *float64) string {
	if v == nil {
		return "-"
	}
	switch x := *v; {
	case x >= 1000:
		return fmt.Sprintf("%.0f", x)
	case x >= 100:
		return fmt.Sprintf("%.1f", x)
	case x >= 1:
		return fmt.Sprintf("%.2f", x)
	default:
		return fmt.Sprintf("%.3f", x)
	}
}

func f1(v float64) string { return fmt.Sprintf("%.1f", v) }

// busy renders the proxy's and the machine's busy CPUs as "proxy/machine", with a
// dash for a path without a proxy process.
func busy(pr PathResult) string {
	if pr.MachineBusy == nil {
		return "-"
	}
	proxy := "-"
	if pr.ProxyBusy != nil {
		proxy = fmt.Sprintf("%.2f", *pr.ProxyBusy)
	}
	return fmt.Sprintf("%s/%.2f", proxy, *pr.MachineBusy)
}

func signed(v *float64) string {
	if v == nil {
		return "-"
	}
	return fmt.Sprintf("%+.1f", *v)
}

func ratio(v *float64) string {
	if v == nil {
		return "-"
	}
	return fmt.Sprintf("%.2f", *v)
}

func pct(v *float64) string {
	if v == nil {
		return "-"
	}
	return fmt.Sprintf("%.0f%%", *v*100)
}

// msOrNotDone renders seconds as milliseconds, or "not done" for a step that did
// not finish.
func kibOrNotDone(bytes *float64) string {
	if bytes == nil {
		return "not done"
	}
	return fmt.Sprintf("%.2f", *bytes/1024)
}

func msOrNotDone(sec *float64) string {
	if sec == nil {
		return "not done"
	}
	return fmt.Sprintf("%.1f", *sec*1e3)
}
