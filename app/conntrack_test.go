package app

import (
	"errors"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/netfilter/conntrack"
)

// The conntrack sysctls come from kube-proxy's flags or from the conntrack
// section of its configuration file, with kube-proxy's defaults and its
// reading of a zero.
func TestConntrackSettings(t *testing.T) {
	kubeProxyDefaults := conntrack.Sysctls{MaxPerCore: 32768, Min: 131072, TCPEstablishedTimeout: 24 * time.Hour, TCPCloseWaitTimeout: time.Hour}
	every := conntrack.Sysctls{MaxPerCore: 65536, Min: 1000, TCPEstablishedTimeout: 2 * time.Hour, TCPCloseWaitTimeout: 30 * time.Minute,
		TCPBeLiberal: true, UDPTimeout: 45 * time.Second, UDPStreamTimeout: 3 * time.Minute}
	for _, tc := range []struct {
		name   string
		args   []string // "CONFIG" stands for a file holding config
		config string
		want   conntrack.Sysctls
	}{{
		name: "no flag: kube-proxy's defaults",
		want: kubeProxyDefaults,
	}, {
		name: "every flag",
		args: []string{"--conntrack-max-per-core=65536", "--conntrack-min=1000", "--conntrack-tcp-timeout-established=2h",
			"--conntrack-tcp-timeout-close-wait=30m", "--conntrack-tcp-be-liberal", "--conntrack-udp-timeout=45s", "--conntrack-udp-timeout-stream=3m"},
		want: every,
	}, {
		name: "zero flags leave the sysctls alone",
		args: []string{"--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0"},
		want: conntrack.Sysctls{Min: 131072},
	}, {
		name:   "every field of the file",
		args:   []string{"--config", "CONFIG"},
		config: "conntrack: {maxPerCore: 65536, min: 1000, tcpEstablishedTimeout: 2h, tcpCloseWaitTimeout: 30m, tcpBeLiberal: true, udpTimeout: 45s, udpStreamTimeout: 3m}\n",
		want:   every,
	}, {
		name:   "a file without the section: kube-proxy's defaults, whatever the flags",
		args:   []string{"--config", "CONFIG", "--conntrack-tcp-timeout-close-wait=5m", "--conntrack-max-per-core=0"},
		config: "mode: iptables\n",
		want:   kubeProxyDefaults,
	}, {
		// As kind writes it: null is the default, a zero leaves the sysctl alone.
		name:   "zero and null fields",
		args:   []string{"--config", "CONFIG"},
		config: "conntrack: {maxPerCore: 0, min: null, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: null, udpTimeout: 0s}\n",
		want:   conntrack.Sysctls{Min: 131072, TCPCloseWaitTimeout: time.Hour},
	}, {
		name: "kubeadm's file: kube-proxy's defaults",
		args: []string{"--config", filepath.Join(moduleRoot, "proxyconfig", "testdata", "kubeadm.conf")},
		want: kubeProxyDefaults,
	}} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"--hostname-override", "node-a"}, tc.args...)
			for i, a := range args {
				if a == "CONFIG" {
					args[i] = writeConfig(t, tc.config)
				}
			}
			_, c, err := loadArgs(t, args...)
			if err != nil {
				t.Fatalf("got error %v, want none", err)
			}
			if c.conntrack != tc.want {
				t.Errorf("got %+v, want %+v", c.conntrack, tc.want)
			}
		})
	}
}

// A negative value is refused naming its flag, or its field when the file
// set it.
func TestConntrackNegativeValues(t *testing.T) {
	for _, tc := range []struct {
		flag, field, value string
	}{
		{"--conntrack-max-per-core", "conntrack.maxPerCore", "-1"},
		{"--conntrack-min", "conntrack.min", "-1"},
		{"--conntrack-tcp-timeout-established", "conntrack.tcpEstablishedTimeout", "-1s"},
		{"--conntrack-tcp-timeout-close-wait", "conntrack.tcpCloseWaitTimeout", "-1h"},
		{"--conntrack-udp-timeout", "conntrack.udpTimeout", "-5s"},
		{"--conntrack-udp-timeout-stream", "conntrack.udpStreamTimeout", "-1m"},
	} {
		t.Run(tc.flag, func(t *testing.T) {
			_, _, err := loadArgs(t, tc.flag+"="+tc.value)
			if err == nil || !strings.HasPrefix(err.Error(), tc.flag+" ") || !strings.Contains(err.Error(), "must not be negative") {
				t.Errorf("%s=%s: got %v, want an error starting with %s saying it must not be negative", tc.flag, tc.value, err, tc.flag)
			}
			section, name, _ := strings.Cut(tc.field, ".")
			config := writeConfig(t, section+": {"+name+": "+tc.value+"}\n")
			_, _, err = loadArgs(t, "--config", config, "--hostname-override", "n")
			if err == nil || !strings.Contains(err.Error(), `field "`+tc.field+`"`) || !strings.Contains(err.Error(), config) {
				t.Errorf("%s: %s: got %v, want an error naming the file and the field", tc.field, tc.value, err)
			}
		})
	}
}

// A setting that cannot be written stops the start with an error naming its
// flag, or its field, and the value that leaves it alone.
func TestConntrackErrorNamesTheFlag(t *testing.T) {
	denied := &conntrack.SysctlError{Key: conntrack.SysctlMax, Value: 131072, Err: &fs.PathError{Op: "open", Path: "/proc/sys/net/netfilter/nf_conntrack_max", Err: unix.EACCES}}
	readOnly := &conntrack.SysctlError{Key: conntrack.SysctlTCPTimeoutCloseWait, Value: 3600, Err: unix.EROFS}
	err := errors.Join(denied, readOnly)

	o, _, lerr := loadArgs(t)
	if lerr != nil {
		t.Fatal(lerr)
	}
	got := o.conntrackError(err).Error()
	for _, want := range []string{
		"--conntrack-max-per-core: set net.netfilter.nf_conntrack_max to 131072",
		"--conntrack-max-per-core=0 leaves it as it is",
		"--conntrack-tcp-timeout-close-wait: set net.netfilter.nf_conntrack_tcp_timeout_close_wait to 3600",
		"--conntrack-tcp-timeout-close-wait=0 leaves it as it is",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("got %q, want it to contain %q", got, want)
		}
	}

	config := writeConfig(t, "mode: iptables\n")
	o, _, lerr = loadArgs(t, "--config", config, "--hostname-override", "n")
	if lerr != nil {
		t.Fatal(lerr)
	}
	got = o.conntrackError(denied).Error()
	for _, want := range []string{`--config ` + config + `: field "conntrack.maxPerCore": set net.netfilter.nf_conntrack_max`, "conntrack.maxPerCore: 0 leaves it as it is"} {
		if !strings.Contains(got, want) {
			t.Errorf("with --config: got %q, want it to contain %q", got, want)
		}
	}
}
