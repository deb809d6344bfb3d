package integration

import (
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// localhostServices starts a TCP and a UDP backend of each family in the pod
// namespace and returns the manifests of two dual-stack NodePort Services over
// them: web (TCP, NodePort 30080) and dns (UDP, NodePort 30053).
func localhostServices(t *testing.T, tp *testbed.Topology) string {
	pod := tp.NS(testbed.Pod)
	var docs []string
	for _, s := range []struct {
		name, proto string
		nodePort    int
		listen      func(family, addr string) int
	}{
		{"web", "TCP", 30080, func(family, addr string) int {
			return namedTCP(t, tp, testbed.Pod, addr, "web-"+family).Addr().(*net.TCPAddr).Port
		}},
		{"dns", "UDP", 30053, func(family, addr string) int {
			return namedUDP(t, tp, testbed.Pod, addr, "dns-"+family).LocalAddr().(*net.UDPAddr).Port
		}},
	} {
		v4 := s.listen("v4", pod.IPv4.String()+":0")
		v6 := s.listen("v6", "["+pod.IPv6.String()+"]:0")
		octet := map[string]int{"web": 30, "dns": 53}[s.name]
		docs = append(docs, fmt.Sprintf(`apiVersion: v1
kind: Service
metadata: {name: %[1]s, namespace: it}
spec:
  type: NodePort
  clusterIP: 10.96.0.%[4]d
  clusterIPs: [10.96.0.%[4]d, "fd00:96::%[4]d"]
  ipFamilyPolicy: PreferDualStack
  ports: [{name: p, protocol: %[2]s, port: 80, nodePort: %[3]d}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: %[1]s-v4, namespace: it, labels: {kubernetes.io/service-name: %[1]s}}
addressType: IPv4
ports: [{name: p, protocol: %[2]s, port: %[5]d}]
endpoints: [{addresses: [%[7]q], conditions: {ready: true}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: %[1]s-v6, namespace: it, labels: {kubernetes.io/service-name: %[1]s}}
addressType: IPv6
ports: [{name: p, protocol: %[2]s, port: %[6]d}]
endpoints: [{addresses: [%[8]q], conditions: {ready: true}}]
`, s.name, s.proto, s.nodePort, octet, v4, v6, pod.IPv4, pod.IPv6))
	}
	return join(docs...)
}

// localhostCase is one way to run uproxy, and which localhost NodePorts it
// serves: on 127.0.0.1 (v4) and [::1] (v6).
type localhostCase struct {
	name   string
	flags  []string
	want   int // Service ports with proxy ports to await; -1 for a kernel mode
	v4, v6 bool
	// gateway: NodePorts answer on the node's address toward the pod, which
	// is not its primary IP (the one its default route leaves from).
	gateway bool
	// routeLocalnet: the mode sets it, and counts localhost NodePort packets.
	routeLocalnet bool
	// nft: the mode needs nft.
	nft bool
}

var localhostCases = []localhostCase{
	{"userspace, iptables portals", []string{"--proxy-mode", "userspace", "--rules", "iptables"}, 2, true, true, true, false, false},
	{"userspace, nftables portals", []string{"--proxy-mode", "userspace", "--rules", "nftables"}, 2, true, true, true, false, true},
	{"iptables mode", []string{"--proxy-mode", "iptables"}, -1, true, false, true, true, false},
	{"iptables mode, --iptables-localhost-nodeports=false", []string{"--proxy-mode", "iptables", "--iptables-localhost-nodeports=false"}, -1, false, false, true, false, false},
	// The nftables mode's default is primary, and localhost through a relay.
	{"nftables mode", []string{"--proxy-mode", "nftables"}, -1, true, true, false, false, true},
	{"nftables mode, --nodeport-addresses 0.0.0.0/0,::/0", []string{"--proxy-mode", "nftables", "--nodeport-addresses", "0.0.0.0/0,::/0"}, -1, true, true, true, false, true},
	{"nftables mode, --nodeport-addresses primary", []string{"--proxy-mode", "nftables", "--nodeport-addresses", "primary"}, -1, false, false, false, false, true},
	{"userspace, --nodeport-addresses primary", []string{"--proxy-mode", "userspace", "--rules", "nftables", "--nodeport-addresses", "primary"}, 2, false, false, false, false, true},
	{"iptables mode, --nodeport-addresses primary", []string{"--proxy-mode", "iptables", "--nodeport-addresses", "primary"}, -1, false, false, false, false, false},
}

// nodeIPv4 is the node's address facing outside in every topology, the
// source of its default route: its primary IP.
const nodeIPv4 = "192.168.50.1"

// TestLocalhostNodePorts runs the binary in each mode and connects from the
// node to its NodePorts on 127.0.0.1 and [::1], TCP and UDP: served where the
// mode serves them (kube-proxy's iptables mode: IPv4 only, with route_localnet),
// refused or unanswered elsewhere; the node IP's NodePorts answer in every case.
func TestLocalhostNodePorts(t *testing.T) {
	for _, tc := range localhostCases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.nft {
				testbed.Needs(t, testbed.NFTables)
			}
			tp := testbed.New(t, testbed.WithIPv6())
			px := runUproxy(t, tp, localhostServices(t, tp), launch{want: tc.want, flags: append([]string{"--shutdown-grace", "1s"}, tc.flags...)})
			node := tp.NS(testbed.Node)
			if node.IPv4.String() != nodeIPv4 {
				t.Fatalf("the node IP facing outside: got %s, want %s", node.IPv4, nodeIPv4)
			}
			if name, err := whoTCP(tp, testbed.External, node.IPv4.String()+":30080"); err != nil || name != "web-v4" {
				t.Errorf("NodePort on the node IP from outside: got %q (%v), want web-v4", name, err)
			}
			// The node's other address, toward the pod, is no primary IP.
			gateway := net.JoinHostPort(tp.NS(testbed.Pod).GatewayIPv4.String(), "30080")
			if name, err := whoTCP(tp, testbed.Pod, gateway); tc.gateway != (err == nil) {
				t.Errorf("NodePort on the node's address toward the pod, from the pod: got %q (%v); want served %v", name, err, tc.gateway)
			}
			for _, c := range []struct {
				family, host string
				served       bool
			}{{"v4", "127.0.0.1", tc.v4}, {"v6", "::1", tc.v6}} {
				tcp := net.JoinHostPort(c.host, "30080")
				udp := net.JoinHostPort(c.host, "30053")
				name, err := whoTCP(tp, testbed.Node, tcp)
				if c.served && (err != nil || name != "web-"+c.family) {
					t.Errorf("TCP %s from the node: got %q (%v), want web-%s", tcp, name, err, c.family)
				}
				if !c.served && err == nil {
					t.Errorf("TCP %s from the node: got %q, want no connection", tcp, name)
				}
				name, err = whoUDP(tp, testbed.Node, udp)
				if c.served && (err != nil || name != "dns-"+c.family) {
					t.Errorf("UDP %s from the node: got %q (%v), want dns-%s", udp, name, err, c.family)
				}
				if !c.served && err == nil {
					t.Errorf("UDP %s from the node: got %q, want no answer", udp, name)
				}
			}
			routeLocalnet := nodeSysctl(t, tp, "net.ipv4.conf.all.route_localnet")
			metrics, err := px.get("/metrics")
			if err != nil {
				t.Fatal(err)
			}
			counted := strings.Contains(metrics, "kubeproxy_iptables_localhost_nodeports_accepted_packets_total ")
			// Only the iptables mode needs route_localnet; the others never set it.
			if (routeLocalnet == "1") != tc.routeLocalnet || counted != tc.routeLocalnet {
				t.Errorf("route_localnet %s, localhost NodePort metric exported %v; want both %v", routeLocalnet, counted, tc.routeLocalnet)
			}
		})
	}
}

