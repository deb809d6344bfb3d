package rules

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/testbed"
)

func mustExec(t *testing.T, tp *testbed.Topology, role string, args ...string) {
	t.Helper()
	if _, err := tp.Exec(role, args...); err != nil {
		t.Fatal(err)
	}
}

// kubeChains installs chains as kube-proxy would, which uproxy must leave alone.
func kubeChains(t *testing.T, tp *testbed.Topology) {
	for _, ipt := range []string{"iptables", "ip6tables"} {
		mustExec(t, tp, testbed.Node, ipt, "-t", "nat", "-N", "KUBE-SERVICES")
		mustExec(t, tp, testbed.Node, ipt, "-t", "filter", "-N", "KUBE-FIREWALL")
		mustExec(t, tp, testbed.Node, ipt, "-t", "filter", "-A", "INPUT", "-j", "KUBE-FIREWALL")
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

// testDialMark stands for the proxy's dial mark (socket.SetDialMark).
const testDialMark = 0x2000

func TestRealPortals(t *testing.T) {
	testbed.RequireIPTables(t)
	tp := testbed.New(t, testbed.WithIPv6())
	node := tp.NS(testbed.Node)
	kubeChains(t, tp)
	before := [2]string{tp.SavedRules(t, false), tp.SavedRules(t, true)}

	// Stand-ins for the proxy: a TCP echo server and two tagged UDP servers.
	tcpProxy := tp.EchoTCP(testbed.Node, ":0")
	udpA := tp.ListenPacket(testbed.Node, "udp", ":0")
	udpB := tp.ListenPacket(testbed.Node, "udp", ":0")
	go serveTagged(udpA, "A")
	go serveTagged(udpB, "B")
	udpPortA := udpA.LocalAddr().(*net.UDPAddr).Port
	udpPortB := udpB.LocalAddr().(*net.UDPAddr).Port

	web := port("shop", "web", "http", service.TCP, 80)
	web.ClusterIPs = ips("10.96.0.10", "fd00:96::10")
	web.ExternalIPs = ips("10.250.0.5", "fd00:250::5")
	web.LoadBalancerIPs = ips("10.251.0.7")
	web.NodePort = 30080
	dns := port("kube-system", "dns", "dns", service.UDP, 53)
	dns.ClusterIPs = ips("10.96.0.53", "fd00:96::53")
	dns.NodePort = 30053
	portals := []Portal{{web, int(tcpProxy.Port())}, {dns, udpPortA}}

	k := &countingKernel{}
	p, err := NewIPTables(Config{
		NodeIPs:  []netip.Addr{node.IPv4, node.IPv6},
		IPv6:     true,
		DialMark: testDialMark,
		IPTables: k,
	})
	if err != nil {
		t.Fatal(err)
	}
	sync := func(t *testing.T, portals []Portal) {
		t.Helper()
		if err := tp.Run(testbed.Node, func() error { return p.Sync(portals) }); err != nil {
			t.Fatalf("Sync: %v", err)
		}
	}
	sync(t, portals)

	t.Run("iptables-save shows every written rule and the jumps", func(t *testing.T) {
		for f := v4; f <= v6; f++ {
			got := tp.SavedRules(t, f == v6)
			for _, line := range strings.Split(string(p.fams[f].written), "\n") {
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
	})

	t.Run("unchanged sync writes nothing", func(t *testing.T) {
		n := k.restores
		sync(t, portals)
		if k.restores != n {
			t.Errorf("restores during an unchanged sync: got %d, want 0", k.restores-n)
		}
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

	t.Run("ExternalIP not owned by the node is not captured from the node", func(t *testing.T) {
		// Legacy semantics: a node process reaches the real address, here a
		// listener in the external namespace holding that IP.
		mustExec(t, tp, testbed.External, "ip", "addr", "add", "10.250.0.5/32", "dev", "lo")
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
		moved := []Portal{{web, int(tcpProxy.Port())}, {dns, udpPortB}}
		sync(t, moved)
		// Same client socket, same conntrack tuple: only deleting the flow lets
		// the new REDIRECT apply.
		if got, err := exchange(c, "2", 2); got != "B2" {
			t.Errorf("after the proxy port moved: got %q (%v), want %q", got, err, "B2")
		}
		sync(t, portals)
	})

	t.Run("iptables -t nat -F then Sync restores the rules", func(t *testing.T) {
		mustExec(t, tp, testbed.Node, "iptables", "-t", "nat", "-F")
		kubeNATRules(t, tp, "iptables")
		mustExec(t, tp, testbed.Node, "ip6tables", "-t", "nat", "-F", "UPROXY-CANARY")
		mustExec(t, tp, testbed.Node, "ip6tables", "-t", "nat", "-X", "UPROXY-CANARY")
		n := k.restores
		sync(t, portals)
		if got := k.restores - n; got != 2 {
			t.Errorf("restores after flush (IPv4) and canary deletion (IPv6): got %d, want 2", got)
		}
		check(t, paths[0])
		check(t, paths[1])
		check(t, paths[3])
	})

	t.Run("NON-LOCAL accepts redirected NodePort traffic only", func(t *testing.T) {
		// A firewall that refuses every other TCP packet to the node.
		mustExec(t, tp, testbed.Node, "iptables", "-A", "INPUT", "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset")
		defer mustExec(t, tp, testbed.Node, "iptables", "-D", "INPUT", "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset")
		check(t, path{"NodePort through firewall", testbed.External, "tcp", at(node.IPv4, 30080), ""})
		direct := at(node.IPv4, int(tcpProxy.Port())).String()
		if c, err := tp.Dial(testbed.External, "tcp", direct); err == nil {
			c.Close()
			t.Errorf("dial proxy port %s directly from external: got a connection, want refused", direct)
		}
	})

	t.Run("Cleanup restores iptables-save exactly", func(t *testing.T) {
		if err := tp.Run(testbed.Node, p.Cleanup); err != nil {
			t.Fatalf("Cleanup: %v", err)
		}
		for f := v4; f <= v6; f++ {
			if got := tp.SavedRules(t, f == v6); got != before[f] {
				t.Errorf("%s after Cleanup:\ngot:\n%s\nwant:\n%s", familyName(f), got, before[f])
			}
		}
		// The NodePorts are released.
		ln := tp.Listen(testbed.Node, "tcp4", "0.0.0.0:30080")
		ln.Close()
		if err := tp.Run(testbed.Node, p.Cleanup); err != nil {
			t.Errorf("second Cleanup: got %v, want nil", err)
		}
	})
}

func TestRealStandaloneCleanup(t *testing.T) {
	testbed.RequireIPTables(t)
	tp := testbed.New(t)
	kubeChains(t, tp)
	before := [2]string{tp.SavedRules(t, false), tp.SavedRules(t, true)}
	node := tp.NS(testbed.Node)
	p, err := NewIPTables(Config{ChainPrefix: "UPX", NodeIPs: []netip.Addr{node.IPv4}})
	if err != nil {
		t.Fatal(err)
	}
	svc := port("a", "b", "", service.TCP, 80)
	svc.ClusterIPs = ips("10.96.0.1")
	svc.NodePort = 30001
	if err := tp.Run(testbed.Node, func() error { return p.Sync([]Portal{{svc, 40000}}) }); err != nil {
		t.Fatal(err)
	}
	if got := tp.SavedRules(t, false); !strings.Contains(got, "UPX-PORTALS-CONTAINER") {
		t.Fatalf("Sync wrote nothing:\n%s", got)
	}
	for i := range 2 { // the second run finds nothing to remove
		if err := tp.Run(testbed.Node, func() error { return Cleanup("UPX") }); err != nil {
			t.Fatalf("Cleanup run %d: %v", i, err)
		}
		for f := v4; f <= v6; f++ {
			if got := tp.SavedRules(t, f == v6); got != before[f] {
				t.Errorf("run %d %s:\ngot:\n%s\nwant:\n%s", i, familyName(f), got, before[f])
			}
		}
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
				testbed.RequireIPTables(b)
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
				size = len(r.render(entries))
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
		out[i] = Portal{Port: sp, ProxyPort: proxyBase + i}
	}
	return out
}

// BenchmarkNodeDialThroughPortals measures the CPU of one TCP connection opened on
// the node (connect, accept, close) while 10k portals are programmed: what each of
// the proxy's dials to an endpoint pays, with its dial mark and without it, and
// with no portals at all.
func BenchmarkNodeDialThroughPortals(b *testing.B) {
	testbed.RequireIPTables(b)
	tp := testbed.New(b)
	node := tp.NS(testbed.Node)
	p, err := NewIPTables(Config{NodeIPs: []netip.Addr{node.IPv4}, DialMark: testDialMark})
	if err != nil {
		b.Fatal(err)
	}
	ln := tp.Listen(testbed.Node, "tcp", node.IPv4.String()+":0")
	to := ln.Addr().(*net.TCPAddr).AddrPort()
	sa := &unix.SockaddrInet4{Addr: to.Addr().As4(), Port: int(to.Port())}
	lfd, err := ln.(*net.TCPListener).File()
	if err != nil {
		b.Fatal(err)
	}
	defer lfd.Close()
	unix.SetNonblock(int(lfd.Fd()), false)
	dial := func(mark int) error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		if mark != 0 {
			if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, mark); err != nil {
				return err
			}
		}
		if err := unix.Connect(fd, sa); err != nil {
			return err
		}
		afd, _, err := unix.Accept(int(lfd.Fd()))
		if err != nil {
			return err
		}
		return unix.Close(afd)
	}
	cpu := func() time.Duration {
		var ru unix.Rusage
		unix.Getrusage(unix.RUSAGE_SELF, &ru)
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	run := func(name string, portals []Portal, mark int) {
		b.Run(name, func(b *testing.B) {
			err := tp.Run(testbed.Node, func() error {
				if err := p.Sync(portals); err != nil {
					return err
				}
				for range 200 { // warm-up: conntrack and routing caches
					if err := dial(mark); err != nil {
						return err
					}
				}
				b.ResetTimer()
				start := cpu()
				for b.Loop() {
					if err := dial(mark); err != nil {
						return err
					}
				}
				b.ReportMetric(float64(cpu()-start)/float64(b.N)/1e3, "cpu-us/conn")
				return nil
			})
			if err != nil {
				b.Fatal(err)
			}
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
