// Package bench measures the same traffic over several paths in one run:
// straight to a backend, through uproxy's userspace mode and kernel modes, and
// through HAProxy and nginx, interleaved round by round so machine drift falls
// on every path alike.
//
//	rep, err := bench.Run(ctx, bench.Config{Quick: true, Progress: os.Stderr})
//	rep.WriteTable(os.Stdout)
//
// It builds its own network namespaces (client, node, backends) with topology,
// runs the proxies in the node namespace and the load generators, in this
// process, in the client namespace; everything is torn down when Run returns.
// Beside throughput and latency it reports every proxy's own CPU per unit of
// work, read from /proc, which stays meaningful on a noisy machine.
// Run needs root.
package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"time"
)

// Config selects what Run measures. The zero value runs everything at full
// length.
type Config struct {
	// Paths and Workloads to run (names from Paths and Workloads); empty: all.
	Paths     []string
	Workloads []string
	// Quick shortens every default below so a run ends within two minutes.
	Quick bool
	// Duration is the measurement window of one round of one workload over one
	// path; a warm-up of a fifth of it (at most 1s) precedes it. 0: 5s (quick 500ms).
	Duration time.Duration
	// Rounds per workload and path, interleaved across paths. 0: 3 (quick 2).
	Rounds int
	// IdleConns is how many idle connections the memory workload opens. 0: 10000
	// (quick 1000).
	IdleConns int
	// SyncSizes are the Service-port counts of the control-plane syncs. Empty:
	// 1000, 10000 and 50000 (quick 1000).
	SyncSizes []int
	// EndpointChanges is how many endpoint changes the control plane times.
	// 0: 5 (quick 3).
	EndpointChanges int
	// StepLimit bounds each control-plane step (plus 1ms per Service port): a
	// proxy that takes longer fails the step. 0: 2m (quick 20s).
	StepLimit time.Duration
	// UDPClients is how many clients the UDP workload runs at once. 0: 4.
	UDPClients int
	// ConnClients is how many clients each short-connection workload
	// (Connections, ServerClose, ClientReset) runs at once, each with one
	// connection open. 0: 4; at most MaxConnClients.
	ConnClients int
	// ProxyCPUs, if not empty, are the CPUs every proxy process runs on; this
	// process's load generators and the backends run on the others (see
	// cpus.go). Empty: every process shares every CPU.
	ProxyCPUs []int
	// Uproxy is the uproxy binary for the uproxy paths; "": this executable.
	Uproxy string
	// Progress, if not nil, receives a progress line rewritten in place.
	Progress io.Writer
	// Log, if not nil, receives diagnostics (teardown problems).
	Log io.Writer
}

// MaxConnClients is the most clients a short-connection workload runs.
const MaxConnClients = 64

// workload returns the traffic workload name as c sets it up: the UDP one with
// c.UDPClients clients, the short-connection ones with c.ConnClients.
func (c Config) workload(name string) *workload {
	wl := trafficWorkloads[name]
	var clients int
	switch name {
	case UDP:
		clients = c.UDPClients
	case Connections, ServerClose, ClientReset:
		clients = c.ConnClients
	default:
		return wl
	}
	if clients == wl.workers {
		return wl
	}
	w := *wl
	w.workers = clients
	w.title = clientTitles[name](clients)
	return &w
}

func (c Config) withDefaults() (Config, error) {
	if len(c.Paths) == 0 {
		c.Paths = Paths
	}
	if len(c.Workloads) == 0 {
		c.Workloads = Workloads
	}
	for _, p := range c.Paths {
		if !slices.Contains(Paths, p) {
			return c, fmt.Errorf("unknown path %q (want some of %s)", p, strings.Join(Paths, ","))
		}
	}
	for _, w := range c.Workloads {
		if !slices.Contains(Workloads, w) {
			return c, fmt.Errorf("unknown workload %q (want some of %s)", w, strings.Join(Workloads, ","))
		}
	}
	pick := func(v, full, quick int) int {
		if v > 0 {
			return v
		}
		if c.Quick {
			return quick
		}
		return full
	}
	if c.Duration <= 0 {
		c.Duration = 5 * time.Second
		if c.Quick {
			c.Duration = 500 * time.Millisecond
		}
	}
	c.Rounds = pick(c.Rounds, 3, 2)
	c.UDPClients = pick(c.UDPClients, 4, 4)
	c.ConnClients = pick(c.ConnClients, 4, 4)
	if c.ConnClients > MaxConnClients {
		return c, fmt.Errorf("%d short-connection clients: at most %d", c.ConnClients, MaxConnClients)
	}
	c.IdleConns = pick(c.IdleConns, 10000, 1000)
	c.EndpointChanges = pick(c.EndpointChanges, 5, 3)
	if c.StepLimit <= 0 {
		c.StepLimit = 2 * time.Minute
		if c.Quick {
			c.StepLimit = 20 * time.Second
		}
	}
	if len(c.SyncSizes) == 0 {
		c.SyncSizes = []int{1000, 10000, 50000}
		if c.Quick {
			c.SyncSizes = []int{1000}
		}
	}
	if c.Uproxy == "" {
		exe, err := os.Executable()
		if err != nil {
			return c, fmt.Errorf("find the uproxy binary: %w", err)
		}
		c.Uproxy = exe
	}
	if c.Log == nil {
		c.Log = io.Discard
	}
	return c, nil
}

