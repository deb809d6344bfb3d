package integration

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/test/testbed"
)

// ep is one endpoint of a hand-written EndpointSlice: its address and port,
// and the node it runs on ("" for none).
type ep struct {
	addr string
	port int
	node string
}

// slice writes an EndpointSlice of Service svc, named name, with one ready
// endpoint per entry of eps, all of family (IPv4 or IPv6) and protocol proto.
func slice(name, svc, family, proto string, eps ...ep) string {
	var b strings.Builder
	fmt.Fprintf(&b, "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: %s, namespace: it, labels: {kubernetes.io/service-name: %s}}\naddressType: %s\n", name, svc, family)
	// Every endpoint of a slice shares its ports: one slice per endpoint port.
	fmt.Fprintf(&b, "ports: [{name: p, protocol: %s, port: %d}]\nendpoints:\n", proto, eps[0].port)
	for _, e := range eps {
		fmt.Fprintf(&b, "- {addresses: [%q], conditions: {ready: true}", e.addr)
		if e.node != "" {
			fmt.Fprintf(&b, ", nodeName: %s", e.node)
		}
		b.WriteString("}\n")
	}
	return b.String()
}

// localSvc writes a NodePort Service with externalTrafficPolicy: Local.
func localSvc(name, proto, clusterIP string, nodePort int) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Service
metadata: {name: %s, namespace: it}
spec:
  type: NodePort
  clusterIP: %s
  clusterIPs: [%s]
  externalTrafficPolicy: Local
  ports:
  - {name: p, protocol: %s, port: 80, nodePort: %d}
