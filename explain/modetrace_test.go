package explain

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/kernelmodes/iptables"
	knft "github.com/uproxy/uproxy/kernelmodes/nftables"
	"github.com/uproxy/uproxy/netfilter/conntrack/conntracktest"
	"github.com/uproxy/uproxy/netfilter/iptables/iptablestest"
	"github.com/uproxy/uproxy/netfilter/nftables/nftablestest"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/service/servicetest"
)

// The addresses of the packet-tracer tests: the node's, a pod's on it, a host
// outside the cluster.
var (
	traceNodeIP   = netip.MustParseAddr("192.0.2.10")
	tracePodIP    = netip.MustParseAddr("10.244.0.5")
	traceOutsider = netip.MustParseAddr("203.0.113.7")
)

// traceServices are the Service ports the packet-tracer tests program: one of
// every kind of address with two endpoints on other nodes, one without
// endpoints, one with externalTrafficPolicy Local and one endpoint on this
// node, one with ClientIP affinity.
func traceServices() *service.Snapshot {
	web := servicetest.Port("shop", "web", "http", service.TCP, 80)
	web.ClusterIPs = servicetest.Addrs("10.96.0.10")
	web.ExternalIPs = servicetest.Addrs("10.250.0.5")
	web.NodePort = 30080
	web.Endpoints = []service.Endpoint{servicetest.Endpoint("10.244.1.2:8080", false), servicetest.Endpoint("10.244.2.3:8080", false)}

	empty := servicetest.Port("shop", "empty", "http", service.TCP, 80)
	empty.ClusterIPs = servicetest.Addrs("10.96.0.12")
	empty.NodePort = 30081

	local := servicetest.Port("shop", "local", "http", service.TCP, 80)
	local.ClusterIPs = servicetest.Addrs("10.96.0.13")
	local.NodePort = 30082
	local.ExternalPolicyLocal = true
	local.Endpoints = []service.Endpoint{servicetest.Endpoint("10.244.0.8:8080", true), servicetest.Endpoint("10.244.2.9:8080", false)}

	sticky := servicetest.Port("shop", "sticky", "http", service.TCP, 80)
	sticky.ClusterIPs = servicetest.Addrs("10.96.0.14")
	sticky.AffinityClientIP = true
	sticky.AffinityTimeout = 3 * time.Hour
	sticky.Endpoints = []service.Endpoint{servicetest.Endpoint("10.244.1.6:8080", false), servicetest.Endpoint("10.244.2.7:8080", false)}

	return servicetest.Snapshot(web, empty, local, sticky)
}

// iptablesModeRules syncs s through the iptables mode into an in-memory
// iptables and returns what iptables-save would print: the mode's own rule
// text, the fake standing in for the kernel only.
func iptablesModeRules(t *testing.T, s *service.Snapshot) []byte {
	t.Helper()
	kernel := iptablestest.New()
	p, err := iptables.New(iptables.Config{IPTables: kernel, Conntrack: &conntracktest.Recorder{}})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Sync(s); err != nil {
		t.Fatalf("sync: %v", err)
	}
	save, err := kernel.Save(false)
	if err != nil {
		t.Fatal(err)
	}
	return save
}

