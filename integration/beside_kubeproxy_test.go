package integration

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/uproxy/uproxy/source/kube"
	"github.com/uproxy/uproxy/test/testbed"
	"github.com/uproxy/uproxy/test/testbed/kubeproxy"
)

// TestBesideKubeProxy runs uproxy beside the real kube-proxy of the pinned
// Kubernetes release on one node, against one API server, as the README's
// "Running beside kube-proxy" describes: kube-proxy serves the unlabelled
// Service, uproxy the one labelled service.kubernetes.io/service-proxy-name=uproxy.
// Both Services answer from a pod, and neither proxy's rules change while the
// other restarts, follows an endpoint change, or (uproxy) cleans up.
func TestBesideKubeProxy(t *testing.T) {
	testbed.Needs(t, testbed.IPTables, testbed.NFTables, testbed.APIServer, testbed.KubeBinaries("kube-proxy")) // before any API server starts
	uproxyModes := []struct {
		name  string
		flags []string
	}{
		{"userspace-iptables-portals", []string{"--proxy-mode", "userspace", "--rules", "iptables", "--dial-timeouts", "200ms"}},
		{"userspace-nftables-portals", []string{"--proxy-mode", "userspace", "--rules", "nftables", "--dial-timeouts", "200ms"}},
		{"iptables", []string{"--proxy-mode", "iptables"}},
	}
	for _, kpMode := range []string{"iptables", "nftables"} {
		for _, um := range uproxyModes {
			t.Run("kube-proxy="+kpMode+"/uproxy="+um.name, func(t *testing.T) {
				testBesideKubeProxy(t, kpMode, um.flags)
			})
		}
	}
}

