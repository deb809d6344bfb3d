package integration

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/test/testbed"
)

// nodeSysctl reads a sysctl in the node namespace.
func nodeSysctl(t *testing.T, tp *testbed.Topology, key string) string {
	t.Helper()
	out, err := tp.Exec(testbed.Node, "cat", "/proc/sys/"+strings.ReplaceAll(key, ".", "/"))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(out))
}

const (
	closeWait   = "net.netfilter.nf_conntrack_tcp_timeout_close_wait"
	established = "net.netfilter.nf_conntrack_tcp_timeout_established"
	beLiberal   = "net.netfilter.nf_conntrack_tcp_be_liberal"
	udpTimeout  = "net.netfilter.nf_conntrack_udp_timeout"
	udpStream   = "net.netfilter.nf_conntrack_udp_timeout_stream"
	tableSize   = "net.netfilter.nf_conntrack_max"
)

// checkSysctls compares the node namespace's sysctls with want.
func checkSysctls(t *testing.T, tp *testbed.Topology, want map[string]string) {
	t.Helper()
	for key, v := range want {
		if got := nodeSysctl(t, tp, key); got != v {
			t.Errorf("%s in the node namespace: got %s, want %s", key, got, v)
		}
	}
}

// TestConntrackSysctls runs uproxy in the node namespace of a topology and
// reads the conntrack sysctls back there: every mode that programs rules sets
// them at start as kube-proxy does, with kube-proxy's defaults, its flags or
// its configuration file, and upstream's e2e check ("KubeProxy should set TCP
// CLOSE_WAIT timeout") holds: a TCP flow in CLOSE_WAIT through the node lives
// an hour. The userspace mode without rules sets none, and the table's size,
// which no namespace but the initial one may set, stops the start naming the
// flag, as it stops kube-proxy's.
func TestConntrackSysctls(t *testing.T) {
	testbed.Needs(t, testbed.Netns)

	t.Run("userspace mode with portals: kube-proxy's defaults", func(t *testing.T) {
		tp := testbed.New(t)
		px := startProxy(t, tp, webService(t, tp), 1)
		checkSysctls(t, tp, map[string]string{closeWait: "3600", established: "86400"})
		if !strings.Contains(px.logText(), "Set a conntrack sysctl") {
			t.Errorf("uproxy's log does not say what it set")
		}
		if got := closeWaitTimeout(t, tp); got > time.Hour || got < time.Hour-time.Minute {
			t.Errorf("timeout of a TCP flow in CLOSE_WAIT: got %v, want about an hour (at most 3600s)", got)
		}
	})

	t.Run("iptables mode: the flags", func(t *testing.T) {
		tp := testbed.New(t)
		unchanged := nodeSysctl(t, tp, established)
		runUproxy(t, tp, webService(t, tp), launch{want: -1, flags: []string{"--proxy-mode", "iptables",
			"--conntrack-tcp-timeout-close-wait=2h", "--conntrack-tcp-timeout-established=0", "--conntrack-tcp-be-liberal",
			"--conntrack-udp-timeout=45s", "--conntrack-udp-timeout-stream=3m"}})
		checkSysctls(t, tp, map[string]string{closeWait: "7200", established: unchanged, beLiberal: "1", udpTimeout: "45", udpStream: "180"})
	})

	t.Run("nftables mode: the configuration file", func(t *testing.T) {
		testbed.Needs(t, testbed.NFTables)
		tp := testbed.New(t)
		config := writeTestFile(t, "config.conf", "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\n"+
			"conntrack: {maxPerCore: 0, tcpCloseWaitTimeout: 90m, udpTimeout: 40s}\n")
		runUproxy(t, tp, webService(t, tp), launch{want: -1, flags: []string{"--config", config}})
		checkSysctls(t, tp, map[string]string{closeWait: "5400", established: "86400", udpTimeout: "40"})
	})

	t.Run("userspace mode without rules: left alone", func(t *testing.T) {
		tp := testbed.New(t)
		before := map[string]string{closeWait: nodeSysctl(t, tp, closeWait), established: nodeSysctl(t, tp, established)}
		px := startProxy(t, tp, webService(t, tp), 1, "--rules", "none")
		checkSysctls(t, tp, before)
		if strings.Contains(px.logText(), "Set a conntrack sysctl") {
			t.Errorf("uproxy with --rules none logged a conntrack sysctl it set")
		}
	})

	t.Run("the table's size outside the initial namespace", func(t *testing.T) {
		tp := testbed.New(t)
		machine := readTableSize(t)
		t.Cleanup(func() {
			// Were the kernel ever to let a namespace write it, put it back.
			if now := readTableSize(t); now != machine {
				os.WriteFile("/proc/sys/net/netfilter/nf_conntrack_max", []byte(strconv.Itoa(machine)), 0)
				t.Errorf("the machine's nf_conntrack_max changed from %d to %d", machine, now)
			}
		})
		rulesBefore := tp.SavedRules(t, false)
		want := machine + 1 // never the size already in place
		ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, "ip", "netns", "exec", tp.NS(testbed.Node).Name, uproxyBin, "--services", t.TempDir(), "--rules", "iptables",
			"--conntrack-max-per-core=1", "--conntrack-min="+strconv.Itoa(want),
			"--metrics-bind-address", "127.0.0.1:0", "--healthz-bind-address", "")
		out, err := cmd.CombinedOutput()
		if ctx.Err() != nil {
			t.Fatalf("uproxy sizing the table from a network namespace: still running after 20s, want a refusal; output:\n%s", out)
		}
		if err == nil {
			t.Fatalf("uproxy sizing the table from a network namespace: exit 0, want a refusal; output:\n%s", out)
		}
		for _, s := range []string{
			fmt.Sprintf("--conntrack-max-per-core: set %s to %d", tableSize, want),
			"only the initial one may change it",
			"--conntrack-max-per-core=0 leaves it as it is",
		} {
			if !strings.Contains(string(out), s) {
				t.Errorf("output lacks %q:\n%s", s, out)
			}
		}
		if got := tp.SavedRules(t, false); got != rulesBefore {
			t.Errorf("rules after the refused start:\n%s\nwant as before:\n%s", got, rulesBefore)
		}
	})
}

