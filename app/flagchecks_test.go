package app

import (
	"context"
	"net/netip"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/proxyconfig"
	"github.com/uproxy/uproxy/test/testbed"
	"github.com/uproxy/uproxy/test/testbed/logs"
)

// A flag the chosen mode does not use is refused naming it, unless kube-proxy
// takes it in every mode or the mode was chosen by auto (then it is only
// warned of); a flag --config set is one of its fields and left alone.
func TestCheckModeFlags(t *testing.T) {
	for _, tc := range []struct {
		mode string
		args []string
		want string // error prefix; "" for none
	}{
		{"iptables", []string{"--proxy-mode=iptables", "--rules=nftables", "--dial-timeouts=1s"}, "--rules: the iptables mode does not use it (the userspace mode does); leave it out; --dial-timeouts:"},
		{"ipvs", []string{"--proxy-mode=ipvs", "--retry-budget=10"}, "--retry-budget: the ipvs mode does not use it"},
		{"iptables", []string{"--proxy-mode=iptables", "--scheduler=sh", "--proxy-port-range=40000-40100"}, ""},
		{"ipvs", []string{"--proxy-mode=ipvs", "--scheduler=sh"}, ""},
		{"userspace", []string{"--cluster-cidr=10.244.0.0/16", "--masquerade-all"}, ""},
		{"userspace", []string{"--rules=none", "--dial-timeouts=1s", "--events=0"}, ""},
		{"iptables", []string{"--proxy-mode=auto", "--dial-timeouts=1s"}, ""},
		{"nftables", []string{"--proxy-mode=nftables", "--bind-address=127.0.0.1", "--sync-period=1m"}, ""},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			o := defaultOptions()
			o.addFlags(&cobra.Command{Use: "uproxy"})
			if err := o.flags.Parse(tc.args); err != nil {
				t.Fatal(err)
			}
			err := o.checkModeFlags(tc.mode)
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("got %v, want no error", err)
			case tc.want != "" && (err == nil || !strings.HasPrefix(err.Error(), tc.want)):
				t.Errorf("got %v, want an error starting %q", err, tc.want)
			}
		})
	}
	o := defaultOptions()
	o.addFlags(&cobra.Command{Use: "uproxy"})
	o.flags.Set("udp-timeout", "1s")
	o.proxyMode = "iptables"
	o.configFields = map[string]proxyconfig.Setting{"udp-timeout": {Field: "udpIdleTimeout", Flag: "udp-timeout"}}
	if err := o.checkModeFlags("iptables"); err != nil {
		t.Errorf("a field of --config the mode does not use: got %v, want none (kube-proxy takes it)", err)
	}
}

// A flag the mode asked for does not use is refused before anything is
// logged: the lines --config has to say (a flag it sets, a field uproxy does
// not use) and the mode's come after the flags are known good.
func TestModeFlagsRefusedBeforeAnyLog(t *testing.T) {
	config := writeConfig(t, "mode: iptables\nmetricsBindAddress: 127.0.0.1:0\nhealthzBindAddress: 127.0.0.1:0\nfeatureGates: {SomeGate: true}\n")
	services := t.TempDir()
	for _, args := range [][]string{
		{"--config", config, "--sync-period", "5s", "--rules", "nftables"},
		{"--proxy-mode", "iptables", "--metrics-bind-address", "127.0.0.1:0", "--healthz-bind-address", "127.0.0.1:0", "--rules", "nftables"},
	} {
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			log := logs.Capture(t)
			o := defaultOptions()
			cmd := &cobra.Command{Use: "uproxy"}
			o.addFlags(cmd)
			if err := cmd.Flags().Parse(append(args, "--services", services, "--hostname-override", "n")); err != nil {
				t.Fatal(err)
			}
			err := runProxy(context.Background(), o, nil)
			const want = "--rules: the iptables mode does not use it (the userspace mode does); leave it out"
			if err == nil || err.Error() != want {
				t.Errorf("got %v, want %q", err, want)
			}
			klog.Flush()
			if lines := log.Since(); len(lines) > 0 {
				t.Errorf("log before the refusal: got\n%s\nwant nothing", strings.Join(lines, "\n"))
			}
		})
	}

	// Flags that pass have them logged when the start goes on.
	log := logs.Capture(t)
	o, _, err := loadArgs(t, "--config", writeConfig(t, "featureGates: {SomeGate: true}\n"), "--sync-period", "5s", "--hostname-override", "n")
	if err != nil {
		t.Fatal(err)
	}
	klog.Flush()
	if lines := log.Since(); len(lines) > 0 {
		t.Errorf("log of applying and checking the flags: got\n%s\nwant nothing yet", strings.Join(lines, "\n"))
	}
	o.logConfigNotes()
	klog.Flush()
	logs.Check(t, "--config's notes", log.Since(), [][]string{
		{"I", `"Ignoring a kube-proxy setting uproxy does not use"`, `field="featureGates"`},
		{"I", `"Ignoring a flag that --config sets, as kube-proxy does"`, `flag="--sync-period"`, `given="5s"`, `value="30s"`},
	})
}