// TestLocalhostNodePortsMetric is upstream's e2e test "KubeProxy should update
// metric for tracking accepted packets destined for localhost nodeports", on
// the binary in the iptables mode: /proxyMode says iptables, route_localnet is
// 1, and ten connections to 127.0.0.1:NodePort raise the metric by ten.
func TestLocalhostNodePortsMetric(t *testing.T) {
	tp := testbed.New(t)
	px := runUproxy(t, tp, webService(t, tp), launch{want: -1, flags: []string{"--proxy-mode", "iptables"}})
	if got, err := px.get("/proxyMode"); err != nil || got != "iptables" {
		t.Fatalf("/proxyMode: got %q (%v), want iptables", got, err)
	}
	if got := nodeSysctl(t, tp, "net.ipv4.conf.all.route_localnet"); got != "1" {
		t.Fatalf("route_localnet: got %s, want 1", got)
	}
	const metric = "kubeproxy_iptables_localhost_nodeports_accepted_packets_total"
	value := func() float64 {
		t.Helper()
		text, err := px.get("/metrics")
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(text, metric+" ") {
			t.Fatalf("/metrics lacks %s", metric)
		}
		return metricValue(text, metric)
	}
	before := value()
	for i := range 10 {
		if name, err := whoTCP(tp, testbed.Node, "127.0.0.1:30080"); err != nil || !strings.HasPrefix(name, "web-") {
			t.Fatalf("connection %d to 127.0.0.1:30080: got %q (%v)", i, name, err)
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for value()-before != 10 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if got := value() - before; got != 10 {
		t.Errorf("%s after 10 connections: grew by %v, want 10", metric, got)
	}
}