`, name, clusterIP, clusterIP, proto, nodePort)
}

// spread makes n connections (or datagrams, each from a new client) from role
// to addr and counts the backends that answered; failures count under "".
func spread(tp *testbed.Topology, proto, role, addr string, n int) map[string]int {
	seen := map[string]int{}
	for range n {
		who := whoTCP
		if proto == "UDP" {
			who = whoUDP
		}
		name, err := who(tp, role, addr)
		if err != nil {
			name = ""
		}
		seen[name]++
	}
	return seen
}

// TestUserspaceExternalTrafficPolicyLocal: a NodePort Service with
// externalTrafficPolicy: Local, one endpoint on this node and one on another,
// is reached from outside on the local endpoint only, while its ClusterIP uses
// both; with no local endpoint the NodePort refuses while the ClusterIP still
// works. TCP and UDP, with either portal backend.
func TestUserspaceExternalTrafficPolicyLocal(t *testing.T) {
	for _, rules := range []string{"iptables", "nftables"} {
		t.Run(rules, func(t *testing.T) {
			tp := testbed.New(t)
			pod, node := tp.NS(testbed.Pod), tp.NS(testbed.Node)
			podIP := pod.IPv4.String()
			tcpBackend := func(name string) ep {
				ln := namedTCP(t, tp, testbed.Pod, podIP+":0", name)
				return ep{addr: podIP, port: ln.Addr().(*net.TCPAddr).Port}
			}
			udpBackend := func(name string) ep {
				pc := namedUDP(t, tp, testbed.Pod, podIP+":0", name)
				return ep{addr: podIP, port: pc.LocalAddr().(*net.UDPAddr).Port}
			}
			local, remote, only := tcpBackend("local"), tcpBackend("remote"), tcpBackend("elsewhere")
			local.node, remote.node, only.node = "it-node", "other-node", "other-node"
			ulocal, uremote := udpBackend("udp-local"), udpBackend("udp-remote")
			ulocal.node, uremote.node = "it-node", "other-node"
			manifests := join(
				localSvc("mixed", "TCP", "10.96.0.20", 30090),
				slice("mixed-local", "mixed", "IPv4", "TCP", local),
				slice("mixed-remote", "mixed", "IPv4", "TCP", remote),
				localSvc("remote", "TCP", "10.96.0.21", 30091),
				slice("remote-1", "remote", "IPv4", "TCP", only),
				localSvc("dns", "UDP", "10.96.0.22", 30092),
				slice("dns-local", "dns", "IPv4", "UDP", ulocal),
				slice("dns-remote", "dns", "IPv4", "UDP", uremote),
			)
			px := startProxy(t, tp, manifests, 3, "--hostname-override", "it-node", "--rules", rules)
			nodePort := func(p int) string { return fmt.Sprintf("%s:%d", node.IPv4, p) }

			t.Run("NodePort from outside: the local endpoint only", func(t *testing.T) {
				if got := spread(tp, "TCP", testbed.External, nodePort(30090), 12); got["local"] != 12 {
					t.Errorf("12 connections to the NodePort: got %v, want all on local", got)
				}
			})
			t.Run("ClusterIP from the pod: both endpoints", func(t *testing.T) {
				if got := spread(tp, "TCP", testbed.Pod, "10.96.0.20:80", 12); got["local"] != 6 || got["remote"] != 6 {
					t.Errorf("12 connections to the ClusterIP: got %v, want 6 on each (round robin)", got)
				}
			})
			t.Run("no local endpoint: the NodePort fails, the ClusterIP works", func(t *testing.T) {
				if got := spread(tp, "TCP", testbed.External, nodePort(30091), 3); got[""] != 3 {
					t.Errorf("3 connections to the NodePort: got %v, want all failed", got)
				}
				if got := spread(tp, "TCP", testbed.Pod, "10.96.0.21:80", 3); got["elsewhere"] != 3 {
					t.Errorf("3 connections to the ClusterIP: got %v, want all on elsewhere", got)
				}
			})
			t.Run("UDP NodePort from outside: the local endpoint only", func(t *testing.T) {
				if got := spread(tp, "UDP", testbed.External, nodePort(30092), 8); got["udp-local"] != 8 {
					t.Errorf("8 clients of the NodePort: got %v, want all on udp-local", got)
				}
				if got := spread(tp, "UDP", testbed.Pod, "10.96.0.22:80", 8); got["udp-local"] == 0 || got["udp-remote"] == 0 {
					t.Errorf("8 clients of the ClusterIP: got %v, want both endpoints", got)
				}
			})
			t.Run("debug view shows both proxy ports", func(t *testing.T) {
				out, err := px.get("/debug/services")
				if err != nil {
					t.Fatal(err)
				}
				if n := strings.Count(out, `"externalProxyPort"`); n != 3 {
					t.Errorf("/debug/services: got %d externalProxyPort fields, want 3:\n%s", n, out)
				}
			})
		})
	}
}

// TestUserspaceAddressFamilies: a dual-stack Service with endpoints of both
// families sends IPv4 clients to IPv4 endpoints only and IPv6 clients to IPv6
// ones, through the ClusterIPs and through the NodePort of either family.
func TestUserspaceAddressFamilies(t *testing.T) {
	tp := testbed.New(t, testbed.WithIPv6())
	pod, node := tp.NS(testbed.Pod), tp.NS(testbed.Node)
	backend := func(ip netip.Addr, name string) ep {
		ln := namedTCP(t, tp, testbed.Pod, netip.AddrPortFrom(ip, 0).String(), name)
		return ep{addr: ip.String(), port: ln.Addr().(*net.TCPAddr).Port}
	}
	manifests := join(`apiVersion: v1
kind: Service
metadata: {name: dual, namespace: it}
spec:
  type: NodePort
  clusterIP: 10.96.0.30
  clusterIPs: [10.96.0.30, "fd00:96::30"]
  ipFamilyPolicy: RequireDualStack
  ports:
  - {name: p, protocol: TCP, port: 80, nodePort: 30093}
