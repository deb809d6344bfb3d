// Package kubeproxy runs the real kube-proxy, built by `make kube-bins` from the
// Kubernetes release pinned for kube-apiserver, in a namespace of a testbed
// topology, so tests can run uproxy beside it.
//
//	kp := kubeproxy.Start(t, tp, kubeproxy.Options{Mode: "nftables", Kubeconfig: kc, NodeName: "node-a"})
//	kp.Restart()
//
// kube-proxy runs as root inside the namespace, with every setting that would
// reach outside it turned off (conntrack table size and timeouts), and its
// metrics and health servers on ports chosen free in that namespace.
// t.Cleanup stops it.
package kubeproxy

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// Options say how kube-proxy runs.
type Options struct {
	// Mode is kube-proxy's --proxy-mode: "iptables" or "nftables".
	Mode string
	// Kubeconfig is a kubeconfig file that reaches the API server from the namespace.
	Kubeconfig string
	// NodeName is --hostname-override; the Node object must exist (kube-proxy
	// reads its addresses and waits for it).
	NodeName string
	// ClusterCIDR is --cluster-cidr: traffic from it is local to the cluster.
	ClusterCIDR string
	// Role is the namespace kube-proxy runs in; empty: testbed.Node.
	Role string
	// Args are added last, to override any of the above.
	Args []string
}

// Proxy is a kube-proxy process owned by one test.
type Proxy struct {
	t       testing.TB
	tp      *testbed.Topology
	o       Options
	bin     string
	metrics string // metrics address inside the namespace
	healthz string
	log     string
	cmd     *exec.Cmd
	exited  chan struct{}
	client  *http.Client
}

// syncTimeout bounds the wait for a sync: kube-proxy's first sync waits for
// the Node and for both informers, on two cores shared with the whole suite.
const syncTimeout = 60 * time.Second

// Start runs kube-proxy and returns once it has completed a sync.
func Start(t testing.TB, tp *testbed.Topology, o Options) *Proxy {
	t.Helper()
	if o.Role == "" {
		o.Role = testbed.Node
	}
	dir := testbed.KubeBin(t, "kube-proxy")
	p := &Proxy{t: t, tp: tp, o: o, bin: filepath.Join(dir, "kube-proxy"), log: filepath.Join(t.TempDir(), "kube-proxy.log")}
	p.metrics = "127.0.0.1:" + strconv.Itoa(freePort(t, tp, o.Role))
	p.healthz = "127.0.0.1:" + strconv.Itoa(freePort(t, tp, o.Role))
	p.client = &http.Client{
		Timeout: 5 * time.Second,
		Transport: &http.Transport{DisableKeepAlives: true, DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			return tp.Dial(o.Role, network, addr)
		}},
	}
	t.Cleanup(func() {
		p.Stop()
		if t.Failed() {
			t.Logf("kube-proxy log (%s mode):\n%s", o.Mode, p.tail(60))
		}
	})
	p.start()
	return p
}

// freePort returns a TCP port that nothing listens on in role's namespace.
func freePort(t testing.TB, tp *testbed.Topology, role string) int {
	ln := tp.Listen(role, "tcp", "127.0.0.1:0")
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// Args returns kube-proxy's command line, without the binary.
func (p *Proxy) Args() []string {
	args := []string{
		"--kubeconfig", p.o.Kubeconfig,
		"--hostname-override", p.o.NodeName,
		"--proxy-mode", p.o.Mode,
		"--metrics-bind-address", p.metrics,
		"--healthz-bind-address", p.healthz,
		// The conntrack table and its timeouts are the host's, not the
		// namespace's: leave them as they are.
		"--conntrack-max-per-core", "0",
		"--conntrack-tcp-timeout-established", "0",
		"--conntrack-tcp-timeout-close-wait", "0",
		// Periodic resyncs would repair rules another program damaged before
		// a test could see the damage; changes still sync at once.
		"--iptables-sync-period", "1h",
		"--iptables-min-sync-period", "0",
		"--v", "2",
	}
	if p.o.ClusterCIDR != "" {
		args = append(args, "--cluster-cidr", p.o.ClusterCIDR)
	}
	return append(args, p.o.Args...)
}

func (p *Proxy) start() {
	p.t.Helper()
	logf, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		p.t.Fatal(err)
	}
	fmt.Fprintf(logf, "=== %s %s\n", p.bin, strings.Join(p.Args(), " "))
	started := time.Now()
	p.cmd = exec.Command("ip", append([]string{"netns", "exec", p.tp.NS(p.o.Role).Name, p.bin}, p.Args()...)...)
	p.cmd.Stdout, p.cmd.Stderr = logf, logf
	if err := p.cmd.Start(); err != nil {
		logf.Close()
		p.t.Fatalf("start kube-proxy: %v", err)
	}
	exited := make(chan struct{})
	p.exited = exited
	go func(cmd *exec.Cmd) {
		cmd.Wait()
		logf.Close()
		close(exited)
	}(p.cmd)
	p.WaitSynced(started)
}

