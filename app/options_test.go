package app

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/app/registry"
	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/rules"
)

// validateArgs parses args as the command line and validates the options.
func validateArgs(t *testing.T, args ...string) (*config, error) {
	t.Helper()
	o := defaultOptions()
	cmd := &cobra.Command{Use: "uproxy"}
	o.addFlags(cmd)
	if err := cmd.Flags().Parse(args); err != nil {
		t.Fatalf("parse %v: %v", args, err)
	}
	return o.validate()
}

// Each bad flag value is refused at start with an error naming the flag.
func TestValidateNamesTheBadFlag(t *testing.T) {
	tests := []struct {
		args     []string
		wantFlag string
	}{
		{[]string{"--event-loops=-1"}, "--event-loops"},
		{[]string{"--event-loops=100000"}, "--event-loops"},
		{[]string{"--eject-after=-2"}, "--eject-after"},
		{[]string{"--dial-mark-bit=32"}, "--dial-mark-bit"},
		{[]string{"--dial-mark-bit=-2"}, "--dial-mark-bit"},
		{[]string{"--dial-timeouts=1s,,2s"}, "--dial-timeouts"},
		{[]string{"--udp-timeout=0s"}, "--udp-timeout"},
		{[]string{"--tcp-keepalive=-1s"}, "--tcp-keepalive"},
		{[]string{"--tcp-keepalive=500ms"}, "--tcp-keepalive"},
		{[]string{"--tcp-keepalive=10h"}, "--tcp-keepalive"},
		{[]string{"--tcp-idle-timeout=-1s"}, "--tcp-idle-timeout"},
		{[]string{"--bind-address=not-an-ip"}, "--bind-address"},
		{[]string{"--rules=ipfw"}, "--rules"},
		{[]string{"--events=-5"}, "--events"},
		{[]string{"--metrics-bind-address=127.0.0.1:10256"}, "--metrics-bind-address 127.0.0.1:10256 and --healthz-bind-address 0.0.0.0:10256: the same port"},
		{[]string{"--metrics-bind-address=127.0.0.1:10256", "--healthz-bind-address=0.0.0.0:10256"}, "--metrics-bind-address 127.0.0.1:10256 and"},
		{[]string{"--events=100001"}, "--events"},
		{[]string{"--events=4611686018427387904"}, "--events"},
		{[]string{"--bind-address=224.0.0.1"}, "--bind-address"},
		{[]string{"--bind-address=ff02::1"}, "--bind-address"},
		{[]string{"--bind-address=255.255.255.255"}, "--bind-address"},
		{[]string{"--chain-prefix=A.B"}, "--chain-prefix"},
		{[]string{"--chain-prefix=A;B"}, "--chain-prefix"},
		{[]string{"--dial-mark-bit=14"}, "--dial-mark-bit"},
		{[]string{"--dial-mark-bit=15"}, "--dial-mark-bit"},
		{[]string{"--metrics-bind-address=127.0.0.1:99999"}, "--metrics-bind-address"},
		{[]string{"--metrics-bind-address=127.0.0.1:http"}, "--metrics-bind-address"},
		{[]string{"--healthz-bind-address=0.0.0.0:-1"}, "--healthz-bind-address"},
		{[]string{"--proxy-mode=nope"}, "--proxy-mode"},
		{[]string{"--chain-prefix=KUBE"}, "--chain-prefix"},
		{[]string{"--chain-prefix=kube-x"}, "--chain-prefix"},
		{[]string{"--chain-prefix=TOOLONGPREFIX"}, "--chain-prefix"},
		{[]string{"--proxy-mode=userspace", "--scheduler=wrr"}, "--scheduler"},
		{[]string{"--node-labels=topology.kubernetes.io/zone=z1"}, "--node-labels"},
		{[]string{"--services=x", "--node-labels=bad key=z1"}, "--node-labels"},
		{[]string{"--services=x", "--node-labels=topology.kubernetes.io/zone=not a value"}, "--node-labels"},
		{[]string{"--dial-hedge=-1ms"}, "--dial-hedge"},
		{[]string{"--retry-budget=120"}, "--retry-budget"},
		{[]string{"--retry-budget=some"}, "--retry-budget"},
		{[]string{"--cluster-cidr=10.244.0.0"}, "--cluster-cidr"},
		{[]string{"--cluster-cidr=10.244.0.0/16,"}, "--cluster-cidr"},
		{[]string{"--cluster-cidr=10.244.0.0/16,10.245.0.0/16"}, "--cluster-cidr"},
		{[]string{"--cluster-cidr=fd00::/64,fd01::/64"}, "--cluster-cidr"},
		{[]string{"--nodeport-addresses=10.0.0.0/8,everywhere"}, "--nodeport-addresses"},
		{[]string{"--nodeport-addresses=primary,10.0.0.0/8"}, "--nodeport-addresses"},
		{[]string{"--nodeport-addresses=10.0.0.0/8,primary"}, "--nodeport-addresses"},
		{[]string{"--nodeport-addresses=Primary"}, "--nodeport-addresses"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			_, err := validateArgs(t, tt.args...)
			if err == nil || !strings.HasPrefix(err.Error(), tt.wantFlag) {
				t.Errorf("validate with %v: got %v, want an error starting with %q", tt.args, err, tt.wantFlag)
			}
		})
	}
	if c, err := validateArgs(t, "--services=x", "--node-labels=topology.kubernetes.io/zone=z1,rack=r7"); err != nil || c.zone != "z1" {
		t.Errorf("validate with --node-labels: got %+v, %v; want zone z1", c, err)
	}
	c, err := validateArgs(t, "--cluster-cidr= 10.244.1.7/16 , fd00:10:244::/56", "--masquerade-all")
	if want := []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16"), netip.MustParsePrefix("fd00:10:244::/56")}; err != nil ||
		fmt.Sprint(c.common.ClusterCIDRs) != fmt.Sprint(want) || !c.common.MasqueradeAll {
		t.Errorf("validate with a dual-stack --cluster-cidr and --masquerade-all: got %+v, %v; want %v and masquerade all", c, err, want)
	}
	c, err = validateArgs(t, "--event-loops=3")
	if err != nil || c.specific.Userspace.EventLoops != 3 {
		t.Errorf("validate with --event-loops=3: got %v, %v; want 3 event loops", c, err)
	}
	if c, err := validateArgs(t, "--dial-hedge=30ms", "--retry-budget=20%"); err != nil || c.specific.Userspace.DialHedge != 30*time.Millisecond || c.specific.Userspace.RetryBudget != 20 {
		t.Errorf("validate with --dial-hedge=30ms --retry-budget=20%%: got %+v, %v; want hedge 30ms and budget 20", c, err)
	}
	if c, err := validateArgs(t); err != nil || c.specific.Userspace.DialHedge != 0 || c.specific.Userspace.RetryBudget != 0 {
		t.Errorf("validate with no policy flag: got %+v, %v; want no hedge and no budget", c, err)
	}
	for bit, want := range map[string]uint32{"13": 0x2000, "0": 1, "31": 0x80000000, "-1": 0} {
		if c, err := validateArgs(t, "--dial-mark-bit="+bit); err != nil || c.specific.Userspace.DialMark != want {
			t.Errorf("validate with --dial-mark-bit=%s: got %+v, %v; want dial mark %#x", bit, c, err, want)
		}
	}
}

