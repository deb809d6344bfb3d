package conntrack

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// kubeProxyDefaults are kube-proxy's conntrack settings when its configuration
// leaves them out.
var kubeProxyDefaults = Sysctls{MaxPerCore: 32 * 1024, Min: 128 * 1024, TCPEstablishedTimeout: 24 * time.Hour, TCPCloseWaitTimeout: time.Hour}

func TestSysctlsMax(t *testing.T) {
	for _, tc := range []struct {
		name      string
		perCore   int
		min, cpus int
		want      int
	}{
		{"kube-proxy's defaults, 2 CPUs: the minimum", 32768, 131072, 2, 131072},
		{"kube-proxy's defaults, 8 CPUs: per core", 32768, 131072, 8, 262144},
		{"a product over 1Mi is capped", 65536, 0, 32, 1 << 20},
		{"the cap applies whatever the minimum", 65536, 4 << 20, 32, 1 << 20},
		{"a minimum over 1Mi stands when the product is below it", 100, 4 << 20, 2, 4 << 20},
		{"0 per core leaves the size alone, whatever the minimum", 0, 131072, 2, 0},
	} {
		if got := (Sysctls{MaxPerCore: tc.perCore, Min: tc.min}).Max(tc.cpus); got != tc.want {
			t.Errorf("%s: got %d, want %d", tc.name, got, tc.want)
		}
	}
}

