// Package topology builds a three-namespace network on one machine: a node
// namespace, a pod namespace and an external host, each joined to the node by a
// veth pair, with addresses, routes and forwarding set up. `uproxy bench` runs its
// proxies in one; the tests build theirs through testbed.
//
//	tp, err := topology.Build(topology.WithIPv6())
//	if err != nil { ... }
//	defer tp.Close()
//	c, err := tp.Dial(topology.Pod, "tcp", "10.96.0.10:80")
//
// Every namespace has a unique name, so parallel runs do not clash, and Close
// deletes them (and with them their links and rules). The addresses below exist
// only inside these namespaces.
package topology

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/vishvananda/netns"
)

// Roles of the namespaces in a Topology.
const (
	Node     = "node" // runs the proxy; forwards between the other two
	Pod      = "pod"  // a pod on the node, routed through it
	External = "ext"  // a host outside the node, the node's default gateway

	// With WithSecondNode only:
	Pod2      = "pod2"  // another pod on the node, on a link of its own
	NodeB     = "nodeb" // a second node, linked to the first
	RemotePod = "podb"  // a pod on the second node
)

// DialTimeout bounds Dial: a packet the rules drop shows up as a timeout, never
// as a hang.
const DialTimeout = 5 * time.Second

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

// Topology is a set of namespaces made by Build and removed by Close.
type Topology struct {
	ipv6, secondNode bool
	ns               map[string]*Namespace
	// created lists the namespaces that exist, in creation order.
	created []string
}

// Option changes what Build makes.
type Option func(*Topology)

// WithIPv6 adds IPv6 addresses and routes on the same links.
func WithIPv6() Option { return func(tp *Topology) { tp.ipv6 = true } }

// WithSecondNode adds a second pod on the node (Pod2), and a second node
// (NodeB) with a pod of its own (RemotePod), as a cluster routes pod networks:
// each node routes the other's pod networks through the other, so a pod's
// traffic to a pod on the other node, and the replies, pass both nodes.
func WithSecondNode() Option { return func(tp *Topology) { tp.secondNode = true } }

// Fixed addresses: they live only inside the topology's namespaces, which no other
// topology shares, so they never clash.
var (
	podIPv4     = netip.MustParsePrefix("10.244.1.2/24")
	nodePodIPv4 = netip.MustParsePrefix("10.244.1.1/24")
	extIPv4     = netip.MustParsePrefix("192.168.50.2/24")
	nodeExtIPv4 = netip.MustParsePrefix("192.168.50.1/24")
	podIPv6     = netip.MustParsePrefix("fd00:244:1::2/64")
	nodePodIPv6 = netip.MustParsePrefix("fd00:244:1::1/64")
	extIPv6     = netip.MustParsePrefix("fd00:50::2/64")
	nodeExtIPv6 = netip.MustParsePrefix("fd00:50::1/64")
	// WithSecondNode: the nodes' link, the second pod of the first node, the
	// pod of the second node.
	nodeBIPv4    = netip.MustParsePrefix("192.168.60.2/24")
	nodeAToBIPv4 = netip.MustParsePrefix("192.168.60.1/24")
	pod2IPv4     = netip.MustParsePrefix("10.244.3.2/24")
	nodePod2IPv4 = netip.MustParsePrefix("10.244.3.1/24")
	podBIPv4     = netip.MustParsePrefix("10.244.2.2/24")
	nodeBPodIPv4 = netip.MustParsePrefix("10.244.2.1/24")
	nodeBIPv6    = netip.MustParsePrefix("fd00:60::2/64")
	nodeAToBIPv6 = netip.MustParsePrefix("fd00:60::1/64")
	pod2IPv6     = netip.MustParsePrefix("fd00:244:3::2/64")
	nodePod2IPv6 = netip.MustParsePrefix("fd00:244:3::1/64")
	podBIPv6     = netip.MustParsePrefix("fd00:244:2::2/64")
	nodeBPodIPv6 = netip.MustParsePrefix("fd00:244:2::1/64")
	topologySeq  atomic.Int64
	runSignature = randomHex(3)
)

