package integration

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/measure/topology"
	"github.com/uproxy/uproxy/test/testbed"
)

// whoSaw is an identity endpoint: the namespace it runs in and its TCP and UDP
// ports, each answering "local|client" with the client address it saw.
type whoSaw struct {
	role, addr string
	tcp, udp   int
}

func startWhoSaw(t *testing.T, tp *testbed.Topology, role string, addr netip.Addr) whoSaw {
	t.Helper()
	ln := tp.Listen(role, "tcp", netip.AddrPortFrom(addr, 0).String())
	go testbed.ServeIdentity(ln)
	pc := tp.ListenPacket(role, "udp", netip.AddrPortFrom(addr, 0).String())
	go func() {
		buf := make([]byte, 512)
		for {
			_, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			pc.WriteTo([]byte(pc.LocalAddr().String()+"|"+from.String()), from)
		}
	}()
	return whoSaw{role: role, addr: addr.String(), tcp: ln.Addr().(*net.TCPAddr).Port, udp: pc.LocalAddr().(*net.UDPAddr).Port}
}

// askWho connects (TCP) or sends a datagram (UDP) from role to addr and returns
// the endpoint that answered and the client address it saw.
func askWho(tp *testbed.Topology, proto, role, addr string) (endpoint, client netip.AddrPort, err error) {
	var line string
	if proto == "TCP" {
		var e, c string
		if e, c, err = tp.Ask(role, addr); err != nil {
			return
		}
		line = e + "|" + c
	} else {
		var conn net.Conn
		if conn, err = tp.Dial(role, "udp", addr); err != nil {
			return
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(3 * time.Second))
		conn.Write([]byte("who"))
		buf := make([]byte, 512)
		var n int
		if n, err = conn.Read(buf); err != nil {
			return
		}
		line = string(buf[:n])
	}
	e, c, _ := strings.Cut(line, "|")
	if endpoint, err = netip.ParseAddrPort(e); err == nil {
		client, err = netip.ParseAddrPort(c)
	}
	return endpoint, client, err
}

// TestUserspaceKeepsClientAddress runs the userspace mode on a node with two
// pods, beside a second node with a pod of its own, and checks the source
// address each endpoint sees against kube-proxy's masquerading:
//   - a pod's connection to a ClusterIP keeps the pod's address, whether the
//     endpoint is a pod on the same node or on the other node (its replies
//     come back through this node), TCP and UDP;
//   - a connection from outside to an externalTrafficPolicy Local NodePort
//     keeps the client's address;
//   - a connection from outside to an externalTrafficPolicy Cluster NodePort,
//     and to a ClusterIP from outside --cluster-cidr, comes from the node;
//   - a pod reaching itself through its Service comes from the node;
//   - a filter on the remote pod that admits only the client pod (a network
//     policy) lets the kept connections in and the node's out.
//
// Both portal backends, IPv4 and IPv6.
func TestUserspaceKeepsClientAddress(t *testing.T) {
	for _, rules := range []string{"nftables", "iptables"} {
		for _, v6 := range []bool{false, true} {
			family := "IPv4"
			if v6 {
				family = "IPv6"
			}
			t.Run(rules+"/"+family, func(t *testing.T) {
				if rules == "nftables" {
					testbed.Needs(t, testbed.NFTables)
				}
				testKeepsClientAddress(t, rules, v6)
			})
		}
	}
}

// twoNodes is the world of the client-address tests: a node with two pods
// and a second node with one (testbed.WithSecondNode), in one address
// family, with that family's Service and cluster addresses.
type twoNodes struct {
	tp     *testbed.Topology
	v6     bool
	family string // as an EndpointSlice's addressType and a Service's ipFamilies say it
	cidr   string // --cluster-cidr
}

func newTwoNodes(t *testing.T, v6 bool) twoNodes {
	opts := []topology.Option{testbed.WithSecondNode()}
	w := twoNodes{v6: v6, family: "IPv4", cidr: "10.244.0.0/16"}
	if v6 {
		opts = append(opts, testbed.WithIPv6())
		w.family, w.cidr = "IPv6", "fd00:244::/32"
	}
	w.tp = testbed.New(t, opts...)
	return w
}

// ip is role's address in the family.
func (w twoNodes) ip(role string) netip.Addr {
	if w.v6 {
		return w.tp.NS(role).IPv6
	}
	return w.tp.NS(role).IPv4
}

