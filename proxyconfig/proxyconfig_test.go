package proxyconfig

import (
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

const header = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"

// defaults are the settings of a file that sets nothing mapped: kube-proxy's
// defaults, and the program's own for mode and ipvs.scheduler.
var defaults = map[string]string{
	"bindAddress":                     "--bind-address=0.0.0.0",
	"clientConnection.burst":          "--kube-api-burst=10",
	"clientConnection.contentType":    "--kube-api-content-type=application/vnd.kubernetes.protobuf",
	"clientConnection.kubeconfig":     "--kubeconfig=",
	"clientConnection.qps":            "--kube-api-qps=5",
	"clusterCIDR":                     "--cluster-cidr=",
	"configSyncPeriod":                "--config-sync-period=15m0s",
	"conntrack.maxPerCore":            "--conntrack-max-per-core=32768",
	"conntrack.min":                   "--conntrack-min=131072",
	"conntrack.tcpBeLiberal":          "--conntrack-tcp-be-liberal=false",
	"conntrack.tcpCloseWaitTimeout":   "--conntrack-tcp-timeout-close-wait=1h0m0s",
	"conntrack.tcpEstablishedTimeout": "--conntrack-tcp-timeout-established=24h0m0s",
	"conntrack.udpStreamTimeout":      "--conntrack-udp-timeout-stream=0s",
	"conntrack.udpTimeout":            "--conntrack-udp-timeout=0s",
	"enableProfiling":                 "--profiling=false",
	"healthzBindAddress":              "--healthz-bind-address=0.0.0.0:10256",
	"hostnameOverride":                "--hostname-override=",
	"iptables.localhostNodePorts":     "--iptables-localhost-nodeports=true",
	"iptables.masqueradeAll":          "--masquerade-all=false",
	"iptables.minSyncPeriod":          "--min-sync-period=1s",
	"iptables.syncPeriod":             "--sync-period=30s",
	"ipvs.scheduler":                  "--scheduler (default)",
	"metricsBindAddress":              "--metrics-bind-address=127.0.0.1:10249",
	"mode":                            "--proxy-mode (default)",
	"nodePortAddresses":               "--nodeport-addresses=",
	"portRange":                       "--proxy-port-range=",
	"udpIdleTimeout":                  "--udp-timeout (default)",
}

// settings renders defaults with changes applied (an empty value deletes),
// ordered by field, as Parse returns them.
func settings(changes map[string]string) []string {
	m := maps.Clone(defaults)
	for k, v := range changes {
		if v == "" {
			delete(m, k)
		} else {
			m[k] = v
		}
	}
	var out []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		out = append(out, k+" -> "+m[k])
	}
	return out
}

