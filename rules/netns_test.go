package rules

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"sigs.k8s.io/knftables"

	"github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/netfilter/nftables"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/test/testbed"
)

func mustExec(t *testing.T, tp *testbed.Topology, role string, args ...string) {
	t.Helper()
	if _, err := tp.Exec(role, args...); err != nil {
		t.Fatal(err)
	}
}

// kubeChains installs chains as kube-proxy would, which uproxy must leave alone.
// kube-proxy has jumps in every filter hook; with iptables on nf_tables these
// also create the base chains, which a jump of uproxy's would otherwise create
// and its cleanup leave behind, empty.
func kubeChains(t *testing.T, tp *testbed.Topology) {
	for _, ipt := range []string{"iptables", "ip6tables"} {
		mustExec(t, tp, testbed.Node, ipt, "-t", "nat", "-N", "KUBE-SERVICES")
		mustExec(t, tp, testbed.Node, ipt, "-t", "filter", "-N", "KUBE-FIREWALL")
		mustExec(t, tp, testbed.Node, ipt, "-t", "filter", "-N", "KUBE-FORWARD")
		mustExec(t, tp, testbed.Node, ipt, "-t", "filter", "-A", "INPUT", "-j", "KUBE-FIREWALL")
		mustExec(t, tp, testbed.Node, ipt, "-t", "filter", "-A", "FORWARD", "-j", "KUBE-FORWARD")
		mustExec(t, tp, testbed.Node, ipt, "-t", "filter", "-A", "OUTPUT", "-j", "KUBE-FIREWALL")
	}
	kubeNATRules(t, tp, "iptables", "ip6tables")
}

// kubeNATRules fills kube-proxy's nat rules, as kube-proxy does again after a
// flush of the nat table.
func kubeNATRules(t *testing.T, tp *testbed.Topology, ipts ...string) {
	for _, ipt := range ipts {
		mustExec(t, tp, testbed.Node, ipt, "-t", "nat", "-A", "PREROUTING", "-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES")
		mustExec(t, tp, testbed.Node, ipt, "-t", "nat", "-A", "OUTPUT", "-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES")
		mustExec(t, tp, testbed.Node, ipt, "-t", "nat", "-A", "KUBE-SERVICES", "-p", "tcp", "--dport", "8080", "-m", "comment", "--comment", "other/svc", "-j", "RETURN")
	}
}

// serveTagged answers every datagram with tag followed by the datagram, so a
// client can tell which proxy port its flow reached.
func serveTagged(pc net.PacketConn, tag string) {
	buf := make([]byte, 64<<10)
	for {
		n, from, err := pc.ReadFrom(buf)
		if err != nil {
			return
		}
		pc.WriteTo(append([]byte(tag), buf[:n]...), from)
	}
}

func exchange(c net.Conn, msg string, replyLen int) (string, error) {
	c.SetDeadline(time.Now().Add(testbed.DialTimeout))
	if _, err := c.Write([]byte(msg)); err != nil {
		return "", err
	}
	buf := make([]byte, replyLen)
	if _, ok := c.(*net.UDPConn); ok {
		n, err := c.Read(buf)
		return string(buf[:n]), err
	}
	_, err := io.ReadFull(c, buf)
	return string(buf), err
}

// countingKernel is the real iptables, counting the restores.
type countingKernel struct {
	iptables.Commands
	restores int
}

func (k *countingKernel) Restore(v6 bool, input []byte) error {
	k.restores++
	return k.Commands.Restore(v6, input)
}

// countingNFT is the real nftables table, counting the transactions: nft
// runs and the netlink batches of WriteElements.
type countingNFT struct {
	nftables.Kernel
	runs int
}

func (k *countingNFT) Run(ctx context.Context, tx *knftables.Transaction) error {
	k.runs++
	return k.Kernel.Run(ctx, tx)
}

func (k *countingNFT) WriteElements(ctx context.Context, changes nftables.ElementChanges) error {
	k.runs++
	return k.Kernel.WriteElements(ctx, changes)
}

// testDialMark stands for the proxy's dial mark (socket.TCPProxy.DialMark).
const testDialMark = 0x2000