func testBesideKubeProxy(t *testing.T, kpMode string, uproxyFlags []string) {
	w := newKubeWorld(t)
	c := newCluster(t, w.srv, "beside")
	createNode(t, c.client, kubeNode, w.tp.NS(testbed.Node).IPv4)
	b1, b2, b3, b4 := w.backend(t, "b1"), w.backend(t, "b2"), w.backend(t, "b3"), w.backend(t, "b4")
	theirs := clusterAddr(c.service("web-kube-proxy", nil))
	// The backends run behind this node: kube-proxy's nftables mode
	// masquerades a pod's connection to itself only for its node's endpoints.
	c.endpoints("web-kube-proxy", endpoint{b: b1, node: kubeNode})
	mine := clusterAddr(c.service("web-uproxy", func(s *v1.Service) {
		s.Labels = map[string]string{kube.LabelServiceProxyName: "uproxy"}
	}))
	uproxyEndpoints := func(b *backend) {
		t.Helper()
		c.endpoints("web-uproxy", endpoint{b: b, node: kubeNode})
		// The EndpointSlice controller copies the Service's labels to its
		// slices, and kube-proxy leaves labelled slices alone too.
		labelSlices(t, c, "web-uproxy", map[string]string{kube.LabelServiceProxyName: "uproxy"})
	}
	uproxyEndpoints(b3)

	kp := kubeproxy.Start(t, w.tp, kubeproxy.Options{
		Mode: kpMode, Kubeconfig: w.kubeconfig, NodeName: kubeNode, ClusterCIDR: "10.244.0.0/16",
	})
	startUproxy := func() *proxy {
		t.Helper()
		l := launch{
			source: []string{"--kubeconfig", w.kubeconfig, "--hostname-override", kubeNode},
			flags:  append([]string{"--service-proxy-name", "uproxy", "--shutdown-grace", "1s"}, uproxyFlags...),
			want:   -1,
		}
		if uproxyFlags[1] == "userspace" {
			l.ready = func(s []serviceState) bool { return len(withProxyPorts(s)) == 1 }
		}
		return runUproxy(t, w.tp, "", l)
	}
	up := startUproxy()
	w.awaitServed(t, theirs, "b1")
	w.awaitServed(t, mine, "b3")
	// From the node too (host-network clients): each proxy's output path
	// passes the other's rules, kube-proxy's nftables drop of ClusterIPs it
	// does not know among them.
	for _, c := range []struct{ addr, want string }{{theirs, "b1"}, {mine, "b3"}} {
		if got, err := whoTCP(w.tp, testbed.Node, c.addr); err != nil || got != c.want {
			t.Errorf("from the node, %s: got %q (%v), want %s", c.addr, got, err, c.want)
		}
	}

	before := ownedRules(t, w.tp)
	if before.kubeProxy == "" || before.uproxy == "" {
		t.Fatalf("rules with both proxies running: kube-proxy's:\n%s\nuproxy's:\n%s\nwant both present", before.kubeProxy, before.uproxy)
	}
	// untouched fails the test if whose rules differ from want.
	untouched := func(step, whose string, want, got string) {
		t.Helper()
		if got == want {
			return
		}
		if d := lineDiff(want, got); d != "" {
			t.Errorf("%s: %s's rules changed:\n%s", step, whose, d)
		} else if iptablesLines(got) != iptablesLines(want) {
			t.Errorf("%s: %s's iptables rules were reordered:\nbefore:\n%s\nafter:\n%s", step, whose, iptablesLines(want), iptablesLines(got))
		}
		// Otherwise the same lines came back in another order in an nftables
		// table: kube-proxy's nftables mode rewrites its maps' elements at
		// its own syncs, and nft lists them in the order the kernel keeps.
	}

	up.stop()
	up = startUproxy()
	w.awaitServed(t, mine, "b3")
	w.awaitServed(t, theirs, "b1")
	untouched("uproxy restarted", "kube-proxy", before.kubeProxy, ownedRules(t, w.tp).kubeProxy)

	before = ownedRules(t, w.tp)
	uproxyEndpoints(b4)
	w.awaitServed(t, mine, "b4")
	untouched("uproxy's EndpointSlice changed", "kube-proxy", before.kubeProxy, ownedRules(t, w.tp).kubeProxy)

	before = ownedRules(t, w.tp)
	synced := time.Now()
	c.endpoints("web-kube-proxy", endpoint{b: b2, node: kubeNode})
	w.awaitServed(t, theirs, "b2")
	kp.WaitSynced(synced)
	untouched("kube-proxy's EndpointSlice changed", "uproxy", before.uproxy, ownedRules(t, w.tp).uproxy)

	before = ownedRules(t, w.tp)
	kp.Restart()
	w.awaitServed(t, theirs, "b2")
	w.awaitServed(t, mine, "b4")
	untouched("kube-proxy restarted", "uproxy", before.uproxy, ownedRules(t, w.tp).uproxy)

	up.stop()
	before = ownedRules(t, w.tp)
	if out, err := exec.Command("ip", "netns", "exec", w.tp.NS(testbed.Node).Name, uproxyBin, "cleanup").CombinedOutput(); err != nil {
		t.Fatalf("uproxy cleanup: %v\n%s", err, out)
	}
	after := ownedRules(t, w.tp)
	untouched("uproxy cleanup", "kube-proxy", before.kubeProxy, after.kubeProxy)
	if after.uproxy != "" {
		t.Errorf("after uproxy cleanup, uproxy's rules remain:\n%s", after.uproxy)
	}
	w.awaitServed(t, theirs, "b2")

	// uproxy comes back over kube-proxy's running rules.
	startUproxy()
	w.awaitServed(t, mine, "b4")
	w.awaitServed(t, theirs, "b2")
	untouched("uproxy started after cleanup", "kube-proxy", before.kubeProxy, ownedRules(t, w.tp).kubeProxy)
}

// createNode creates the Node kube-proxy runs as, with ip as its InternalIP:
// kube-proxy waits for its Node and takes the node IPs from it.
func createNode(t *testing.T, client kubernetes.Interface, name string, ip netip.Addr) {
	t.Helper()
	ctx := context.Background()
	node, err := client.CoreV1().Nodes().Create(ctx, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create Node %s: %v", name, err)
	}
	node.Status.Addresses = []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: ip.String()}, {Type: v1.NodeHostName, Address: name}}
	if _, err := client.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("set the addresses of Node %s: %v", name, err)
	}
}