func TestParse(t *testing.T) {
	kubeadm, err := os.ReadFile(filepath.Join("testdata", "kubeadm.conf"))
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name        string
		doc         string
		want        []string // Setting.String()
		wantIgnored []string
	}{{
		name: "every mapped field",
		doc: header + `
bindAddress: 127.0.0.1
healthzBindAddress: 0.0.0.0:10256
metricsBindAddress: 127.0.0.1:10249
clientConnection: {kubeconfig: /var/lib/kube-proxy/kubeconfig.conf, qps: 50, burst: 100, contentType: application/json}
hostnameOverride: node-1
mode: iptables
nodePortAddresses: [10.0.0.0/8, 192.168.0.0/16]
iptables: {syncPeriod: 20s, minSyncPeriod: 2s, masqueradeAll: true}
ipvs: {scheduler: lc}
udpIdleTimeout: 300ms
portRange: 30000-31000
configSyncPeriod: 10m
clusterCIDR: 10.244.0.0/16,fd00:10:244::/56
conntrack: {maxPerCore: 65536, min: 1000, tcpEstablishedTimeout: 2h, tcpCloseWaitTimeout: 30m, tcpBeLiberal: true, udpTimeout: 45s, udpStreamTimeout: 3m}
enableProfiling: true
`,
		want: []string{
			"bindAddress -> --bind-address=127.0.0.1",
			"clientConnection.burst -> --kube-api-burst=100",
			"clientConnection.contentType -> --kube-api-content-type=application/json",
			"clientConnection.kubeconfig -> --kubeconfig=/var/lib/kube-proxy/kubeconfig.conf",
			"clientConnection.qps -> --kube-api-qps=50",
			"clusterCIDR -> --cluster-cidr=10.244.0.0/16,fd00:10:244::/56",
			"configSyncPeriod -> --config-sync-period=10m0s",
			"conntrack.maxPerCore -> --conntrack-max-per-core=65536",
			"conntrack.min -> --conntrack-min=1000",
			"conntrack.tcpBeLiberal -> --conntrack-tcp-be-liberal=true",
			"conntrack.tcpCloseWaitTimeout -> --conntrack-tcp-timeout-close-wait=30m0s",
			"conntrack.tcpEstablishedTimeout -> --conntrack-tcp-timeout-established=2h0m0s",
			"conntrack.udpStreamTimeout -> --conntrack-udp-timeout-stream=3m0s",
			"conntrack.udpTimeout -> --conntrack-udp-timeout=45s",
			"enableProfiling -> --profiling=true",
			"healthzBindAddress -> --healthz-bind-address=0.0.0.0:10256",
			"hostnameOverride -> --hostname-override=node-1",
			"iptables.localhostNodePorts -> --iptables-localhost-nodeports=true",
			"iptables.masqueradeAll -> --masquerade-all=true",
			"iptables.minSyncPeriod -> --min-sync-period=2s",
			"iptables.syncPeriod -> --sync-period=20s",
			"ipvs.scheduler -> --scheduler=lc",
			"metricsBindAddress -> --metrics-bind-address=127.0.0.1:10249",
			"mode -> --proxy-mode=iptables",
			"nodePortAddresses -> --nodeport-addresses=10.0.0.0/8,192.168.0.0/16",
			"portRange -> --proxy-port-range=30000-31000",
			"udpIdleTimeout -> --udp-timeout=300ms",
		},
	}, {
		name: "nothing mapped: kube-proxy's defaults",
		doc:  header,
		want: settings(nil),
	}, {
		// kubeadm writes every field, zero unless it knows better; kube-proxy
		// reads each zero as its default.
		name: "kubeadm's file",
		doc:  string(kubeadm),
		want: settings(map[string]string{
			"clientConnection.kubeconfig": "--kubeconfig=/var/lib/kube-proxy/kubeconfig.conf",
			"clusterCIDR":                 "--cluster-cidr=10.244.0.0/16",
		}),
	}, {
		// kube-proxy's IPVS mode takes masqueradeAll from the iptables section.
		name: "sync periods come from the mode's section",
		doc:  header + "mode: ipvs\niptables: {syncPeriod: 30s, masqueradeAll: true}\nipvs: {syncPeriod: 10s, minSyncPeriod: 0s}\n",
		want: settings(map[string]string{
			"iptables.masqueradeAll": "--masquerade-all=true",
			"iptables.minSyncPeriod": "", "iptables.syncPeriod": "", "iptables.localhostNodePorts": "",
			"ipvs.minSyncPeriod": "--min-sync-period=0s",
			"ipvs.syncPeriod":    "--sync-period=10s",
			"mode":               "--proxy-mode=ipvs",
		}),
		wantIgnored: []string{"iptables.syncPeriod"},
	}, {
		// ipvs.minSyncPeriod has no default: zero is no minimum.
		name: "zero sync periods of the ipvs section",
		doc:  header + "mode: ipvs\nipvs: {syncPeriod: 0s}\n",
		want: settings(map[string]string{
			"iptables.minSyncPeriod": "", "iptables.syncPeriod": "", "iptables.localhostNodePorts": "",
			"ipvs.minSyncPeriod": "--min-sync-period=0s",
			"ipvs.syncPeriod":    "--sync-period=30s",
			"mode":               "--proxy-mode=ipvs",
		}),
	}, {
		// and the iptables section's masqueradeAll is not the nftables mode's.
		name: "zero sync periods of the nftables section",
		doc:  header + "mode: nftables\niptables: {masqueradeAll: true, localhostNodePorts: true}\nnftables: {syncPeriod: 0s, minSyncPeriod: 0s, masqueradeAll: true}\n",
		want: settings(map[string]string{
			"iptables.minSyncPeriod": "", "iptables.syncPeriod": "", "iptables.masqueradeAll": "", "iptables.localhostNodePorts": "",
			"nftables.masqueradeAll": "--masquerade-all=true",
			"nftables.minSyncPeriod": "--min-sync-period=1s",
			"nftables.syncPeriod":    "--sync-period=30s",
			"mode":                   "--proxy-mode=nftables",
		}),
		wantIgnored: []string{"iptables.localhostNodePorts", "iptables.masqueradeAll"},
	}, {
		// kube-proxy's *bool: left out or null is true, false is false.
		name: "iptables.localhostNodePorts false, and nodePortAddresses primary",
		doc:  header + "iptables: {localhostNodePorts: false}\nnodePortAddresses: [primary]\n",
		want: settings(map[string]string{
			"iptables.localhostNodePorts": "--iptables-localhost-nodeports=false",
			"nodePortAddresses":           "--nodeport-addresses=primary",
		}),
	}, {
		name: "iptables.localhostNodePorts null is true",
		doc:  header + "iptables: {localhostNodePorts: null}\n",
		want: settings(nil),
	}, {
		name: "an IPv6 bindAddress makes the servers' default addresses IPv6",
		doc:  header + "bindAddress: '::'\n",
		want: settings(map[string]string{
			"bindAddress":        "--bind-address=::",
			"healthzBindAddress": "--healthz-bind-address=[::]:10256",
			"metricsBindAddress": "--metrics-bind-address=[::1]:10249",
		}),
	}, {
		name: "a bind address without a port gets kube-proxy's",
		doc:  header + "healthzBindAddress: 10.0.0.1\nmetricsBindAddress: 'fd00::1'\n",
		want: settings(map[string]string{
			"healthzBindAddress": "--healthz-bind-address=10.0.0.1:10256",
			"metricsBindAddress": "--metrics-bind-address=[fd00::1]:10249",
		}),
	}, {
		name:        "kube-proxy fields uproxy does not use are reported when set",
		doc:         header + "iptables: {masqueradeBit: 14, masqueradeAll: false}\nfeatureGates: {SomeGate: true}\nclusterCIDR: \"\"\n",
		want:        settings(nil),
		wantIgnored: []string{"featureGates", "iptables.masqueradeBit"},
	}, {
		// kube-proxy's pointer fields: left out or null, the default; zero,
		// zero (leave the sysctl alone), as kind and usernetes write them.
		name: "conntrack: null is the default, zero is zero",
		doc:  header + "conntrack: {maxPerCore: 0, min: null, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: null, tcpBeLiberal: false, udpTimeout: 0s}\n",
		want: settings(map[string]string{
			"conntrack.maxPerCore":            "--conntrack-max-per-core=0",
			"conntrack.tcpEstablishedTimeout": "--conntrack-tcp-timeout-established=0s",
		}),
	}, {
		name: "conntrack: a zero minimum is zero",
		doc:  header + "conntrack: {min: 0}\n",
		want: settings(map[string]string{"conntrack.min": "--conntrack-min=0"}),
	}, {
		name: "JSON and nulls",
		doc:  `{"apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration", "bindAddress": null, "hostnameOverride": "n"}`,
		want: settings(map[string]string{"hostnameOverride": "--hostname-override=n"}),
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			settings, ignored, err := Parse([]byte(tt.doc))
			if err != nil {
				t.Fatalf("got error %v, want none", err)
			}
			var got []string
			for _, s := range settings {
				got = append(got, s.String())
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("got settings\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(tt.want, "\n"))
			}
			if !slices.Equal(ignored, tt.wantIgnored) {
				t.Errorf("got ignored %q, want %q", ignored, tt.wantIgnored)
			}
		})
	}
}