// vip is the n-th Service address of the family.
func (w twoNodes) vip(n int) string {
	if w.v6 {
		return fmt.Sprintf("fd00:96::%d", n)
	}
	return fmt.Sprintf("10.96.0.%d", n)
}

func testKeepsClientAddress(t *testing.T, rules string, v6 bool) {
	w := newTwoNodes(t, v6)
	tp, ip, vip, family, cidr := w.tp, w.ip, w.vip, w.family, w.cidr
	hostPort := func(a string, port int) string { return net.JoinHostPort(a, fmt.Sprint(port)) }
	podIP, extIP, nodeIP := ip(testbed.Pod), ip(testbed.External), ip(testbed.Node)
	local := startWhoSaw(t, tp, testbed.Pod2, ip(testbed.Pod2))
	remote := startWhoSaw(t, tp, testbed.RemotePod, ip(testbed.RemotePod))

	svcs := []string{}
	both := func(name string, n int, proto string, extra string, eps ...whoSaw) {
		doc := fmt.Sprintf("apiVersion: v1\nkind: Service\nmetadata: {name: %s, namespace: it}\nspec:\n  clusterIP: %s\n  clusterIPs: [%s]\n  ipFamilies: [%s]\n%s  ports:\n  - {name: p, protocol: %s, port: 80",
			name, vip(n), vip(n), family, extra, proto)
		if strings.Contains(extra, "NodePort") {
			doc += fmt.Sprintf(", nodePort: %d", 30000+n)
		}
		doc += "}\n"
		svcs = append(svcs, doc)
		for i, e := range eps {
			port := e.tcp
			if proto == "UDP" {
				port = e.udp
			}
			node := "it-node"
			if e.role == testbed.RemotePod {
				node = "node-b"
			}
			svcs = append(svcs, slice(fmt.Sprintf("%s-%d", name, i), name, family, proto, ep{addr: e.addr, port: port, node: node}))
		}
	}
	both("cip", 30, "TCP", "", local, remote)
	both("cip-udp", 31, "UDP", "", local, remote)
	both("local", 32, "TCP", "  type: NodePort\n  externalTrafficPolicy: Local\n", local, remote)
	both("cluster", 33, "TCP", "  type: NodePort\n", local)
	both("cluster-remote", 35, "TCP", "  type: NodePort\n", remote)
	both("local-elsewhere", 36, "TCP", "  type: NodePort\n  externalTrafficPolicy: Local\n", remote)
	both("self", 34, "TCP", "", local)
	px := runUproxy(t, tp, join(svcs...), launch{want: 7, flags: []string{"--rules", rules, "--hostname-override", "it-node",
		"--cluster-cidr", cidr, "--shutdown-grace", "1s"}})

	// The node's own connection to an externalTrafficPolicy Local NodePort
	// without a local endpoint goes to the remote one (from the node's
	// address, before the remote pod's policy below would drop it).
	if e, c, err := askWho(tp, "TCP", testbed.Node, hostPort(nodeIP.String(), 30036)); err != nil || e.Addr() != ip(testbed.RemotePod) {
		t.Errorf("the node to an externalTrafficPolicy Local NodePort without a local endpoint: endpoint %v saw %v (%v); want the remote endpoint", e, c, err)
	}

	// The remote pod's policy: nothing but the client pod.
	nft := fmt.Sprintf("table inet netpol { chain input { type filter hook input priority 0; policy accept; meta l4proto { tcp, udp } th dport { %d, %d } %s saddr != %s drop; }; }",
		remote.tcp, remote.udp, map[bool]string{false: "ip", true: "ip6"}[v6], podIP)
	tp.MustExec(t, testbed.RemotePod, "nft", nft)

	check := func(name, proto, role, addr string, wantClient netip.Addr, wantEndpoints int) {
		t.Helper()
		seen := map[netip.Addr]bool{}
		for i := 0; i < 8 && len(seen) < wantEndpoints; i++ {
			e, c, err := askWho(tp, proto, role, addr)
			if err != nil {
				t.Errorf("%s: %s from %s to %s: %v", name, proto, role, addr, err)
				return
			}
			seen[e.Addr()] = true
			if c.Addr().Unmap() != wantClient {
				t.Errorf("%s: endpoint %v saw the client as %v; want %v", name, e, c, wantClient)
			}
		}
		if len(seen) < wantEndpoints {
			t.Errorf("%s: answered by %v; want %d endpoints", name, seen, wantEndpoints)
		}
	}
	check("pod to ClusterIP, a local and a remote endpoint", "TCP", testbed.Pod, hostPort(vip(30), 80), podIP, 2)
	check("pod to ClusterIP, UDP", "UDP", testbed.Pod, hostPort(vip(31), 80), podIP, 2)
	check("outside to an externalTrafficPolicy Local NodePort", "TCP", testbed.External, hostPort(nodeIP.String(), 30032), extIP, 1)
	check("pod to the ClusterIP of that Service", "TCP", testbed.Pod, hostPort(vip(32), 80), podIP, 2)
	// The node's address toward the local endpoint: where kube-proxy
	// masquerades, that is the source.
	nodeToLocal := tp.NS(testbed.Pod2).GatewayIPv4
	if v6 {
		nodeToLocal = tp.NS(testbed.Pod2).GatewayIPv6
	}
	check("a pod reaching itself", "TCP", testbed.Pod2, hostPort(vip(34), 80), nodeToLocal, 1)
	check("outside --cluster-cidr to a ClusterIP", "TCP", testbed.External, hostPort(vip(33), 80), nodeToLocal, 1)
	check("outside to an externalTrafficPolicy Cluster NodePort", "TCP", testbed.External, hostPort(nodeIP.String(), 30033), nodeToLocal, 1)
	check("a pod to an externalTrafficPolicy Cluster NodePort", "TCP", testbed.Pod, hostPort(nodeIP.String(), 30033), nodeToLocal, 1)
	// externalTrafficPolicy Local without an endpoint on this node: only the
	// node's own connections go to the others (checked above, before the
	// policy); pods' and other hosts' get nothing.
	for _, role := range []string{testbed.Pod, testbed.External} {
		if e, c, err := askWho(tp, "TCP", role, hostPort(nodeIP.String(), 30036)); err == nil {
			t.Errorf("%s to an externalTrafficPolicy Local NodePort without a local endpoint: endpoint %v saw %v; want no answer", role, e, c)
		}
	}
	// explain says whose address a client's dial would carry, and why.
	// Through a NodePort it is the external route's answer, as for the
	// connection itself.
	for _, c := range []struct {
		dst    string
		client netip.Addr
		want   string
	}{
		{hostPort(vip(30), 80), podIP, "Its dial goes from the client's address, " + podIP.String() + ": a pod's connection to a ClusterIP keeps its address"},
		{hostPort(vip(30), 80), extIP, "Its dial goes from the node's address: the client is outside --cluster-cidr"},
		{hostPort(nodeIP.String(), 30032), extIP, "Its dial goes from the client's address, " + extIP.String() + ": externalTrafficPolicy Local keeps the client's address"},
		{hostPort(vip(32), 80), extIP, "Its dial goes from the node's address: the client is outside --cluster-cidr"},
		{hostPort(nodeIP.String(), 30033), extIP, "Its dial goes from the node's address: externalTrafficPolicy Cluster"},
	} {
		out, err := tp.Exec(testbed.Node, uproxyBin, "explain", c.dst, "--client", c.client.String(), "--metrics-address", px.metrics)
		if err != nil || !strings.Contains(string(out), c.want) {
			t.Errorf("uproxy explain %s --client %s: %v\n%s\nwant a line with %q", c.dst, c.client, err, out, c.want)
		}
	}
	if m, err := px.get("/metrics"); err != nil || !strings.Contains(m, `uproxy_dial_sources_total{source="client"}`) {
		t.Errorf("/metrics: %v; want uproxy_dial_sources_total{source=\"client\"}", err)
	}
	// The node's address does not pass the remote pod's policy.
	if e, c, err := askWho(tp, "TCP", testbed.External, hostPort(nodeIP.String(), 30035)); err == nil {
		t.Errorf("outside to an externalTrafficPolicy Cluster NodePort: endpoint %v saw %v through the remote pod's policy; want the node's address, dropped", e, c)
	}
}

