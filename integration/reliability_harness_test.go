package integration

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// launch says how runUproxy starts the binary.
type launch struct {
	// wrapper runs before the binary inside the namespace (prlimit, setpriv).
	wrapper []string
	// bin is the binary to run; empty: uproxyBin.
	bin string
	// dir holds the manifests; empty: a fresh test directory.
	dir string
	// want Service ports with proxy ports are awaited through /debug/services;
	// a negative want waits only for a completed sync (for --debug-handlers=false).
	want  int
	flags []string
	// defaultAddrs leaves --metrics-bind-address and --healthz-bind-address to
	// their defaults.
	defaultAddrs bool
	// source replaces "--services DIR" (e.g. --kubeconfig FILE); manifests are
	// then not written.
	source []string
	// ready, when set, replaces want: the state /debug/services must reach.
	ready func([]serviceState) bool
	// noWait returns once the process started, before it serves.
	noWait bool
}

// start runs `ip` with args (uproxy in the node namespace), its output in a log
// of the test's, a client for its HTTP addresses that dials from the node, and
// a cleanup that stops it and shows its log when the test failed.
func (p *proxy) start(args []string) {
	t, tp := p.t, p.tp
	t.Helper()
	p.log = filepath.Join(t.TempDir(), "uproxy.log")
	logf, err := os.Create(p.log)
	if err != nil {
		t.Fatal(err)
	}
	p.cmd = exec.Command("ip", args...)
	p.cmd.Stdout, p.cmd.Stderr = logf, logf
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		p.cmd.Wait()
		logf.Close()
		close(p.exited)
	}()
	p.client = &http.Client{
		Timeout: 5 * time.Second,
		Transport: &http.Transport{DisableKeepAlives: true, DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			return tp.Dial(testbed.Node, network, addr)
		}},
	}
	t.Cleanup(func() {
		p.stop()
		if t.Failed() {
			t.Logf("uproxy log:\n%s", tail(p.logText(), 60))
		}
	})
}

// runUproxy starts uproxy in the node namespace, as l says, and waits until it
// has completed a sync with the state l asks for.
func runUproxy(t testing.TB, tp *testbed.Topology, manifests string, l launch) *proxy {
	t.Helper()
	p := &proxy{t: t, tp: tp, dir: l.dir, exited: make(chan struct{}), metrics: "127.0.0.1:10249"}
	source := l.source
	if source == nil {
		if p.dir == "" {
			p.dir = t.TempDir()
		}
		p.write("services.yaml", manifests)
		source = []string{"--services", p.dir}
	}
	bin := l.bin
	if bin == "" {
		bin = uproxyBin
	}
	args := []string{"netns", "exec", tp.NS(testbed.Node).Name}
	args = append(args, l.wrapper...)
	args = append(args, bin)
	args = append(args, source...)
	args = append(args,
		"--sync-period", "1s",
		"--min-sync-period", "0",
		"-v", "2",
		// The conntrack table's size is the machine's: outside the initial
		// network namespace uproxy could not set it and would not start. The
		// timeouts are the namespace's own, and are set.
		"--conntrack-max-per-core", "0",
	)
	if !l.defaultAddrs {
		args = append(args, "--metrics-bind-address", p.metrics, "--healthz-bind-address", "127.0.0.1:10256")
	}
	args = append(args, l.flags...)
	p.start(args)
	if l.noWait {
		return p
	}
	seen := time.Now()
	if l.ready != nil {
		p.waitFor(l.ready, "the expected Service ports")
	} else if l.want >= 0 {
		p.waitFor(func(s []serviceState) bool {
			n := 0
			for _, st := range s {
				if st.ProxyPort != 0 {
					n++
				}
			}
			return n == l.want
		}, fmt.Sprintf("%d Service ports with proxy ports", l.want))
	}
	p.waitSynced(seen)
	return p
}

func (p *proxy) logText() string {
	b, _ := os.ReadFile(p.log)
	return string(b)
}