// --nodeport-addresses takes CIDRs or the word primary, which the registry
// resolves to the node IPs at start; left empty it is every address, except in the
// nftables mode, where it is primary, as kube-proxy's defaults are.
func TestNodePortAddresses(t *testing.T) {
	ips := []netip.Addr{netip.MustParseAddr("192.168.50.1"), netip.MustParseAddr("fd00:50::1")}
	primary := []netip.Prefix{netip.MustParsePrefix("192.168.50.1/32"), netip.MustParsePrefix("fd00:50::1/128")}
	for _, tc := range []struct {
		name    string
		args    []string
		mode    string
		ips     []netip.Addr
		want    []netip.Prefix
		primary bool
		err     string
		// relay: the nftables mode's loopback NodePorts, IPv4 and IPv6.
		relay [2]bool
	}{
		{"CIDRs", []string{"--nodeport-addresses= 10.1.2.3/8 ,fd00::/64"}, "iptables", ips,
			[]netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("fd00::/64")}, false, "", [2]bool{}},
		{"primary", []string{"--nodeport-addresses=primary"}, "iptables", ips, primary, true, "", [2]bool{}},
		{"primary in the userspace mode", []string{"--nodeport-addresses=primary"}, "userspace", ips[:1], primary[:1], true, "", [2]bool{}},
		{"empty: every address", nil, "iptables", ips, nil, false, "", [2]bool{}},
		{"empty in the userspace mode: every address", nil, "userspace", ips, nil, false, "", [2]bool{}},
		{"empty in the nftables mode: primary and localhost, as kube-proxy (KEP-6032)", nil, "nftables", ips, primary, true, "", [2]bool{true, true}},
		{"empty in the nftables mode, IPv4 only", nil, "nftables", ips[:1], primary[:1], true, "", [2]bool{true, false}},
		{"primary in the nftables mode: no localhost", []string{"--nodeport-addresses=primary"}, "nftables", ips, primary, true, "", [2]bool{}},
		{"CIDRs in the nftables mode", []string{"--nodeport-addresses=10.0.0.0/8"}, "nftables", ips, []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, false, "", [2]bool{}},
		{"CIDRs with loopback in the nftables mode", []string{"--nodeport-addresses=10.0.0.0/8,127.0.0.0/8,::1/128"}, "nftables", ips,
			[]netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("::1/128")}, false, "", [2]bool{true, true}},
		{"empty in the nftables mode without a node IP: every address", nil, "nftables", nil, nil, false, "", [2]bool{true, false}},
		{"primary without a node IP", []string{"--nodeport-addresses=primary"}, "iptables", nil, nil, false, "--nodeport-addresses primary: the node has no primary IP", [2]bool{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := validateArgs(t, tc.args...)
			if err != nil {
				t.Fatal(err)
			}
			// No portals to choose: this is about NodePorts.
			c.specific.Userspace.Rules = rules.BackendNone
			c.common.IPv6 = proxymode.HasIPv6(tc.ips)
			c.nodePorts.PrimaryIPs = tc.ips
			err = registry.Resolve(tc.mode, &c.common, &c.specific, &c.nodePorts)
			if tc.err != "" {
				if err == nil || !strings.HasPrefix(err.Error(), tc.err) {
					t.Errorf("got %v, want an error starting with %q", err, tc.err)
				}
				return
			}
			relay := c.specific.NFTables.LoopbackNodePorts
			if err != nil || fmt.Sprint(c.common.NodePortAddresses) != fmt.Sprint(tc.want) || c.nodePorts.Primary != tc.primary || relay != tc.relay {
				t.Errorf("got %v primary=%v relay=%v (%v), want %v primary=%v relay=%v", c.common.NodePortAddresses, c.nodePorts.Primary, relay, err, tc.want, tc.primary, tc.relay)
			}
		})
	}
	bind := netip.MustParseAddr("10.9.8.7")
	if got := primaryIPs(bind, ips); !slices.Equal(got, []netip.Addr{bind}) {
		t.Errorf("primary IPs with --bind-address %s: got %v, want it alone", bind, got)
	}
	if c, err := validateArgs(t); err != nil || !c.specific.IPTables.LocalhostNodePorts {
		t.Errorf("--iptables-localhost-nodeports by default: got %v (%v), want true, as kube-proxy", c.specific.IPTables.LocalhostNodePorts, err)
	}
	if c, err := validateArgs(t, "--iptables-localhost-nodeports=false"); err != nil || c.specific.IPTables.LocalhostNodePorts {
		t.Errorf("--iptables-localhost-nodeports=false: got %v (%v), want false", c.specific.IPTables.LocalhostNodePorts, err)
	}
}

