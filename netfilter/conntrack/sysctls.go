package conntrack

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Sysctls are the conntrack settings kube-proxy makes when it starts, in every
// mode (its KubeProxyConntrackConfiguration): the size of the table and the
// timeouts of some TCP and UDP states. A zero field leaves its sysctl as it is,
// as kube-proxy's does, so the zero Sysctls change nothing.
//
// The timeouts and tcp_be_liberal belong to the network namespace they are
// written in. The table's size is one for the whole machine: outside the
// initial network namespace the kernel makes nf_conntrack_max read-only.
type Sysctls struct {
	// MaxPerCore sizes the table (nf_conntrack_max, see Max): this many
	// entries per CPU. 0: leave the size alone, whatever Min.
	MaxPerCore int
	// Min is the table's least size when MaxPerCore sizes it.
	Min int
	// TCPEstablishedTimeout is how long an idle established TCP flow stays
	// tracked (nf_conntrack_tcp_timeout_established), in whole seconds.
	TCPEstablishedTimeout time.Duration
	// TCPCloseWaitTimeout is how long a TCP flow stays tracked after the
	// first FIN, waiting for the other side's (nf_conntrack_tcp_timeout_close_wait).
	TCPCloseWaitTimeout time.Duration
	// TCPBeLiberal sets nf_conntrack_tcp_be_liberal to 1: TCP packets outside
	// the window conntrack expects are tracked, not marked INVALID. false:
	// leave it alone (kube-proxy never sets it back to 0 either).
	TCPBeLiberal bool
	// UDPTimeout is how long a UDP flow without a reply stays tracked
	// (nf_conntrack_udp_timeout).
	UDPTimeout time.Duration
	// UDPStreamTimeout is how long a UDP flow with replies stays tracked
	// (nf_conntrack_udp_timeout_stream).
	UDPStreamTimeout time.Duration
}

// The settings Set writes, as sysctl names them (HashSize is a parameter of
// the nf_conntrack module, written with the table's size).
const (
	SysctlMax                   = "net.netfilter.nf_conntrack_max"
	SysctlTCPTimeoutEstablished = "net.netfilter.nf_conntrack_tcp_timeout_established"
	SysctlTCPTimeoutCloseWait   = "net.netfilter.nf_conntrack_tcp_timeout_close_wait"
	SysctlTCPBeLiberal          = "net.netfilter.nf_conntrack_tcp_be_liberal"
	SysctlUDPTimeout            = "net.netfilter.nf_conntrack_udp_timeout"
	SysctlUDPTimeoutStream      = "net.netfilter.nf_conntrack_udp_timeout_stream"
	HashSize                    = "nf_conntrack.hashsize"
)

// maxTableSize caps MaxPerCore's product, as kube-proxy does, so that a
// machine with many CPUs does not get a table of a few GiB.
const maxTableSize = 1 << 20

// Max returns the table size s asks for on a machine of cpus CPUs, as
// kube-proxy computes it: MaxPerCore×cpus, at least Min, but at most 1Mi
// when the product is larger (whatever Min). 0: leave the size alone.
func (s Sysctls) Max(cpus int) int {
	if s.MaxPerCore <= 0 {
		return 0
	}
	scaled := s.MaxPerCore * cpus
	if scaled > maxTableSize {
		return maxTableSize
	}
	return max(scaled, s.Min)
}

// Change is one value Set wrote.
type Change struct {
	Key  string // SysctlMax, ..., HashSize
	From string // the value it replaced; "" when it could not be read
	To   int
}

// SysctlError is a setting Set could not write.
type SysctlError struct {
	Key   string // SysctlMax, ..., HashSize
	Value int
	Err   error
	// why says what stands in the way, when the error shows it.
	why string
}

func (e *SysctlError) Error() string {
	msg := fmt.Sprintf("set %s to %d: %v", e.Key, e.Value, e.Err)
	if e.why != "" {
		msg += " (" + e.why + ")"
	}
	return msg
}

func (e *SysctlError) Unwrap() error { return e.Err }

// Set writes every setting of s whose value differs from the current one, in
// the network namespace the process is in, and returns what it wrote. With the
// table's size it grows the hash table (HashSize) to a quarter of the size
// when it is smaller, as kube-proxy does. A setting that fails does not stop
// the others: the errors, a *SysctlError each, are joined.
func (s Sysctls) Set() ([]Change, error) {
	return s.set(kernel{
		procSys:  "/proc/sys",
		hashSize: "/sys/module/nf_conntrack/parameters/hashsize",
		cpus:     onlineCPUs,
	})
}

// kernel is where Set reads and writes: the real files, or a test's copies.
type kernel struct {
	procSys  string // the sysctl tree
	hashSize string // nf_conntrack's hashsize parameter
	cpus     func() int
}

