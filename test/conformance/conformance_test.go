package conformance

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

var (
	nodesFlag   = flag.Int("conformance.nodes", 1, "nodes of the cluster")
	proxiesFlag = flag.String("conformance.proxies", "uproxy-userspace-nftables", "comma-separated proxies to judge: "+strings.Join(proxyNames(), ", "))
	suitesFlag  = flag.String("conformance.suites", `\[sig-network\] Services`, "regular expressions of the suites to run, |-separated; \"all\" for every suite of Suites")
	procsFlag   = flag.Int("conformance.procs", 4, "ginkgo processes (the tests mostly wait, so more than the cores)")
	reportFlag  = flag.String("conformance.report", "", "write the markdown table here too")
	keepFlag    = flag.Bool("conformance.keep", false, "leave the last cluster running (remove it with `make conformance-down`)")
	downFlag    = flag.Bool("conformance.down", false, "only remove a cluster left running (`make conformance-down`)")
	rolloutFlag = flag.Bool("conformance.rollout", true, "before a uproxy mode's suite, update its DaemonSet twice under load, then kill each node's serving uproxy (RollOutUnderLoad): the suite then judges the uproxies that took over and were started again")
)

// proxy is one way of running the nodes' service proxy.
type proxy struct {
	kubeProxy string    // kube-proxy's mode, when kube-proxy runs
	uproxy    ProxyMode // otherwise
}

var proxies = map[string]proxy{
	"kube-proxy-iptables":       {kubeProxy: "iptables"},
	"kube-proxy-nftables":       {kubeProxy: "nftables"},
	"uproxy-userspace-nftables": {uproxy: ProxyMode{Mode: "userspace", Rules: "nftables"}},
	"uproxy-userspace-iptables": {uproxy: ProxyMode{Mode: "userspace", Rules: "iptables"}},
	"uproxy-nftables":           {uproxy: ProxyMode{Mode: "nftables"}},
	"uproxy-iptables":           {uproxy: ProxyMode{Mode: "iptables"}},
}

// proxyOrder is the order of the table: the baselines first.
var proxyOrder = []string{"kube-proxy-iptables", "kube-proxy-nftables", "uproxy-userspace-nftables",
	"uproxy-userspace-iptables", "uproxy-nftables", "uproxy-iptables"}

func proxyNames() []string { return proxyOrder }

// expectedFailures are the tests a uproxy mode may fail (or skip) where kube-proxy
// passes, each for a documented reason (docs/conformance.md).
var expectedFailures = map[string]map[string]string{
	// None today: the userspace mode's client-address tests pass since it
	// dials from the client's address (docs/userspace-mode.md, "Client address").
}

// notApplicable are the tests that skip themselves under a uproxy mode as they do
// under one of kube-proxy's modes, for the same reason: they judge a feature of
// another mode. A skip of one is no difference (whatever a kube-proxy of the run
// did); failing it, or passing nothing, still is.
var notApplicable = map[string]map[string]string{
	"uproxy-userspace-nftables": {nfacctTest: nfacctElsewhere},
	"uproxy-userspace-iptables": {nfacctTest: nfacctElsewhere},
	"uproxy-nftables":           {nfacctTest: nfacctElsewhere},
}

// nfacctTest checks kube-proxy's iptables mode's count of localhost NodePort
// packets: it runs only where /proxyMode says iptables and route_localnet is 1,
// and skips itself elsewhere, kube-proxy's nftables mode included. uproxy's
// iptables mode runs and must pass it.
const nfacctTest = "[sig-network] KubeProxy should update metric for tracking accepted packets destined for localhost nodeports [Feature:KubeProxyNFAcct]"

const nfacctElsewhere = "not applicable, skipped as under kube-proxy-nftables: the test judges the iptables mode's nfacct count and route_localnet; " +
	"this mode answers /proxyMode with its own name and serves 127.0.0.1:NODEPORT without either (docs/configuration.md: Localhost NodePorts)"