func (c Config) warmup() time.Duration { return min(c.Duration/5, time.Second) }

// Run builds the topology, starts every available path, runs the workloads
// and tears everything down. The error is for a run that could not happen at
// all (no root, no namespaces, interrupted); a path or workload that failed is
// recorded in the Report, whose Failed says so.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if os.Geteuid() != 0 {
		return nil, fmt.Errorf("the benchmark needs root (network namespaces, iptables)")
	}
	fileLimit := raiseFileLimit()
	dir, err := os.MkdirTemp("", "uproxy-bench-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	// The backends run this very executable (see backendEnv).
	self, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find this executable: %w", err)
	}
	var place *placement
	if len(cfg.ProxyCPUs) > 0 {
		if place, err = newPlacement(cfg.ProxyCPUs); err != nil {
			return nil, err
		}
		// Before the launcher starts, so that its thread, and every child it
		// starts but the proxies, inherits the rest.
		if err := pinProcess(&place.rest); err != nil {
			pinProcess(&place.orig)
			return nil, fmt.Errorf("--proxy-cpus: %w", err)
		}
		defer pinProcess(&place.orig)
	}
	td := &teardown{log: cfg.Log}
	launch := newLauncher(place)
	defer func() {
		td.run()
		launch.close()
	}()

	rep := &Report{
		Started:  time.Now(),
		Machine:  machineInfo(),
		Settings: Settings{Quick: cfg.Quick, DurationSeconds: cfg.Duration.Seconds(), Rounds: cfg.Rounds, IdleConns: cfg.IdleConns, SyncSizes: cfg.SyncSizes, EndpointChanges: cfg.EndpointChanges, UDPClients: cfg.UDPClients, ConnClients: cfg.ConnClients},
	}
	if place != nil {
		rep.Settings.ProxyCPUs = formatCPUList(&place.proxy)
		// What the kernel says this process now runs on, not what was asked.
		if rep.Settings.LoadCPUs, err = allowedCPUs(os.Getpid()); err != nil {
			return nil, err
		}
	}
	prog := newProgress(cfg.Progress, rep.Started)
	defer prog.done()

	// A proxy holds two sockets per idle connection, and needs some for
	// listeners, logs and HAProxy's splice pipes (see setupHAProxy).
	if most := (fileLimit - 3000) / 2; cfg.IdleConns > most {
		rep.Settings.IdleNote = fmt.Sprintf("%d asked, clamped by the open-file limit of %d (raising it needs CAP_SYS_RESOURCE)", cfg.IdleConns, fileLimit)
		cfg.IdleConns = max(most, 1)
		rep.Settings.IdleConns = cfg.IdleConns
	}
	paths, err := setupPaths(ctx, cfg, rep, td, launch, self, dir, fileLimit, prog)
	if err != nil {
		return nil, err
	}
	if err := runWorkloads(ctx, cfg, rep, paths, prog); err != nil {
		return nil, err
	}
	rep.Seconds = time.Since(rep.Started).Seconds()
	rep.Machine.LoadAfter = loadAverage()
	return rep, nil
}