// TestTraceIPTablesMode follows a connection's first packet through the rules
// the iptables mode writes for a Snapshot, as the kernel would walk them: to
// the DNAT of an endpoint (each with its share of new connections), to the
// filter table's REJECT of a Service port without endpoints, or to nothing.
func TestTraceIPTablesMode(t *testing.T) {
	t.Parallel()
	save := iptablesModeRules(t, traceServices())
	nat, filter := parseNAT(save), parseFilter(save)
	// The recent lists of the affinity rules, as the kernel would hold them
	// after the pod's first connection went to 10.244.2.7:8080.
	pinned := map[string]bool{}
	for _, c := range nat.t.Chains {
		for _, r := range c.Rules {
			if strings.Contains(r.Text, "--to-destination 10.244.2.7:8080") {
				pinned[c.Name] = true
			}
		}
	}
	if len(pinned) != 1 {
		t.Fatalf("chains DNATing to the sticky Service's endpoint: got %v, want one", pinned)
	}
	recent := func(list string, ip netip.Addr) (bool, error) { return pinned[list] && ip == tracePodIP, nil }

	tests := []struct {
		name   string
		table  ruleTable
		hook   string
		client netip.Addr
		dst    string
		// want is each verdict as "TARGET to certain chance", in the order the
		// rules give them.
		want []string
	}{
		{name: "ClusterIP from a pod", table: nat, hook: "PREROUTING", client: tracePodIP, dst: "10.96.0.10:80",
			want: []string{"DNAT 10.244.1.2:8080 false 0.50", "DNAT 10.244.2.3:8080 true 0.50"}},
		{name: "ClusterIP from the node", table: nat, hook: "OUTPUT", client: traceNodeIP, dst: "10.96.0.10:80",
			want: []string{"DNAT 10.244.1.2:8080 false 0.50", "DNAT 10.244.2.3:8080 true 0.50"}},
		{name: "ClusterIP, another port", table: nat, hook: "PREROUTING", client: tracePodIP, dst: "10.96.0.10:443",
			want: []string{"none  true 1.00"}},
		{name: "NodePort from outside", table: nat, hook: "PREROUTING", client: traceOutsider, dst: "192.0.2.10:30080",
			want: []string{"DNAT 10.244.1.2:8080 false 0.50", "DNAT 10.244.2.3:8080 true 0.50"}},
		{name: "ExternalIP from outside", table: nat, hook: "PREROUTING", client: traceOutsider, dst: "10.250.0.5:80",
			want: []string{"DNAT 10.244.1.2:8080 false 0.50", "DNAT 10.244.2.3:8080 true 0.50"}},
		{name: "no endpoints: nat rewrites nothing", table: nat, hook: "PREROUTING", client: tracePodIP, dst: "10.96.0.12:80",
			want: []string{"none  true 1.00"}},
		// FORWARD first accepts what nat marked for masquerading and what
		// belongs to a known connection: state the trace cannot know, so
		// those are maybes, and the REJECT decides the rest.
		{name: "no endpoints: a pod is refused", table: filter, hook: "FORWARD", client: tracePodIP, dst: "10.96.0.12:80",
			want: []string{"ACCEPT  false 0.00", "ACCEPT  false 0.00", "REJECT  true 0.00"}},
		{name: "no endpoints: the node is refused", table: filter, hook: "OUTPUT", client: traceNodeIP, dst: "10.96.0.12:80",
			want: []string{"REJECT  true 1.00"}},
		{name: "no endpoints: a NodePort from outside is refused", table: filter, hook: "INPUT", client: traceOutsider, dst: "192.0.2.10:30081",
			want: []string{"REJECT  true 1.00"}},
		{name: "externalTrafficPolicy Local: from outside only the node's endpoint", table: nat, hook: "PREROUTING", client: traceOutsider, dst: "192.0.2.10:30082",
			want: []string{"DNAT 10.244.0.8:8080 true 1.00"}},
		{name: "externalTrafficPolicy Local: a pod's ClusterIP connection goes anywhere", table: nat, hook: "PREROUTING", client: tracePodIP, dst: "10.96.0.13:80",
			want: []string{"DNAT 10.244.0.8:8080 false 0.50", "DNAT 10.244.2.9:8080 true 0.50"}},
		{name: "affinity: a client in a recent list goes back to its endpoint", table: nat, hook: "PREROUTING", client: tracePodIP, dst: "10.96.0.14:80",
			want: []string{"DNAT 10.244.2.7:8080 true 1.00"}},
		{name: "affinity: a new client is split at random", table: nat, hook: "PREROUTING", client: netip.MustParseAddr("10.244.0.6"), dst: "10.96.0.14:80",
			want: []string{"DNAT 10.244.1.6:8080 false 0.50", "DNAT 10.244.2.7:8080 true 0.50"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := packet{dst: netip.MustParseAddrPort(tc.dst), proto: "tcp", client: tc.client,
				local: map[netip.Addr]bool{traceNodeIP: true}, recent: recent}
			rp := tc.table.trace(tc.hook, p)
			var got, steps []string
			for _, v := range rp.Verdicts {
				got = append(got, fmt.Sprintf("%s %s %v %.2f", v.Target, v.To, v.Certain, v.Chance))
			}
			for _, s := range rp.Steps {
				steps = append(steps, s.Text)
			}
			if strings.Join(got, ", ") != strings.Join(tc.want, ", ") {
				t.Errorf("verdicts: got %q, want %q\nthrough:\n%s", got, tc.want, strings.Join(steps, "\n"))
			}
		})
	}
}

