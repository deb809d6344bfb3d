package integration

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// TestFlagsRefusedAtStart: a flag that would be accepted and then ignored, or
// fail only later, is refused at start with an error naming it, before
// anything is logged or any rule touched.
func TestFlagsRefusedAtStart(t *testing.T) {
	tp := testbed.New(t, testbed.WithIPv6())
	dir := t.TempDir()
	before := tp.SavedRules(t, false)
	quiet := []string{"--metrics-bind-address", "127.0.0.1:0", "--healthz-bind-address", ""}
	for _, tc := range []struct {
		args []string
		want []string // the error starts with the first
	}{
		{[]string{"--services", dir, "--rules", "none", "--bind-address", "10.9.9.9"}, []string{"--bind-address 10.9.9.9: not an address of this node"}},
		{[]string{"--services", dir, "--rules", "none", "--bind-address", "fe80::1"}, []string{"--bind-address fe80::1: a link-local address needs its interface"}},
		{[]string{"--services", "/nonexistent", "--rules", "none"}, []string{"--services /nonexistent: no such file or directory"}},
		{[]string{"--services", dir, "--kubeconfig", "/etc/kubeconfig"}, []string{`--kubeconfig "/etc/kubeconfig": the Services come from --services`}},
		{[]string{"--services", dir, "--master", "https://10.0.0.1:6443"}, []string{`--master "https://10.0.0.1:6443": the Services come from --services`}},
		{[]string{"--services", dir, "--service-proxy-name", "uproxy"}, []string{`--service-proxy-name "uproxy": the Services come from --services`}},
		{[]string{"--services", dir, "--tcp-keepalive", "1500ms"}, []string{"--tcp-keepalive 1.5s: want whole seconds"}},
		{[]string{"--services", dir, "--proxy-mode", "iptables", "--rules", "nftables", "--scheduler", "sh", "--dial-timeouts", "1s", "--retry-budget", "10"},
			[]string{"--rules: the iptables mode does not use it (the userspace mode does)", "--dial-timeouts: the iptables mode", "--retry-budget: the iptables mode"}},
		{[]string{"--services", dir, "--proxy-mode", "nftables", "--events", "10"}, []string{"--events: the nftables mode does not use it"}},
	} {
		name := strings.Join(tc.args[2:], " ")
		// A start that is not refused runs on: timeout ends it (exit 124).
		out, err := tp.Exec(testbed.Node, append(append([]string{"timeout", "10", uproxyBin}, tc.args...), quiet...)...)
		if code := exitCode(err); code == 0 || code == -1 || code == 124 {
			t.Errorf("%s: exit %d (%v), want a refusal; output:\n%s", name, code, err, tail(string(out), 10))
			continue
		}
		msg := string(out)
		if !strings.Contains(msg, "uproxy: "+tc.want[0]) {
			t.Errorf("%s: output lacks the error %q:\n%s", name, "uproxy: "+tc.want[0], msg)
		}
		for _, w := range tc.want[1:] {
			if !strings.Contains(msg, w) {
				t.Errorf("%s: output lacks %q:\n%s", name, w, msg)
			}
		}
		if strings.Contains(msg, "Starting uproxy") {
			t.Errorf("%s: uproxy logged its start before the refusal:\n%s", name, msg)
		}
		if strings.Contains(name, "--scheduler") && strings.Contains(msg, "--scheduler:") {
			t.Errorf("%s: --scheduler refused; kube-proxy takes its scheduler in every mode (want a warning):\n%s", name, msg)
		}
	}
	if got := tp.SavedRules(t, false); got != before {
		t.Errorf("iptables-save after the refused starts:\n%s\nwant as before:\n%s", got, before)
	}
}

// TestFlagOfAnotherModeWarnedOnce: a flag that kube-proxy takes in every mode,
// given to a mode that does not use it, is warned of once, naming it, and the
// start line names only what the mode uses.
func TestFlagOfAnotherModeWarnedOnce(t *testing.T) {
	tp := testbed.New(t)
	px := runUproxy(t, tp, webService(t, tp), launch{want: -1, flags: []string{"--proxy-mode", "iptables", "--scheduler", "sh"}})
	log := px.logText()
	want := `"Ignoring a flag the proxy mode does not use" flag="--scheduler" mode="iptables"`
	if n := strings.Count(log, want); n != 1 {
		t.Errorf("log has %q %d times, want once:\n%s", want, n, tail(log, 30))
	}
	for _, line := range strings.Split(log, "\n") {
		if strings.Contains(line, `"Starting uproxy"`) && (strings.Contains(line, "scheduler=") || strings.Contains(line, "rules=")) {
			t.Errorf("start line of the iptables mode names a scheduler or portal rules: %s", line)
		}
	}
}

// TestEventsZeroKeepsNone: --events 0 keeps no event (connections are not
// recorded), where it used to mean the default of 256.
func TestEventsZeroKeepsNone(t *testing.T) {
	for _, tc := range []struct {
		flags    []string
		wantNone bool
	}{{[]string{"--events", "0"}, true}, {nil, false}} {
		t.Run(strings.Join(append([]string{"flags"}, tc.flags...), " "), func(t *testing.T) {
			tp := testbed.New(t)
			px := startProxy(t, tp, webService(t, tp), 1, tc.flags...)
			if name, err := whoTCP(tp, testbed.Pod, "10.96.0.10:80"); err != nil || !strings.HasPrefix(name, "web-") {
				t.Fatalf("through the proxy: got %q (%v), want a web backend", name, err)
			}
			var got struct{ Events []json.RawMessage }
			testbed.Await(t, 5*time.Second, "the connection's end", func() bool {
				body, err := px.get("/debug/events")
				if err != nil || json.Unmarshal([]byte(body), &got) != nil {
					return false
				}
				return tc.wantNone || len(got.Events) > 0
			})
			if tc.wantNone && len(got.Events) != 0 {
				t.Errorf("/debug/events with --events 0: got %d events, want none", len(got.Events))
			}
		})
	}
}