// setupPaths probes every selected path and starts the available ones. The
// main topology holds direct, userspace and the peers; each kernel mode, and
// the userspace mode with nftables portals, gets a topology of its own, so its
// rules never meet the main userspace mode's. The loopback topology holds the
// lo- paths: direct, userspace and the peers again, on 127.0.0.1.
func setupPaths(ctx context.Context, cfg Config, rep *Report, td *teardown, launch *launcher, self, dir string, fileLimit int, prog *progress) ([]*path, error) {
	var main, lo *world
	mainWorld := func() (*world, error) {
		if main != nil {
			return main, nil
		}
		prog.show("building the main topology")
		w, err := newWorld("main", td, launch, self, dir, fileLimit)
		main = w
		return w, err
	}
	loWorld := func() (*world, error) {
		if lo != nil {
			return lo, nil
		}
		prog.show("building the loopback topology")
		w, err := newLoopbackWorld("loopback", td, launch, self, dir, fileLimit)
		lo = w
		return w, err
	}
	var paths []*path
	for _, name := range Paths {
		if !slices.Contains(cfg.Paths, name) {
			continue
		}
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		st := PathStatus{Name: name, Available: true}
		if st.Reason = probe(name, cfg.Uproxy); st.Reason != "" {
			st.Available = false
			rep.Paths = append(rep.Paths, st)
			continue
		}
		prog.show("starting " + name)
		var p *path
		var err error
		switch name {
		case IPTables, NFTables, IPVS, UserspaceNFT, UserspaceNFTNode:
			mode := name
			if name == UserspaceNFT || name == UserspaceNFTNode {
				mode = ""
			}
			var w *world
			if w, err = newWorld(name, td, launch, self, dir, fileLimit); err == nil {
				p, err = setupUproxy(ctx, w, name, mode, "nftables", cfg.Uproxy)
			}
		default:
			build, rules := mainWorld, "iptables"
			if loopbackPath(name) {
				build, rules = loWorld, "none"
			}
			var w *world
			if w, err = build(); err != nil {
				// Without the topology nothing else in it can run.
				return nil, err
			}
			switch baseName(name) {
			case Direct:
				p = setupDirect(w, name)
			case Userspace:
				p, err = setupUproxy(ctx, w, name, "", rules, cfg.Uproxy)
			case HAProxy:
				p, err = setupHAProxy(ctx, w, name)
			case Nginx:
				p, err = setupNginx(ctx, w, name)
			}
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if err == nil {
			err = p.w.halfCloseTrip(p.echo, "half-closed?")
		}
		if err == nil && p.proxy != nil && len(cfg.ProxyCPUs) > 0 {
			st.ProxyCPUs, err = allowedCPUs(p.proxy.pid)
		}
		if err != nil {
			st.Error = err.Error()
		} else {
			st.Version = p.version
			paths = append(paths, p)
		}
		rep.Paths = append(rep.Paths, st)
	}
	return paths, nil
}

// runWorkloads runs each workload round by round; within a round every path
// runs once, in an order that reverses every other round (A B, B A, ...), so a
// drift in the machine's speed costs every path the same.
func runWorkloads(ctx context.Context, cfg Config, rep *Report, paths []*path, prog *progress) error {
	prog.total = 0
	for _, name := range cfg.Workloads {
		switch name {
		case Control:
			prog.total += len(paths)
			if hasPath(paths, NFTables) {
				prog.total++ // the reference layout
			}
		case Idle:
			prog.total += len(paths)
		default:
			prog.total += len(paths) * cfg.Rounds
		}
	}
	for _, name := range Workloads {
		if !slices.Contains(cfg.Workloads, name) {
			continue
		}
		var err error
		switch name {
		case Idle:
			err = runIdleWorkload(ctx, cfg, rep, paths, prog)
		case Control:
			err = runControlWorkload(ctx, cfg, rep, paths, prog)
		default:
			err = runTrafficWorkload(ctx, cfg, rep, cfg.workload(name), paths, prog)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func runTrafficWorkload(ctx context.Context, cfg Config, rep *Report, wl *workload, paths []*path, prog *progress) error {
	results := map[string]*PathResult{}
	for _, p := range paths {
		r := &PathResult{Path: p.name}
		if wl.skip != nil {
			r.Skipped = wl.skip(p)
		}
		results[p.name] = r
	}
	for round := range cfg.Rounds {
		order := slices.Clone(paths)
		if round%2 == 1 {
			slices.Reverse(order)
		}
		for _, p := range order {
			r := results[p.name]
			prog.step(fmt.Sprintf("%s · %s · round %d/%d", wl.name, p.name, round+1, cfg.Rounds))
			if r.Skipped != "" || r.Error != "" {
				continue
			}
			rd, err := runTrial(ctx, p, wl, cfg.warmup(), cfg.Duration)
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if err != nil {
				r.Error = err.Error()
				continue
			}
			r.Rounds = append(r.Rounds, *rd)
		}
	}
	rep.Workloads = append(rep.Workloads, summarize(wl, paths, results))
	return nil
}

func runIdleWorkload(ctx context.Context, cfg Config, rep *Report, paths []*path, prog *progress) error {
	wr := WorkloadResult{
		Name:  Idle,
		Title: fmt.Sprintf("Idle connections (%d held open: growth of the proxy's RSS, and of uproxy's live heap, each read after a garbage collection)", cfg.IdleConns),
		Note:  rep.Settings.IdleNote,
		Unit:  "KiB/conn",
	}
	for _, p := range paths {
		prog.step(fmt.Sprintf("idle · %s · %d connections", p.name, cfg.IdleConns))
		r := PathResult{Path: p.name}
		if p.proxy == nil {
			r.Skipped = "no proxy process: the kernel holds the state"
			wr.Results = append(wr.Results, r)
			continue
		}
		ir, err := runIdle(ctx, p, cfg.IdleConns)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if err != nil {
			r.Error = err.Error()
		} else {
			// Below its noise the growth is no figure: Value stays absent,
			// and ir.Note says why.
			r.Idle = ir
			r.Value = ir.KiBPerConn
		}
		wr.Results = append(wr.Results, r)
	}
	ratios(&wr, false)
	rep.Workloads = append(rep.Workloads, wr)
	return nil
}

func runControlWorkload(ctx context.Context, cfg Config, rep *Report, paths []*path, prog *progress) error {
	for _, p := range paths {
		prog.step(fmt.Sprintf("control · %s · syncs of %v Service ports, %d endpoint changes", p.name, cfg.SyncSizes, cfg.EndpointChanges))
		e := ControlEntry{Path: p.name}
		if p.ctl == nil {
			e.Skipped = "not programmed by uproxy"
			rep.Control = append(rep.Control, e)
			continue
		}
		res, err := runControl(ctx, p, cfg.SyncSizes, cfg.EndpointChanges, cfg.StepLimit)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if err != nil {
			// A step that did not finish leaves the proxy busy with it: stop
			// it, so it does not load the machine under the paths after it.
			e.Error = err.Error() + " (uproxy stopped)"
			p.ctl.p.stop(5 * time.Second)
		}
		e.Result = res
		rep.Control = append(rep.Control, e)
	}
	if hasPath(paths, NFTables) {
		prog.step(fmt.Sprintf("control · %s · nft -f of %v Service ports", KubeProxyLayout, cfg.SyncSizes))
		e := ControlEntry{Path: KubeProxyLayout}
		res, err := runKubeProxyLayout(ctx, cfg.SyncSizes, cfg.StepLimit, paths[0].w.dir)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if err != nil {
			e.Error = err.Error()
		}
		e.Result = res
		rep.Control = append(rep.Control, e)
	}
	return nil
}

// raiseFileLimit lifts the open-file limit, which the proxies, the backends and
// this process inherit, and returns it: 10000 idle proxied connections are
// 20000 sockets in the proxy alone. Raising the hard limit needs
// CAP_SYS_RESOURCE; without it the soft limit goes up to the hard one.
func raiseFileLimit() int {
	const want = 1 << 20
	lim := syscall.Rlimit{Cur: want, Max: want}
	if syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim) == nil {
		return want
	}
	var cur syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &cur); err != nil {
		return 1024
	}
	cur.Cur = cur.Max
	syscall.Setrlimit(syscall.RLIMIT_NOFILE, &cur)
	return int(min(cur.Cur, want))
}

func machineInfo() Machine {
	m := Machine{CPUs: runtime.NumCPU(), GoVersion: runtime.Version()}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.Kernel = strings.TrimSpace(string(b))
	}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(l, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPUModel = strings.TrimSpace(v)
				break
			}
		}
	}
	m.LoadBefore = loadAverage()
	return m
}