func TestParseErrors(t *testing.T) {
	tests := []struct {
		name, doc, want string
	}{
		{"unknown top-level field", header + "bindAdress: 1.2.3.4\n", `unknown field "bindAdress"`},
		{"unknown nested field", header + "ipvs: {schedular: rr}\n", `unknown field "ipvs.schedular"`},
		{"wrong kind", "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration\n", "want kubeproxy.config.k8s.io/v1alpha1, KubeProxyConfiguration"},
		{"wrong version", "apiVersion: kubeproxy.config.k8s.io/v1alpha2\nkind: KubeProxyConfiguration\n", "want kubeproxy.config.k8s.io/v1alpha1"},
		{"duplicate key", header + "bindAddress: 1.2.3.4\nbindAddress: 1.2.3.5\n", "bindAddress"},
		{"bad duration", header + "iptables: {syncPeriod: 30}\n", `field "iptables.syncPeriod": want a duration`},
		{"unparsable duration", header + "iptables: {syncPeriod: soon}\n", `field "iptables.syncPeriod"`},
		{"number as string", header + "clientConnection: {qps: fast}\n", `field "clientConnection.qps": want a number`},
		{"list of numbers", header + "nodePortAddresses: [1]\n", `field "nodePortAddresses"[0]: want a string`},
		{"boolean as string", header + "nftables: {masqueradeAll: \"yes\"}\nmode: nftables\n", `field "nftables.masqueradeAll": want true or false`},
		{"object expected", header + "ipvs: rr\n", `field "ipvs": want an object`},
		{"bind address neither IP nor IP:PORT", header + "metricsBindAddress: localhost\n", `field "metricsBindAddress": "localhost" is neither IP:PORT nor an IP address`},
		{"not YAML", "{", "parse"},
		{"a second document", header + "mode: iptables\n---\n" + header + "mode: ipvs\n",
			"more than one YAML document: the file must hold one KubeProxyConfiguration"},
		{"a second document, not YAML", header + "---\n: : [\n",
			"more than one YAML document (document 2 does not parse as YAML): the file must hold one KubeProxyConfiguration"},
		{"a second document after an empty one", header + "---\n---\nmode: ipvs\n", "more than one YAML document"},
		{"JSON, then another object", `{"apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration"}` + "\n{}\n", "more than one YAML document"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, _, err := Parse([]byte(tt.doc))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("got error %v, want one containing %q", err, tt.want)
			}
		})
	}
}