var sweepOnce sync.Once

// sweepDead deletes the namespaces of topologies whose process is gone: the
// namespace names start with "tb-" and that process's ID, and a process that
// was killed outright (SIGKILL, or go test's timeout) never ran its Close.
// Namespaces of live processes are left alone, as is anything not named so; a
// reused process ID only keeps the dead one's namespaces a while longer. What
// cannot be deleted is left for the next sweep.
func sweepDead() {
	entries, err := os.ReadDir("/run/netns")
	if err != nil {
		return
	}
	for _, e := range entries {
		pid, ok := topologyPID(e.Name())
		if !ok || pid == os.Getpid() || syscall.Kill(pid, 0) != syscall.ESRCH {
			continue
		}
		exec.Command("ip", "netns", "del", e.Name()).Run()
	}
}

// topologyPID is the process ID in a namespace name Build gives ("tb-PID-..."),
// and whether name is one.
func topologyPID(name string) (int, bool) {
	rest, ok := strings.CutPrefix(name, "tb-")
	if !ok {
		return 0, false
	}
	digits, _, ok := strings.Cut(rest, "-")
	if !ok {
		return 0, false
	}
	pid, err := strconv.Atoi(digits)
	if err != nil || pid <= 0 {
		return 0, false
	}
	return pid, true
}

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

