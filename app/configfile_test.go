package app

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"
)

// loadArgs parses args as the command line, applies --config and validates, as
// runProxy does.
func loadArgs(t *testing.T, args ...string) (*options, *config, error) {
	t.Helper()
	o := defaultOptions()
	cmd := &cobra.Command{Use: "uproxy"}
	o.addFlags(cmd)
	if err := cmd.Flags().Parse(args); err != nil {
		t.Fatalf("parse %v: %v", args, err)
	}
	if err := o.applyConfigFile(); err != nil {
		return o, nil, err
	}
	c, err := o.validate()
	if err != nil {
		return o, nil, o.configFieldError(err)
	}
	return o, c, nil
}

// writeConfig writes a KubeProxyConfiguration with the given fields.
func writeConfig(t *testing.T, fields string) string {
	t.Helper()
	return writeConfigFile(t, "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"+fields)
}

// writeConfigFile writes data to a configuration file of its own and
// returns its path.
func writeConfigFile(t *testing.T, data string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "config.conf")
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// kubeadm's KubeProxyConfiguration holds nearly every field at its zero value;
// uproxy takes each as kube-proxy does, as the default, and starts.
func TestConfigFileFromKubeadm(t *testing.T) {
	o, _, err := loadArgs(t, "--config", filepath.Join(moduleRoot, "proxyconfig", "testdata", "kubeadm.conf"), "--hostname-override", "node-a")
	if err != nil {
		t.Fatalf("got error %v, want kubeadm's file accepted", err)
	}
	for _, c := range []struct {
		what      string
		got, want any
	}{
		{"metrics address", o.metricsBindAddress, "127.0.0.1:10249"},
		{"healthz address", o.healthzBindAddress, "0.0.0.0:10256"},
		{"bind address", o.bindAddress, "0.0.0.0"},
		{"sync period", o.syncPeriod, 30 * time.Second},
		{"min sync period", o.minSyncPeriod, time.Second},
		{"config sync period", o.configSyncPeriod, 15 * time.Minute},
		{"QPS", o.kubeAPIQPS, float32(5)},
		{"burst", o.kubeAPIBurst, 10},
		{"content type", o.kubeAPIContentType, "application/vnd.kubernetes.protobuf"},
		{"scheduler", o.scheduler, "rr"},
		{"mode", o.proxyMode, "userspace"},
		{"kubeconfig", o.kubeconfig, "/var/lib/kube-proxy/kubeconfig.conf"},
		{"node", o.hostnameOverride, "node-a"},
		{"UDP timeout", o.udpTimeout, 250 * time.Millisecond},
		{"cluster CIDR", o.clusterCIDR, "10.244.0.0/16"},
		{"masquerade all", o.masqueradeAll, false},
	} {
		if c.got != c.want {
			t.Errorf("%s: got %v, want %v", c.what, c.got, c.want)
		}
	}
}

// With --config, the file decides every flag that stands for one of its
// fields, defaults included, as in kube-proxy; --hostname-override and the
// flags without a field still count.
func TestConfigFilePrecedence(t *testing.T) {
	config := writeConfig(t, "metricsBindAddress: 127.0.0.1:10268\nhostnameOverride: node-from-file\n")
	o, c, err := loadArgs(t, "--config", config,
		"--metrics-bind-address", "127.0.0.1:9999", // set by the file: ignored
		"--sync-period", "5s", // left to kube-proxy's default by the file: ignored
		"--scheduler", "lc", // ipvs.scheduler, absent: the default
		"--master", "https://10.0.0.1:6443", // no field: applies
		"--dial-timeouts", "1s", // uproxy's own: applies
	)
	if err != nil {
		t.Fatal(err)
	}
	if o.metricsBindAddress != "127.0.0.1:10268" || o.syncPeriod != 30*time.Second || o.scheduler != "rr" {
		t.Errorf("got metrics %s, sync period %v, scheduler %s; want the file's 127.0.0.1:10268 and kube-proxy's defaults 30s, rr",
			o.metricsBindAddress, o.syncPeriod, o.scheduler)
	}
	if o.master != "https://10.0.0.1:6443" || o.dialTimeouts != "1s" {
		t.Errorf("got --master %q, --dial-timeouts %q; want the command line's", o.master, o.dialTimeouts)
	}
	if c.nodeName != "node-from-file" {
		t.Errorf("node without --hostname-override: got %q, want the file's node-from-file", c.nodeName)
	}

	_, c, err = loadArgs(t, "--config", config, "--hostname-override", "Node-From-Flag")
	if err != nil {
		t.Fatal(err)
	}
	if c.nodeName != "node-from-flag" {
		t.Errorf("node with --hostname-override: got %q, want node-from-flag (the flag wins, lower-cased)", c.nodeName)
	}
	if _, _, err := loadArgs(t, "--config", config, "--hostname-override", " "); err == nil || !strings.Contains(err.Error(), "--hostname-override") {
		t.Errorf("--hostname-override of spaces: got %v, want an error naming it (kube-proxy refuses it too)", err)
	}
}

