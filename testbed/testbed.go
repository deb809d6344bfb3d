// Package testbed builds network-namespace topologies for integration tests and
// benchmarks: a node namespace, a pod namespace and an external namespace, each
// joined to the node by a veth pair, with addresses, routes and forwarding set up.
//
//	tp := testbed.New(t, testbed.WithIPv6())
//	echo := tp.EchoTCP(testbed.Node, ":0")
//	c, err := tp.Dial(testbed.Pod, "tcp", "10.96.0.10:80")
//
// Every namespace has a unique name, so parallel runs do not clash, and
// t.Cleanup deletes them (and with them their links and iptables rules).
// The addresses below exist only inside these namespaces.
package testbed

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/vishvananda/netns"
)

// Roles of the namespaces in a Topology.
const (
	Node     = "node" // runs the proxy; forwards between the other two
	Pod      = "pod"  // a pod on the node, routed through it
	External = "ext"  // a host outside the node, the node's default gateway
)

// Namespace is one network namespace of a Topology.
type Namespace struct {
	Role string
	// Name is the namespace's name for `ip netns`.
	Name string
	// IPv4 and IPv6 are its address: for the node, the one facing External (the
	// node IP); for the others, the one on their link to the node. IPv6 is the zero
	// Addr unless the topology was built WithIPv6.
	IPv4, IPv6 netip.Addr
	// GatewayIPv4 and GatewayIPv6 are the node's addresses on this namespace's
	// link (zero for the node itself).
	GatewayIPv4, GatewayIPv6 netip.Addr
}

// Topology is a set of namespaces built by New.
type Topology struct {
	t    testing.TB
	ipv6 bool
	ns   map[string]*Namespace
}

// Option changes what New builds.
type Option func(*Topology)

// WithIPv6 adds IPv6 addresses and routes on the same links.
func WithIPv6() Option { return func(tp *Topology) { tp.ipv6 = true } }

// Fixed addresses: they live only inside the topology's namespaces, which no other
// topology shares, so they never clash.
var (
	podIPv4      = netip.MustParsePrefix("10.244.1.2/24")
	nodePodIPv4  = netip.MustParsePrefix("10.244.1.1/24")
	extIPv4      = netip.MustParsePrefix("192.168.50.2/24")
	nodeExtIPv4  = netip.MustParsePrefix("192.168.50.1/24")
	podIPv6      = netip.MustParsePrefix("fd00:244:1::2/64")
	nodePodIPv6  = netip.MustParsePrefix("fd00:244:1::1/64")
	extIPv6      = netip.MustParsePrefix("fd00:50::2/64")
	nodeExtIPv6  = netip.MustParsePrefix("fd00:50::1/64")
	topologySeq  atomic.Int64
	runSignature = randomHex(3)
)

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

// Require skips the test unless it can build topologies (root, and `ip netns`
// working); with CI=true it fails instead, so CI never skips silently.
func Require(t testing.TB) {
	t.Helper()
	reason := ""
	if os.Geteuid() != 0 {
		reason = "network namespaces need root"
	} else if out, err := exec.Command("ip", "netns", "list").CombinedOutput(); err != nil {
		reason = fmt.Sprintf("ip netns unavailable: %v: %s", err, strings.TrimSpace(string(out)))
	}
	if reason == "" {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatal(reason)
	}
	t.Skip(reason)
}