// fakeKernel is a sysctl tree and hashsize file in a temporary directory,
// holding a fresh kernel's values.
func fakeKernel(t *testing.T, cpus int) kernel {
	t.Helper()
	dir := t.TempDir()
	k := kernel{procSys: filepath.Join(dir, "sys"), hashSize: filepath.Join(dir, "hashsize"), cpus: func() int { return cpus }}
	files := map[string]string{
		filepath.Join(k.procSys, "net/netfilter/nf_conntrack_max"):                     "262144",
		filepath.Join(k.procSys, "net/netfilter/nf_conntrack_tcp_timeout_established"): "432000",
		filepath.Join(k.procSys, "net/netfilter/nf_conntrack_tcp_timeout_close_wait"):  "60",
		filepath.Join(k.procSys, "net/netfilter/nf_conntrack_tcp_be_liberal"):          "0",
		filepath.Join(k.procSys, "net/netfilter/nf_conntrack_udp_timeout"):             "30",
		filepath.Join(k.procSys, "net/netfilter/nf_conntrack_udp_timeout_stream"):      "120",
		k.hashSize: "65536",
	}
	for path, v := range files {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(v+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return k
}

func (k kernel) read(t *testing.T, key string) string {
	t.Helper()
	path := filepath.Join(k.procSys, strings.ReplaceAll(key, ".", "/"))
	if key == HashSize {
		path = k.hashSize
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

func TestSysctlsSet(t *testing.T) {
	every := Sysctls{MaxPerCore: 32768, Min: 131072, TCPEstablishedTimeout: 24 * time.Hour, TCPCloseWaitTimeout: time.Hour,
		TCPBeLiberal: true, UDPTimeout: 45 * time.Second, UDPStreamTimeout: 3 * time.Minute}
	for _, tc := range []struct {
		name    string
		s       Sysctls
		cpus    int
		changes []Change
		want    map[string]string
	}{{
		name: "kube-proxy's defaults on 2 CPUs",
		s:    kubeProxyDefaults, cpus: 2,
		changes: []Change{
			{SysctlMax, "262144", 131072},
			{SysctlTCPTimeoutEstablished, "432000", 86400},
			{SysctlTCPTimeoutCloseWait, "60", 3600},
		},
		want: map[string]string{SysctlMax: "131072", HashSize: "65536", SysctlTCPTimeoutCloseWait: "3600", SysctlTCPBeLiberal: "0", SysctlUDPTimeout: "30"},
	}, {
		name: "every setting, a table that needs more buckets",
		s:    every, cpus: 16,
		changes: []Change{
			{SysctlMax, "262144", 524288},
			{HashSize, "65536", 131072},
			{SysctlTCPTimeoutEstablished, "432000", 86400},
			{SysctlTCPTimeoutCloseWait, "60", 3600},
			{SysctlTCPBeLiberal, "0", 1},
			{SysctlUDPTimeout, "30", 45},
			{SysctlUDPTimeoutStream, "120", 180},
		},
		want: map[string]string{SysctlMax: "524288", HashSize: "131072", SysctlTCPBeLiberal: "1", SysctlUDPTimeoutStream: "180"},
	}, {
		name: "zero changes nothing",
		s:    Sysctls{Min: 131072}, cpus: 2,
		want: map[string]string{SysctlMax: "262144", SysctlTCPTimeoutEstablished: "432000", SysctlTCPTimeoutCloseWait: "60"},
	}, {
		name: "values already in place are not written",
		s:    Sysctls{MaxPerCore: 131072, TCPCloseWaitTimeout: 60 * time.Second, UDPTimeout: 30 * time.Second}, cpus: 2,
	}, {
		// kube-proxy takes whole seconds.
		name: "timeouts in whole seconds",
		s:    Sysctls{TCPCloseWaitTimeout: 90*time.Minute + 999*time.Millisecond}, cpus: 2,
		changes: []Change{{SysctlTCPTimeoutCloseWait, "60", 5400}},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			k := fakeKernel(t, tc.cpus)
			changes, err := tc.s.set(k)
			if err != nil {
				t.Fatalf("got error %v, want none", err)
			}
			if !slices.Equal(changes, tc.changes) {
				t.Errorf("got changes %v, want %v", changes, tc.changes)
			}
			for key, want := range tc.want {
				if got := k.read(t, key); got != want {
					t.Errorf("%s: got %s, want %s", key, got, want)
				}
			}
			if again, err := tc.s.set(k); err != nil || len(again) != 0 {
				t.Errorf("a second Set: got changes %v, error %v; want none", again, err)
			}
		})
	}
}

// Every setting that cannot be written is reported, the others are written.
func TestSysctlsSetErrors(t *testing.T) {
	k := fakeKernel(t, 2)
	for _, key := range []string{SysctlMax, SysctlTCPTimeoutEstablished} {
		if err := os.Remove(filepath.Join(k.procSys, strings.ReplaceAll(key, ".", "/"))); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Remove(k.hashSize); err != nil {
		t.Fatal(err)
	}
	changes, err := kubeProxyDefaults.set(k)
	var failed []string
	for _, e := range err.(interface{ Unwrap() []error }).Unwrap() {
		var se *SysctlError
		if !errors.As(e, &se) {
			t.Fatalf("error %v: got %T, want a *SysctlError", e, e)
		}
		failed = append(failed, se.Key)
		if !errors.Is(e, fs.ErrNotExist) || !strings.Contains(e.Error(), "the nf_conntrack module is not loaded") {
			t.Errorf("error %q: want it to wrap ErrNotExist and say the module is not loaded", e)
		}
	}
	// The hash table is not looked at once the size failed, as in kube-proxy.
	if want := []string{SysctlMax, SysctlTCPTimeoutEstablished}; !slices.Equal(failed, want) {
		t.Errorf("failed settings: got %v, want %v", failed, want)
	}
	if want := []Change{{SysctlTCPTimeoutCloseWait, "60", 3600}}; !slices.Equal(changes, want) {
		t.Errorf("changes beside the failures: got %v, want %v", changes, want)
	}
}

func TestWhy(t *testing.T) {
	dir := t.TempDir()
	readOnly, writable := filepath.Join(dir, "ro"), filepath.Join(dir, "rw")
	for path, mode := range map[string]os.FileMode{readOnly: 0o444, writable: 0o644} {
		if err := os.WriteFile(path, []byte("1"), mode); err != nil {
			t.Fatal(err)
		}
	}
	denied := func(path string) error { return &fs.PathError{Op: "open", Path: path, Err: unix.EACCES} }
	for _, tc := range []struct {
		name string
		path string
		err  error
		want string
	}{
		{"a read-only sysctl: another network namespace", readOnly, denied(readOnly), "only the initial one may change it"},
		{"a writable sysctl denied: no privilege", writable, denied(writable), "needs root or CAP_NET_ADMIN"},
		{"a read-only mount", writable, &fs.PathError{Op: "open", Path: writable, Err: unix.EROFS}, "mounted read-only"},
		{"hashsize outside the initial namespace", writable, unix.EOPNOTSUPP, "only the initial network namespace"},
		{"a conntrack setting missing: the module", "/proc/sys/net/netfilter/nf_conntrack_max", fs.ErrNotExist, "modprobe nf_conntrack"},
		{"another setting missing", "/proc/sys/net/ipv4/conf/all/route_localnet", fs.ErrNotExist, "no such setting in this kernel"},
		{"anything else", writable, unix.EIO, ""},
	} {
		if got := why(tc.path, tc.err); tc.want == "" && got != "" || !strings.Contains(got, tc.want) || strings.Contains(tc.path, "route_localnet") && strings.Contains(got, "conntrack") {
			t.Errorf("%s: got %q, want %q", tc.name, got, tc.want)
		}
	}
}

func TestCountCPUs(t *testing.T) {
	for list, want := range map[string]int{"0": 1, "0-1": 2, "0-3,6": 5, "0,2,4-7": 6} {
		if got, err := countCPUs(list); err != nil || got != want {
			t.Errorf("countCPUs(%q): got %d, %v; want %d", list, got, err, want)
		}
	}
	for _, bad := range []string{"", "x", "3-1", "0-"} {
		if _, err := countCPUs(bad); err == nil {
			t.Errorf("countCPUs(%q): got no error, want one", bad)
		}
	}
}
