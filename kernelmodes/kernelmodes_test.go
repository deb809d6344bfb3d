package kernelmodes

import (
	"bufio"
	"compress/gzip"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/kernelmodes/iptables"
	"github.com/uproxy/uproxy/kernelmodes/nftables"
	"github.com/uproxy/uproxy/rules"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/testbed"
)

// kernelConfig reads the running kernel's build options from /proc/config.gz
// or /boot/config-<release>; nil when neither exists.
func kernelConfig(t *testing.T) map[string]string {
	t.Helper()
	var r io.Reader
	if f, err := os.Open("/proc/config.gz"); err == nil {
		defer f.Close()
		gz, err := gzip.NewReader(f)
		if err != nil {
			t.Fatal(err)
		}
		r = gz
	} else {
		var uts unix.Utsname
		unix.Uname(&uts)
		f, err := os.Open("/boot/config-" + unix.ByteSliceToString(uts.Release[:]))
		if err != nil {
			return nil
		}
		defer f.Close()
		r = f
	}
	cfg := map[string]string{}
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), "="); ok && !strings.HasPrefix(k, "#") {
			cfg[k] = v
		}
	}
	return cfg
}

// TestProbeMatchesKernel checks the probe against what the kernel was built
// with (or, without a config file, against /proc/net/ip_vs, which exists
// exactly when IPVS is there), in a fresh network namespace.
func TestProbeMatchesKernel(t *testing.T) {
	testbed.Needs(t, testbed.Netns)
	cfg := kernelConfig(t)
	var wantIPVS, wantDummy bool
	if cfg != nil {
		wantIPVS = cfg["CONFIG_IP_VS"] == "y" || cfg["CONFIG_IP_VS"] == "m"
		wantDummy = cfg["CONFIG_DUMMY"] == "y" || cfg["CONFIG_DUMMY"] == "m"
	} else {
		_, err := os.Stat("/proc/net/ip_vs")
		wantIPVS = err == nil
		wantDummy = exec.Command("ip", "link", "add", "uproxy-tprobe0", "type", "dummy").Run() == nil
		exec.Command("ip", "link", "del", "uproxy-tprobe0").Run()
	}
	tp := testbed.New(t)
	var v Verdict
	tp.Run(testbed.Node, func() error { v = Probe("rr"); return nil })
	t.Logf("kernel config: IP_VS=%q DUMMY=%q; verdict %+v", cfg["CONFIG_IP_VS"], cfg["CONFIG_DUMMY"], v)

	gotIPVS := !slices.Contains(v.IPVSMissing, "no IPVS netlink family (CONFIG_IP_VS)")
	gotDummy := !slices.Contains(v.IPVSMissing, "cannot create dummy links (CONFIG_DUMMY)")
	if gotIPVS != wantIPVS {
		t.Errorf("IPVS available: got %v, want %v (verdict %q)", gotIPVS, wantIPVS, v.IPVSMissing)
	}
	if gotDummy != wantDummy {
		t.Errorf("dummy links available: got %v, want %v (verdict %q)", gotDummy, wantDummy, v.IPVSMissing)
	}
	if v.IPVS() != (wantIPVS && wantDummy && len(v.IPVSMissing) == 0) {
		t.Errorf("IPVS mode usable: got %v with missing %q", v.IPVS(), v.IPVSMissing)
	}
	_, lookErr := exec.LookPath("iptables-restore")
	if v.IPTables() != (lookErr == nil) {
		t.Errorf("iptables mode usable: got %v, want %v (missing %q)", v.IPTables(), lookErr == nil, v.IPTablesMissing)
	}
	_, nftErr := exec.LookPath("nft")
	if v.NFTables() != (nftErr == nil) {
		t.Errorf("nftables mode usable: got %v, want %v (missing %q)", v.NFTables(), nftErr == nil, v.NFTablesMissing)
	}
	if out, err := tp.Exec(testbed.Node, "nft", "list", "tables"); nftErr == nil && (err != nil || strings.TrimSpace(string(out)) != "") {
		t.Errorf("the nftables probe left tables behind: %s (%v)", out, err)
	}
	if out, err := tp.Exec(testbed.Node, "ip", "link", "show", "uproxy-probe0"); err == nil {
		t.Errorf("the probe left its dummy link behind: %s", out)
	}

	if !wantIPVS && !wantDummy && v.IPTables() && v.NFTables() {
		// The kernel of our machines: the exact message users see.
		want := "ipvs mode unavailable on this kernel: no IPVS netlink family (CONFIG_IP_VS), cannot create dummy links (CONFIG_DUMMY); use --proxy-mode nftables or --proxy-mode iptables or --proxy-mode userspace"
		if err := v.IPVSError(); err == nil || err.Error() != want {
			t.Errorf("IPVSError: got %v, want %q", err, want)
		}
		var err error
		tp.Run(testbed.Node, func() error { _, _, err = Choose(IPVS, ""); return nil })
		if err == nil || err.Error() != want {
			t.Errorf("Choose(ipvs): got %v, want %q", err, want)
		}
		var mode, reason string
		tp.Run(testbed.Node, func() error { mode, reason, err = Choose(Auto, ""); return nil })
		if mode != NFTables || err != nil || !strings.Contains(reason, "CONFIG_IP_VS") {
			t.Errorf("Choose(auto): got %q %q %v, want nftables with a reason naming CONFIG_IP_VS", mode, reason, err)
		}
	}
}

