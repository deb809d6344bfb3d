package integration

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// A second uproxy that cannot start leaves the running one's rules as they are:
// it is refused before it touches any (here a kernel mode, which would first
// remove the userspace portals), and names the process that holds them.
func TestSecondInstanceLeavesTheRulesAlone(t *testing.T) {
	tp := testbed.New(t)
	manifests := webService(t, tp)
	first := startProxy(t, tp, manifests, 1)
	before := tp.SavedRules(t, false)

	cmd := exec.Command("ip", "netns", "exec", tp.NS(testbed.Node).Name, uproxyBin,
		"--proxy-mode", "iptables", "--services", first.dir,
		"--metrics-bind-address", "127.0.0.1:0", "--healthz-bind-address", "")
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Fatalf("second uproxy on the node: exit 0, want a refusal; output:\n%s", out)
	}
	for _, want := range []string{"another uproxy (process ", "--chain-prefix UPROXY"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("second uproxy's output lacks %q:\n%s", want, out)
		}
	}
	if got := tp.SavedRules(t, false); got != before {
		t.Errorf("iptables-save after the refused start:\n%s\nwant as before:\n%s", got, before)
	}
	if name, err := whoTCP(tp, testbed.Pod, "10.96.0.10:80"); err != nil || !strings.HasPrefix(name, "web-") {
		t.Errorf("the first uproxy's Service after the refused start: got %q (%v), want a web backend", name, err)
	}
}

// As root in a network namespace with nothing but loopback, --rules auto has no
// node IP for the portals of the node's own connections: it runs without
// portals and says why, instead of exiting.
func TestRulesAutoWithoutNodeAddress(t *testing.T) {
	testbed.Needs(t, testbed.Netns)
	b := make([]byte, 4)
	rand.Read(b)
	ns := "uproxy-bare-" + hex.EncodeToString(b)
	if out, err := exec.Command("ip", "netns", "add", ns).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
	if out, err := exec.Command("ip", "-n", ns, "link", "set", "lo", "up").CombinedOutput(); err != nil {
		t.Fatalf("lo up: %v: %s", err, out)
	}

	cmd := exec.Command("ip", "netns", "exec", ns, uproxyBin, "--services", t.TempDir(),
		"--metrics-bind-address", "127.0.0.1:0", "--healthz-bind-address", "")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		cmd.Process.Kill()
		cmd.Wait()
	}()
	lines := make(chan string)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			lines <- sc.Text()
		}
	}()
	var log []string
	deadline := time.After(20 * time.Second)
	for {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("uproxy exited; log:\n%s", strings.Join(log, "\n"))
			}
			log = append(log, l)
			if strings.Contains(l, `"Starting uproxy"`) {
				if !strings.Contains(l, `rules="none"`) {
					t.Errorf("start line: got %q, want rules=\"none\"", l)
				}
				if !strings.Contains(strings.Join(log, "\n"), "no IPv4 address outside loopback") {
					t.Errorf("log does not say why the portals are off:\n%s", strings.Join(log, "\n"))
				}
				return
			}
		case <-deadline:
			t.Fatalf("no start within 20s; log:\n%s", strings.Join(log, "\n"))
		}
	}
}

// A specific --bind-address (the node IP, as kube-proxy operators set it) keeps
// every portal working: pods reach the ClusterIP, other hosts the NodePort, and
// the node itself both, with either rule backend.
func TestBindAddressNodeIPWithPortals(t *testing.T) {
	testbed.Needs(t, testbed.NFTables)
	for _, backend := range []string{"iptables", "nftables"} {
		t.Run(backend, func(t *testing.T) {
			tp := testbed.New(t)
			nodeIP := tp.NS(testbed.Node).IPv4.String()
			runUproxy(t, tp, webService(t, tp), launch{want: 1,
				flags: []string{"--rules", backend, "--bind-address", nodeIP, "--shutdown-grace", "1s"}})
			for _, c := range []struct{ from, to string }{
				{testbed.Pod, "10.96.0.10:80"},
				{testbed.External, nodeIP + ":30080"},
				{testbed.Node, "10.96.0.10:80"},
				{testbed.Node, nodeIP + ":30080"},
			} {
				if name, err := whoTCP(tp, c.from, c.to); err != nil || !strings.HasPrefix(name, "web-") {
					t.Errorf("%s to %s: got %q (%v), want a web backend", c.from, c.to, name, err)
				}
			}
		})
	}
}

// Rules someone else removes are back within the check period (5s), not a
// whole --sync-period (here an hour) later: the running uproxy notices the loss
// of its canary (iptables) or of its chains' rules (nftables) between syncs.
func TestFlushRepairedBeforeTheSyncPeriod(t *testing.T) {
	testbed.Needs(t, testbed.NFTables)
	for _, c := range []struct {
		name         string
		flags, flush []string
	}{
		{"userspace iptables portals", []string{"--rules", "iptables"}, []string{"iptables", "-t", "nat", "-F"}},
		{"userspace nftables portals", []string{"--rules", "nftables"}, []string{"nft", "flush", "ruleset"}},
		{"iptables mode", []string{"--proxy-mode", "iptables"}, []string{"iptables", "-t", "nat", "-F"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			tp := testbed.New(t)
			want := 1
			if c.flags[0] == "--proxy-mode" {
				want = -1
			}
			runUproxy(t, tp, webService(t, tp), launch{want: want,
				flags: append(c.flags, "--sync-period", "1h", "--shutdown-grace", "1s")})
			if name, err := whoTCP(tp, testbed.Pod, "10.96.0.10:80"); err != nil || !strings.HasPrefix(name, "web-") {
				t.Fatalf("before the flush: got %q (%v), want a web backend", name, err)
			}
			if out, err := tp.Exec(testbed.Node, c.flush...); err != nil {
				t.Fatalf("%v: %v: %s", c.flush, err, out)
			}
			deadline := time.Now().Add(15 * time.Second)
			for {
				name, err := whoTCP(tp, testbed.Pod, "10.96.0.10:80")
				if err == nil && strings.HasPrefix(name, "web-") {
					return
				}
				if time.Now().After(deadline) {
					t.Fatalf("15s after %v: got %q (%v), want the Service served again", c.flush, name, err)
				}
				time.Sleep(200 * time.Millisecond)
			}
		})
	}
}
