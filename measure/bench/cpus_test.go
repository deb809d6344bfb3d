package bench

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/test/testbed"
)

func TestParseCPUList(t *testing.T) {
	good := []struct {
		in   string
		want []int
	}{
		{"1", []int{1}},
		{"0,2", []int{0, 2}},
		{"2-3", []int{2, 3}},
		{" 5 , 1-2,2", []int{1, 2, 5}},
	}
	for _, tt := range good {
		got, err := ParseCPUList(tt.in)
		if err != nil || !slices.Equal(got, tt.want) {
			t.Errorf("ParseCPUList(%q): got %v, %v, want %v", tt.in, got, err, tt.want)
		}
	}
	for _, in := range []string{"", "a", "3-1", "-1", "1-", "1,,2", "1-x"} {
		if got, err := ParseCPUList(in); err == nil {
			t.Errorf("ParseCPUList(%q): got %v, want an error", in, got)
		} else if !strings.Contains(err.Error(), strconv.Quote(in)) {
			t.Errorf("ParseCPUList(%q): error %q does not name the list", in, err)
		}
	}
}

func TestFormatCPUList(t *testing.T) {
	var set unix.CPUSet
	for _, c := range []int{0, 2, 3, 5, 6, 7, 64, 100, 101} {
		set.Set(c)
	}
	const want = "0,2-3,5-7,64,100-101"
	if got := formatCPUList(&set); got != want {
		t.Fatalf("formatCPUList: got %q, want %q", got, want)
	}
	back, err := ParseCPUList(want)
	if err != nil {
		t.Fatal(err)
	}
	var again unix.CPUSet
	for _, c := range back {
		again.Set(c)
	}
	if again != set {
		t.Errorf("the list read back is %s, want %s", formatCPUList(&again), want)
	}
}

func TestPlacementRejects(t *testing.T) {
	var mine unix.CPUSet
	if err := unix.SchedGetaffinity(0, &mine); err != nil {
		t.Fatal(err)
	}
	var all []int
	for c := 0; c < len(mine)*64; c++ {
		if mine.IsSet(c) {
			all = append(all, c)
		}
	}
	if _, err := newPlacement(all); err == nil || !strings.Contains(err.Error(), "leaves no CPU") {
		t.Errorf("every CPU: got %v, want an error saying none is left", err)
	}
	outside := len(mine)*64 - 1
	if mine.IsSet(outside) {
		t.Fatalf("this process may run on CPU %d; the test needs one it may not", outside)
	}
	want := fmt.Sprintf("CPU %d is not one this process may run on", outside)
	if _, err := newPlacement([]int{outside}); err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("CPU %d: got %v, want an error containing %q", outside, err, want)
	}
}