func readTableSize(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile("/proc/sys/net/netfilter/nf_conntrack_max")
	if err != nil {
		t.Fatal(err)
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// writeTestFile writes content to a file of the test and returns its path.
func writeTestFile(t *testing.T, name, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// closeWaitTimeout makes a TCP flow from the pod to the external host, through
// the node, whose server end closes while the client keeps its end open, as
// upstream's e2e test does, and returns the timeout of its conntrack entry in
// the node namespace once conntrack has it in CLOSE_WAIT.
func closeWaitTimeout(t *testing.T, tp *testbed.Topology) time.Duration {
	t.Helper()
	ext := tp.NS(testbed.External)
	ln := tp.Listen(testbed.External, "tcp", ext.IPv4.String()+":0")
	server := netip.MustParseAddrPort(ln.Addr().String())
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			close(accepted)
			return
		}
		accepted <- c
	}()
	client, err := tp.Dial(testbed.Pod, "tcp", server.String())
	if err != nil {
		t.Fatalf("dial %s from the pod: %v", server, err)
	}
	defer client.Close()
	c, ok := <-accepted
	if !ok {
		t.Fatal("accept failed")
	}
	defer c.Close()
	// The server's FIN, acknowledged by the client that stays open.
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}

	var timeout time.Duration
	var last []string
	testbed.Await(t, 10*time.Second, "a conntrack entry in CLOSE_WAIT to "+server.String(), func() bool {
		last = last[:0]
		err := tp.Run(testbed.Node, func() error {
			flows, err := netlink.ConntrackTableList(netlink.ConntrackTable, unix.AF_INET)
			if err != nil {
				return err
			}
			for _, f := range flows {
				dst, _ := netip.AddrFromSlice(f.Forward.DstIP)
				if f.Forward.Protocol != unix.IPPROTO_TCP || netip.AddrPortFrom(dst.Unmap(), f.Forward.DstPort) != server {
					continue
				}
				last = append(last, f.String())
				if info, ok := f.ProtoInfo.(*netlink.ProtoInfoTCP); ok && info.State == nl.TCP_CONNTRACK_CLOSE_WAIT {
					timeout = time.Duration(f.TimeOut) * time.Second
				}
			}
			return nil
		})
		if err != nil {
			t.Fatalf("list the node's conntrack entries: %v", err)
		}
		return timeout != 0
	})
	return timeout
}