func (s Sysctls) set(k kernel) ([]Change, error) {
	var changes []Change
	var errs []error
	write := func(key, path string, value int) {
		c, err := writeIfDifferent(key, path, value)
		if err != nil {
			errs = append(errs, err)
		} else if c != nil {
			changes = append(changes, *c)
		}
	}
	sysctl := func(key string) string {
		return filepath.Join(k.procSys, strings.ReplaceAll(key, ".", "/"))
	}
	if size := s.Max(k.cpus()); size > 0 {
		n := len(errs)
		write(SysctlMax, sysctl(SysctlMax), size)
		if len(errs) == n {
			if err := growHashSize(k.hashSize, size/4, &changes); err != nil {
				errs = append(errs, err)
			}
		}
	}
	for _, t := range []struct {
		key string
		d   time.Duration
	}{
		{SysctlTCPTimeoutEstablished, s.TCPEstablishedTimeout},
		{SysctlTCPTimeoutCloseWait, s.TCPCloseWaitTimeout},
	} {
		if t.d > 0 {
			write(t.key, sysctl(t.key), int(t.d/time.Second))
		}
	}
	if s.TCPBeLiberal {
		write(SysctlTCPBeLiberal, sysctl(SysctlTCPBeLiberal), 1)
	}
	for _, t := range []struct {
		key string
		d   time.Duration
	}{
		{SysctlUDPTimeout, s.UDPTimeout},
		{SysctlUDPTimeoutStream, s.UDPStreamTimeout},
	} {
		if t.d > 0 {
			write(t.key, sysctl(t.key), int(t.d/time.Second))
		}
	}
	return changes, errors.Join(errs...)
}

// growHashSize sets the hash table's buckets to want when it has fewer. Only
// the initial network namespace may change it; kube-proxy reads it even when
// the table's size was already right, and so does this.
func growHashSize(path string, want int, changes *[]Change) error {
	cur, err := readInt(path)
	if err != nil {
		return &SysctlError{Key: HashSize, Value: want, Err: err, why: why(path, err)}
	}
	if cur >= want {
		return nil
	}
	if err := writeInt(path, want); err != nil {
		return &SysctlError{Key: HashSize, Value: want, Err: err, why: why(path, err)}
	}
	*changes = append(*changes, Change{Key: HashSize, From: strconv.Itoa(cur), To: want})
	return nil
}

// SetSysctl writes the sysctl key (dotted, as sysctl(8) names it) in the
// network namespace of the calling thread, unless it holds value already, and
// returns what it changed (nil: nothing). Set writes the conntrack settings so;
// the iptables mode writes net.ipv4.conf.all.route_localnet through it, so that
// every sysctl uproxy sets explains a failure the same way.
func SetSysctl(key string, value int) (*Change, error) {
	return writeIfDifferent(key, filepath.Join("/proc/sys", strings.ReplaceAll(key, ".", "/")), value)
}

// writeIfDifferent writes value to path unless it holds it already; a value
// that cannot be read is written all the same, as kube-proxy does.
func writeIfDifferent(key, path string, value int) (*Change, error) {
	cur, readErr := os.ReadFile(path)
	from := strings.TrimSpace(string(cur))
	if readErr == nil && from == strconv.Itoa(value) {
		return nil, nil
	}
	if err := writeInt(path, value); err != nil {
		return nil, &SysctlError{Key: key, Value: value, Err: err, why: why(path, err)}
	}
	return &Change{Key: key, From: from, To: value}, nil
}

// why explains a failed access to path, when the error tells.
func why(path string, err error) string {
	switch {
	case errors.Is(err, unix.EROFS):
		return "mounted read-only here, as /proc/sys and /sys are in a container that is not privileged"
	case errors.Is(err, fs.ErrNotExist) && strings.Contains(path, "nf_conntrack"):
		return "no such setting: the nf_conntrack module is not loaded (modprobe nf_conntrack)"
	case errors.Is(err, fs.ErrNotExist):
		return "no such setting in this kernel"
	case errors.Is(err, unix.EOPNOTSUPP):
		return "only the initial network namespace may change it"
	case errors.Is(err, fs.ErrPermission):
		// The kernel makes the machine-wide settings read-only, for root
		// too, in every other network namespace.
		if fi, serr := os.Stat(path); serr == nil && fi.Mode().Perm()&0o222 == 0 {
			return "read-only in this network namespace: only the initial one may change it"
		}
		return "needs root or CAP_NET_ADMIN"
	}
	return ""
}

func readInt(path string) (int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(strings.TrimSpace(string(b)))
}

// writeInt writes v to an existing file (a sysctl or module parameter is
// never created).
func writeInt(path string, v int) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString(strconv.Itoa(v))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// onlineCPUs counts the machine's online CPUs (/sys/devices/system/cpu/online,
// such as "0-3,6"), as kube-proxy counts them from sysfs rather than from the
// process's CPU affinity (runtime.NumCPU), which a container's cpuset narrows.
// It falls back to runtime.NumCPU.
func onlineCPUs() int {
	b, err := os.ReadFile("/sys/devices/system/cpu/online")
	if err != nil {
		return runtime.NumCPU()
	}
	n, err := countCPUs(strings.TrimSpace(string(b)))
	if err != nil || n < 1 {
		return runtime.NumCPU()
	}
	return n
}

// countCPUs counts the CPUs of a kernel CPU list ("0-3,6").
func countCPUs(list string) (int, error) {
	n := 0
	for _, part := range strings.Split(list, ",") {
		lo, hi, isRange := strings.Cut(part, "-")
		first, err := strconv.Atoi(lo)
		if err != nil {
			return 0, fmt.Errorf("CPU list %q: %w", list, err)
		}
		last := first
		if isRange {
			if last, err = strconv.Atoi(hi); err != nil || last < first {
				return 0, fmt.Errorf("CPU list %q: bad range %q", list, part)
			}
		}
		n += last - first + 1
	}
	return n, nil
}
