package integration

import (
	"fmt"
	"net"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// TestUserspaceEndToEnd runs uproxy's userspace mode with each portal backend
// (iptables, nftables) in a node namespace and reaches its Services the ways a
// cluster does: from a pod, from the node, and from outside through NodePorts,
// ExternalIPs and a LoadBalancer IP.
func TestUserspaceEndToEnd(t *testing.T) {
	for _, rules := range []string{"iptables", "nftables"} {
		t.Run(rules, func(t *testing.T) { testUserspaceEndToEnd(t, rules) })
	}
}

func testUserspaceEndToEnd(t *testing.T, rules string) {
	if rules == "nftables" {
		testbed.Needs(t, testbed.NFTables)
	}
	tp := testbed.New(t, testbed.WithIPv6())
	pod := tp.NS(testbed.Pod)
	node := tp.NS(testbed.Node)

	// Backends live in the pod namespace, one port each.
	backend := func(name string) (net.Listener, int) {
		ln := namedTCP(t, tp, testbed.Pod, pod.IPv4.String()+":0", name)
		return ln, ln.Addr().(*net.TCPAddr).Port
	}
	var webLn []net.Listener
	var webPorts, stickyPorts []int
	for i := 1; i <= 3; i++ {
		ln, p := backend(fmt.Sprintf("web-%d", i))
		webLn = append(webLn, ln)
		webPorts = append(webPorts, p)
		_, p = backend(fmt.Sprintf("sticky-%d", i))
		stickyPorts = append(stickyPorts, p)
	}
	_, lbPort := backend("lb-1")
	var dnsPorts []int
	for i := 1; i <= 2; i++ {
		pc := namedUDP(t, tp, testbed.Pod, pod.IPv4.String()+":0", fmt.Sprintf("dns-%d", i))
		dnsPorts = append(dnsPorts, pc.LocalAddr().(*net.UDPAddr).Port)
	}
	podIP := pod.IPv4.String()
	three := []string{podIP, podIP, podIP}

	manifests := join(
		svc{name: "web", proto: "TCP", clusterIPs: []string{"10.96.0.10", "fd00:96::10"}, port: 80, nodePort: 30080,
			externalIPs: []string{"10.250.0.5"}, endpoints: three, endpointPorts: webPorts}.yaml(),
		svc{name: "lb", proto: "TCP", clusterIPs: []string{"10.96.0.12"}, port: 80, nodePort: 30081,
			lbIP: "10.251.0.7", endpoints: []string{podIP}, endpointPorts: []int{lbPort}}.yaml(),
		svc{name: "sticky", proto: "TCP", clusterIPs: []string{"10.96.0.11"}, port: 80, affinity: true,
			endpoints: three, endpointPorts: stickyPorts}.yaml(),
		svc{name: "dns", proto: "UDP", clusterIPs: []string{"10.96.0.53"}, port: 53,
			endpoints: []string{podIP, podIP}, endpointPorts: dnsPorts}.yaml(),
	)
	px := startProxy(t, tp, manifests, 4, "--rules", rules)

	t.Run("ClusterIP TCP from pod: round robin visible at the backends", func(t *testing.T) {
		seen := map[string]int{}
		for i := 0; i < 30; i++ {
			name, err := whoTCP(tp, testbed.Pod, "10.96.0.10:80")
			if err != nil {
				t.Fatalf("connection %d: %v", i, err)
			}
			seen[name]++
		}
		for i := 1; i <= 3; i++ {
			if n := seen[fmt.Sprintf("web-%d", i)]; n != 10 {
				t.Errorf("web-%d served %d of 30 connections, want 10 (round robin): %v", i, n, seen)
			}
		}
	})

	paths := []struct{ name, from, addr, wantPrefix string }{
		{"ClusterIP TCP from node", testbed.Node, "10.96.0.10:80", "web-"},
		{"NodePort from external", testbed.External, node.IPv4.String() + ":30080", "web-"},
		{"ExternalIP from external", testbed.External, "10.250.0.5:80", "web-"},
		{"LoadBalancer IP from external", testbed.External, "10.251.0.7:80", "lb-1"},
		{"LoadBalancer NodePort from external", testbed.External, node.IPv4.String() + ":30081", "lb-1"},
	}
	for _, pt := range paths {
		t.Run(pt.name, func(t *testing.T) {
			name, err := whoTCP(tp, pt.from, pt.addr)
			if err != nil || !strings.HasPrefix(name, pt.wantPrefix) {
				t.Errorf("%s from %s: got %q (%v), want a %s backend", pt.addr, pt.from, name, err, pt.wantPrefix)
			}
		})
	}

	t.Run("ClusterIP IPv6 from pod: no IPv6 endpoint, refused as by kube-proxy", func(t *testing.T) {
		// web's endpoints are all IPv4: its IPv6 ClusterIP has none, and the
		// portal refuses the connect itself rather than the proxy resetting it.
		if name, err := whoTCP(tp, testbed.Pod, "[fd00:96::10]:80"); !isRefused(err) {
			t.Errorf("[fd00:96::10]:80 from pod: got %q (%v), want the connection refused", name, err)
		}
	})

	t.Run("ClusterIP UDP from pod and node", func(t *testing.T) {
		seen := map[string]int{}
		for i := 0; i < 4; i++ {
			for _, from := range []string{testbed.Pod, testbed.Node} {
				name, err := whoUDP(tp, from, "10.96.0.53:53")
				if err != nil {
					t.Fatalf("datagram %d from %s: %v", i, from, err)
				}
				seen[name]++
			}
		}
		if seen["dns-1"] == 0 || seen["dns-2"] == 0 {
			t.Errorf("UDP clients spread over backends: got %v, want both dns-1 and dns-2", seen)
		}
	})

	t.Run("the proxy's dials to endpoints skip the portal rules", func(t *testing.T) {
		if rules == "nftables" {
			// The portal table's output chain returns marked packets before its
			// map lookups; nft keeps no count without a counter statement.
			out, err := tp.Exec(testbed.Node, "nft", "list", "table", "inet", "uproxy")
			if err != nil {
				t.Fatal(err)
			}
			if !regexp.MustCompile(`meta mark & 0x0*2000 != 0x0+ return`).Match(out) {
				t.Fatalf("nftables portal table has no dial-mark return:\n%s", out)
			}
			return
		}
		// The connections and datagrams above were dialed by the proxy with its
		// mark: the first rule of the HOST chain returned them, one count each.
		out, err := tp.Exec(testbed.Node, "iptables", "-w", "-t", "nat", "-L", "UPROXY-PORTALS-HOST", "1", "-v", "-x", "-n")
		if err != nil {
			t.Fatal(err)
		}
		f := strings.Fields(string(out))
		if len(f) < 3 || !strings.Contains(string(out), "mark match 0x2000/0x2000") {
			t.Fatalf("first rule of UPROXY-PORTALS-HOST: got %q, want the dial mark's RETURN", out)
		}
		if n, err := strconv.Atoi(f[0]); err != nil || n < 30 {
			t.Errorf("packets returned by the dial-mark rule: got %q, want at least the 30 proxied TCP connections", f[0])
		}
	})

	t.Run("ClientIP affinity through the portal sees the pod's address", func(t *testing.T) {
		first, err := whoTCP(tp, testbed.Pod, "10.96.0.11:80")
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i < 9; i++ {
			if name, err := whoTCP(tp, testbed.Pod, "10.96.0.11:80"); err != nil || name != first {
				t.Fatalf("connection %d: got %q (%v), want %q (sticky)", i, name, err, first)
			}
		}
		st := px.waitFor(func(s []serviceState) bool {
			for _, x := range s {
				if x.Name == "it/sticky:p" && len(x.Affinity) == 1 {
					return true
				}
			}
			return false
		}, "one affinity entry for it/sticky:p")
		for _, x := range st {
			if x.Name == "it/sticky:p" && x.Affinity[0].Client != podIP {
				t.Errorf("affinity client: got %s, want the pod's %s", x.Affinity[0].Client, podIP)
			}
		}
	})

	t.Run("backend killed: every new connection still succeeds", func(t *testing.T) {
		webLn[1].Close()
		for i := 0; i < 30; i++ {
			name, err := whoTCP(tp, testbed.Pod, "10.96.0.10:80")
			if err != nil || name == "web-2" || !strings.HasPrefix(name, "web-") {
				t.Fatalf("connection %d after killing web-2: got %q (%v), want web-1 or web-3", i, name, err)
			}
		}
		metrics, err := px.get("/metrics")
		if err != nil {
			t.Fatal(err)
		}
		want := fmt.Sprintf(`uproxy_dial_attempts_total{endpoint="%s:%d",result="refused",service="it/web:p"}`, podIP, webPorts[1])
		if !strings.Contains(metrics, want) {
			t.Errorf("metrics lack %s", want)
		}
	})

	t.Run("recovers within a sync period after an external flush", func(t *testing.T) {
		flush := []string{"iptables", "-t", "nat", "-F"}
		if rules == "nftables" {
			flush = []string{"nft", "flush", "ruleset"}
		}
		if out, err := tp.Exec(testbed.Node, flush...); err != nil {
			t.Fatalf("%v: %v: %s", flush, err, out)
		}
		deadline := time.Now().Add(10 * time.Second)
		for {
			name, err := whoTCP(tp, testbed.Pod, "10.96.0.10:80")
			if err == nil && strings.HasPrefix(name, "web-") {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("ClusterIP still unreachable 10s after the flush: %q %v", name, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	})

	t.Run("manifest rewrite moves endpoints, keeps the proxy port", func(t *testing.T) {
		before := proxyPortOf(px.waitFor(func([]serviceState) bool { return true }, "state"), "it/web:p")
		_, p := backend("web-new")
		updated := strings.Replace(manifests,
			svc{name: "web", proto: "TCP", clusterIPs: []string{"10.96.0.10", "fd00:96::10"}, port: 80, nodePort: 30080,
				externalIPs: []string{"10.250.0.5"}, endpoints: three, endpointPorts: webPorts}.yaml(),
			svc{name: "web", proto: "TCP", clusterIPs: []string{"10.96.0.10", "fd00:96::10"}, port: 80, nodePort: 30080,
				externalIPs: []string{"10.250.0.5"}, endpoints: []string{podIP}, endpointPorts: []int{p}}.yaml(), 1)
		px.write("services.yaml", updated)
		st := px.waitFor(func(s []serviceState) bool {
			for _, x := range s {
				if x.Name == "it/web:p" && len(x.Endpoints) == 1 {
					return true
				}
			}
			return false
		}, "it/web:p with one endpoint")
		if after := proxyPortOf(st, "it/web:p"); after != before {
			t.Errorf("proxy port changed with the endpoints: got %d, want %d", after, before)
		}
		if name, err := whoTCP(tp, testbed.Pod, "10.96.0.10:80"); err != nil || name != "web-new" {
			t.Errorf("after the rewrite: got %q (%v), want web-new", name, err)
		}
	})
}

func proxyPortOf(s []serviceState, name string) int {
	for _, x := range s {
		if x.Name == name {
			return x.ProxyPort
		}
	}
	return 0
}

// TestCleanupLeavesIPTablesAsBefore runs uproxy beside kube-proxy-like KUBE-*
// chains, stops it, runs `uproxy cleanup`, and expects iptables-save to be
// exactly what it was before uproxy started.
func TestCleanupLeavesIPTablesAsBefore(t *testing.T) {
	tp := testbed.New(t, testbed.WithIPv6())
	for _, cmd := range []string{"iptables", "ip6tables"} {
		for _, args := range [][]string{
			{"-t", "nat", "-N", "KUBE-SERVICES"},
			{"-t", "nat", "-A", "KUBE-SERVICES", "-d", "10.96.0.1/32", "-p", "tcp", "--dport", "443", "-j", "RETURN"},
			{"-t", "nat", "-I", "PREROUTING", "-j", "KUBE-SERVICES"},
			{"-t", "filter", "-N", "KUBE-FIREWALL"},
			{"-t", "filter", "-I", "INPUT", "-j", "KUBE-FIREWALL"},
		} {
			if cmd == "ip6tables" && strings.Contains(strings.Join(args, " "), "10.96") {
				args = []string{"-t", "nat", "-A", "KUBE-SERVICES", "-d", "fd00:96::1/128", "-p", "tcp", "--dport", "443", "-j", "RETURN"}
			}
			if out, err := tp.Exec(testbed.Node, append([]string{cmd}, args...)...); err != nil {
				t.Fatalf("%s %v: %v: %s", cmd, args, err, out)
			}
		}
	}
	before4, before6 := tp.SavedRules(t, false), tp.SavedRules(t, true)

	pod := tp.NS(testbed.Pod)
	ln := namedTCP(t, tp, testbed.Pod, pod.IPv4.String()+":0", "web-1")
	px := startProxy(t, tp, svc{name: "web", proto: "TCP", clusterIPs: []string{"10.96.0.10", "fd00:96::10"}, port: 80,
		nodePort: 30080, endpoints: []string{pod.IPv4.String()}, endpointPorts: []int{ln.Addr().(*net.TCPAddr).Port}}.yaml(), 1)
	if name, err := whoTCP(tp, testbed.Pod, "10.96.0.10:80"); err != nil || name != "web-1" {
		t.Fatalf("through the proxy: got %q (%v), want web-1", name, err)
	}
	px.stop()
	if got := tp.SavedRules(t, false); !strings.Contains(got, "UPROXY-PORTALS-CONTAINER") {
		t.Errorf("rules removed on plain SIGTERM; want them kept until cleanup")
	}
	for i := 0; i < 2; i++ { // cleanup is idempotent
		if out, err := tp.Exec(testbed.Node, uproxyBin, "cleanup"); err != nil {
			t.Fatalf("uproxy cleanup (run %d): %v: %s", i+1, err, out)
		}
	}
	if got := tp.SavedRules(t, false); got != before4 {
		t.Errorf("iptables-save after cleanup:\n%s\nwant:\n%s", got, before4)
	}
	if got := tp.SavedRules(t, true); got != before6 {
		t.Errorf("ip6tables-save after cleanup:\n%s\nwant:\n%s", got, before6)
	}
}