// The file's clusterCIDR and its mode's masqueradeAll reach the kernel modes'
// configuration; kube-proxy's IPVS mode reads masqueradeAll from the iptables
// section, and so does uproxy's.
func TestConfigFileMasquerading(t *testing.T) {
	tests := []struct {
		fields string
		want   bool
	}{
		{"mode: iptables\niptables: {masqueradeAll: true}\n", true},
		{"mode: ipvs\niptables: {masqueradeAll: true}\n", true},
		{"mode: nftables\nnftables: {masqueradeAll: true}\n", true},
		{"mode: nftables\niptables: {masqueradeAll: true}\n", false},
	}
	for _, tt := range tests {
		_, c, err := loadArgs(t, "--config", writeConfig(t, tt.fields+"clusterCIDR: 10.244.0.0/16,fd00:10:244::/56\n"), "--hostname-override", "n", "--masquerade-all=false")
		if err != nil {
			t.Fatalf("%q: %v", tt.fields, err)
		}
		if c.common.MasqueradeAll != tt.want || len(c.common.ClusterCIDRs) != 2 || c.common.ClusterCIDRs[1].String() != "fd00:10:244::/56" {
			t.Errorf("%q: got masquerade all %v, cluster CIDRs %v; want %v and both of the file's", tt.fields, c.common.MasqueradeAll, c.common.ClusterCIDRs, tt.want)
		}
	}
}

// A bad value in the file is refused with an error naming the file's field,
// not the flag it maps to.
func TestConfigFileErrorNamesTheField(t *testing.T) {
	tests := []struct {
		fields, wantField string
	}{
		{"iptables: {syncPeriod: -5s}\n", "iptables.syncPeriod"},
		{"iptables: {syncPeriod: 10s, minSyncPeriod: 20s}\n", "iptables.minSyncPeriod"},
		{"mode: ipvs\nipvs: {scheduler: fastest}\n", "ipvs.scheduler"},
		{"ipvs: {scheduler: wrr}\n", "ipvs.scheduler"}, // IPVS-only, in the userspace mode
		{"clientConnection: {qps: -1}\n", "clientConnection.qps"},
		{"metricsBindAddress: 127.0.0.1:99999\n", "metricsBindAddress"},
		{"healthzBindAddress: localhost\n", "healthzBindAddress"},
		{"bindAddress: not-an-ip\n", "bindAddress"},
		{"mode: fastest\n", "mode"},
		// primary is a value of its own (TestNodePortAddresses), not beside CIDRs.
		{"nodePortAddresses: [primary, 10.0.0.0/8]\n", "nodePortAddresses"},
		{"nodePortAddresses: [everywhere]\n", "nodePortAddresses"},
		{"configSyncPeriod: -1m\n", "configSyncPeriod"},
		{"udpIdleTimeout: -1s\n", "udpIdleTimeout"},
		{"portRange: 3-2\n", "portRange"},
		{"clusterCIDR: 10.244.0.0/16,10.245.0.0/16\n", "clusterCIDR"},
		{"clusterCIDR: pods\n", "clusterCIDR"},
	}
	for _, tt := range tests {
		t.Run(tt.wantField, func(t *testing.T) {
			config := writeConfig(t, tt.fields)
			_, _, err := loadArgs(t, "--config", config, "--hostname-override", "n")
			if err == nil {
				t.Fatalf("%q: got no error, want one naming %s", tt.fields, tt.wantField)
			}
			msg := err.Error()
			if !strings.Contains(msg, `field "`+tt.wantField+`"`) || !strings.Contains(msg, config) {
				t.Errorf("%q: got error %q, want one naming the file and field %s", tt.fields, msg, tt.wantField)
			}
		})
	}
}

