// Package testbed is the tests' side of package topology: it builds a topology
// for one test (skipping, or failing when CI=true, where none can be built), and
// adds servers and checks that report through testing.TB.
//
//	tp := testbed.New(t, testbed.WithIPv6())
//	echo := tp.EchoTCP(testbed.Node, ":0")
//	c, err := tp.Dial(testbed.Pod, "tcp", "10.96.0.10:80")
//
// t.Cleanup deletes the namespaces, even after a failure.
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

// Skip skips the test, or fails it when CI=true: CI never skips silently. Every
// test that cannot run here goes through it.
func Skip(t testing.TB, args ...any) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatal(args...)
	}
	t.Skip(args...)
}

// Require skips the test unless it can build topologies (root, and `ip netns`
// working); with CI=true it fails instead.
func Require(t testing.TB) {
	t.Helper()
	if err := topology.Available(); err != nil {
		Skip(t, err)
	}
}

// New builds a topology for t: it calls t.Fatal when anything fails, and
// t.Cleanup removes the namespaces.
func New(t testing.TB, opts ...topology.Option) *Topology {
	t.Helper()
	Require(t)
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