// labelSlices adds labels to every EndpointSlice of Service svc.
func labelSlices(t *testing.T, c *cluster, svc string, labels map[string]string) {
	t.Helper()
	api := c.client.DiscoveryV1().EndpointSlices(c.ns)
	list, err := api.List(context.Background(), metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=" + svc})
	if err != nil {
		t.Fatalf("list EndpointSlices of %s: %v", svc, err)
	}
	for _, s := range list.Items {
		for k, v := range labels {
			s.Labels[k] = v
		}
		if _, err := api.Update(context.Background(), &s, metav1.UpdateOptions{}); err != nil {
			t.Fatalf("label EndpointSlice %s: %v", s.Name, err)
		}
	}
}

// rulesByOwner is the part of the node's packet filter each proxy owns.
type rulesByOwner struct {
	// kubeProxy: the iptables lines (both families) naming a KUBE-* chain, and
	// nftables' kube-proxy tables.
	kubeProxy string
	// uproxy: the iptables lines naming an UPROXY-* chain, and nftables'
	// uproxy* tables.
	uproxy string
}

// ownedRules reads the node's iptables (both families, counters zeroed) and
// nftables rulesets and splits out each proxy's part. With iptables on its
// nf_tables backend, iptables' own tables show in the nftables ruleset too;
// they are read through iptables-save only.
func ownedRules(t *testing.T, tp *testbed.Topology) rulesByOwner {
	t.Helper()
	var kp, up strings.Builder
	for _, v6 := range []bool{false, true} {
		table := ""
		for _, line := range strings.Split(tp.SavedRules(t, v6), "\n") {
			if name, ok := strings.CutPrefix(line, "*"); ok {
				table = name
				continue
			}
			family := "ipv4"
			if v6 {
				family = "ipv6"
			}
			if strings.Contains(line, "KUBE-") {
				kp.WriteString(family + " " + table + " " + line + "\n")
			}
			if strings.Contains(line, "UPROXY-") {
				up.WriteString(family + " " + table + " " + line + "\n")
			}
		}
	}
	var block *strings.Builder
	for _, line := range strings.Split(tp.NFTRuleset(t), "\n") {
		if strings.HasPrefix(line, "table ") {
			block = nil
			switch f := strings.Fields(line); {
			case len(f) >= 3 && f[2] == "kube-proxy":
				block = &kp
			case len(f) >= 3 && strings.HasPrefix(f[2], "uproxy"):
				block = &up
			}
		}
		if block != nil {
			block.WriteString(line + "\n")
		}
		if line == "}" {
			block = nil
		}
	}
	return rulesByOwner{kubeProxy: kp.String(), uproxy: up.String()}
}

// lineDiff lists the lines only in want (-) and only in got (+).
// iptablesLines returns the iptables part of ownedRules' text, in order: the
// order of rules in a chain is part of what they do.
func iptablesLines(rules string) string {
	var b strings.Builder
	for line := range strings.Lines(rules) {
		if strings.HasPrefix(line, "ipv4 ") || strings.HasPrefix(line, "ipv6 ") {
			b.WriteString(line)
		}
	}
	return b.String()
}

func lineDiff(want, got string) string {
	count := map[string]int{}
	for _, l := range strings.Split(want, "\n") {
		count[l]++
	}
	for _, l := range strings.Split(got, "\n") {
		count[l]--
	}
	var b strings.Builder
	for _, l := range strings.Split(want, "\n") {
		if count[l] > 0 {
			b.WriteString("- " + l + "\n")
			count[l]--
		}
	}
	for _, l := range strings.Split(got, "\n") {
		if count[l] < 0 {
			b.WriteString("+ " + l + "\n")
			count[l]++
		}
	}
	return b.String()
}

// TestABBesideKubeProxy runs the README's A/B recipe on one node: the same
// three echo backends behind a Service kube-proxy serves (its iptables mode)
// and a labelled copy uproxy serves (userspace mode, nftables portals), and
// `uproxy ab` from a pod between the two ClusterIPs. Every connection on both
// sides must succeed, and the report must cover both. With
// UPROXY_AB_SAMPLE=FILE it also writes the text report of a 5000-connection
// run to FILE (the README's sample).
func TestABBesideKubeProxy(t *testing.T) {
	testbed.Needs(t, testbed.IPTables, testbed.NFTables, testbed.APIServer, testbed.KubeBinaries("kube-proxy"))
	w := newKubeWorld(t)
	c := newCluster(t, w.srv, "ab")
	createNode(t, c.client, kubeNode, w.tp.NS(testbed.Node).IPv4)
	var eps []endpoint
	for i := 1; i <= 3; i++ {
		addr := netip.MustParseAddrPort(startEcho(t, w.tp, testbed.Pod))
		eps = append(eps, endpoint{b: &backend{name: fmt.Sprintf("echo-%d", i), ip: addr.Addr().String(), port: int32(addr.Port())}, node: kubeNode})
	}
	theirs := clusterAddr(c.service("echo", nil))
	c.endpoints("echo", eps...)
	mine := clusterAddr(c.service("echo-uproxy", func(s *v1.Service) {
		s.Labels = map[string]string{kube.LabelServiceProxyName: "uproxy"}
	}))
	c.endpoints("echo-uproxy", eps...)
	labelSlices(t, c, "echo-uproxy", map[string]string{kube.LabelServiceProxyName: "uproxy"})

	kubeproxy.Start(t, w.tp, kubeproxy.Options{
		Mode: "iptables", Kubeconfig: w.kubeconfig, NodeName: kubeNode, ClusterCIDR: "10.244.0.0/16",
	})
	runUproxy(t, w.tp, "", launch{
		source: []string{"--kubeconfig", w.kubeconfig, "--hostname-override", kubeNode},
		flags:  []string{"--service-proxy-name", "uproxy", "--proxy-mode", "userspace", "--rules", "nftables", "--shutdown-grace", "1s"},
		want:   -1,
		ready:  func(s []serviceState) bool { return len(withProxyPorts(s)) == 1 },
	})
	for _, addr := range []string{theirs, mine} {
		awaitEcho(t, w.tp, addr)
	}

	rep := runAB(t, w.tp, testbed.Pod, theirs, mine, "--connections", "500")
	if rep.A.Failed+rep.B.Failed != 0 || rep.A.Exchanges != 500 || rep.B.Exchanges != 500 {
		t.Errorf("A (kube-proxy) %d exchanges %v, B (uproxy) %d exchanges %v; want 500 each, no errors",
			rep.A.Exchanges, rep.A.Errors, rep.B.Exchanges, rep.B.Errors)
	}
	if r := abRow(rep, "connection", "p50"); r.Verdict == "row missing" {
		t.Errorf("no connection p50 row in the report")
	}

	if file := os.Getenv("UPROXY_AB_SAMPLE"); file != "" {
		cmd := exec.Command("ip", "netns", "exec", w.tp.NS(testbed.Pod).Name, uproxyBin, "ab", theirs, mine, "--connections", "5000")
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("uproxy ab: %v\n%s", err, out)
		}
		if err := os.WriteFile(file, out, 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("uproxy ab %s %s:\n%s", theirs, mine, out)
	}
}

// awaitEcho waits until a connection from the pod namespace to addr echoes.
func awaitEcho(t *testing.T, tp *testbed.Topology, addr string) {
	t.Helper()
	testbed.AwaitNoError(t, 30*time.Second, addr+" to echo from the pod", func() error {
		c, err := tp.Dial(testbed.Pod, "tcp", addr)
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(time.Second))
		if _, err := c.Write([]byte("ping")); err != nil {
			return err
		}
		buf := make([]byte, 4)
		if _, err := io.ReadFull(c, buf); err != nil {
			return err
		}
		if string(buf) != "ping" {
			return fmt.Errorf("echo: got %q, want ping", buf)
		}
		return nil
	})
}
