// Package testbed is what the tests share: the one way a test says what it
// needs of the machine (Needs), network namespaces built for one test (New, on
// package topology), servers and checks that report through testing.TB, and
// Await for a condition that comes true later.
//
//	tp := testbed.New(t, testbed.WithIPv6())
//	echo := tp.EchoTCP(testbed.Node, ":0")
//	c, err := tp.Dial(testbed.Pod, "tcp", "10.96.0.10:80")
//
// t.Cleanup deletes the namespaces, even after a failure.
//
// # Tiers
//
// The tests come in three tiers, and a test names its tier through Needs:
//
//   - Unit tests need nothing but the Go toolchain: no root, no namespace,
//     real sockets on loopback, fakes only at the kernel boundary. They are
//     what -short runs, as any user, in under a minute.
//   - Root and network namespaces: Needs(t, testbed.Root), testbed.Netns (what
//     New needs), testbed.IPTables or testbed.NFTables; real rules in
//     namespaces the test builds, uproxy built (testbed.Build) and run as a
//     process.
//   - A cluster: a real kube-apiserver and etcd (Needs(t, testbed.APIServer);
//     kubeapi.Start says it too), kube-proxy beside uproxy
//     (testbed.KubeBinaries), the conformance cluster. The binaries come from
//     `make kube-bins` (`make cluster-bins` for the conformance cluster), in
//     bin/ at the repository's root or in $UPROXY_KUBE_BIN.
//
// From the repository's root:
//
//	go test -short ./...                   # unit tests, as any user
//	sudo go test ./...                     # and root and namespaces
//	make kube-bins && sudo go test ./...   # and the cluster tier
//	CI=true make test                      # all three, never skipping
//
// Build and Browser need no root, but seconds of a build or of a browser's
// start: their tests run with the upper tiers, not under -short.
//
// Where a need is not met a test is skipped with the reason; under CI=true it
// fails instead, so that CI never passes by skipping. -short skips the upper
// tiers even under CI=true: it asks for the unit tests alone. A command a unit
// test needs (testbed.Commands) is no tier: -short keeps it.
package testbed

import (
	"os"
	"testing"

	"github.com/uproxy/uproxy/measure/topology"
)

// Roles of the namespaces, as in package topology.
const (
	Node     = topology.Node
	Pod      = topology.Pod
	External = topology.External

	Pod2      = topology.Pod2
	NodeB     = topology.NodeB
	RemotePod = topology.RemotePod
)

// DialTimeout bounds Dial, as in package topology.
const DialTimeout = topology.DialTimeout

// Namespace is one network namespace of a Topology.
type Namespace = topology.Namespace

// Topology is a topology owned by one test.
type Topology struct {
	*topology.Topology
	t testing.TB
}

// WithIPv6 adds IPv6 addresses and routes on the same links.
func WithIPv6() topology.Option { return topology.WithIPv6() }

// WithSecondNode adds another pod on the node and a second node with a pod of
// its own, as in package topology.
func WithSecondNode() topology.Option { return topology.WithSecondNode() }

// Skip skips the test, or fails it when CI=true: CI never skips silently.
// Needs goes through it; so does a test that cannot run here for a reason no
// Need names (fewer CPUs than it places proxies on, no browser).
func Skip(t testing.TB, args ...any) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatal(args...)
	}
	t.Skip(args...)
}

// New builds a topology for t: it calls t.Fatal when anything fails, and
// t.Cleanup removes the namespaces.
func New(t testing.TB, opts ...topology.Option) *Topology {
	t.Helper()
	Needs(t, Netns)
	tp, err := topology.Build(opts...)
	if err != nil {
		t.Fatalf("build topology: %v", err)
	}
	t.Cleanup(func() {
		if err := tp.Close(); err != nil {
			t.Logf("remove topology: %v", err)
		}
	})
	return &Topology{Topology: tp, t: t}
}