// TestPodReusesAKeptDialsPort: a dial from a pod's address leaves nothing on
// the node that takes that pod's own later connections. The pod reaches an
// endpoint through a ClusterIP and closes first, so the dial to the endpoint
// ends on the node (the side that sent the first FIN). The pod then connects
// to the endpoint directly from the address and port that dial had. A socket
// the node still held for that pair (TIME_WAIT) would be matched to the
// endpoint's replies before routing, and the kernel drops a forwarded packet
// that a local socket claimed: the pod's connection would never complete.
func TestPodReusesAKeptDialsPort(t *testing.T) {
	for _, c := range []struct {
		rules string
		v6    bool
	}{{"nftables", false}, {"iptables", false}, {"nftables", true}} {
		family, vip, cidr := "IPv4", "10.96.0.40", "10.244.0.0/16"
		if c.v6 {
			family, vip, cidr = "IPv6", "fd00:96::40", "fd00:244::/32"
		}
		rules := c.rules
		t.Run(rules+"/"+family, func(t *testing.T) {
			if rules == "nftables" {
				testbed.Needs(t, testbed.NFTables)
			}
			opts := []topology.Option{testbed.WithSecondNode()}
			if c.v6 {
				opts = append(opts, testbed.WithIPv6())
			}
			tp := testbed.New(t, opts...)
			podIP, epIP := tp.NS(testbed.Pod).IPv4, tp.NS(testbed.Pod2).IPv4
			if c.v6 {
				podIP, epIP = tp.NS(testbed.Pod).IPv6, tp.NS(testbed.Pod2).IPv6
			}
			// The endpoint writes the client address it saw, then waits for
			// the client's end before its own.
			ln := tp.Listen(testbed.Pod2, "tcp", netip.AddrPortFrom(epIP, 0).String())
			go testbed.ServeEach(ln, func(c net.Conn) {
				fmt.Fprintf(c, "%s\n", c.RemoteAddr())
				io.Copy(io.Discard, c)
			})
			epPort := ln.Addr().(*net.TCPAddr).Port
			svc := fmt.Sprintf("apiVersion: v1\nkind: Service\nmetadata: {name: reuse, namespace: it}\nspec:\n  clusterIP: %s\n  clusterIPs: [%s]\n  ipFamilies: [%s]\n  ports:\n  - {name: p, protocol: TCP, port: 80}\n", vip, vip, family)
			runUproxy(t, tp, join(svc, slice("reuse-0", "reuse", family, "TCP", ep{addr: epIP.String(), port: epPort, node: "it-node"})),
				launch{want: 1, flags: []string{"--rules", rules, "--hostname-override", "it-node", "--cluster-cidr", cidr}})

			// seen connects from role (from local when valid), reads the
			// client address the endpoint saw, and closes first.
			seen := func(addr string, local netip.AddrPort) (netip.AddrPort, error) {
				var saw netip.AddrPort
				err := tp.Run(testbed.Pod, func() error {
					d := net.Dialer{Timeout: 3 * time.Second}
					if local.IsValid() {
						d.LocalAddr = net.TCPAddrFromAddrPort(local)
					}
					c, err := d.Dial("tcp", addr)
					if err != nil {
						return err
					}
					defer c.Close()
					c.SetDeadline(time.Now().Add(3 * time.Second))
					line, err := bufio.NewReader(c).ReadString('\n')
					if err != nil {
						return err
					}
					if saw, err = netip.ParseAddrPort(strings.TrimSpace(line)); err != nil {
						return err
					}
					c.(*net.TCPConn).CloseWrite()
					_, err = io.Copy(io.Discard, c)
					return err
				})
				return saw, err
			}
			direct := netip.AddrPortFrom(epIP, uint16(epPort)).String()
			for i := range 3 {
				kept, err := seen(net.JoinHostPort(vip, "80"), netip.AddrPort{})
				if err != nil {
					t.Fatalf("pod to the ClusterIP: %v", err)
				}
				if kept.Addr() != podIP {
					t.Fatalf("pod to the ClusterIP: the endpoint saw %v; want the pod's address %v", kept, podIP)
				}
				got, err := seen(direct, kept)
				if err != nil {
					t.Fatalf("round %d: the pod to the endpoint directly from %v, the address and port of the dial before: %v", i, kept, err)
				}
				if got != kept {
					t.Errorf("round %d: the endpoint saw the pod's direct connection from %v; want %v", i, got, kept)
				}
			}
		})
	}
}