// realBackend is one Portals implementation as the namespace tests drive it.
type realBackend struct {
	name string
	need testbed.Need // the kernel need of its namespace tests
	// build returns the backend's Portals for cfg and the count of its writes
	// to the kernel (restores, transactions).
	build func(t testing.TB, cfg Config) (Portals, *int)
	// inspect checks what the first sync wrote, as the backend's own tools show it.
	inspect func(t *testing.T, tp *testbed.Topology, p Portals)
	// flushes are what other programs do to the backend's rules, each followed
	// by a sync that must restore every path with that many writes.
	flushes []externalFlush
	// opensFirewall: redirected NodePort traffic passes a host firewall that
	// rejects every other TCP packet to the node.
	opensFirewall bool
}

type externalFlush struct {
	name   string
	do     func(t *testing.T, tp *testbed.Topology)
	writes int
}

var realBackends = []realBackend{
	{
		name: "iptables",
		need: testbed.IPTables,
		build: func(t testing.TB, cfg Config) (Portals, *int) {
			k := &countingKernel{}
			cfg.IPTables = k
			p, err := NewIPTables(cfg)
			if err != nil {
				t.Fatal(err)
			}
			return p, &k.restores
		},
		inspect: func(t *testing.T, tp *testbed.Topology, p Portals) {
			for f := v4; f <= v6; f++ {
				got := tp.SavedRules(t, f == v6)
				for _, line := range strings.Split(string(p.(*IPTables).fams[f].written), "\n") {
					if strings.HasPrefix(line, "-A ") && !strings.Contains(got, line+"\n") {
						t.Errorf("%s: rule %q missing from iptables-save:\n%s", familyName(f), line, got)
					}
				}
				var prerouting []string
				for _, line := range strings.Split(got, "\n") {
					if strings.HasPrefix(line, "-A PREROUTING ") {
						prerouting = append(prerouting, line)
					}
				}
				want := []string{
					`-A PREROUTING -m comment --comment "uproxy service portals" -j UPROXY-PORTALS-CONTAINER`,
					`-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES`,
					`-A PREROUTING -m addrtype --dst-type LOCAL -m comment --comment "uproxy NodePorts" -j UPROXY-NODEPORT-CONTAINER`,
				}
				if strings.Join(prerouting, "\n") != strings.Join(want, "\n") {
					t.Errorf("%s PREROUTING:\ngot  %q\nwant %q", familyName(f), prerouting, want)
				}
			}
		},
		flushes: []externalFlush{{
			name: "iptables -t nat -F (IPv4), canary chain deleted (IPv6)",
			do: func(t *testing.T, tp *testbed.Topology) {
				mustExec(t, tp, testbed.Node, "iptables", "-t", "nat", "-F")
				kubeNATRules(t, tp, "iptables")
				mustExec(t, tp, testbed.Node, "ip6tables", "-t", "nat", "-F", "UPROXY-CANARY")
				mustExec(t, tp, testbed.Node, "ip6tables", "-t", "nat", "-X", "UPROXY-CANARY")
			},
			writes: 2, // one restore per family
		}},
		opensFirewall: true,
	},
	{
		name: "nftables",
		need: testbed.NFTables,
		build: func(t testing.TB, cfg Config) (Portals, *int) {
			name, err := nftables.TableName(cmp.Or(cfg.ChainPrefix, iptables.DefaultChainPrefix))
			if err != nil {
				t.Fatal(err)
			}
			real, err := nftables.New(nftables.Table{Family: knftables.InetFamily, Name: name})
			if err != nil {
				t.Fatal(err)
			}
			k := &countingNFT{Kernel: real}
			cfg.NFTables = k
			p, err := NewNFTables(cfg)
			if err != nil {
				t.Fatal(err)
			}
			return p, &k.runs
		},
		inspect: func(t *testing.T, tp *testbed.Topology, p Portals) {
			out, err := tp.Exec(testbed.Node, "nft", "list", "table", "inet", "uproxy")
			if err != nil {
				t.Fatal(err)
			}
			got := string(out)
			t.Logf("nft list table inet uproxy:\n%s", got)
			for _, want := range []string{
				"type nat hook prerouting priority dstnat - 10; policy accept;",
				"type nat hook output priority -110; policy accept;",
				`10.96.0.10 . tcp . 80 comment "shop/web:http"`,
				`fd00:96::10 . tcp . 80 comment "shop/web:http"`,
				`10.250.0.5 . tcp . 80 comment "shop/web:http"`,
				`10.96.0.53 . udp . 53 comment "kube-system/dns:dns"`,
				`udp . 30053 comment "kube-system/dns:dns"`,
				"meta mark & 0x00002000 != 0x00000000 return",
			} {
				if !strings.Contains(got, want) {
					t.Errorf("nft list table lacks %q", want)
				}
			}
		},
		flushes: []externalFlush{
			{
				name: "nft flush table inet uproxy",
				do: func(t *testing.T, tp *testbed.Topology) {
					mustExec(t, tp, testbed.Node, "nft", "flush", "table", "inet", "uproxy")
				},
				writes: 1,
			},
			{
				name: "nft delete table inet uproxy",
				do: func(t *testing.T, tp *testbed.Topology) {
					mustExec(t, tp, testbed.Node, "nft", "delete", "table", "inet", "uproxy")
				},
				writes: 1,
			},
			{
				name: "nft flush ruleset, then the others write theirs again",
				do: func(t *testing.T, tp *testbed.Topology) {
					mustExec(t, tp, testbed.Node, "nft", "flush", "ruleset")
					kubeChains(t, tp)
					kubeNFTables(t, tp)
				},
				writes: 1,
			},
		},
	},
}