// --rules takes each backend by name; auto leaves the choice to the start,
// where the kernel is probed, unless the proxy cannot touch the kernel at all.
func TestValidateRules(t *testing.T) {
	autoWant := rules.BackendNone
	if os.Geteuid() == 0 {
		autoWant = rules.BackendAuto
	}
	for flag, want := range map[string]rules.Backend{"nftables": rules.BackendNFTables, "iptables": rules.BackendIPTables, "none": rules.BackendNone, "auto": autoWant} {
		if c, err := validateArgs(t, "--rules="+flag); err != nil || c.specific.Userspace.Rules != want {
			t.Errorf("validate with --rules=%s: got %+v, %v; want rules %q", flag, c, err, want)
		}
	}
}

// A taken --metrics-bind-address or --healthz-bind-address port fails the start
// with the flag's name, before anything is logged or touched.
func TestTakenHTTPPortNamesItsFlagFirst(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	var logged bytes.Buffer
	klog.LogToStderr(false)
	klog.SetOutput(&logged)
	defer func() {
		klog.SetOutput(os.Stderr)
		klog.LogToStderr(true)
	}()
	for _, flag := range []string{"--metrics-bind-address", "--healthz-bind-address"} {
		t.Run(flag, func(t *testing.T) {
			logged.Reset()
			o := defaultOptions()
			cmd := &cobra.Command{Use: "uproxy"}
			o.addFlags(cmd)
			args := []string{"--services", t.TempDir(), "--rules", "none",
				"--metrics-bind-address", "127.0.0.1:0", "--healthz-bind-address", "127.0.0.1:0",
				flag, taken.Addr().String()}
			if err := cmd.Flags().Parse(args); err != nil {
				t.Fatal(err)
			}
			err := runProxy(context.Background(), o, nil)
			if err == nil || !strings.HasPrefix(err.Error(), flag+" ") || !strings.Contains(err.Error(), "address already in use") {
				t.Errorf("runProxy with %s taken: got %v, want an error starting with %s and saying the address is in use", flag, err, flag)
			}
			klog.Flush()
			if logged.Len() != 0 {
				t.Errorf("log before the flag error: got %q, want nothing", logged.String())
			}
		})
	}
}