`,
		slice("dual-v4-1", "dual", "IPv4", "TCP", backend(pod.IPv4, "v4-1")),
		slice("dual-v4-2", "dual", "IPv4", "TCP", backend(pod.IPv4, "v4-2")),
		slice("dual-v6-1", "dual", "IPv6", "TCP", backend(pod.IPv6, "v6-1")),
		slice("dual-v6-2", "dual", "IPv6", "TCP", backend(pod.IPv6, "v6-2")),
	)
	startProxy(t, tp, manifests, 1)
	for _, c := range []struct {
		name, from, addr, family string
	}{
		{"IPv4 ClusterIP from the pod", testbed.Pod, "10.96.0.30:80", "v4-"},
		{"IPv6 ClusterIP from the pod", testbed.Pod, "[fd00:96::30]:80", "v6-"},
		{"IPv4 ClusterIP from the node", testbed.Node, "10.96.0.30:80", "v4-"},
		{"IPv6 ClusterIP from the node", testbed.Node, "[fd00:96::30]:80", "v6-"},
		{"IPv4 NodePort from outside", testbed.External, netip.AddrPortFrom(node.IPv4, 30093).String(), "v4-"},
		{"IPv6 NodePort from outside", testbed.External, netip.AddrPortFrom(node.IPv6, 30093).String(), "v6-"},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := spread(tp, "TCP", c.from, c.addr, 8)
			if got[c.family+"1"] != 4 || got[c.family+"2"] != 4 {
				t.Errorf("8 connections to %s: got %v, want 4 on each %s endpoint (round robin within the family)", c.addr, got, c.family)
			}
		})
	}
}

// TestUserspaceTopologyFromFiles: with manifests on disk, --node-labels gives
// the node its zone, so zone hints apply; node hints (trafficDistribution:
// PreferSameNode) name the node given by --hostname-override.
func TestUserspaceTopologyFromFiles(t *testing.T) {
	tp := testbed.New(t)
	podIP := tp.NS(testbed.Pod).IPv4.String()
	port := func(name string) int {
		return namedTCP(t, tp, testbed.Pod, podIP+":0", name).Addr().(*net.TCPAddr).Port
	}
	svc := func(name, clusterIP string) string {
		return fmt.Sprintf("apiVersion: v1\nkind: Service\nmetadata: {name: %s, namespace: it}\nspec:\n  clusterIP: %s\n  ports:\n  - {name: p, protocol: TCP, port: 80}\n", name, clusterIP)
	}
	// hinted is a slice of one endpoint with the given hints.
	hinted := func(name, svc, backend, hints string) string {
		return fmt.Sprintf(`apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: %s, namespace: it, labels: {kubernetes.io/service-name: %s}}
addressType: IPv4
ports: [{name: p, protocol: TCP, port: %d}]
endpoints: [{addresses: [%q], conditions: {ready: true}, hints: %s}]
`, name, svc, port(backend), podIP, hints)
	}
	manifests := join(
		svc("zoned", "10.96.0.40"),
		hinted("zoned-a", "zoned", "in-zone-a", "{forZones: [{name: zone-a}]}"),
		hinted("zoned-b", "zoned", "in-zone-b", "{forZones: [{name: zone-b}]}"),
		svc("samenode", "10.96.0.41"),
		hinted("samenode-1", "samenode", "on-it-node", "{forZones: [{name: zone-a}], forNodes: [{name: it-node}]}"),
		hinted("samenode-2", "samenode", "on-other-node", "{forZones: [{name: zone-a}], forNodes: [{name: other-node}]}"),
	)
	startProxy(t, tp, manifests, 2, "--hostname-override", "it-node", "--node-labels", "topology.kubernetes.io/zone=zone-a")
	if got := spread(tp, "TCP", testbed.Pod, "10.96.0.40:80", 6); got["in-zone-a"] != 6 {
		t.Errorf("zone hints: 6 connections got %v, want all on in-zone-a", got)
	}
	if got := spread(tp, "TCP", testbed.Pod, "10.96.0.41:80", 6); got["on-it-node"] != 6 {
		t.Errorf("node hints: 6 connections got %v, want all on on-it-node", got)
	}
}
