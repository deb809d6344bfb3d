package registry

import (
	"net/netip"
	"os/exec"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/kernelmodes/iptables"
	"github.com/uproxy/uproxy/kernelmodes/nftables"
	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/rules"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/test/testbed"
)

// TestModeSwitches programs the userspace portals, the iptables mode and
// leftovers of the IPVS mode's chains in one namespace, then checks that
// CleanupOthers removes exactly the other modes' state and CleanupAll all of it.
func TestModeSwitches(t *testing.T) {
	testbed.Needs(t, testbed.Netns)
	if _, err := exec.LookPath("iptables-restore"); err != nil {
		testbed.Skip(t, err)
	}
	tp := testbed.New(t)
	must := func(t *testing.T, args ...string) {
		t.Helper()
		if _, err := tp.Exec(testbed.Node, args...); err != nil {
			t.Fatal(err)
		}
	}
	for _, ipt := range []string{"iptables", "ip6tables"} {
		must(t, ipt, "-t", "nat", "-N", "KUBE-SERVICES")
		must(t, ipt, "-t", "nat", "-A", "PREROUTING", "-j", "KUBE-SERVICES")
		must(t, ipt, "-t", "filter", "-A", "INPUT", "-j", "ACCEPT")
	}
	testbed.Needs(t, testbed.NFTables)
	// kube-proxy's nftables table, which no cleanup may touch.
	must(t, "nft", "add table inet kube-proxy")
	must(t, "nft", "add chain inet kube-proxy services { type nat hook prerouting priority dstnat; }")
	before := [2]string{tp.SavedRules(t, false), tp.SavedRules(t, true)}
	// iptables-nft creates its built-in chains when first used, which
	// iptables-save already covers: nftables is compared table by table.
	nftTables := func() string {
		out, err := tp.Exec(testbed.Node, "nft", "list", "tables")
		if err != nil {
			t.Fatal(err)
		}
		return string(out)
	}
	beforeNFT := nftTables()

	web := &service.Port{Name: service.PortName{Namespace: "shop", Name: "web"}, Protocol: service.TCP, Port: 80,
		ClusterIPs: []netip.Addr{netip.MustParseAddr("10.96.0.10")}, NodePort: 30080,
		Endpoints: []service.Endpoint{{Addr: netip.MustParseAddrPort("192.168.50.2:8080"), Ready: true, Serving: true}}}
	// The portals hold NodePorts open; this test is about chains, so its
	// portal has none.
	portal := *web
	portal.NodePort = 0
	program := func(t *testing.T) {
		t.Helper()
		err := tp.Run(testbed.Node, func() error {
			portals, err := rules.NewIPTables(rules.Config{NodeIPs: []netip.Addr{tp.NS(testbed.Node).IPv4}})
			if err != nil {
				return err
			}
			if err := portals.Sync([]rules.Portal{{Port: &portal, ProxyPort: 40000}}); err != nil {
				return err
			}
			// A userspace run with --rules nftables.
			nft, err := rules.NewNFTables(rules.Config{NodeIPs: []netip.Addr{tp.NS(testbed.Node).IPv4}})
			if err != nil {
				return err
			}
			if err := nft.Sync([]rules.Portal{{Port: &portal, ProxyPort: 40000}}); err != nil {
				return err
			}
			p, err := iptables.New(iptables.Config{})
			if err != nil {
				return err
			}
			if err := p.Sync(&service.Snapshot{Ports: []*service.Port{web}}); err != nil {
				return err
			}
			k, err := nftables.New(nftables.Config{})
			if err != nil {
				return err
			}
			return k.Sync(&service.Snapshot{Ports: []*service.Port{web}})
		})
		if err != nil {
			t.Fatal(err)
		}
		// What an IPVS-mode run would leave in iptables (IPVS itself cannot run here).
		must(t, "iptables", "-t", "nat", "-N", "UPROXY-IPVS-SERVICES")
		must(t, "iptables", "-t", "nat", "-I", "PREROUTING", "-m", "comment", "--comment", "uproxy ipvs service portals", "-j", "UPROXY-IPVS-SERVICES")
		must(t, "iptables", "-t", "filter", "-N", "UPROXY-IPVS-FILTER")
		must(t, "iptables", "-t", "filter", "-I", "INPUT", "-m", "comment", "--comment", "uproxy ipvs service IPs", "-j", "UPROXY-IPVS-FILTER")
	}
	// nftPortals stands for the nftables portals' table among the chains.
	const nftPortals = "table inet uproxy"
	const nftKernel = "table inet uproxy-kernel"
	has := func(chains ...string) map[string]bool {
		s := tp.SavedRules(t, false)
		tables := nftTables()
		got := map[string]bool{}
		for _, c := range chains {
			got[c] = strings.Contains(s, ":"+c+" ")
		}
		got[nftPortals] = strings.Contains(tables, nftPortals+"\n")
		got[nftKernel] = strings.Contains(tables, nftKernel+"\n")
		return got
	}
	chains := []string{"UPROXY-PORTALS-CONTAINER", nftPortals, "UPROXY-SERVICES", nftKernel, "UPROXY-IPVS-SERVICES", "UPROXY-IPVS-FILTER"}
	steps := []struct {
		name  string
		clean func() error
		want  map[string]bool
	}{
		{"start in iptables mode", func() error { return CleanupOthers(proxymode.IPTables, "", "") },
			map[string]bool{"UPROXY-PORTALS-CONTAINER": false, nftPortals: false, "UPROXY-SERVICES": true, nftKernel: false, "UPROXY-IPVS-SERVICES": false, "UPROXY-IPVS-FILTER": false}},
		{"start in nftables mode", func() error { return CleanupOthers(proxymode.NFTables, "", "") },
			map[string]bool{"UPROXY-PORTALS-CONTAINER": false, nftPortals: false, "UPROXY-SERVICES": false, nftKernel: true, "UPROXY-IPVS-SERVICES": false, "UPROXY-IPVS-FILTER": false}},
		{"start in userspace mode", func() error { return CleanupOthers(proxymode.Userspace, "", "") },
			map[string]bool{"UPROXY-PORTALS-CONTAINER": true, nftPortals: true, "UPROXY-SERVICES": false, nftKernel: false, "UPROXY-IPVS-SERVICES": false, "UPROXY-IPVS-FILTER": false}},
		// The portals of the other backend go too.
		{"start in userspace mode with nftables portals", func() error { return CleanupOthers(proxymode.Userspace, rules.BackendNFTables, "") },
			map[string]bool{"UPROXY-PORTALS-CONTAINER": false, nftPortals: true, "UPROXY-SERVICES": false, nftKernel: false, "UPROXY-IPVS-SERVICES": false, "UPROXY-IPVS-FILTER": false}},
		{"start in userspace mode with iptables portals", func() error { return CleanupOthers(proxymode.Userspace, rules.BackendIPTables, "") },
			map[string]bool{"UPROXY-PORTALS-CONTAINER": true, nftPortals: false, "UPROXY-SERVICES": false, nftKernel: false, "UPROXY-IPVS-SERVICES": false, "UPROXY-IPVS-FILTER": false}},
		{"start in ipvs mode", func() error { return CleanupOthers(proxymode.IPVS, "", "") },
			map[string]bool{"UPROXY-PORTALS-CONTAINER": false, nftPortals: false, "UPROXY-SERVICES": false, nftKernel: false, "UPROXY-IPVS-SERVICES": true, "UPROXY-IPVS-FILTER": true}},
	}
	for _, st := range steps {
		t.Run(st.name, func(t *testing.T) {
			program(t)
			if err := tp.Run(testbed.Node, st.clean); err != nil {
				t.Fatalf("cleanup: %v", err)
			}
			got := has(chains...)
			for _, c := range chains {
				if got[c] != st.want[c] {
					t.Errorf("chain %s present: got %v, want %v", c, got[c], st.want[c])
				}
			}
			if err := tp.Run(testbed.Node, func() error { return CleanupAll("") }); err != nil {
				t.Fatalf("CleanupAll: %v", err)
			}
			for i, v6 := range []bool{false, true} {
				if got := tp.SavedRules(t, v6); got != before[i] {
					t.Errorf("after CleanupAll (v6=%v):\ngot:\n%s\nwant:\n%s", v6, got, before[i])
				}
			}
			if got := nftTables(); got != beforeNFT {
				t.Errorf("nftables tables after CleanupAll:\ngot:\n%s\nwant:\n%s", got, beforeNFT)
			}
		})
	}
	if err := CleanupOthers("kernelspace", "", ""); err == nil {
		t.Errorf("CleanupOthers(kernelspace): got nil error, want one")
	}
}