// Available reports why no topology can be built here (nil when one can): it
// takes root and a working `ip netns`.
func Available() error {
	if os.Geteuid() != 0 {
		return errors.New("network namespaces need root")
	}
	if out, err := exec.Command("ip", "netns", "list").CombinedOutput(); err != nil {
		return fmt.Errorf("ip netns unavailable: %v: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// Build makes a topology: the node, a pod and an external host. Pod and External
// route everything through the node; the node's default route goes to External,
// so it has a route to any virtual IP. On failure it removes whatever it made.
func Build(opts ...Option) (*Topology, error) {
	sweepOnce.Do(sweepDead)
	tp := &Topology{ns: map[string]*Namespace{}}
	for _, o := range opts {
		o(tp)
	}
	if err := tp.build(); err != nil {
		if cerr := tp.Close(); cerr != nil {
			err = fmt.Errorf("%w (and removing it: %v)", err, cerr)
		}
		return nil, err
	}
	return tp, nil
}

func (tp *Topology) build() error {
	id := fmt.Sprintf("tb-%d-%s-%d", os.Getpid(), runSignature, topologySeq.Add(1))
	if err := tp.addNamespaces(id, Node, Pod, External); err != nil {
		return err
	}
	node, pod, ext := tp.ns[Node], tp.ns[Pod], tp.ns[External]
	node.IPv4 = nodeExtIPv4.Addr()
	pod.IPv4, pod.GatewayIPv4 = podIPv4.Addr(), nodePodIPv4.Addr()
	ext.IPv4, ext.GatewayIPv4 = extIPv4.Addr(), nodeExtIPv4.Addr()

	// The veths are created inside the node namespace, so their names never
	// meet another topology's.
	steps := [][]string{}
	steps = append(steps, link(node, "veth-pod", pod, nodePodIPv4, podIPv4)...)
	steps = append(steps, link(node, "veth-ext", ext, nodeExtIPv4, extIPv4)...)
	steps = append(steps,
		[]string{"ip", "-n", pod.Name, "route", "add", "default", "via", nodePodIPv4.Addr().String()},
		[]string{"ip", "-n", ext.Name, "route", "add", "default", "via", nodeExtIPv4.Addr().String()},
		[]string{"ip", "-n", node.Name, "route", "add", "default", "via", extIPv4.Addr().String()},
		[]string{"ip", "netns", "exec", node.Name, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"},
	)
	if tp.ipv6 {
		node.IPv6 = nodeExtIPv6.Addr()
		pod.IPv6, pod.GatewayIPv6 = podIPv6.Addr(), nodePodIPv6.Addr()
		ext.IPv6, ext.GatewayIPv6 = extIPv6.Addr(), nodeExtIPv6.Addr()
		steps = append(steps,
			address(node, "veth-pod", nodePodIPv6),
			address(pod, "eth0", podIPv6),
			address(node, "veth-ext", nodeExtIPv6),
			address(ext, "eth0", extIPv6),
			[]string{"ip", "-n", pod.Name, "-6", "route", "add", "default", "via", nodePodIPv6.Addr().String()},
			[]string{"ip", "-n", ext.Name, "-6", "route", "add", "default", "via", nodeExtIPv6.Addr().String()},
			[]string{"ip", "-n", node.Name, "-6", "route", "add", "default", "via", extIPv6.Addr().String()},
			[]string{"ip", "netns", "exec", node.Name, "sysctl", "-q", "-w", "net.ipv6.conf.all.forwarding=1"},
		)
	}
	for _, args := range steps {
		if err := run(args...); err != nil {
			return err
		}
	}
	if tp.secondNode {
		return tp.buildSecondNode(id)
	}
	return nil
}

// addNamespaces creates a namespace per role, named after id, with its
// loopback up.
func (tp *Topology) addNamespaces(id string, roles ...string) error {
	for _, role := range roles {
		n := &Namespace{Role: role, Name: id + "-" + role}
		tp.ns[role] = n
		if err := run("ip", "netns", "add", n.Name); err != nil {
			return err
		}
		tp.created = append(tp.created, n.Name)
		if err := run("ip", "-n", n.Name, "link", "set", "lo", "up"); err != nil {
			return err
		}
	}
	return nil
}

// buildSecondNode adds Pod2, NodeB and RemotePod (WithSecondNode).
func (tp *Topology) buildSecondNode(id string) error {
	if err := tp.addNamespaces(id, Pod2, NodeB, RemotePod); err != nil {
		return err
	}
	node, pod2, nodeB, podB := tp.ns[Node], tp.ns[Pod2], tp.ns[NodeB], tp.ns[RemotePod]
	pod2.IPv4, pod2.GatewayIPv4 = pod2IPv4.Addr(), nodePod2IPv4.Addr()
	nodeB.IPv4, nodeB.GatewayIPv4 = nodeBIPv4.Addr(), nodeAToBIPv4.Addr()
	podB.IPv4, podB.GatewayIPv4 = podBIPv4.Addr(), nodeBPodIPv4.Addr()
	route := func(n *Namespace, family, dst string, via netip.Prefix) []string {
		return []string{"ip", "-n", n.Name, family, "route", "add", dst, "via", via.Addr().String()}
	}
	steps := [][]string{}
	if tp.ipv6 {
		// The links' link-local addresses would be tentative for a second
		// or two of duplicate address detection, and neighbour discovery,
		// which needs them, with them: the first packets to a pod behind a
		// router would wait.
		for _, n := range []*Namespace{node, pod2, nodeB, podB} {
			steps = append(steps, []string{"ip", "netns", "exec", n.Name, "sysctl", "-q", "-w", "net.ipv6.conf.default.accept_dad=0"})
		}
	}
	steps = append(steps, link(node, "veth-pod2", pod2, nodePod2IPv4, pod2IPv4)...)
	steps = append(steps, link(node, "veth-nodeb", nodeB, nodeAToBIPv4, nodeBIPv4)...)
	steps = append(steps, link(nodeB, "veth-pod", podB, nodeBPodIPv4, podBIPv4)...)
	steps = append(steps,
		route(pod2, "-4", "default", nodePod2IPv4),
		route(podB, "-4", "default", nodeBPodIPv4),
		route(node, "-4", podBIPv4.Masked().String(), nodeBIPv4),
		route(nodeB, "-4", "default", nodeAToBIPv4),
		[]string{"ip", "netns", "exec", nodeB.Name, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"},
	)
	if tp.ipv6 {
		pod2.IPv6, pod2.GatewayIPv6 = pod2IPv6.Addr(), nodePod2IPv6.Addr()
		nodeB.IPv6, nodeB.GatewayIPv6 = nodeBIPv6.Addr(), nodeAToBIPv6.Addr()
		podB.IPv6, podB.GatewayIPv6 = podBIPv6.Addr(), nodeBPodIPv6.Addr()
		steps = append(steps,
			address(node, "veth-pod2", nodePod2IPv6), address(pod2, "eth0", pod2IPv6),
			address(node, "veth-nodeb", nodeAToBIPv6), address(nodeB, "eth0", nodeBIPv6),
			address(nodeB, "veth-pod", nodeBPodIPv6), address(podB, "eth0", podBIPv6),
			route(pod2, "-6", "default", nodePod2IPv6),
			route(podB, "-6", "default", nodeBPodIPv6),
			route(node, "-6", podBIPv6.Masked().String(), nodeBIPv6),
			route(nodeB, "-6", "default", nodeAToBIPv6),
			[]string{"ip", "netns", "exec", nodeB.Name, "sysctl", "-q", "-w", "net.ipv6.conf.all.forwarding=1"},
		)
	}
	for _, args := range steps {
		if err := run(args...); err != nil {
			return err
		}
	}
	return nil
}

// link returns the commands that join node and peer with a veth pair: nodeSide in
// node, eth0 in peer.
func link(node *Namespace, nodeSide string, peer *Namespace, nodeAddr, peerAddr netip.Prefix) [][]string {
	return [][]string{
		{"ip", "-n", node.Name, "link", "add", nodeSide, "type", "veth", "peer", "name", "eth0", "netns", peer.Name},
		address(node, nodeSide, nodeAddr),
		address(peer, "eth0", peerAddr),
		{"ip", "-n", node.Name, "link", "set", nodeSide, "up"},
		{"ip", "-n", peer.Name, "link", "set", "eth0", "up"},
	}
}

// address returns the command that adds addr to dev; IPv6 skips duplicate address
// detection, which would leave the address unusable ("tentative") for a second or
// more.
func address(n *Namespace, dev string, addr netip.Prefix) []string {
	args := []string{"ip", "-n", n.Name, "addr", "add", addr.String(), "dev", dev}
	if addr.Addr().Is6() {
		args = append(args, "nodad")
	}
	return args
}

func run(args ...string) error {
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		return fmt.Errorf("%s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// Close deletes every namespace of the topology, newest first, and with them
// their links, addresses and rules. It returns every failure; the namespaces that
// could be deleted are gone either way.
func (tp *Topology) Close() error {
	var errs []error
	for i := len(tp.created) - 1; i >= 0; i-- {
		if err := run("ip", "netns", "del", tp.created[i]); err != nil {
			errs = append(errs, err)
		}
	}
	tp.created = nil
	return errors.Join(errs...)
}

// NS returns the namespace with role (Node, Pod or External); it panics on an
// unknown role, a bug in the caller.
func (tp *Topology) NS(role string) *Namespace {
	n, ok := tp.ns[role]
	if !ok {
		panic(fmt.Sprintf("topology: no namespace %q", role))
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

// Dial connects from inside the namespace, within DialTimeout.
func (tp *Topology) Dial(role, network, address string) (net.Conn, error) {
	var c net.Conn
	err := tp.Run(role, func() (err error) {
		c, err = net.DialTimeout(network, address, DialTimeout)
		return err
	})
	return c, err
}

// Run calls fn on an OS thread switched into the namespace. Sockets fn creates
// stay in the namespace after Run returns, and processes it starts run there.
// fn runs on a goroutine of its own (in a test, it must not call t.FailNow: it
// returns an error instead). Goroutines fn starts do not inherit the namespace.
func (tp *Topology) Run(role string, fn func() error) error {
	name := tp.NS(role).Name
	errc := make(chan error, 1)
	go func() {
		errc <- RunIn(name, fn)
	}()
	return <-errc
}

// RunIn calls fn on the calling goroutine's thread switched into the named
// network namespace (one of `ip netns`), and switches it back. It locks the
// goroutine to its thread for the whole call; if the thread cannot be switched
// back it stays locked, so Go discards it when the goroutine ends instead of
// reusing a thread in the wrong namespace. Call it on a goroutine of its own.
func RunIn(name string, fn func() error) error {
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