func TestChoose(t *testing.T) {
	all := Verdict{}
	noIPVS := Verdict{IPVSMissing: []string{"no IPVS netlink family (CONFIG_IP_VS)"}}
	onlyIPT := Verdict{IPVSMissing: noIPVS.IPVSMissing, NFTablesMissing: []string{"nftables: no nft command"}}
	nothing := Verdict{IPVSMissing: noIPVS.IPVSMissing, NFTablesMissing: onlyIPT.NFTablesMissing, IPTablesMissing: []string{"no iptables-restore command"}}
	cases := []struct {
		requested string
		v         Verdict
		mode      string
		errText   string
	}{
		{Auto, all, IPVS, ""},
		{"", noIPVS, NFTables, ""},
		{Auto, onlyIPT, IPTables, ""},
		{Auto, nothing, Userspace, ""},
		{IPVS, all, IPVS, ""},
		{IPVS, noIPVS, "", "ipvs mode unavailable on this kernel: no IPVS netlink family (CONFIG_IP_VS); use --proxy-mode nftables or --proxy-mode iptables or --proxy-mode userspace"},
		{IPVS, onlyIPT, "", "ipvs mode unavailable on this kernel: no IPVS netlink family (CONFIG_IP_VS); use --proxy-mode iptables or --proxy-mode userspace"},
		{IPVS, nothing, "", "ipvs mode unavailable on this kernel: no IPVS netlink family (CONFIG_IP_VS); use --proxy-mode userspace"},
		{NFTables, noIPVS, NFTables, ""},
		{NFTables, onlyIPT, "", "nftables mode unavailable: nftables: no nft command; use --proxy-mode iptables or --proxy-mode userspace"},
		{NFTables, nothing, "", "nftables mode unavailable: nftables: no nft command; use --proxy-mode userspace"},
		{IPTables, noIPVS, IPTables, ""},
		{IPTables, nothing, "", "iptables mode unavailable: no iptables-restore command; use --proxy-mode userspace"},
	}
	for _, c := range cases {
		t.Run(c.requested+"/"+strings.Join(slices.Concat(c.v.IPVSMissing, c.v.NFTablesMissing, c.v.IPTablesMissing), ","), func(t *testing.T) {
			mode, reason, err := choose(c.requested, c.v)
			errText := ""
			if err != nil {
				errText = err.Error()
			}
			if mode != c.mode || errText != c.errText {
				t.Errorf("got %q, %v; want %q, %q", mode, err, c.mode, c.errText)
			}
			if err == nil && reason == "" {
				t.Errorf("reason: got empty, want an explanation")
			}
		})
	}
	if _, _, err := Choose("kernelspace", ""); err == nil {
		t.Errorf("Choose(kernelspace): got nil error, want one")
	}
	if mode, _, err := Choose(Userspace, ""); mode != Userspace || err != nil {
		t.Errorf("Choose(userspace): got %q %v, want userspace", mode, err)
	}
}

// TestModeSwitches programs the userspace portals, the iptables mode and
// leftovers of the IPVS mode's chains in one namespace, then checks that
// CleanupOthers removes exactly the other modes' state and CleanupAll all of it.
func TestModeSwitches(t *testing.T) {
	testbed.Needs(t, testbed.Netns, testbed.Commands("iptables-restore"))
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
		must(t, "iptables", "-t", "nat", "-I", "PREROUTING", "-j", "UPROXY-IPVS-SERVICES")
		must(t, "iptables", "-t", "filter", "-N", "UPROXY-IPVS-FILTER")
		must(t, "iptables", "-t", "filter", "-I", "INPUT", "-j", "UPROXY-IPVS-FILTER")
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
		{"start in iptables mode", func() error { return CleanupOthers(IPTables, "") },
			map[string]bool{"UPROXY-PORTALS-CONTAINER": false, nftPortals: false, "UPROXY-SERVICES": true, nftKernel: false, "UPROXY-IPVS-SERVICES": false, "UPROXY-IPVS-FILTER": false}},
		{"start in nftables mode", func() error { return CleanupOthers(NFTables, "") },
			map[string]bool{"UPROXY-PORTALS-CONTAINER": false, nftPortals: false, "UPROXY-SERVICES": false, nftKernel: true, "UPROXY-IPVS-SERVICES": false, "UPROXY-IPVS-FILTER": false}},
		{"start in userspace mode", func() error { return CleanupOthers(Userspace, "") },
			map[string]bool{"UPROXY-PORTALS-CONTAINER": true, nftPortals: true, "UPROXY-SERVICES": false, nftKernel: false, "UPROXY-IPVS-SERVICES": false, "UPROXY-IPVS-FILTER": false}},
		{"start in ipvs mode", func() error { return CleanupOthers(IPVS, "") },
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
	if err := CleanupOthers("kernelspace", ""); err == nil {
		t.Errorf("CleanupOthers(kernelspace): got nil error, want one")
	}
}