// Every error of --config begins "--config FILE: " and names the file there
// only, whatever step finds it: reading the file, parsing it, setting a
// flag from a field or checking the value.
func TestConfigFileErrorsBeginAlike(t *testing.T) {
	dir := t.TempDir()
	tests := []struct {
		name, path, want string // want: what follows the prefix
	}{
		{"missing", filepath.Join(dir, "missing.conf"), "no such file or directory"},
		{"a directory", dir, "not a regular file (a directory): not read"},
		{"not YAML", writeConfigFile(t, "a: [\n"), "parse: "},
		{"unknown field", writeConfig(t, "oops: 1\n"), `unknown field "oops"`},
		{"two documents", writeConfig(t, "mode: iptables\n---\nmode: ipvs\n"), "more than one YAML document: the file must hold one KubeProxyConfiguration"},
		{"a field's flag refuses the value", writeConfig(t, "clientConnection: {burst: 1.5}\n"), `field "clientConnection.burst": strconv.ParseInt: parsing "1.5": invalid syntax`},
		{"a field's value refused", writeConfig(t, "iptables: {syncPeriod: -5s}\n"), `field "iptables.syncPeriod" -5s: must be positive`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, _, err := loadArgs(t, "--config", tt.path, "--hostname-override", "n")
			if err == nil {
				t.Fatalf("got no error, want one starting %q", "--config "+tt.path+": "+tt.want)
			}
			msg := err.Error()
			if !strings.HasPrefix(msg, "--config "+tt.path+": "+tt.want) || strings.Count(msg, tt.path) != 1 || strings.Contains(msg, "config file") {
				t.Errorf("got %q, want it to start %q and name the file once", msg, "--config "+tt.path+": "+tt.want)
			}
		})
	}
}

// A minSyncPeriod above syncPeriod is refused naming the file's fields; when
// the file leaves minSyncPeriod to its default, syncPeriod, which it sets, is
// the one blamed. The flags keep their own wording.
func TestConfigFileSyncPeriods(t *testing.T) {
	tests := []struct {
		fields string
		want   string // what follows "--config FILE: "; "" for no error
	}{
		{"mode: nftables\nnftables: {syncPeriod: 1ns}\n",
			`field "nftables.syncPeriod" 1ns: must be at least 1s, the default value of nftables.minSyncPeriod (which the file leaves out or zero)`},
		{"iptables: {syncPeriod: 1ns, minSyncPeriod: 0s}\n",
			`field "iptables.syncPeriod" 1ns: must be at least 1s, the default value of iptables.minSyncPeriod (which the file leaves out or zero)`},
		{"mode: ipvs\nipvs: {syncPeriod: 1ns}\n", ""}, // ipvs.minSyncPeriod's default is 0
		{"mode: ipvs\nipvs: {minSyncPeriod: 1m}\n",
			`field "ipvs.minSyncPeriod" 1m0s: must be between 0 and ipvs.syncPeriod (30s, its default value)`},
		{"mode: iptables\niptables: {syncPeriod: 10s, minSyncPeriod: 20s}\n",
			`field "iptables.minSyncPeriod" 20s: must be between 0 and iptables.syncPeriod (10s)`},
	}
	for _, tt := range tests {
		config := writeConfig(t, tt.fields)
		_, _, err := loadArgs(t, "--config", config, "--hostname-override", "n")
		switch {
		case tt.want == "" && err != nil:
			t.Errorf("%q: got %v, want no error", tt.fields, err)
		case tt.want != "" && (err == nil || err.Error() != "--config "+config+": "+tt.want):
			t.Errorf("%q: got %v, want %q", tt.fields, err, "--config "+config+": "+tt.want)
		}
	}
	want := "--min-sync-period 1s: must be between 0 and --sync-period (1ns)"
	if _, _, err := loadArgs(t, "--sync-period", "1ns"); err == nil || err.Error() != want {
		t.Errorf("--sync-period 1ns: got %v, want %q", err, want)
	}
}
