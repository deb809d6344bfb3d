package bench

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// CPU placement. With Config.ProxyCPUs set, every proxy process of a run
// (uproxy, HAProxy, nginx) runs on those CPUs, and everything else (this
// process and its load generators, the backend servers) on the CPUs left: the
// proxy under test then never waits for a CPU behind the load it is measured
// with, and the peers run one worker or thread per proxy CPU, as uproxy runs
// its default of event loops for them. Without it every process shares every
// CPU of the run.

// ParseCPUList reads a CPU list as the kernel writes one: numbers and ranges
// separated by commas ("1", "0,2", "2-3").
func ParseCPUList(s string) ([]int, error) {
	var cpus []int
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		lo, hi, isRange := strings.Cut(part, "-")
		first, err := strconv.Atoi(lo)
		if err != nil || first < 0 {
			return nil, fmt.Errorf("CPU list %q: %q is not a CPU number or range", s, part)
		}
		last := first
		if isRange {
			if last, err = strconv.Atoi(hi); err != nil || last < first {
				return nil, fmt.Errorf("CPU list %q: %q is not a CPU range (low-high)", s, part)
			}
		}
		for c := first; c <= last; c++ {
			if !slices.Contains(cpus, c) {
				cpus = append(cpus, c)
			}
		}
	}
	slices.Sort(cpus)
	return cpus, nil
}

// formatCPUList writes set as a CPU list, ranges folded ("0,2-3").
func formatCPUList(set *unix.CPUSet) string {
	var parts []string
	for c := 0; c < len(set)*64; c++ {
		if !set.IsSet(c) {
			continue
		}
		end := c
		for end+1 < len(set)*64 && set.IsSet(end+1) {
			end++
		}
		if end > c {
			parts = append(parts, fmt.Sprintf("%d-%d", c, end))
		} else {
			parts = append(parts, strconv.Itoa(c))
		}
		c = end
	}
	return strings.Join(parts, ",")
}

// placement is the CPU split of a run: proxy for the proxies, rest for the
// others; orig is this process's affinity before the run, given back after.
type placement struct {
	proxy, rest, orig unix.CPUSet
}

// newPlacement splits this process's CPUs into cpus and the others. Every CPU
// asked for must be one this process may run on, and at least one must be
// left.
func newPlacement(cpus []int) (*placement, error) {
	pl := &placement{}
	if err := unix.SchedGetaffinity(0, &pl.orig); err != nil {
		return nil, fmt.Errorf("--proxy-cpus: read this process's CPUs: %w", err)
	}
	pl.rest = pl.orig
	for _, c := range cpus {
		if c >= len(pl.orig)*64 || !pl.orig.IsSet(c) {
			return nil, fmt.Errorf("--proxy-cpus: CPU %d is not one this process may run on (%s)", c, formatCPUList(&pl.orig))
		}
		pl.proxy.Set(c)
		pl.rest.Clear(c)
	}
	if pl.rest.Count() == 0 {
		return nil, fmt.Errorf("--proxy-cpus %s leaves no CPU for the load generators and backends (this process may run on %s)", formatCPUList(&pl.proxy), formatCPUList(&pl.orig))
	}
	return pl, nil
}

// workers is how many workers a peer runs: one per proxy CPU.
func (pl *placement) workers() int { return pl.proxy.Count() }

// pinProcess moves every thread of this process onto set. A thread made
// meanwhile inherits its maker's CPUs, so the threads are listed again until a
// pass finds none it had not moved.
func pinProcess(set *unix.CPUSet) error {
	done := map[int]bool{}
	for {
		tids, err := filepath.Glob("/proc/self/task/*")
		if err != nil {
			return err
		}
		moved := 0
		for _, dir := range tids {
			tid, err := strconv.Atoi(filepath.Base(dir))
			if err != nil || done[tid] {
				continue
			}
			// A thread that ended since the listing is not an error.
			if err := unix.SchedSetaffinity(tid, set); err != nil && err != unix.ESRCH {
				return fmt.Errorf("set the CPUs of thread %d: %w", tid, err)
			}
			done[tid] = true
			moved++
		}
		if moved == 0 {
			return nil
		}
	}
}

// allowedCPUs is the CPU list the kernel lets pid run on, from /proc.
func allowedCPUs(pid int) (string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Cpus_allowed_list:"); ok {
			return strings.TrimSpace(v), nil
		}
	}
	return "", fmt.Errorf("/proc/%d/status has no Cpus_allowed_list", pid)
}
