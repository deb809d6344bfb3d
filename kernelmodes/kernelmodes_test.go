package kernelmodes

import (
	"bufio"
	"compress/gzip"
	"io"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/test/testbed"
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
		tp.Run(testbed.Node, func() error { _, _, err = Choose(proxymode.IPVS, ""); return nil })
		if err == nil || err.Error() != want {
			t.Errorf("Choose(ipvs): got %v, want %q", err, want)
		}
		var mode, reason string
		tp.Run(testbed.Node, func() error { mode, reason, err = Choose(proxymode.Auto, ""); return nil })
		if mode != proxymode.NFTables || err != nil || !strings.Contains(reason, "CONFIG_IP_VS") {
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
		{proxymode.Auto, all, proxymode.IPVS, ""},
		{"", noIPVS, proxymode.NFTables, ""},
		{proxymode.Auto, onlyIPT, proxymode.IPTables, ""},
		{proxymode.Auto, nothing, proxymode.Userspace, ""},
		{proxymode.IPVS, all, proxymode.IPVS, ""},
		{proxymode.IPVS, noIPVS, "", "ipvs mode unavailable on this kernel: no IPVS netlink family (CONFIG_IP_VS); use --proxy-mode nftables or --proxy-mode iptables or --proxy-mode userspace"},
		{proxymode.IPVS, onlyIPT, "", "ipvs mode unavailable on this kernel: no IPVS netlink family (CONFIG_IP_VS); use --proxy-mode iptables or --proxy-mode userspace"},
		{proxymode.IPVS, nothing, "", "ipvs mode unavailable on this kernel: no IPVS netlink family (CONFIG_IP_VS); use --proxy-mode userspace"},
		{proxymode.NFTables, noIPVS, proxymode.NFTables, ""},
		{proxymode.NFTables, onlyIPT, "", "nftables mode unavailable: nftables: no nft command; use --proxy-mode iptables or --proxy-mode userspace"},
		{proxymode.NFTables, nothing, "", "nftables mode unavailable: nftables: no nft command; use --proxy-mode userspace"},
		{proxymode.IPTables, noIPVS, proxymode.IPTables, ""},
		{proxymode.IPTables, nothing, "", "iptables mode unavailable: no iptables-restore command; use --proxy-mode userspace"},
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
	if mode, _, err := Choose(proxymode.Userspace, ""); mode != proxymode.Userspace || err != nil {
		t.Errorf("Choose(userspace): got %q %v, want userspace", mode, err)
	}
}
