// Command coredns is the cluster DNS of `make conformance`: CoreDNS with only the
// plugins a Kubernetes cluster's Corefile uses, so it builds in a fraction of the time
// of CoreDNS's full plugin set. It deliberately has no forward plugin: the test cluster
// answers its own names and sends no query off the machine.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
)

// The order in which CoreDNS chains the plugins, a subsequence of its own plugin.cfg.
func init() {
	dnsserver.Directives = []string{"reload", "ready", "health", "errors", "log", "loadbalance", "cache", "kubernetes"}
}

func main() { coremain.Run() }