// TestProxyCPUs runs the proxies of both topologies on the last CPU: each proxy
// process, as the kernel reports it, may run there alone, the load generators
// and backends on every other CPU, the peers with one worker each, and the test
// process has its CPUs back afterwards.
func TestProxyCPUs(t *testing.T) {
	testbed.Needs(t, testbed.Netns, testbed.Build)
	var mine unix.CPUSet
	if err := unix.SchedGetaffinity(0, &mine); err != nil {
		t.Fatal(err)
	}
	if mine.Count() < 2 {
		testbed.Skip(t, "placing the proxies needs 2 CPUs, this process has", mine.Count())
	}
	last := -1
	for c := 0; c < len(mine)*64; c++ {
		if mine.IsSet(c) {
			last = c
		}
	}
	rest := mine
	rest.Clear(last)
	bin := filepath.Join(t.TempDir(), "uproxy")
	if out, err := exec.Command("go", "build", "-o", bin, "../..").CombinedOutput(); err != nil {
		t.Fatalf("go build uproxy: %v\n%s", err, out)
	}

	// The peers' worker counts are read while the run goes on; the count seen
	// most often is the one they serve with (a process starting or stopping
	// may show another for a moment).
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	seen := map[string]map[int]int{"nginx": {}, "haproxy": {}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			for peer, counts := range seen {
				if n := peerWorkers(peer); n > 0 {
					counts[n]++
				}
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	var table bytes.Buffer
	rep, err := Run(ctx, Config{
		Paths:     []string{Userspace, HAProxy, Nginx, LoUserspace, LoNginx},
		Workloads: []string{Connections},
		Duration:  200 * time.Millisecond,
		Rounds:    1,
		ProxyCPUs: []int{last},
		Uproxy:    bin,
		Log:       testWriter{t},
	})
	cancel()
	<-done
	workers := map[string]int{}
	for peer, counts := range seen {
		for n, times := range counts {
			if times > counts[workers[peer]] {
				workers[peer] = n
			}
		}
	}
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if f := rep.Failed(); len(f) > 0 {
		t.Errorf("failures: got %q, want none", f)
	}
	want := strconv.Itoa(last)
	if rep.Settings.ProxyCPUs != want || rep.Settings.LoadCPUs != formatCPUList(&rest) {
		t.Errorf("settings: proxies on %q, load on %q; want %q and %q", rep.Settings.ProxyCPUs, rep.Settings.LoadCPUs, want, formatCPUList(&rest))
	}
	for _, p := range rep.Paths {
		if !p.Available || p.Error != "" {
			if p.Name == Userspace || p.Name == LoUserspace {
				t.Errorf("%s: got unavailable or failed (%s%s), want it to run", p.Name, p.Reason, p.Error)
			}
			continue
		}
		if p.ProxyCPUs != want {
			t.Errorf("%s: the proxy may run on CPUs %q, want %q", p.Name, p.ProxyCPUs, want)
		}
		if isPeer(p.Name) && workers[baseName(p.Name)] != 1 {
			t.Errorf("%s: ran with %d workers most of the time, want 1 (one per proxy CPU); counts seen: %v", p.Name, workers[baseName(p.Name)], seen[baseName(p.Name)])
		}
	}
	if err := rep.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	if line := fmt.Sprintf("proxies on CPUs %s", want); !strings.Contains(table.String(), line) {
		t.Errorf("the table does not say %q:\n%s", line, table.String())
	}
	tasks, err := filepath.Glob("/proc/self/task/*")
	if err != nil {
		t.Fatal(err)
	}
	for _, task := range tasks {
		tid, _ := strconv.Atoi(filepath.Base(task))
		var got unix.CPUSet
		if err := unix.SchedGetaffinity(tid, &got); err == nil && got != mine {
			t.Errorf("after the run, thread %d may run on %s, want %s as before", tid, formatCPUList(&got), formatCPUList(&mine))
		}
	}
}

// peerWorkers counts the processes or threads of a running peer that do its
// work, the most of any one instance: an nginx master's worker processes, or
// a haproxy process's threads; 0 when none runs.
func peerWorkers(peer string) int {
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	perMaster := map[int]int{}
	most := 0
	for _, dir := range dirs {
		cmdline, err := os.ReadFile(filepath.Join(dir, "cmdline"))
		if err != nil {
			continue
		}
		// Other runs of the benchmark on a shared machine have peers too.
		pid, _ := strconv.Atoi(filepath.Base(dir))
		if !startedByThisProcess(pid) {
			continue
		}
		switch {
		case peer == "nginx" && strings.HasPrefix(string(cmdline), "nginx: worker process"):
			if master, ok := parentPID(pid); ok {
				perMaster[master]++
				most = max(most, perMaster[master])
			}
		case peer == "haproxy" && strings.HasPrefix(string(cmdline), "haproxy\x00"):
			threads, _ := filepath.Glob(filepath.Join(dir, "task", "*"))
			most = max(most, len(threads))
		}
	}
	return most
}

// startedByThisProcess reports whether pid descends from this process.
func startedByThisProcess(pid int) bool {
	self := os.Getpid()
	for pid > 1 {
		var ok bool
		if pid, ok = parentPID(pid); !ok {
			return false
		}
		if pid == self {
			return true
		}
	}
	return false
}

// parentPID reads the parent of process pid from /proc.
func parentPID(pid int) (int, bool) {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, false
	}
	// The parent's pid is the fourth field, after the name in parentheses.
	fields := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
	if len(fields) < 2 {
		return 0, false
	}
	ppid, err := strconv.Atoi(fields[1])
	return ppid, err == nil
}
