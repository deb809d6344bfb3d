package app

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/netfilter/conntrack"
)

// conntrackOptions are kube-proxy's --conntrack-* flags, with its defaults.
type conntrackOptions struct {
	maxPerCore       int32
	min              int32
	tcpEstablished   time.Duration
	tcpCloseWait     time.Duration
	tcpBeLiberal     bool
	udpTimeout       time.Duration
	udpStreamTimeout time.Duration
}

func defaultConntrackOptions() conntrackOptions {
	return conntrackOptions{
		maxPerCore:     32 * 1024,
		min:            128 * 1024,
		tcpEstablished: 24 * time.Hour,
		tcpCloseWait:   time.Hour,
	}
}

func (c *conntrackOptions) addFlags(f *pflag.FlagSet) {
	f.Int32Var(&c.maxPerCore, "conntrack-max-per-core", c.maxPerCore, "size the machine's conntrack table (net.netfilter.nf_conntrack_max) at this many entries per CPU, at least --conntrack-min, at most 1048576; only a uproxy in the initial network namespace can, elsewhere it does not start (as kube-proxy); 0: leave the size as it is")
	f.Int32Var(&c.min, "conntrack-min", c.min, "least size of the conntrack table that --conntrack-max-per-core sets")
	f.DurationVar(&c.tcpEstablished, "conntrack-tcp-timeout-established", c.tcpEstablished, "set net.netfilter.nf_conntrack_tcp_timeout_established: how long an idle established TCP flow stays in the conntrack table (whole seconds); 0: leave it as it is")
	f.DurationVar(&c.tcpCloseWait, "conntrack-tcp-timeout-close-wait", c.tcpCloseWait, "set net.netfilter.nf_conntrack_tcp_timeout_close_wait: how long a TCP flow stays in the conntrack table after one side's FIN (whole seconds); 0: leave it as it is")
	f.BoolVar(&c.tcpBeLiberal, "conntrack-tcp-be-liberal", c.tcpBeLiberal, "set net.netfilter.nf_conntrack_tcp_be_liberal to 1: TCP packets outside the expected window are tracked instead of marked INVALID; false: leave it as it is")
	f.DurationVar(&c.udpTimeout, "conntrack-udp-timeout", c.udpTimeout, "set net.netfilter.nf_conntrack_udp_timeout: how long a UDP flow without a reply stays in the conntrack table (whole seconds); 0: leave it as it is")
	f.DurationVar(&c.udpStreamTimeout, "conntrack-udp-timeout-stream", c.udpStreamTimeout, "set net.netfilter.nf_conntrack_udp_timeout_stream: how long a UDP flow with replies stays in the conntrack table (whole seconds); 0: leave it as it is")
}

// sysctls checks the flags and gives the settings they stand for.
func (c *conntrackOptions) sysctls() (conntrack.Sysctls, error) {
	for _, n := range []struct {
		flag  string
		value int32
	}{{"--conntrack-max-per-core", c.maxPerCore}, {"--conntrack-min", c.min}} {
		if n.value < 0 {
			return conntrack.Sysctls{}, fmt.Errorf("%s %d: must not be negative (--conntrack-max-per-core 0: leave the table's size as it is)", n.flag, n.value)
		}
	}
	for _, d := range []struct {
		flag  string
		value time.Duration
	}{
		{"--conntrack-tcp-timeout-established", c.tcpEstablished},
		{"--conntrack-tcp-timeout-close-wait", c.tcpCloseWait},
		{"--conntrack-udp-timeout", c.udpTimeout},
		{"--conntrack-udp-timeout-stream", c.udpStreamTimeout},
	} {
		if d.value < 0 {
			return conntrack.Sysctls{}, fmt.Errorf("%s %v: must not be negative (0: leave the sysctl as it is)", d.flag, d.value)
		}
	}
	return conntrack.Sysctls{
		MaxPerCore:            int(c.maxPerCore),
		Min:                   int(c.min),
		TCPEstablishedTimeout: c.tcpEstablished,
		TCPCloseWaitTimeout:   c.tcpCloseWait,
		TCPBeLiberal:          c.tcpBeLiberal,
		UDPTimeout:            c.udpTimeout,
		UDPStreamTimeout:      c.udpStreamTimeout,
	}, nil
}

// conntrackFlags names the flag that asks for each setting, and the value of
// that flag that leaves the setting alone.
var conntrackFlags = map[string][2]string{
	conntrack.SysctlMax:                   {"conntrack-max-per-core", "0"},
	conntrack.HashSize:                    {"conntrack-max-per-core", "0"},
	conntrack.SysctlTCPTimeoutEstablished: {"conntrack-tcp-timeout-established", "0"},
	conntrack.SysctlTCPTimeoutCloseWait:   {"conntrack-tcp-timeout-close-wait", "0"},
	conntrack.SysctlTCPBeLiberal:          {"conntrack-tcp-be-liberal", "false"},
	conntrack.SysctlUDPTimeout:            {"conntrack-udp-timeout", "0"},
	conntrack.SysctlUDPTimeoutStream:      {"conntrack-udp-timeout-stream", "0"},
}

// setConntrackSysctls writes the conntrack sysctls, where they differ, as
// kube-proxy does at start in every mode, and logs each write. As in
// kube-proxy (v1.36), a setting that cannot be written stops the start: the
// error names, for each, its flag (or --config field), what stood in the way,
// and the value that leaves the setting alone. The table's size is the usual
// one: outside the initial network namespace, or with /proc/sys read-only, only
// --conntrack-max-per-core=0 starts (kube-proxy needs the same).
func (o *options) setConntrackSysctls(s conntrack.Sysctls) error {
	changes, err := s.Set()
	for _, c := range changes {
		klog.InfoS("Set a conntrack sysctl, as kube-proxy does", "sysctl", c.Key, "from", c.From, "to", c.To)
	}
	if err == nil {
		return nil
	}
	return o.conntrackError(err)
}

// conntrackError rewrites an error of conntrack.Sysctls.Set into the one the
// start fails with.
func (o *options) conntrackError(err error) error {
	errs := []error{err}
	if joined, ok := err.(interface{ Unwrap() []error }); ok {
		errs = joined.Unwrap()
	}
	var msgs []string
	for _, e := range errs {
		msg := e.Error()
		var se *conntrack.SysctlError
		if errors.As(e, &se) {
			flag := conntrackFlags[se.Key]
			name, keep := "--"+flag[0], "--"+flag[0]+"="+flag[1]
			if st, ok := o.configFields[flag[0]]; ok {
				name, keep = fmt.Sprintf("--config %s: field %q", o.configFile, st.Field), st.Field+": "+flag[1]
			}
			msg = fmt.Sprintf("%s: %s; %s leaves it as it is", name, msg, keep)
		}
		msgs = append(msgs, msg)
	}
	return fmt.Errorf("conntrack sysctls, which kube-proxy sets at start too: %s", strings.Join(msgs, "; "))
}