func TestVersionFlag(t *testing.T) {
	for _, args := range [][]string{{"--version"}, {"version"}} {
		root := NewRootCommand()
		var out bytes.Buffer
		root.SetOut(&out)
		root.SetArgs(args)
		if err := root.Execute(); err != nil {
			t.Fatalf("uproxy %v: %v", args, err)
		}
		if got, want := out.String(), "uproxy "+version+"\n"; got != want {
			t.Errorf("uproxy %v: got %q, want %q", args, got, want)
		}
	}
}

// One uproxy at a time programs a network namespace's rules under a prefix; the
// refusal names the holder, and the lock is free again once released.
func TestRulesLock(t *testing.T) {
	prefix := fmt.Sprintf("T%d", os.Getpid()%100000)
	first, err := lockRules(prefix)
	if err != nil {
		t.Fatalf("first lock: %v", err)
	}
	_, err = lockRules(prefix)
	if err == nil {
		t.Fatal("second lock of the same prefix: got none, want a refusal")
	}
	for _, want := range []string{fmt.Sprintf("process %d", os.Getpid()), "--chain-prefix " + prefix} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("refusal %q: want it to name %q", err, want)
		}
	}
	other, err := lockRules(prefix + "X")
	if err != nil {
		t.Errorf("lock of another prefix: %v", err)
	}
	other.Close()
	first.Close()
	again, err := lockRules(prefix)
	if err != nil {
		t.Fatalf("lock after release: %v", err)
	}
	again.Close()
}

// --tcp-keepalive and --tcp-idle-timeout reach the proxier's Config, whose zero
// keepalive is the default: the flag's 0 (off) becomes a negative one.
func TestTCPLivenessFlags(t *testing.T) {
	tests := []struct {
		args                    []string
		wantKeepAlive, wantIdle time.Duration
	}{
		{nil, 15 * time.Second, 0},
		{[]string{"--tcp-keepalive=0"}, -1, 0},
		{[]string{"--tcp-keepalive=1m", "--tcp-idle-timeout=1h"}, time.Minute, time.Hour},
	}
	for _, tt := range tests {
		c, err := validateArgs(t, tt.args...)
		if err != nil {
			t.Fatalf("validate with %v: %v", tt.args, err)
		}
		if c.specific.Userspace.TCPKeepAlive != tt.wantKeepAlive || c.specific.Userspace.TCPIdleTimeout != tt.wantIdle {
			t.Errorf("validate with %v: got keepalive %v, idle timeout %v; want %v, %v",
				tt.args, c.specific.Userspace.TCPKeepAlive, c.specific.Userspace.TCPIdleTimeout, tt.wantKeepAlive, tt.wantIdle)
		}
	}
}