// TestConformance builds a cluster per proxy, runs upstream's suite against it and
// fails when a uproxy mode fails a test that kube-proxy passes in the same run, or,
// when no kube-proxy ran, any test at all but the expected failures.
func TestConformance(t *testing.T) {
	testbed.Needs(t, testbed.Netns)
	if *downFlag {
		down(t)
		return
	}
	// make cluster-bins and make deps give what it needs.
	binDir := testbed.KubeBin(t, "etcd", "kube-apiserver", "kube-proxy", "kubelet",
		"kube-controller-manager", "kube-scheduler", "agnhost", "regression-issue-74839", "coredns", "ginkgo", "e2e-network.test")
	testbed.Needs(t, testbed.Commands("containerd", "ctr", "runc", "nsenter", "unshare", "debootstrap"))
	if _, err := os.Stat("/usr/lib/cni/ptp"); err != nil {
		testbed.Skip(t, "the CNI plugins are needed for the conformance cluster (make deps installs containernetworking-plugins):", err)
	}
	var chosen []string
	for _, name := range strings.Split(*proxiesFlag, ",") {
		if _, ok := proxies[name]; !ok {
			t.Fatalf("-conformance.proxies: unknown proxy %q (known: %s)", name, strings.Join(proxyNames(), ", "))
		}
		chosen = append(chosen, name)
	}
	focus := strings.Split(*suitesFlag, "|")
	if *suitesFlag == "all" {
		focus = Suites
	}

	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	work := t.TempDir()
	logf := func(format string, args ...any) {
		t.Logf("%s "+format, append([]any{time.Now().Format("15:04:05")}, args...)...)
	}
	start := time.Now()
	images := ImageSet{
		BinDir: binDir, UProxyTag: DefaultUProxyTag,
		Pause:      goBuild(t, root, work, "pause", "./test/conformance/pause"),
		UProxy:     goBuild(t, root, work, "uproxy", "."),
		Dockerfile: filepath.Join(root, "deploy", "Dockerfile"), RepoRoot: root,
		CacheDir: cacheDir(t), WorkDir: work, Logf: logf,
	}
	archive, err := images.BuildImages()
	if err != nil {
		t.Fatalf("images: %v", err)
	}
	logf("images built in %s", time.Since(start).Round(time.Second))

	skip := Skip
	if !KernelHasSCTP() {
		skip += "|" + SkipSCTP
		logf("this kernel has no SCTP: the SCTP connectivity tests are left out")
	}

	ctx := t.Context()
	var results []Result
	for _, name := range chosen {
		// Each proxy's ginkgo log and report outlive the test, for reading a failure.
		reportDir := filepath.Join(os.TempDir(), "uproxy-conformance-"+Prefix, name)
		os.RemoveAll(reportDir)
		res, err := judge(ctx, t, name, binDir, archive, focus, skip, reportDir, logf)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		results = append(results, res)
		logf("%s: %d passed, %d failed, %d skipped in %s", name, res.Count("passed"), res.Count("failed"), res.Count("skipped"), res.Wall.Round(time.Second))
	}
	table := Table(results)
	t.Logf("nodes: %d, suites: %s\n%s", *nodesFlag, strings.Join(focus, " | "), table)
	if *reportFlag != "" {
		// A document under docs/ names its reader first (docs_test.go).
		header := fmt.Sprintf("# Conformance table (for people comparing the proxies in the last make conformance run)\n\n"+
			"Nodes: %d. Suites: `%s`, skipping `%s`.\n\n", *nodesFlag, strings.Join(focus, "|"), skip)
		if err := os.WriteFile(*reportFlag, []byte(header+table), 0o644); err != nil {
			t.Error(err)
		}
	}
	for _, r := range results {
		for _, s := range r.Specs {
			if reason, ok := notApplicable[r.Proxy][s.Name]; ok && s.State == "skipped" {
				t.Logf("%s skipped %q: %s", r.Proxy, s.Name, reason)
			}
		}
	}
	for _, problem := range verdict(results) {
		t.Error(problem)
	}
}

// verdict lists what fails the run: a uproxy mode failing a test some kube-proxy
// of the run passed, or, without kube-proxy in the run, any unexpected failure.
func verdict(results []Result) []string {
	baseline := map[string]bool{}
	haveBaseline := false
	for _, r := range results {
		if proxies[r.Proxy].kubeProxy != "" {
			haveBaseline = true
			for name := range r.Passed() {
				baseline[name] = true
			}
		}
	}
	var problems []string
	for _, r := range results {
		if r.Count("passed") == 0 {
			problems = append(problems, fmt.Sprintf("%s: no test passed (%d ran): a suite that judges nothing is a failure", r.Proxy, len(r.Specs)))
		}
		for _, s := range r.Specs {
			if s.State == "passed" || proxies[r.Proxy].kubeProxy != "" {
				continue
			}
			if _, ok := notApplicable[r.Proxy][s.Name]; ok && s.State == "skipped" {
				continue
			}
			if _, ok := expectedFailures[r.Proxy][s.Name]; ok {
				continue
			}
			switch {
			case s.State == "failed" && (!haveBaseline || baseline[s.Name]):
				problems = append(problems, fmt.Sprintf("%s failed %q: %s", r.Proxy, s.Name, s.Reason))
			case s.State == "skipped" && baseline[s.Name]:
				// A test that skips itself under uproxy but passes under kube-proxy
				// judged something uproxy does not do.
				problems = append(problems, fmt.Sprintf("%s skipped %q, which kube-proxy passed: %s", r.Proxy, s.Name, s.Reason))
			}
		}
	}
	return problems
}