// The flags of the API source are refused beside --services, whose manifests
// are then the only source; --tcp-keepalive takes whole seconds only.
func TestValidateRefusesIgnoredFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--services=x", "--kubeconfig=k"}, `--kubeconfig "k": the Services come from --services x`},
		{[]string{"--services=x", "--master=https://m"}, `--master "https://m"`},
		{[]string{"--services=x", "--service-proxy-name=uproxy"}, `--service-proxy-name "uproxy"`},
		{[]string{"--tcp-keepalive=1500ms"}, "--tcp-keepalive 1.5s: want whole seconds"},
	} {
		if _, err := validateArgs(t, tc.args...); err == nil || !strings.HasPrefix(err.Error(), tc.want) {
			t.Errorf("validate with %v: got %v, want an error starting %q", tc.args, err, tc.want)
		}
	}
	for _, args := range [][]string{{"--kubeconfig=k", "--service-proxy-name=uproxy"}, {"--services=x"}, {"--tcp-keepalive=2m"}, {"--events=0"}} {
		if _, err := validateArgs(t, args...); err != nil {
			t.Errorf("validate with %v: got %v, want none", args, err)
		}
	}
}

// A specific --bind-address must be one of the node's; unspecified binds all.
func TestCheckBindAddress(t *testing.T) {
	checkBindAddresses(t, map[string]string{
		"0.0.0.0":   "",
		"::":        "",
		"127.0.0.1": "",
		"192.0.2.1": "--bind-address 192.0.2.1: not an address of this node",
		"fe80::1":   "--bind-address fe80::1: a link-local address needs its interface",
	})
}

// In a namespace of its own with 10.9.0.1/24 on lo: the subnet's broadcast
// address, which the kernel lets a socket bind, and an address bound only
// through net.ipv4.ip_nonlocal_bind are refused; the interface's address is
// taken.
func TestCheckBindAddressWantsAnInterfacesAddress(t *testing.T) {
	if !testbed.InOwnNetns(t) {
		return
	}
	for _, cmd := range [][]string{
		{"ip", "link", "set", "lo", "up"},
		{"ip", "addr", "add", "10.9.0.1/24", "brd", "10.9.0.255", "dev", "lo"},
		{"sysctl", "-q", "-w", "net.ipv4.ip_nonlocal_bind=1"},
	} {
		if out, err := exec.Command(cmd[0], cmd[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v: %s", cmd, err, out)
		}
	}
	checkBindAddresses(t, map[string]string{
		"10.9.0.1":   "",
		"10.9.0.255": "--bind-address 10.9.0.255: not an address of this node: no interface has it",
		"192.0.2.1":  "--bind-address 192.0.2.1: not an address of this node: no interface has it",
	})
}

// checkBindAddresses checks each address of want with checkBindAddress: ""
// for none, else the start of the error.
func checkBindAddresses(t *testing.T, want map[string]string) {
	t.Helper()
	for addr, w := range want {
		err := checkBindAddress(netip.MustParseAddr(addr))
		if (w == "") != (err == nil) || (err != nil && !strings.HasPrefix(err.Error(), w)) {
			t.Errorf("checkBindAddress(%s): got %v, want %q", addr, err, w)
		}
	}
}

// A --services path that is not there is named once, with the flag.
func TestCheckServicesPath(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "missing")
	o := &options{services: missing}
	want := "--services " + missing + ": no such file or directory"
	if err := o.checkServicesPath(); err == nil || err.Error() != want {
		t.Errorf("got %v, want %q", err, want)
	}
	o.services = t.TempDir()
	if err := o.checkServicesPath(); err != nil {
		t.Errorf("an existing directory: got %v, want none", err)
	}
}