// kubeNFTables installs tables as kube-proxy's nftables mode would, which
// uproxy must leave alone: a nat chain at dstnat in each family, and in IPv4 a
// Service map whose verdict DNATs to a host that answers nothing.
func kubeNFTables(t *testing.T, tp *testbed.Topology) {
	t.Helper()
	file := filepath.Join(t.TempDir(), "kube-proxy.nft")
	err := os.WriteFile(file, []byte(`table ip kube-proxy {
	map service-ips {
		type ipv4_addr . inet_proto . inet_service : verdict
		elements = { 10.96.0.99 . tcp . 80 : goto service-other }
	}
	chain service-other {
		meta l4proto tcp dnat to 192.0.2.1:80
	}
	chain services {
		ip daddr . meta l4proto . th dport vmap @service-ips
	}
	chain nat-prerouting {
		type nat hook prerouting priority dstnat; policy accept;
		jump services
	}
	chain nat-output {
		type nat hook output priority -100; policy accept;
		jump services
	}
}
table ip6 kube-proxy {
	chain nat-prerouting {
		type nat hook prerouting priority dstnat; policy accept;
	}
}
`), 0o644)
	if err != nil {
		t.Fatal(err)
	}
	mustExec(t, tp, testbed.Node, "nft", "-f", file)
}

// rulesets returns everything the node's packet filter holds, for exact
// before/after comparisons: iptables-save of both families, and the nftables
// ruleset when nft is there.
func rulesets(t testing.TB, tp *testbed.Topology) string {
	t.Helper()
	all := tp.SavedRules(t, false) + tp.SavedRules(t, true)
	if _, err := exec.LookPath("nft"); err == nil {
		all += tp.NFTRuleset(t)
	}
	return all
}

func TestRealPortals(t *testing.T) {
	for _, b := range realBackends {
		t.Run(b.name, func(t *testing.T) { testRealPortals(t, b) })
	}
}

// kubeNode builds the namespaces of a test of backend b's real portals, with
// kube-proxy's chains and tables in the node, which uproxy must leave alone,
// and returns them with the node's whole ruleset as it is before uproxy.
func kubeNode(t *testing.T, b realBackend) (*testbed.Topology, string) {
	t.Helper()
	testbed.Needs(t, testbed.IPTables, b.need) // kube-proxy's chains are iptables
	tp := testbed.New(t, testbed.WithIPv6())
	kubeChains(t, tp)
	// kube-proxy's nftables tables too, where nft exists (the nftables backend
	// requires it; the iptables one must leave those tables alone as well).
	if _, err := exec.LookPath("nft"); err == nil {
		kubeNFTables(t, tp)
	}
	return tp, rulesets(t, tp)
}