// New builds a topology: the node, a pod and an external host. Pod and External
// route everything through the node; the node's default route goes to External,
// so it has a route to any virtual IP. It calls t.Fatal when anything fails, and
// t.Cleanup removes whatever was built, even after a failure.
func New(t testing.TB, opts ...Option) *Topology {
	t.Helper()
	Require(t)
	tp := &Topology{t: t, ns: map[string]*Namespace{}}
	for _, o := range opts {
		o(tp)
	}
	id := fmt.Sprintf("tb-%d-%s-%d", os.Getpid(), runSignature, topologySeq.Add(1))
	for _, role := range []string{Node, Pod, External} {
		n := &Namespace{Role: role, Name: id + "-" + role}
		tp.ns[role] = n
		// Registered before creation so a half-built topology is removed too.
		t.Cleanup(func() {
			if out, err := exec.Command("ip", "netns", "del", n.Name).CombinedOutput(); err != nil {
				t.Logf("delete netns %s: %v: %s", n.Name, err, out)
			}
		})
		tp.must("ip", "netns", "add", n.Name)
		tp.must("ip", "-n", n.Name, "link", "set", "lo", "up")
	}
	node, pod, ext := tp.ns[Node], tp.ns[Pod], tp.ns[External]
	node.IPv4 = nodeExtIPv4.Addr()
	pod.IPv4, pod.GatewayIPv4 = podIPv4.Addr(), nodePodIPv4.Addr()
	ext.IPv4, ext.GatewayIPv4 = extIPv4.Addr(), nodeExtIPv4.Addr()

	// The veths are created inside the node namespace, so their names never
	// meet another topology's.
	tp.link(node, "veth-pod", pod, nodePodIPv4, podIPv4)
	tp.link(node, "veth-ext", ext, nodeExtIPv4, extIPv4)
	tp.must("ip", "-n", pod.Name, "route", "add", "default", "via", nodePodIPv4.Addr().String())
	tp.must("ip", "-n", ext.Name, "route", "add", "default", "via", nodeExtIPv4.Addr().String())
	tp.must("ip", "-n", node.Name, "route", "add", "default", "via", extIPv4.Addr().String())
	tp.must("ip", "netns", "exec", node.Name, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")

	if tp.ipv6 {
		node.IPv6 = nodeExtIPv6.Addr()
		pod.IPv6, pod.GatewayIPv6 = podIPv6.Addr(), nodePodIPv6.Addr()
		ext.IPv6, ext.GatewayIPv6 = extIPv6.Addr(), nodeExtIPv6.Addr()
		tp.address(node, "veth-pod", nodePodIPv6)
		tp.address(pod, "eth0", podIPv6)
		tp.address(node, "veth-ext", nodeExtIPv6)
		tp.address(ext, "eth0", extIPv6)
		tp.must("ip", "-n", pod.Name, "-6", "route", "add", "default", "via", nodePodIPv6.Addr().String())
		tp.must("ip", "-n", ext.Name, "-6", "route", "add", "default", "via", nodeExtIPv6.Addr().String())
		tp.must("ip", "-n", node.Name, "-6", "route", "add", "default", "via", extIPv6.Addr().String())
		tp.must("ip", "netns", "exec", node.Name, "sysctl", "-q", "-w", "net.ipv6.conf.all.forwarding=1")
	}
	return tp
}

// link joins node and peer with a veth pair: nodeSide in node, eth0 in peer.
func (tp *Topology) link(node *Namespace, nodeSide string, peer *Namespace, nodeAddr, peerAddr netip.Prefix) {
	tp.must("ip", "-n", node.Name, "link", "add", nodeSide, "type", "veth", "peer", "name", "eth0", "netns", peer.Name)
	tp.address(node, nodeSide, nodeAddr)
	tp.address(peer, "eth0", peerAddr)
	tp.must("ip", "-n", node.Name, "link", "set", nodeSide, "up")
	tp.must("ip", "-n", peer.Name, "link", "set", "eth0", "up")
}

// address adds addr to dev; IPv6 skips duplicate address detection, which would
// leave the address unusable ("tentative") for a second or more.
func (tp *Topology) address(n *Namespace, dev string, addr netip.Prefix) {
	args := []string{"ip", "-n", n.Name, "addr", "add", addr.String(), "dev", dev}
	if addr.Addr().Is6() {
		args = append(args, "nodad")
	}
	tp.must(args...)
}

func (tp *Topology) must(args ...string) {
	tp.t.Helper()
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		tp.t.Fatalf("%s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
}

// NS returns the namespace with role (Node, Pod or External); it panics on an
// unknown role, a bug in the test.
func (tp *Topology) NS(role string) *Namespace {
	n, ok := tp.ns[role]
	if !ok {
		panic(fmt.Sprintf("testbed: no namespace %q", role))
	}
	return n
}

// Exec runs a command inside the namespace (`ip netns exec`) and returns its
// combined output; the error includes the output.
func (tp *Topology) Exec(role string, args ...string) ([]byte, error) {
	cmd := exec.Command("ip", append([]string{"netns", "exec", tp.NS(role).Name}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("in %s: %s: %w: %s", role, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return out, nil
}

// Run calls fn on an OS thread switched into the namespace. Sockets fn creates
// stay in the namespace after Run returns, and processes it starts run there.
// fn runs on its own goroutine, so it must not call t.FailNow: it returns an
// error instead. Goroutines fn starts do not inherit the namespace.
func (tp *Topology) Run(role string, fn func() error) error {
	name := tp.NS(role).Name
	errc := make(chan error, 1)
	go func() {
		errc <- runInNamespace(name, fn)
	}()
	return <-errc
}

// runInNamespace locks the goroutine to its thread for the whole call. If the
// thread cannot be switched back it stays locked, so Go discards it when the
// goroutine ends instead of reusing a thread in the wrong namespace.
func runInNamespace(name string, fn func() error) error {
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("current netns: %w", err)
	}
	defer orig.Close()
	target, err := netns.GetFromName(name)
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("open netns %s: %w", name, err)
	}
	defer target.Close()
	if err := netns.Set(target); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("enter netns %s: %w", name, err)
	}
	fnErr := fn()
	if err := netns.Set(orig); err != nil {
		return fmt.Errorf("leave netns %s: %w (after fn: %v)", name, err, fnErr)
	}
	runtime.UnlockOSThread()
	return fnErr
}
