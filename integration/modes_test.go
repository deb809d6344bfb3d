package integration

import (
	"bufio"
	"fmt"
	"net"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/kernelmodes"
	"github.com/uproxy/uproxy/test/testbed"
)

// webService starts three named backends in the pod namespace and returns the
// manifest of a NodePort Service over them.
func webService(t *testing.T, tp *testbed.Topology) string {
	pod := tp.NS(testbed.Pod)
	var ports []int
	for i := 1; i <= 3; i++ {
		ln := namedTCP(t, tp, testbed.Pod, pod.IPv4.String()+":0", fmt.Sprintf("web-%d", i))
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	ip := pod.IPv4.String()
	return svc{name: "web", proto: "TCP", clusterIPs: []string{"10.96.0.10"}, port: 80, nodePort: 30080,
		endpoints: []string{ip, ip, ip}, endpointPorts: ports}.yaml()
}

// TestIPTablesModeEndToEnd runs the binary in the iptables kernel mode: the
// Service is served by the kernel, so it keeps working while uproxy is stopped.
func TestIPTablesModeEndToEnd(t *testing.T) {
	tp := testbed.New(t)
	px := runUproxy(t, tp, webService(t, tp), launch{want: -1, flags: []string{"--proxy-mode", "iptables"}})
	kernelServes(t, tp, px, "iptables")
}

// kernelServes checks that uproxy in kernel mode serves webService: /proxyMode
// says mode, connections from the pod reach all three backends, the NodePort
// answers from outside, and connections still do while uproxy is stopped.
func kernelServes(t *testing.T, tp *testbed.Topology, px *proxy, mode string) {
	t.Helper()
	if got, err := px.get("/proxyMode"); err != nil || got != mode {
		t.Fatalf("/proxyMode: got %q (%v), want %s", got, err, mode)
	}
	seen := map[string]int{}
	for i := 0; i < 60; i++ {
		name, err := whoTCP(tp, testbed.Pod, "10.96.0.10:80")
		if err != nil {
			t.Fatalf("connection %d from pod: %v", i, err)
		}
		seen[name]++
	}
	if len(seen) != 3 {
		t.Errorf("backends over 60 connections: got %v, want all three", seen)
	}
	node := tp.NS(testbed.Node)
	if name, err := whoTCP(tp, testbed.External, node.IPv4.String()+":30080"); err != nil || !strings.HasPrefix(name, "web-") {
		t.Errorf("NodePort from external: got %q (%v), want a web backend", name, err)
	}

	px.signal(syscall.SIGSTOP)
	defer px.signal(syscall.SIGCONT)
	for i := 0; i < 10; i++ {
		if name, err := whoTCP(tp, testbed.Pod, "10.96.0.10:80"); err != nil || !strings.HasPrefix(name, "web-") {
			t.Fatalf("connection %d with uproxy stopped: got %q (%v), want a web backend", i, name, err)
		}
	}
}

// TestKernelModesMasquerade runs the iptables and nftables modes with
// --cluster-cidr and --masquerade-all, as kube-proxy takes them: a connection from
// outside the pods' network to a cluster IP reaches the endpoint from the node
// (masqueraded) with --cluster-cidr, every connection does with
// --masquerade-all, and without either the endpoint sees the client.
func TestKernelModesMasquerade(t *testing.T) {
	for _, mode := range []string{"iptables", "nftables"} {
		for _, tc := range []struct {
			name  string
			flags []string
			masq  bool
		}{
			{"neither", nil, false},
			{"cluster-cidr of the pods", []string{"--cluster-cidr", "10.244.0.0/16,fd00:10:244::/56"}, true},
			{"cluster-cidr holding the client", []string{"--cluster-cidr", "192.168.50.0/24"}, false},
			{"masquerade-all", []string{"--masquerade-all"}, true},
		} {
			t.Run(mode+"/"+tc.name, func(t *testing.T) {
				if mode == "nftables" {
					testbed.Needs(t, testbed.NFTables)
				}
				tp := testbed.New(t)
				pod, ext := tp.NS(testbed.Pod), tp.NS(testbed.External)
				ln := tp.Listen(testbed.Pod, "tcp", pod.IPv4.String()+":0")
				go testbed.ServeIdentity(ln)
				manifest := svc{name: "who", proto: "TCP", clusterIPs: []string{"10.96.0.20"}, port: 80,
					endpoints: []string{pod.IPv4.String()}, endpointPorts: []int{ln.Addr().(*net.TCPAddr).Port}}.yaml()
				runUproxy(t, tp, manifest, launch{want: -1, flags: append([]string{"--proxy-mode", mode}, tc.flags...)})
				c, err := tp.Dial(testbed.External, "tcp", "10.96.0.20:80")
				if err != nil {
					t.Fatalf("dial the cluster IP from outside the pods' network: %v", err)
				}
				defer c.Close()
				c.SetDeadline(time.Now().Add(5 * time.Second))
				line, err := bufio.NewReader(c).ReadString('\n')
				if err != nil {
					t.Fatalf("read the endpoint's identity: %v", err)
				}
				_, remote, _ := strings.Cut(strings.TrimSpace(line), "|")
				host, _, _ := net.SplitHostPort(remote)
				want := ext.IPv4.String()
				if tc.masq {
					want = pod.GatewayIPv4.String() // the node's address toward the pod
				}
				if host != want {
					t.Errorf("%s %v: the endpoint saw the connection from %s, want %s", mode, tc.flags, host, want)
				}
			})
		}
	}
}

// TestNFTablesModeEndToEnd runs the binary in the nftables kernel mode: the
// Service is served by the kernel, so it keeps working while uproxy is
// stopped; `uproxy cleanup` then leaves the ruleset as it found it, kube-proxy's
// table included.
func TestNFTablesModeEndToEnd(t *testing.T) {
	testbed.Needs(t, testbed.NFTables)
	tp := testbed.New(t)
	for _, cmd := range []string{"add table inet kube-proxy", "add chain inet kube-proxy services { type nat hook prerouting priority dstnat; }"} {
		if out, err := tp.Exec(testbed.Node, "nft", cmd); err != nil {
			t.Fatalf("nft %s: %v: %s", cmd, err, out)
		}
	}
	before := tp.NFTRuleset(t)
	px := runUproxy(t, tp, webService(t, tp), launch{want: -1, flags: []string{"--proxy-mode", "nftables"}})
	if svcs, err := px.get("/debug/services"); err != nil || !strings.Contains(svcs, `"usable": true`) {
		t.Errorf("/debug/services: got %s (%v), want usable endpoints", svcs, err)
	}
	kernelServes(t, tp, px, "nftables")

	// Someone flushes the ruleset: the mode notices and writes its table again.
	if out, err := tp.Exec(testbed.Node, "nft", "delete", "table", "inet", "uproxy-kernel"); err != nil {
		t.Fatalf("nft delete table: %v: %s", err, out)
	}
	testbed.AwaitNoError(t, 15*time.Second, "the deleted table repaired", func() error {
		if name, err := whoTCP(tp, testbed.Pod, "10.96.0.10:80"); err != nil || !strings.HasPrefix(name, "web-") {
			return fmt.Errorf("got %q, %v; want a web- backend", name, err)
		}
		return nil
	})

	px.stop()
	if out, err := tp.Exec(testbed.Node, uproxyBin, "cleanup"); err != nil {
		t.Fatalf("uproxy cleanup: %v: %s", err, out)
	}
	if got := tp.NFTRuleset(t); got != before {
		t.Errorf("ruleset after cleanup:\n%s\nwant:\n%s", got, before)
	}
}

// TestModeSwitchLeavesNoStaleState switches modes and portal backends on one
// node (userspace with iptables portals, with nftables portals, the iptables
// mode, and back): each start removes what the others left, and cleanup
// returns iptables-save and the list of nftables tables to what they were.
func TestModeSwitchLeavesNoStaleState(t *testing.T) {
	testbed.Needs(t, testbed.NFTables)
	tp := testbed.New(t)
	// Create the (empty) tables, so the baseline has them as cleanup leaves them.
	for _, table := range []string{"nat", "filter"} {
		for _, op := range []string{"-N", "-X"} {
			if out, err := tp.Exec(testbed.Node, "iptables", "-t", table, op, "BASELINE"); err != nil {
				t.Fatalf("iptables -t %s %s: %v: %s", table, op, err, out)
			}
		}
	}
	// The tables that hold a rule: iptables-nft keeps a table (ip mangle) a
	// program once used, empty, after its chains are gone.
	nftTables := func() string {
		out, err := tp.Exec(testbed.Node, "nft", "list", "tables")
		if err != nil {
			t.Fatal(err)
		}
		var b strings.Builder
		for _, line := range strings.SplitAfter(string(out), "\n") {
			table := strings.Fields(line)
			if len(table) != 3 {
				continue
			}
			rules, err := tp.Exec(testbed.Node, "nft", "list", "table", table[1], table[2])
			if err != nil {
				t.Fatal(err)
			}
			if table[1] == "inet" || strings.Contains(string(rules), "counter") || strings.Contains(string(rules), "jump") || strings.Contains(string(rules), "comment") {
				b.WriteString(line)
			}
		}
		return b.String()
	}
	before, beforeNFT := tp.SavedRules(t, false), nftTables()
	manifests := webService(t, tp)
	const nftPortals = "table inet uproxy\n"
	const nftKernel = "table inet uproxy-kernel\n"
	steps := []struct {
		flags      []string
		want       int
		has, lacks string // iptables chains; "" checks nothing
		nft        bool   // the nftables portals' table is there
	}{
		{[]string{"--proxy-mode", "userspace", "--rules", "iptables"}, 1, "UPROXY-PORTALS-CONTAINER", "UPROXY-SERVICES", false},
		{[]string{"--proxy-mode", "userspace", "--rules", "nftables"}, 1, "", "UPROXY-PORTALS-CONTAINER", true},
		{[]string{"--proxy-mode", "userspace", "--rules", "iptables"}, 1, "UPROXY-PORTALS-CONTAINER", "UPROXY-SERVICES", false},
		{[]string{"--proxy-mode", "iptables"}, -1, "UPROXY-SERVICES", "UPROXY-PORTALS-CONTAINER", false},
		{[]string{"--proxy-mode", "nftables"}, -1, "", "UPROXY-SERVICES", false},
		{[]string{"--proxy-mode", "userspace", "--rules", "nftables"}, 1, "", "UPROXY-SERVICES", true},
	}
	for i, st := range steps {
		px := runUproxy(t, tp, manifests, launch{want: st.want, flags: st.flags})
		if name, err := whoTCP(tp, testbed.Pod, "10.96.0.10:80"); err != nil || !strings.HasPrefix(name, "web-") {
			t.Fatalf("step %d (%v): got %q (%v), want a web backend", i, st.flags, name, err)
		}
		px.stop()
		saved := tp.SavedRules(t, false)
		if st.has != "" && !strings.Contains(saved, ":"+st.has) || strings.Contains(saved, ":"+st.lacks) {
			t.Errorf("step %d (%v): iptables-save should have %q and lack %s:\n%s", i, st.flags, st.has, st.lacks, saved)
		}
		if got := strings.Contains(nftTables(), nftPortals); got != st.nft {
			t.Errorf("step %d (%v): nftables portals' table present: got %v, want %v", i, st.flags, got, st.nft)
		}
		if got, want := strings.Contains(nftTables(), nftKernel), st.flags[1] == "nftables"; got != want {
			t.Errorf("step %d (%v): nftables mode's table present: got %v, want %v", i, st.flags, got, want)
		}
	}
	if out, err := tp.Exec(testbed.Node, uproxyBin, "cleanup"); err != nil {
		t.Fatalf("uproxy cleanup: %v: %s", err, out)
	}
	if got := tp.SavedRules(t, false); got != before {
		t.Errorf("iptables-save after cleanup:\n%s\nwant:\n%s", got, before)
	}
	if got := nftTables(); got != beforeNFT {
		t.Errorf("nftables tables after cleanup:\n%s\nwant:\n%s", got, beforeNFT)
	}
}

// TestIPVSModeOnThisKernel: where the kernel lacks IPVS (as on our machines),
// --proxy-mode ipvs exits at once, non-zero, naming what is missing.
func TestIPVSModeOnThisKernel(t *testing.T) {
	tp := testbed.New(t)
	var verdict kernelmodes.Verdict
	tp.Run(testbed.Node, func() error { verdict = kernelmodes.Probe("rr"); return nil })
	if verdict.IPVS() {
		t.Logf("this kernel offers IPVS; checking that ipvs mode starts instead")
		px := runUproxy(t, tp, webService(t, tp), launch{want: -1, flags: []string{"--proxy-mode", "ipvs"}})
		px.stop()
		return
	}
	start := time.Now()
	cmd := exec.Command("ip", "netns", "exec", tp.NS(testbed.Node).Name, uproxyBin,
		"--proxy-mode", "ipvs", "--services", t.TempDir(), "--metrics-bind-address", "", "--healthz-bind-address", "")
	out, err := cmd.CombinedOutput()
	took := time.Since(start)
	if err == nil {
		t.Fatalf("--proxy-mode ipvs without IPVS: exit 0, want non-zero; output:\n%s", out)
	}
	for _, want := range append([]string{"ipvs mode unavailable on this kernel", "--proxy-mode iptables"}, verdict.IPVSMissing...) {
		if !strings.Contains(string(out), want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if took > 10*time.Second {
		t.Errorf("took %v to fail, want it to fail fast", took)
	}
}