func testRealPortals(t *testing.T, b realBackend) {
	tp, before := kubeNode(t, b)
	node := tp.NS(testbed.Node)

	// Stand-ins for the proxy: a TCP echo server and two tagged UDP servers.
	tcpProxy := tp.EchoTCP(testbed.Node, ":0")
	udpA := tp.ListenPacket(testbed.Node, "udp", ":0")
	udpB := tp.ListenPacket(testbed.Node, "udp", ":0")
	go serveTagged(udpA, "A")
	go serveTagged(udpB, "B")
	udpPortA := udpA.LocalAddr().(*net.UDPAddr).Port
	udpPortB := udpB.LocalAddr().(*net.UDPAddr).Port

	web := webPort(30080)
	dns := dnsPort(30053, "10.96.0.53", "fd00:96::53")
	portals := []Portal{{Port: web, ProxyPort: int(tcpProxy.Port())}, {Port: dns, ProxyPort: udpPortA}}

	p, writes := b.build(t, Config{
		NodeIPs:  []netip.Addr{node.IPv4, node.IPv6},
		IPv6:     true,
		DialMark: testDialMark,
	})
	sync := func(t *testing.T, portals []Portal) {
		t.Helper()
		if err := tp.Run(testbed.Node, func() error { return p.Sync(portals) }); err != nil {
			t.Fatalf("Sync: %v", err)
		}
	}
	sync(t, portals)

	t.Run("the kernel shows what was written", func(t *testing.T) { b.inspect(t, tp, p) })

	t.Run("unchanged sync writes nothing", func(t *testing.T) {
		n := *writes
		sync(t, portals)
		if *writes != n {
			t.Errorf("writes during an unchanged sync: got %d, want 0", *writes-n)
		}
	})

	t.Run("an endpoint change writes nothing", func(t *testing.T) {
		moved := *web
		moved.Endpoints = []service.Endpoint{{Addr: netip.MustParseAddrPort("10.244.9.9:8080"), Ready: true}}
		n := *writes
		sync(t, []Portal{{Port: &moved, ProxyPort: int(tcpProxy.Port())}, portals[1]})
		if *writes != n {
			t.Errorf("writes after an endpoint change: got %d, want 0", *writes-n)
		}
		sync(t, portals)
	})

	pod := tp.NS(testbed.Pod)
	type path struct {
		name, from, network string
		to                  netip.AddrPort
		want                string // reply prefix: "" for TCP echo, the tag for UDP
	}
	at := func(ip netip.Addr, port int) netip.AddrPort { return netip.AddrPortFrom(ip, uint16(port)) }
	paths := []path{
		{"ClusterIP TCP from pod", testbed.Pod, "tcp", at(web.ClusterIPs[0], 80), ""},
		{"ClusterIP TCP from node", testbed.Node, "tcp", at(web.ClusterIPs[0], 80), ""},
		{"ClusterIP TCP IPv6 from pod", testbed.Pod, "tcp", at(web.ClusterIPs[1], 80), ""},
		{"ClusterIP TCP IPv6 from node", testbed.Node, "tcp", at(web.ClusterIPs[1], 80), ""},
		{"ClusterIP UDP from pod", testbed.Pod, "udp", at(dns.ClusterIPs[0], 53), "A"},
		{"ClusterIP UDP from node", testbed.Node, "udp", at(dns.ClusterIPs[0], 53), "A"},
		{"ClusterIP UDP IPv6 from pod", testbed.Pod, "udp", at(dns.ClusterIPs[1], 53), "A"},
		{"ClusterIP UDP IPv6 from node", testbed.Node, "udp", at(dns.ClusterIPs[1], 53), "A"},
		{"ExternalIP from external", testbed.External, "tcp", at(web.ExternalIPs[0], 80), ""},
		{"ExternalIP IPv6 from external", testbed.External, "tcp", at(web.ExternalIPs[1], 80), ""},
		{"ExternalIP from pod", testbed.Pod, "tcp", at(web.ExternalIPs[0], 80), ""},
		{"LoadBalancer IP from external", testbed.External, "tcp", at(web.LoadBalancerIPs[0], 80), ""},
		{"NodePort TCP from external", testbed.External, "tcp", at(node.IPv4, 30080), ""},
		{"NodePort TCP IPv6 from external", testbed.External, "tcp", at(node.IPv6, 30080), ""},
		{"NodePort UDP from external", testbed.External, "udp", at(node.IPv4, 30053), "A"},
		{"NodePort TCP from pod to its gateway", testbed.Pod, "tcp", at(pod.GatewayIPv4, 30080), ""},
		{"NodePort TCP from node", testbed.Node, "tcp", at(node.IPv4, 30080), ""},
		{"NodePort TCP from node to localhost", testbed.Node, "tcp", at(netip.MustParseAddr("127.0.0.1"), 30080), ""},
		{"NodePort TCP from node to another localhost address", testbed.Node, "tcp", at(netip.MustParseAddr("127.0.0.2"), 30080), ""},
		{"NodePort TCP IPv6 from node to localhost", testbed.Node, "tcp", at(netip.MustParseAddr("::1"), 30080), ""},
	}
	check := func(t *testing.T, pt path) {
		t.Helper()
		c, err := tp.Dial(pt.from, pt.network, pt.to.String())
		if err != nil {
			t.Fatalf("dial %s from %s: %v", pt.to, pt.from, err)
		}
		defer c.Close()
		msg := "ping " + pt.name
		got, err := exchange(c, msg, len(pt.want)+len(msg))
		if got != pt.want+msg {
			t.Errorf("%s %s from %s: got %q (%v), want %q", pt.network, pt.to, pt.from, got, err, pt.want+msg)
		}
	}
	for _, pt := range paths {
		t.Run(pt.name, func(t *testing.T) { check(t, pt) })
	}

	t.Run("a Service added, then removed: its portals come and go", func(t *testing.T) {
		extra := port("shop", "extra", "", service.TCP, 80)
		extra.ClusterIPs = ips("10.96.0.77")
		extra.ExternalIPs = ips("10.250.0.77")
		sync(t, append(slices.Clone(portals), Portal{Port: extra, ProxyPort: int(tcpProxy.Port())}))
		for _, pt := range []path{
			{"added ClusterIP from pod", testbed.Pod, "tcp", at(extra.ClusterIPs[0], 80), ""},
			{"added ClusterIP from node", testbed.Node, "tcp", at(extra.ClusterIPs[0], 80), ""},
			{"added ExternalIP from external", testbed.External, "tcp", at(extra.ExternalIPs[0], 80), ""},
		} {
			check(t, pt)
		}
		sync(t, portals)
		rules := tp.SavedRules(t, false)
		if b.name == "nftables" {
			out, err := tp.Exec(testbed.Node, "nft", "list", "ruleset")
			if err != nil {
				t.Fatal(err)
			}
			rules = string(out)
		}
		if strings.Contains(rules, "10.96.0.77") || strings.Contains(rules, "10.250.0.77") {
			t.Errorf("the removed Service's addresses are still in the rules:\n%s", rules)
		}
		check(t, paths[0])
		check(t, paths[8])
	})

	// Only the nftables backend orders its chains before kube-proxy's: iptables'
	// nat table and kube-proxy's nat chains share priority -100, so their order
	// is the kernel's registration order.
	if b.name == "nftables" {
		t.Run("the portals run before kube-proxy's nftables nat chains", func(t *testing.T) {
			// kube-proxy's map now also claims the ClusterIP and would DNAT it to a
			// host that answers nothing.
			mustExec(t, tp, testbed.Node, "nft", "add", "element", "ip", "kube-proxy", "service-ips", "{ 10.96.0.10 . tcp . 80 : goto service-other }")
			defer mustExec(t, tp, testbed.Node, "nft", "delete", "element", "ip", "kube-proxy", "service-ips", "{ 10.96.0.10 . tcp . 80 }")
			check(t, paths[0])
			check(t, paths[1])
		})
	}

	t.Run("ExternalIP not owned by the node is not captured from the node", func(t *testing.T) {
		// Legacy semantics: a node process reaches the real address, here a
		// listener in the external namespace holding that IP.
		mustExec(t, tp, testbed.External, "ip", "addr", "add", "10.250.0.5/32", "dev", "lo")
		defer mustExec(t, tp, testbed.External, "ip", "addr", "del", "10.250.0.5/32", "dev", "lo")
		real := tp.Listen(testbed.External, "tcp", "10.250.0.5:80")
		go func() {
			c, err := real.Accept()
			if err == nil {
				c.Write([]byte("real"))
				c.Close()
			}
		}()
		c, err := tp.Dial(testbed.Node, "tcp", "10.250.0.5:80")
		if err != nil {
			t.Fatalf("dial: %v", err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(testbed.DialTimeout))
		got, err := io.ReadAll(c)
		if string(got) != "real" {
			t.Errorf("node to ExternalIP: got %q (%v), want %q from the real host", got, err, "real")
		}
	})

	t.Run("the proxy's own marked connections skip the portals", func(t *testing.T) {
		// The ClusterIP also lives on a real host: a marked connection from the
		// node reaches it, as the proxy's dial of an endpoint would; an unmarked one
		// is captured by the portal (the echo server standing in for the proxy).
		mustExec(t, tp, testbed.External, "ip", "addr", "add", "10.96.0.10/32", "dev", "lo")
		defer mustExec(t, tp, testbed.External, "ip", "addr", "del", "10.96.0.10/32", "dev", "lo")
		real := tp.Listen(testbed.External, "tcp", "10.96.0.10:80")
		go func() {
			for {
				c, err := real.Accept()
				if err != nil {
					return
				}
				c.Write([]byte("real"))
				c.Close()
			}
		}()
		for _, mark := range []uint32{testDialMark, 0} {
			var got []byte
			err := tp.Run(testbed.Node, func() error {
				d := net.Dialer{Timeout: testbed.DialTimeout, Control: func(_, _ string, rc syscall.RawConn) error {
					var serr error
					rc.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, int(mark)) })
					return serr
				}}
				c, err := d.Dial("tcp", "10.96.0.10:80")
				if err != nil {
					return err
				}
				defer c.Close()
				c.SetDeadline(time.Now().Add(testbed.DialTimeout))
				if mark == 0 {
					c.Write([]byte("echo"))
					got = make([]byte, 4)
					_, err = io.ReadFull(c, got)
					return err
				}
				got, err = io.ReadAll(c)
				return err
			})
			want := map[bool]string{true: "real", false: "echo"}[mark != 0]
			if err != nil || string(got) != want {
				t.Errorf("node to ClusterIP with mark %#x: got %q (%v), want %q", mark, got, err, want)
			}
		}
	})

	t.Run("stale UDP flow follows a new proxy port", func(t *testing.T) {
		c, err := tp.Dial(testbed.Pod, "udp", "10.96.0.53:53")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if got, err := exchange(c, "1", 2); got != "A1" {
			t.Fatalf("before: got %q (%v), want %q", got, err, "A1")
		}
		moved := []Portal{{Port: web, ProxyPort: int(tcpProxy.Port())}, {Port: dns, ProxyPort: udpPortB}}
		sync(t, moved)
		// Same client socket, same conntrack tuple: only deleting the flow lets
		// the new REDIRECT apply.
		if got, err := exchange(c, "2", 2); got != "B2" {
			t.Errorf("after the proxy port moved: got %q (%v), want %q", got, err, "B2")
		}
		sync(t, portals)
	})

	for _, fl := range b.flushes {
		t.Run(fl.name+", then Sync restores the portals", func(t *testing.T) {
			fl.do(t, tp)
			n := *writes
			sync(t, portals)
			if got := *writes - n; got != fl.writes {
				t.Errorf("writes after the flush: got %d, want %d", got, fl.writes)
			}
			check(t, paths[0])
			check(t, paths[1])
			check(t, paths[3])
			check(t, paths[12])
		})
	}

	t.Run("a host firewall rejecting TCP to the node", func(t *testing.T) {
		mustExec(t, tp, testbed.Node, "iptables", "-A", "INPUT", "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset")
		defer mustExec(t, tp, testbed.Node, "iptables", "-D", "INPUT", "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset")
		np := at(node.IPv4, 30080).String()
		c, err := tp.Dial(testbed.External, "tcp", np)
		if b.opensFirewall {
			// The iptables backend's NON-LOCAL chain accepts redirected NodePort traffic.
			if err != nil {
				t.Fatalf("dial NodePort %s through the firewall: %v", np, err)
			}
			defer c.Close()
			msg := "through the firewall"
			if got, err := exchange(c, msg, len(msg)); got != msg {
				t.Errorf("NodePort through the firewall: got %q (%v), want %q", got, err, msg)
			}
		} else if err == nil {
			// An accept in another nftables table cannot overrule the firewall's
			// reject (see NFTables).
			c.Close()
			t.Errorf("dial NodePort %s through the firewall: got a connection, want refused", np)
		}
		direct := at(node.IPv4, int(tcpProxy.Port())).String()
		if c, err := tp.Dial(testbed.External, "tcp", direct); err == nil {
			c.Close()
			t.Errorf("dial proxy port %s directly from external: got a connection, want refused", direct)
		}
	})

	t.Run("Cleanup restores the ruleset exactly", func(t *testing.T) {
		if err := tp.Run(testbed.Node, p.Cleanup); err != nil {
			t.Fatalf("Cleanup: %v", err)
		}
		if got := rulesets(t, tp); got != before {
			t.Errorf("after Cleanup:\ngot:\n%s\nwant:\n%s", got, before)
		}
		// The NodePorts are released.
		ln := tp.Listen(testbed.Node, "tcp4", "0.0.0.0:30080")
		ln.Close()
		if err := tp.Run(testbed.Node, p.Cleanup); err != nil {
			t.Errorf("second Cleanup: got %v, want nil", err)
		}
	})
}

