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

	"github.com/uproxy/uproxy/topology"
)

// Roles of the namespaces, as in package topology.
const (
	Node     = topology.Node
	Pod      = topology.Pod
	External = topology.External
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

// Require skips the test unless it can build topologies (root, and `ip netns`
// working); with CI=true it fails instead, so CI never skips silently.
func Require(t testing.TB) {
	t.Helper()
	err := topology.Available()
	if err == nil {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatal(err)
	}
	t.Skip(err)
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