// signal sends sig to uproxy (ip netns exec and the wrappers exec it, so the
// process started is uproxy itself).
func (p *proxy) signal(sig syscall.Signal) {
	p.t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		p.t.Fatalf("signal uproxy: %v", err)
	}
}

// awaitExit waits for uproxy to exit and returns its exit code.
func (p *proxy) awaitExit(within time.Duration) int {
	p.t.Helper()
	select {
	case <-p.exited:
		p.stopOnce = true
		return p.cmd.ProcessState.ExitCode()
	case <-time.After(within):
		p.t.Fatalf("uproxy still running %s later", within)
		return -1
	}
}

// running reports whether uproxy has not exited.
func (p *proxy) running() bool {
	select {
	case <-p.exited:
		return false
	default:
		return true
	}
}

// echoTCP starts a backend in role's namespace that echoes every connection.
func echoTCP(t *testing.T, tp *testbed.Topology, role, addr string) net.Listener {
	ln := tp.Listen(role, "tcp", addr)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				io.Copy(c, c)
			}()
		}
	}()
	return ln
}

// checkedRoundTrip writes n random bytes on c and reads them back, comparing
// SHA-256 sums: the proxy must deliver every byte, in order, unchanged.
func checkedRoundTrip(c net.Conn, n int) error {
	msg := make([]byte, n)
	for i := range msg {
		msg[i] = byte(rand.Uint32())
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	errc := make(chan error, 1)
	go func() {
		_, err := c.Write(msg)
		errc <- err
	}()
	got := make([]byte, n)
	if _, err := io.ReadFull(c, got); err != nil {
		// The kernel reports a reset once, to whichever call meets it first:
		// when the write took it, the read sees only the end of the stream.
		if werr := <-errc; werr != nil && (errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)) {
			return fmt.Errorf("write: %w", werr)
		}
		return fmt.Errorf("read back: %w", err)
	}
	if err := <-errc; err != nil {
		return fmt.Errorf("write: %w", err)
	}
	if sha256.Sum256(got) != sha256.Sum256(msg) {
		return errors.New("checksum of the echoed bytes differs from what was sent")
	}
	return nil
}

// dialRoundTrip connects from role to addr and does one checked round trip.
func dialRoundTrip(tp *testbed.Topology, role, addr string, n int) error {
	c, err := tp.Dial(role, "tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	return checkedRoundTrip(c, n)
}

func isRefused(err error) bool { return errors.Is(err, syscall.ECONNREFUSED) }

// ruleChains returns the chains of iptables-save (or ip6tables-save) in the node
// namespace that start with prefix.
func ruleChains(t *testing.T, tp *testbed.Topology, cmd, prefix string) []string {
	t.Helper()
	out, err := tp.Exec(testbed.Node, cmd)
	if err != nil {
		t.Fatal(err)
	}
	var chains []string
	for _, line := range strings.Split(string(out), "\n") {
		if name, ok := strings.CutPrefix(line, ":"+prefix); ok {
			chains = append(chains, prefix+strings.Fields(name)[0])
		}
	}
	return chains
}

// worldReadableCopy copies the uproxy binary into a fresh directory anyone may
// read and traverse, for a run as an unprivileged user.
func worldReadableCopy(t *testing.T) (bin, dir string) {
	t.Helper()
	root, err := os.MkdirTemp("", "uproxy-unprivileged-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	dir = filepath.Join(root, "manifests")
	for _, d := range []string{root, dir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	data, err := os.ReadFile(uproxyBin)
	if err != nil {
		t.Fatal(err)
	}
	bin = filepath.Join(root, "uproxy")
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		t.Fatal(err)
	}
	return bin, dir
}

// procStatus returns the value of one field of /proc/PID/status.
func procStatus(t *testing.T, pid int, field string) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range bytes.Split(b, []byte("\n")) {
		if v, ok := bytes.CutPrefix(line, []byte(field+":")); ok {
			return strings.TrimSpace(string(v))
		}
	}
	t.Fatalf("/proc/%d/status has no %s", pid, field)
	return ""
}