// TestRealStandaloneCleanup: `uproxy cleanup` (Cleanup) removes the portals of
// either backend, and only them.
func TestRealStandaloneCleanup(t *testing.T) {
	for _, b := range realBackends {
		t.Run(b.name, func(t *testing.T) {
			testbed.Needs(t, testbed.IPTables, b.need)
			tp := testbed.New(t)
			kubeChains(t, tp)
			if _, err := exec.LookPath("nft"); err == nil {
				kubeNFTables(t, tp)
			}
			before := rulesets(t, tp)
			node := tp.NS(testbed.Node)
			p, _ := b.build(t, Config{ChainPrefix: "UPX", NodeIPs: []netip.Addr{node.IPv4}})
			svc := port("a", "b", "", service.TCP, 80)
			svc.ClusterIPs = ips("10.96.0.1")
			svc.NodePort = 30001
			if err := tp.Run(testbed.Node, func() error { return p.Sync([]Portal{{Port: svc, ProxyPort: 40000}}) }); err != nil {
				t.Fatal(err)
			}
			if got := rulesets(t, tp); got == before {
				t.Fatalf("Sync wrote nothing:\n%s", got)
			}
			for i := range 2 { // the second run finds nothing to remove
				if err := tp.Run(testbed.Node, func() error { return Cleanup("UPX") }); err != nil {
					t.Fatalf("Cleanup run %d: %v", i, err)
				}
				if got := rulesets(t, tp); got != before {
					t.Errorf("run %d:\ngot:\n%s\nwant:\n%s", i, got, before)
				}
			}
			// The backend's own Cleanup, which also releases the held
			// NodePort, finds nothing left to remove.
			if err := tp.Run(testbed.Node, p.Cleanup); err != nil {
				t.Errorf("Cleanup after uproxy cleanup: %v", err)
			}
		})
	}
}