// TestTraceNFTablesMode looks a connection's first packet up in the table the
// nftables mode writes for the same Snapshot, as its rules do (one map lookup
// where iptables walks chains), and follows it to the DNAT of an endpoint with
// its share of new connections, the refusal of a Service port without
// endpoints, or nothing.
func TestTraceNFTablesMode(t *testing.T) {
	t.Parallel()
	table, err := knft.TableName("")
	if err != nil {
		t.Fatal(err)
	}
	kernel := nftablestest.New(table)
	p, err := knft.New(knft.Config{NFTables: kernel, Conntrack: &conntracktest.Recorder{}})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Sync(traceServices()); err != nil {
		t.Fatalf("sync: %v", err)
	}

	tests := []struct {
		name  string
		hook  string
		dst   string
		local bool // dst is an address of the node
		// want is each verdict as "TARGET to certain chance", in the order the
		// elements give them; refused says an element refuses the packet.
		want     []string
		refused  bool
		affinity bool // an element sends it to the affinity chain
	}{
		{name: "ClusterIP", hook: "PREROUTING", dst: "10.96.0.10:80",
			want: []string{"DNAT 10.244.1.2:8080 false 0.50", "DNAT 10.244.2.3:8080 false 0.50"}},
		{name: "ClusterIP from the node", hook: "OUTPUT", dst: "10.96.0.10:80",
			want: []string{"DNAT 10.244.1.2:8080 false 0.50", "DNAT 10.244.2.3:8080 false 0.50"}},
		{name: "ClusterIP, another port", hook: "PREROUTING", dst: "10.96.0.10:443"},
		{name: "NodePort", hook: "PREROUTING", dst: "192.0.2.10:30080", local: true,
			want: []string{"DNAT 10.244.1.2:8080 false 0.50", "DNAT 10.244.2.3:8080 false 0.50"}},
		{name: "ExternalIP", hook: "PREROUTING", dst: "10.250.0.5:80",
			want: []string{"DNAT 10.244.1.2:8080 false 0.50", "DNAT 10.244.2.3:8080 false 0.50"}},
		{name: "no endpoints", hook: "PREROUTING", dst: "10.96.0.12:80", refused: true},
		{name: "no endpoints: NodePort", hook: "PREROUTING", dst: "192.0.2.10:30081", local: true, refused: true},
		{name: "externalTrafficPolicy Local: the node's endpoint for traffic from outside, every endpoint for the rest", hook: "PREROUTING", dst: "192.0.2.10:30082", local: true,
			want: []string{"DNAT 10.244.0.8:8080 false 0.50", "DNAT 10.244.2.9:8080 false 0.50", "DNAT 10.244.0.8:8080 false 0.00"}},
		// The element sends the Service port's connections to a chain of its
		// own, whose rules (not elements) pick: the lookup ends there.
		{name: "affinity: to the Service port's own chain", hook: "PREROUTING", dst: "10.96.0.14:80", affinity: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			x := &explanation{Mode: "nftables"}
			if err := x.findNFTKernel(Options{NFTKernel: kernel}, netip.MustParseAddrPort(tc.dst), "tcp", tc.local); err != nil {
				t.Fatal(err)
			}
			steps, verdicts := x.nftVerdicts(tc.hook)
			var got, found []string
			for _, v := range verdicts {
				got = append(got, fmt.Sprintf("%s %s %v %.2f", v.Target, v.To, v.Certain, v.Chance))
			}
			for _, s := range steps {
				found = append(found, s.Chain+": "+s.Text)
			}
			refused, affinity := false, false
			for _, e := range x.NFTKernel {
				refused = refused || strings.Contains(e.Meaning, "refuse") || strings.Contains(e.Meaning, "reject")
				affinity = affinity || e.Affinity
			}
			if strings.Join(got, ", ") != strings.Join(tc.want, ", ") || refused != tc.refused || affinity != tc.affinity {
				t.Errorf("verdicts: got %q, refused %v, affinity %v; want %q, refused %v, affinity %v\nthrough:\n%s",
					got, refused, affinity, tc.want, tc.refused, tc.affinity, strings.Join(found, "\n"))
			}
		})
	}
}