// TestLoadNamesTheFile: every error begins with the file, and names it
// there only.
// Defaulted tells a value the file asks for from kube-proxy's default for a
// field it leaves out or zero; a pointer field's zero is a value.
func TestParseDefaulted(t *testing.T) {
	settings, _, err := Parse([]byte(header + "iptables: {syncPeriod: 10s, minSyncPeriod: 0s}\nconntrack: {maxPerCore: 0}\n"))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]bool{
		"iptables.syncPeriod":    false,
		"iptables.minSyncPeriod": true,
		"conntrack.maxPerCore":   false,
		"conntrack.min":          true,
	}
	for _, st := range settings {
		if d, ok := want[st.Field]; ok && st.Defaulted != d {
			t.Errorf("%s: got Defaulted %v, want %v", st, st.Defaulted, d)
		}
	}
}

// A document that holds nothing after the configuration (a trailing "---",
// comments) is no second one.
func TestParseTakesAnEmptyLastDocument(t *testing.T) {
	for _, doc := range []string{
		"---\n" + header,
		header + "---\n",
		header + "--- # end\n# nothing more\n",
		header + "...\n",
	} {
		if _, _, err := Parse([]byte(doc)); err != nil {
			t.Errorf("%q: got error %v, want none", doc, err)
		}
	}
}

func TestLoadNamesTheFile(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "config.conf")
	if err := os.WriteFile(path, []byte(header+"oops: 1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	absent := filepath.Join(t.TempDir(), "absent")
	for path, want := range map[string]string{
		path:   path + `: unknown field "oops"`,
		absent: absent + ": no such file or directory",
	} {
		_, _, err := Load(path)
		if err == nil || err.Error() != want {
			t.Errorf("Load(%s): got %v, want %q", path, err, want)
		}
	}
}

// TestLoadRefusesWhatItCannotReadSafely: a named pipe would block the open
// until a writer comes, and a device or a huge file would fill the memory;
// each is refused with an error naming the file (and the limit).
func TestLoadRefusesWhatItCannotReadSafely(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo.conf")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	zero := filepath.Join(dir, "zero.conf")
	if err := os.Symlink("/dev/zero", zero); err != nil {
		t.Fatal(err)
	}
	large := filepath.Join(dir, "large.conf")
	if err := os.WriteFile(large, []byte(header+"# "+strings.Repeat("x", MaxFileSize)+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, path string
		want       []string
	}{
		{"named pipe", fifo, []string{fifo + ": not a regular file (a named pipe)"}},
		{"link to /dev/zero", zero, []string{zero + ": not a regular file (a character device)"}},
		{"larger than the limit", large, []string{large + ": larger than the limit of 4 MiB"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			done := make(chan error, 1)
			go func() {
				_, _, err := Load(tt.path)
				done <- err
			}()
			select {
			case err := <-done:
				for _, want := range tt.want {
					if err == nil || !strings.Contains(err.Error(), want) {
						t.Errorf("got error %v, want one containing %q", err, want)
					}
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("Load(%s) still blocked after 10s, want an error", tt.path)
			}
		})
	}
}