// BenchmarkSync measures Sync with real iptables in a namespace. "full": every
// iteration moves every proxy port, so each one renders and restores everything
// (and runs a conntrack pass for the UDP ports). "unchanged": the same state
// again, which costs a render and the canary read.
func BenchmarkSync(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		for _, mode := range []string{"full", "unchanged"} {
			b.Run(fmt.Sprintf("portals=%d/%s", n, mode), func(b *testing.B) {
				testbed.Needs(b, testbed.IPTables)
				tp := testbed.New(b)
				node := tp.NS(testbed.Node)
				sets := [2][]Portal{benchPortals(n, 20000), benchPortals(n, 40000)}
				if mode == "unchanged" {
					sets[0] = sets[1]
				}
				p, err := NewIPTables(Config{NodeIPs: []netip.Addr{node.IPv4}})
				if err != nil {
					b.Fatal(err)
				}
				err = tp.Run(testbed.Node, func() error {
					if err := p.Sync(sets[1]); err != nil {
						return err
					}
					b.ResetTimer()
					for i := 0; i < b.N; i++ {
						if err := p.Sync(sets[i%2]); err != nil {
							return err
						}
					}
					b.StopTimer()
					return p.Cleanup()
				})
				if err != nil {
					b.Fatal(err)
				}
			})
		}
	}
}