// Stop ends kube-proxy with SIGTERM (SIGKILL after 10s) and waits for it. Its
// rules stay, as they do when kube-proxy restarts on a node.
func (p *Proxy) Stop() {
	if p.cmd == nil {
		return
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(10 * time.Second):
		p.cmd.Process.Kill()
		<-p.exited
	}
	p.cmd = nil
}

// Restart stops kube-proxy and starts it again, returning after its first sync.
func (p *Proxy) Restart() {
	p.t.Helper()
	p.Stop()
	p.start()
}

// WaitSynced waits until kube-proxy has completed a sync that started after
// after, read from kubeproxy_sync_proxy_rules_last_timestamp_seconds, or
// fails the test.
func (p *Proxy) WaitSynced(after time.Time) {
	p.t.Helper()
	deadline := time.Now().Add(syncTimeout)
	var last string
	for time.Now().Before(deadline) {
		select {
		case <-p.exited:
			p.t.Fatalf("kube-proxy (%s mode) exited:\n%s", p.o.Mode, p.tail(40))
		default:
		}
		ts, err := p.lastSync()
		if err == nil && ts.After(after) {
			return
		}
		last = fmt.Sprintf("last sync %v, error %v", ts, err)
		time.Sleep(100 * time.Millisecond)
	}
	p.t.Fatalf("kube-proxy (%s mode): no sync after %v within %v (%s)", p.o.Mode, after, syncTimeout, last)
}

// lastSync reads kubeproxy_sync_proxy_rules_last_timestamp_seconds, the latest
// of its IP families.
func (p *Proxy) lastSync() (time.Time, error) {
	resp, err := p.client.Get("http://" + p.metrics + "/metrics")
	if err != nil {
		return time.Time{}, err
	}
	defer resp.Body.Close()
	var last time.Time
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		// kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family="IPv4"} 1.7e+09
		rest, ok := strings.CutPrefix(sc.Text(), "kubeproxy_sync_proxy_rules_last_timestamp_seconds")
		if !ok || (rest != "" && rest[0] != ' ' && rest[0] != '{') {
			continue
		}
		fields := strings.Fields(rest)
		f, err := strconv.ParseFloat(fields[len(fields)-1], 64)
		if err != nil {
			return time.Time{}, fmt.Errorf("metric line %q: %w", sc.Text(), err)
		}
		if ts := time.Unix(0, int64(f*1e9)); ts.After(last) {
			last = ts
		}
	}
	if err := sc.Err(); err != nil {
		return time.Time{}, err
	}
	if last.IsZero() {
		return last, fmt.Errorf("no kubeproxy_sync_proxy_rules_last_timestamp_seconds yet")
	}
	return last, nil
}

// Log returns kube-proxy's output so far, across restarts.
func (p *Proxy) Log() string {
	b, _ := os.ReadFile(p.log)
	return string(b)
}

func (p *Proxy) tail(n int) string {
	f, err := os.Open(p.log)
	if err != nil {
		return err.Error()
	}
	defer f.Close()
	b, _ := io.ReadAll(f)
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
