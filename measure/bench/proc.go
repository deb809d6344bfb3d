package bench

import (
	"bytes"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
)

// clockTick is USER_HZ, the unit of utime and stime in /proc/<pid>/stat. Linux
// exports 100 to userspace on every architecture Go supports.
const clockTick = 100

var pageSize = int64(os.Getpagesize())

// procStat is what the benchmark reads of one process in /proc/<pid>/stat.
type procStat struct {
	ppid    int
	cpu     time.Duration // utime + stime
	rssByte int64
}

// readProcStat parses /proc/<pid>/stat. The command name (field 2) may hold
// spaces and parentheses, so fields are counted from the last ')'.
func readProcStat(pid int) (procStat, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return procStat{}, err
	}
	return parseProcStat(b)
}

func parseProcStat(b []byte) (procStat, error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procStat{}, fmt.Errorf("stat %q: no command name", b)
	}
	// After ") " come field 3 (state) onwards.
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 22 {
		return procStat{}, fmt.Errorf("stat: %d fields after the name, want at least 22", len(f))
	}
	num := func(k int) int64 { // k is the field number in proc(5)
		v, _ := strconv.ParseInt(f[k-3], 10, 64)
		return v
	}
	ticks := num(14) + num(15)
	return procStat{
		ppid:    int(num(4)),
		cpu:     time.Duration(ticks) * time.Second / clockTick,
		rssByte: num(24) * pageSize,
	}, nil
}

// processTree returns pid and every live descendant of it: nginx's workers,
// anything a proxy forks. Children are found through their ppid in /proc.
func processTree(pid int) []int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return []int{pid}
	}
	children := map[int][]int{}
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		st, err := readProcStat(p)
		if err != nil {
			continue
		}
		children[st.ppid] = append(children[st.ppid], p)
	}
	tree := []int{pid}
	for i := 0; i < len(tree); i++ {
		tree = append(tree, children[tree[i]]...)
	}
	return tree
}

// usage is the CPU time and resident memory of a process tree at one moment.
type usage struct {
	cpu time.Duration
	rss int64
}

// treeUsage sums CPU and RSS over pid's process tree. A process that exited
// since it was listed is left out: its CPU is lost to the sum, which is why the
// proxies measured keep their workers for the whole run.
func treeUsage(pid int) (usage, error) {
	var u usage
	for i, p := range processTree(pid) {
		st, err := readProcStat(p)
		if err != nil {
			if i == 0 {
				return usage{}, fmt.Errorf("process %d: %w", pid, err)
			}
			continue
		}
		u.cpu += st.cpu
		u.rss += st.rssByte
	}
	return u, nil
}

// tcpOutSegs reads the TCP segments the calling thread's network namespace has
// sent (OutSegs of /proc/thread-self/net/snmp, which counts IPv4 and IPv6 alike).
func tcpOutSegs() (uint64, error) {
	b, err := os.ReadFile("/proc/thread-self/net/snmp")
	if err != nil {
		return 0, err
	}
	return parseOutSegs(b)
}

// parseOutSegs finds OutSegs in the Tcp: header and value lines of an snmp file.
func parseOutSegs(b []byte) (uint64, error) {
	var names []string
	for line := range strings.Lines(string(b)) {
		f := strings.Fields(line)
		if len(f) == 0 || f[0] != "Tcp:" {
			continue
		}
		if names == nil {
			names = f
			continue
		}
		if i := slices.Index(names, "OutSegs"); i > 0 && i < len(f) {
			n, err := strconv.ParseUint(f[i], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("snmp: OutSegs %q: %w", f[i], err)
			}
			return n, nil
		}
		break
	}
	return 0, fmt.Errorf("snmp: no Tcp: OutSegs")
}

// machineBusy is the CPU time every core spent on anything but idle and iowait
// since boot, from the first line of /proc/stat: the one figure that also sees
// the kernel's work for the kernel modes (softirq), which no process owns.
func machineBusy() (time.Duration, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, err
	}
	return parseMachineBusy(b)
}

func parseMachineBusy(b []byte) (time.Duration, error) {
	line, _, _ := bytes.Cut(b, []byte("\n"))
	f := strings.Fields(string(line))
	if len(f) < 8 || f[0] != "cpu" {
		return 0, fmt.Errorf("/proc/stat: first line %q is not the cpu total", line)
	}
	var busy int64
	// user nice system idle iowait irq softirq steal ...; guest time is already
	// part of user, so it is not added again.
	for k, v := range f[1:] {
		if k == 3 || k == 4 || k >= 8 {
			continue
		}
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc/stat: field %d %q: %w", k+1, v, err)
		}
		busy += n
	}
	return time.Duration(busy) * time.Second / clockTick, nil
}