// BenchmarkRender measures building one family's restore input alone.
func BenchmarkRender(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		b.Run(fmt.Sprintf("portals=%d", n), func(b *testing.B) {
			entries, errs := entriesOf(benchPortals(n, 20000), [2]bool{true, false})
			if len(errs) > 0 {
				b.Fatal(errs)
			}
			r := newRenderer(chainNames("UPROXY"), v4, nodeIPv4, nil)
			var size int
			for b.Loop() {
				text, _ := r.render(entries)
				size = len(text)
			}
			b.ReportMetric(float64(size), "bytes/op-text")
		})
	}
}

// benchPortals returns n Service ports: alternating TCP and UDP, each with a
// ClusterIP, every tenth with an ExternalIP and a NodePort (NodePort held only in
// the real benchmark; render counts them as held).
func benchPortals(n, proxyBase int) []Portal {
	out := make([]Portal, n)
	for i := range n {
		proto := service.TCP
		if i%2 == 1 {
			proto = service.UDP
		}
		sp := port("bench", "svc-"+strconv.Itoa(i), "p", proto, 80)
		sp.ClusterIPs = []netip.Addr{netip.AddrFrom4([4]byte{10, 96, byte(i >> 8), byte(i)})}
		if i%10 == 0 {
			sp.ExternalIPs = []netip.Addr{netip.AddrFrom4([4]byte{10, 250, byte(i >> 8), byte(i)})}
			sp.NodePort = 30000 + i/10
		}
		// Past 65535 the proxy ports wrap around to 1024: at 50k Service ports
		// some share one, which the portals do not mind.
		out[i] = Portal{Port: sp, ProxyPort: 1024 + (proxyBase+i-1024)%(65536-1024)}
	}
	// In name order, as the proxier hands them over (a Snapshot's order).
	slices.SortFunc(out, func(a, b Portal) int { return a.Port.Name.Compare(b.Port.Name) })
	return out
}