func judge(ctx context.Context, t *testing.T, name, binDir, archive string, focus []string, skip, reportDir string, logf func(string, ...any)) (Result, error) {
	p := proxies[name]
	start := time.Now()
	c, err := Up(ctx, Config{Nodes: *nodesFlag, BinDir: binDir, Images: archive, KubeProxyMode: p.kubeProxy, Logf: logf})
	defer func() {
		if !*keepFlag {
			if err := Teardown(logf); err != nil {
				t.Errorf("teardown after %s: %v", name, err)
			}
			if left := Leftovers(); len(left) > 0 {
				t.Errorf("teardown after %s left %s", name, strings.Join(left, ", "))
			}
		}
		if c != nil {
			c.Close()
		}
	}()
	if err != nil {
		return Result{}, fmt.Errorf("cluster: %w\n%s", err, clusterLogs())
	}
	if p.kubeProxy == "" {
		if err := c.DeployUProxy(ctx, filepath.Join("..", "..", "deploy", "uproxy.yaml"), DefaultUProxyTag, p.uproxy); err != nil {
			return Result{}, fmt.Errorf("deploy uproxy: %w", err)
		}
	}
	if err := c.AwaitDNS(ctx, 3*time.Minute); err != nil {
		return Result{}, err
	}
	logf("%s: cluster of %d nodes up in %s", name, *nodesFlag, time.Since(start).Round(time.Second))
	if p.kubeProxy == "" && *rolloutFlag {
		rep, err := c.RollOutUnderLoad(ctx, NextUProxyTag, true, logf)
		if err != nil {
			return Result{}, fmt.Errorf("rolling update: %w", err)
		}
		logf("%s: rolling update under load: %s", name, rep)
		if !rep.Clean() {
			t.Errorf("%s: the rolling update or the kills under load lost connections: %s", name, rep)
		}
	}
	return RunSuite(ctx, Run{BinDir: binDir, Kubeconfig: c.Kubeconfig, Nodes: *nodesFlag, Focus: focus, Skip: skip, Procs: *procsFlag,
		ReportDir: reportDir, Timeout: 90 * time.Minute}, name, logf)
}

// clusterLogs is the tail of every cluster process's log, for a failure message.
func clusterLogs() string {
	entries, _ := os.ReadDir(filepath.Join(StateDir, "logs"))
	var b strings.Builder
	for _, e := range entries {
		name := strings.TrimSuffix(e.Name(), ".log")
		fmt.Fprintf(&b, "--- %s\n%s\n", e.Name(), LogTail(name, 15))
	}
	return b.String()
}

// goBuild builds a static binary of this module, as the Dockerfile's build stage does.
func goBuild(t *testing.T, root, work, name, pkg string) string {
	t.Helper()
	out := filepath.Join(work, name)
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags", "-s -w -X github.com/uproxy/uproxy/app.version=conformance", "-o", out, pkg)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build %s: %v\n%s", pkg, err, b)
	}
	return out
}

// cacheDir keeps the Debian root filesystems between runs (UPROXY_CACHE, or the
// user's cache directory).
func cacheDir(t *testing.T) string {
	dir := os.Getenv("UPROXY_CACHE")
	if dir == "" {
		base, err := os.UserCacheDir()
		if err != nil {
			t.Fatal(err)
		}
		dir = filepath.Join(base, "uproxy-conformance")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// down removes a cluster left by -conformance.keep or an interrupted run, twice:
// the second time there must be nothing left to remove.
func down(t *testing.T) {
	lock, err := Lock()
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	for range 2 {
		if err := Teardown(t.Logf); err != nil {
			t.Fatal(err)
		}
		if left := Leftovers(); len(left) > 0 {
			t.Fatalf("left after teardown: %s", strings.Join(left, ", "))
		}
	}
}