// loadAverage returns the 1-, 5- and 15-minute load averages from
// /proc/loadavg, or "" where it cannot be read.
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return ""
	}
	return strings.Join(f[:3], " ")
}

func ptr(v float64) *float64 { return &v }

// progress rewrites one line on a terminal (or appends lines elsewhere) with
// the current step.
type progress struct {
	w           io.Writer
	start       time.Time
	n, total    int
	wroteInline bool
}

func newProgress(w io.Writer, start time.Time) *progress { return &progress{w: w, start: start} }

func (p *progress) step(what string) {
	p.n++
	p.show(what)
}

func (p *progress) show(what string) {
	if p.w == nil {
		return
	}
	el := time.Since(p.start).Round(time.Second)
	count := ""
	if p.total > 0 {
		count = fmt.Sprintf("[%d/%d] ", p.n, p.total)
	}
	// \r plus erase-to-end rewrites the line in place.
	fmt.Fprintf(p.w, "\r\033[K%s%v %s", count, el, what)
	p.wroteInline = true
}

func (p *progress) done() {
	if p.w != nil && p.wroteInline {
		fmt.Fprint(p.w, "\r\033[K")
	}
}

func hasPath(paths []*path, name string) bool {
	return slices.ContainsFunc(paths, func(p *path) bool { return p.name == name })
}