// BenchmarkNodeDialThroughPortals measures, for each backend, the CPU of one TCP
// connection opened on the node (connect, accept, close) while 10k portals are
// programmed: what each of the proxy's dials to an endpoint pays, with its dial
// mark and without it, and with no portals at all.
func BenchmarkNodeDialThroughPortals(b *testing.B) {
	for _, be := range realBackends {
		b.Run(be.name, func(b *testing.B) { benchmarkNodeDialThroughPortals(b, be) })
	}
}

func benchmarkNodeDialThroughPortals(b *testing.B, be realBackend) {
	testbed.Needs(b, be.need)
	tp := testbed.New(b)
	node := tp.NS(testbed.Node)
	p, _ := be.build(b, Config{NodeIPs: []netip.Addr{node.IPv4}, DialMark: testDialMark})
	ln := tp.Listen(testbed.Node, "tcp", node.IPv4.String()+":0")
	to := ln.Addr().(*net.TCPAddr).AddrPort()
	sa := &unix.SockaddrInet4{Addr: to.Addr().As4(), Port: int(to.Port())}
	lfd, err := ln.(*net.TCPListener).File()
	if err != nil {
		b.Fatal(err)
	}
	defer lfd.Close()
	unix.SetNonblock(int(lfd.Fd()), false)
	run := func(name string, portals []Portal, mark int) {
		b.Run(name, func(b *testing.B) {
			if err := tp.Run(testbed.Node, func() error { return p.Sync(portals) }); err != nil {
				b.Fatal(err)
			}
			tp.BenchConns(b, testbed.Node, func() error { return testbed.ConnectAccept(sa, int(lfd.Fd()), mark) })
		})
	}
	many := benchPortals(10000, 20000)
	run("portals=10000/unmarked", many, 0)
	run("portals=10000/dial-mark", many, testDialMark)
	run("portals=0", nil, 0)
	if err := tp.Run(testbed.Node, p.Cleanup); err != nil {
		b.Fatal(err)
	}
}
