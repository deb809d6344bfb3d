package integration

import (
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/kernelmodes"
	"github.com/uproxy/uproxy/test/testbed"
)

// kubeProxyState gives the node kube-proxy-like state: the chains its iptables
// mode makes (both families, with its jumps from the built-in chains) and the
// tables of its nftables mode.
func kubeProxyState(t *testing.T, tp *testbed.Topology) {
	t.Helper()
	for _, cmd := range []string{"iptables", "ip6tables"} {
		vip, ep := "10.96.0.1/32", "10.0.0.1:6443"
		if cmd == "ip6tables" {
			vip, ep = "fd00:96::1/128", "[fd00::1]:6443"
		}
		for _, args := range [][]string{
			{"-t", "nat", "-N", "KUBE-SERVICES"},
			{"-t", "nat", "-N", "KUBE-NODEPORTS"},
			{"-t", "nat", "-N", "KUBE-POSTROUTING"},
			{"-t", "nat", "-N", "KUBE-MARK-MASQ"},
			{"-t", "nat", "-N", "KUBE-SVC-NPX46M4PTMTKRN6Y"},
			{"-t", "nat", "-N", "KUBE-SEP-IT2ZTR26TO4XFPTO"},
			{"-t", "nat", "-A", "KUBE-MARK-MASQ", "-j", "MARK", "--or-mark", "0x4000"},
			{"-t", "nat", "-A", "KUBE-POSTROUTING", "-m", "mark", "--mark", "0x4000/0x4000", "-j", "MASQUERADE"},
			{"-t", "nat", "-A", "KUBE-SERVICES", "-d", vip, "-p", "tcp", "--dport", "443", "-j", "KUBE-SVC-NPX46M4PTMTKRN6Y"},
			{"-t", "nat", "-A", "KUBE-SERVICES", "-m", "addrtype", "--dst-type", "LOCAL", "-j", "KUBE-NODEPORTS"},
			{"-t", "nat", "-A", "KUBE-SVC-NPX46M4PTMTKRN6Y", "-j", "KUBE-SEP-IT2ZTR26TO4XFPTO"},
			{"-t", "nat", "-A", "KUBE-SEP-IT2ZTR26TO4XFPTO", "-p", "tcp", "-j", "DNAT", "--to-destination", ep},
			{"-t", "nat", "-I", "PREROUTING", "-j", "KUBE-SERVICES"},
			{"-t", "nat", "-I", "OUTPUT", "-j", "KUBE-SERVICES"},
			{"-t", "nat", "-I", "POSTROUTING", "-j", "KUBE-POSTROUTING"},
			{"-t", "filter", "-N", "KUBE-FIREWALL"},
			{"-t", "filter", "-N", "KUBE-FORWARD"},
			{"-t", "filter", "-N", "KUBE-SERVICES"},
			{"-t", "filter", "-N", "KUBE-PROXY-FIREWALL"},
			{"-t", "filter", "-I", "INPUT", "-j", "KUBE-FIREWALL"},
			{"-t", "filter", "-I", "FORWARD", "-j", "KUBE-FORWARD"},
			{"-t", "filter", "-I", "OUTPUT", "-j", "KUBE-SERVICES"},
		} {
			if out, err := tp.Exec(testbed.Node, append([]string{cmd}, args...)...); err != nil {
				t.Fatalf("%s %v: %v: %s", cmd, args, err, out)
			}
		}
	}
	for _, family := range []string{"ip", "ip6"} {
		for _, args := range [][]string{
			{"add", "table", family, "kube-proxy"},
			{"add", "chain", family, "kube-proxy", "nat-prerouting", "{ type nat hook prerouting priority -100 ; }"},
			{"add", "chain", family, "kube-proxy", "services"},
			{"add", "rule", family, "kube-proxy", "nat-prerouting", "jump", "services"},
		} {
			if out, err := tp.Exec(testbed.Node, append([]string{"nft"}, args...)...); err != nil {
				t.Fatalf("nft %v: %v: %s", args, err, out)
			}
		}
	}
}

// exitCode is the exit code of a command run by tp.Exec (0 without error, -1
// when it did not run to an exit).
func exitCode(err error) int {
	var ee *exec.ExitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ee):
		return ee.ExitCode()
	}
	return -1
}

// TestCleanupRefusesKubeProxysPrefix: `uproxy cleanup --chain-prefix KUBE`
// (in any case) and `uproxy --cleanup --chain-prefix KUBE` are refused, with a
// non-zero exit and an error naming the flag, before they touch anything:
// kube-proxy's chains and jumps, in both families, and its nftables tables stay
// exactly as they were.
func TestCleanupRefusesKubeProxysPrefix(t *testing.T) {
	tp := testbed.New(t, testbed.WithIPv6())
	testbed.Needs(t, testbed.IPTables, testbed.NFTables)
	kubeProxyState(t, tp)
	before4, before6, beforeNFT := tp.SavedRules(t, false), tp.SavedRules(t, true), tp.NFTRuleset(t)
	for _, want := range []string{"KUBE-SERVICES", "KUBE-MARK-MASQ", "-A PREROUTING -j KUBE-SERVICES"} {
		if !strings.Contains(before4, want) {
			t.Fatalf("iptables-save lacks %q before the test:\n%s", want, before4)
		}
	}
	if !strings.Contains(beforeNFT, "table ip kube-proxy") {
		t.Fatalf("nft list ruleset lacks table ip kube-proxy before the test:\n%s", beforeNFT)
	}

	for _, args := range [][]string{
		{"cleanup", "--chain-prefix", "KUBE"},
		{"cleanup", "--chain-prefix", "kube"},
		{"cleanup", "--chain-prefix", "Kube-prox"},
		{"--cleanup", "--chain-prefix", "KUBE"},
	} {
		out, err := tp.Exec(testbed.Node, append([]string{uproxyBin}, args...)...)
		if code := exitCode(err); code == 0 || code == -1 {
			t.Errorf("uproxy %s: exit %d (%v), want a refusal with a non-zero exit; output:\n%s", strings.Join(args, " "), code, err, out)
		}
		for _, want := range []string{"--chain-prefix", "kube-proxy"} {
			if !strings.Contains(string(out), want) {
				t.Errorf("uproxy %s: output lacks %q:\n%s", strings.Join(args, " "), want, out)
			}
		}
		if got := tp.SavedRules(t, false); got != before4 {
			t.Errorf("iptables-save after uproxy %s:\n%s\nwant as before:\n%s", strings.Join(args, " "), got, before4)
		}
		if got := tp.SavedRules(t, true); got != before6 {
			t.Errorf("ip6tables-save after uproxy %s:\n%s\nwant as before:\n%s", strings.Join(args, " "), got, before6)
		}
		if got := tp.NFTRuleset(t); got != beforeNFT {
			t.Errorf("nft list ruleset after uproxy %s:\n%s\nwant as before:\n%s", strings.Join(args, " "), got, beforeNFT)
		}
	}
}

// TestCleanupRefusedWhileUproxyRuns: `uproxy cleanup` (and `uproxy --cleanup`)
// of the prefix a running uproxy programs is refused, naming its pid, and
// touches no rule; `uproxy cleanup --force` removes the rules all the same (the
// running uproxy writes them back); once it has stopped, cleanup needs no force.
func TestCleanupRefusedWhileUproxyRuns(t *testing.T) {
	tp := testbed.New(t)
	testbed.Needs(t, testbed.IPTables)
	px := startProxy(t, tp, webService(t, tp), 1)
	if name, err := whoTCP(tp, testbed.Pod, "10.96.0.10:80"); err != nil || !strings.HasPrefix(name, "web-") {
		t.Fatalf("through the proxy: got %q (%v), want a web backend", name, err)
	}
	before := tp.SavedRules(t, false)
	if !strings.Contains(before, ":UPROXY-") {
		t.Fatalf("iptables-save lacks the running uproxy's chains:\n%s", before)
	}

	pid := fmt.Sprintf("process %d", px.cmd.Process.Pid)
	for _, args := range [][]string{{"cleanup"}, {"--cleanup"}, {"cleanup", "--chain-prefix", "UPROXY"}} {
		out, err := tp.Exec(testbed.Node, append([]string{uproxyBin}, args...)...)
		if code := exitCode(err); code == 0 || code == -1 {
			t.Errorf("uproxy %s beside a running uproxy: exit %d (%v), want a refusal; output:\n%s", strings.Join(args, " "), code, err, out)
		}
		for _, want := range []string{pid, "--chain-prefix UPROXY", "--force"} {
			if !strings.Contains(string(out), want) {
				t.Errorf("uproxy %s: output lacks %q:\n%s", strings.Join(args, " "), want, out)
			}
		}
		if got := tp.SavedRules(t, false); got != before {
			t.Errorf("iptables-save after the refused uproxy %s:\n%s\nwant as before:\n%s", strings.Join(args, " "), got, before)
		}
	}
	if name, err := whoTCP(tp, testbed.Pod, "10.96.0.10:80"); err != nil || !strings.HasPrefix(name, "web-") {
		t.Errorf("the Service after the refused cleanups: got %q (%v), want a web backend", name, err)
	}

	out, err := tp.Exec(testbed.Node, uproxyBin, "cleanup", "--force")
	if err != nil {
		t.Fatalf("uproxy cleanup --force: %v", err)
	}
	for _, want := range []string{"Removing the rules of a running uproxy (--force)", pid, "Removed uproxy's rules of every mode"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("uproxy cleanup --force: output lacks %q:\n%s", want, out)
		}
	}
	// The running uproxy notices and writes its rules back.
	testbed.Await(t, 20*time.Second, "the Service through the rules written back", func() bool {
		name, err := whoTCP(tp, testbed.Pod, "10.96.0.10:80")
		return err == nil && strings.HasPrefix(name, "web-")
	})

	px.stop()
	if out, err := tp.Exec(testbed.Node, uproxyBin, "cleanup"); err != nil {
		t.Fatalf("uproxy cleanup once uproxy has stopped: %v: %s", err, out)
	}
	if got := ruleChains(t, tp, "iptables-save", "UPROXY-"); len(got) != 0 {
		t.Errorf("chains after cleanup: got %v, want none", got)
	}
}

// TestAnotherProgramsTableLeftAlone: a --chain-prefix whose nftables table is
// another program's (FILTER names the distributions' firewall table, inet
// filter) neither deletes nor rewrites it. `uproxy cleanup` leaves it, with an
// error naming it and a non-zero exit; a start with nftables portals, or in
// the nftables mode over a table of that mode's name, is refused. Every table
// stays as it was, rules and all.
func TestAnotherProgramsTableLeftAlone(t *testing.T) {
	tp := testbed.New(t)
	testbed.Needs(t, testbed.NFTables)
	for _, table := range []string{"filter", "filter-kernel"} {
		for _, args := range [][]string{
			{"add", "table", "inet", table},
			{"add", "chain", "inet", table, "input", "{ type filter hook input priority 0 ; policy accept ; }"},
			{"add", "rule", "inet", table, "input", "tcp", "dport", "22", "accept", "comment", `"host ssh"`},
		} {
			if out, err := tp.Exec(testbed.Node, append([]string{"nft"}, args...)...); err != nil {
				t.Fatalf("nft %v: %v: %s", args, err, out)
			}
		}
	}
	before := tp.NFTRuleset(t)
	dir := t.TempDir()
	quiet := []string{"--metrics-bind-address", "127.0.0.1:0", "--healthz-bind-address", ""}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"cleanup", "--chain-prefix", "FILTER"}, "nftables table inet filter is not uproxy's"},
		{[]string{"--cleanup", "--chain-prefix", "filter"}, "nftables table inet filter-kernel is not uproxy's"},
		{append([]string{"--services", dir, "--rules", "nftables", "--chain-prefix", "FILTER"}, quiet...), "nftables table inet filter is not uproxy's"},
		{append([]string{"--services", dir, "--proxy-mode", "nftables", "--chain-prefix", "FILTER"}, quiet...), "nftables table inet filter-kernel is not uproxy's"},
	} {
		name := strings.Join(tc.args, " ")
		// A start that is not refused runs on: timeout ends it (exit 124).
		out, err := tp.Exec(testbed.Node, append([]string{"timeout", "10", uproxyBin}, tc.args...)...)
		if code := exitCode(err); code == 0 || code == -1 || code == 124 {
			t.Errorf("uproxy %s: exit %d (%v), want an error; output:\n%s", name, code, err, tail(string(out), 10))
		}
		for _, want := range []string{tc.want, "--chain-prefix"} {
			if !strings.Contains(string(out), want) {
				t.Errorf("uproxy %s: output lacks %q:\n%s", name, want, tail(string(out), 10))
			}
		}
		if got := tp.NFTRuleset(t); got != before {
			t.Errorf("nft list ruleset after uproxy %s:\n%s\nwant as before:\n%s", name, got, before)
		}
	}
}

// dockerAndCalico gives the node, in both families, chains as Docker and Calico
// make them: Docker's DOCKER-FORWARD, jumped to from FORWARD without a
// comment, is the iptables mode's forward chain of --chain-prefix DOCKER;
// Calico's cali-FORWARD and cali-POSTROUTING, jumped to with comments of its
// own, are that mode's of cali.
func dockerAndCalico(t *testing.T, tp *testbed.Topology) {
	t.Helper()
	for _, cmd := range []string{"iptables", "ip6tables"} {
		for _, args := range [][]string{
			{"-t", "filter", "-N", "DOCKER-FORWARD"},
			{"-t", "filter", "-A", "DOCKER-FORWARD", "-i", "docker0", "-j", "ACCEPT"},
			{"-t", "filter", "-A", "FORWARD", "-j", "DOCKER-FORWARD"},
			{"-t", "filter", "-N", "cali-FORWARD"},
			{"-t", "filter", "-A", "cali-FORWARD", "-m", "mark", "--mark", "0x10000/0x10000", "-j", "ACCEPT"},
			{"-t", "filter", "-A", "FORWARD", "-m", "comment", "--comment", "cali:wUHhoiAYhphO9Mso", "-j", "cali-FORWARD"},
			{"-t", "nat", "-N", "cali-POSTROUTING"},
			{"-t", "nat", "-A", "cali-POSTROUTING", "-m", "mark", "--mark", "0x10000/0x10000", "-j", "MASQUERADE"},
			{"-t", "nat", "-A", "POSTROUTING", "-m", "comment", "--comment", "cali:O3lYWMrLQYEMJtB5", "-j", "cali-POSTROUTING"},
		} {
			if out, err := tp.Exec(testbed.Node, append([]string{cmd}, args...)...); err != nil {
				t.Fatalf("%s %v: %v: %s", cmd, args, err, out)
			}
		}
	}
}

// TestAnotherProgramsChainsLeftAlone: a --chain-prefix under which uproxy's
// chains would be another program's (DOCKER: Docker's DOCKER-FORWARD; cali:
// Calico's cali-FORWARD) neither flushes nor deletes them. `uproxy cleanup`
// and `--cleanup` leave them, and the rules that lead to them, naming each and
// exiting 1; a start in the iptables mode, in the userspace mode with iptables
// portals, and in the IPVS mode (which this kernel refuses first where it has
// no IPVS) is refused. iptables-save and ip6tables-save stay as they were.
func TestAnotherProgramsChainsLeftAlone(t *testing.T) {
	tp := testbed.New(t, testbed.WithIPv6())
	testbed.Needs(t, testbed.IPTables)
	dockerAndCalico(t, tp)
	before4, before6 := tp.SavedRules(t, false), tp.SavedRules(t, true)
	var verdict kernelmodes.Verdict
	tp.Run(testbed.Node, func() error { verdict = kernelmodes.Probe("rr"); return nil })

	notOurs := func(prefix string) []string {
		chains := []string{"chain " + prefix + "-FORWARD (table filter) is not uproxy's"}
		if prefix == "cali" {
			chains = append(chains, "chain cali-POSTROUTING (table nat) is not uproxy's")
		}
		var out []string
		for _, cmd := range []string{"iptables ", "ip6tables "} {
			for _, c := range chains {
				out = append(out, cmd+c)
			}
		}
		return append(out, "choose another --chain-prefix")
	}
	dir := t.TempDir()
	// A start that is not refused would run on and program the node: the
	// conntrack table's size is the machine's (see runUproxy).
	run := []string{"--services", dir, "--metrics-bind-address", "127.0.0.1:0", "--healthz-bind-address", "", "--conntrack-max-per-core", "0"}
	type start struct {
		args []string
		want []string
		// code is the exit code wanted; 0 for any but 0 and timeout's 124.
		code int
	}
	cases := []start{
		{[]string{"cleanup", "--chain-prefix", "DOCKER"}, notOurs("DOCKER"), 1},
		{[]string{"--cleanup", "--chain-prefix", "cali"}, notOurs("cali"), 1},
	}
	for _, prefix := range []string{"DOCKER", "cali"} {
		cases = append(cases,
			start{append([]string{"--proxy-mode", "iptables", "--chain-prefix", prefix}, run...), notOurs(prefix), 0},
			start{append([]string{"--proxy-mode", "userspace", "--rules", "iptables", "--chain-prefix", prefix}, run...), notOurs(prefix), 0})
		ipvs := start{append([]string{"--proxy-mode", "ipvs", "--chain-prefix", prefix}, run...), notOurs(prefix), 0}
		if !verdict.IPVS() {
			ipvs.want = []string{"ipvs mode unavailable on this kernel"}
		}
		cases = append(cases, ipvs)
	}
	for _, tc := range cases {
		name := strings.Join(tc.args, " ")
		out, err := tp.Exec(testbed.Node, append([]string{"timeout", "10", uproxyBin}, tc.args...)...)
		switch code := exitCode(err); {
		case tc.code != 0 && code != tc.code:
			t.Errorf("uproxy %s: exit %d (%v), want %d; output:\n%s", name, code, err, tc.code, tail(string(out), 10))
		case code == 0 || code == -1 || code == 124:
			t.Errorf("uproxy %s: exit %d (%v), want a refusal; output:\n%s", name, code, err, tail(string(out), 10))
		}
		for _, want := range tc.want {
			if !strings.Contains(string(out), want) {
				t.Errorf("uproxy %s: output lacks %q:\n%s", name, want, tail(string(out), 10))
			}
		}
		if got := tp.SavedRules(t, false); got != before4 {
			t.Errorf("iptables-save after uproxy %s:\n%s\nwant as before:\n%s", name, got, before4)
		}
		if got := tp.SavedRules(t, true); got != before6 {
			t.Errorf("ip6tables-save after uproxy %s:\n%s\nwant as before:\n%s", name, got, before6)
		}
	}
}

// TestOwnLeftoverChainsRemoved: chains of the same names that uproxy itself
// wrote (a run in the iptables mode with --chain-prefix DOCKER, on a node
// without Docker) are uproxy's leftovers: a start in the userspace mode
// removes them, and `uproxy cleanup` removes the portals' after it, exiting
// 0 and leaving the node's rules as they were before either run.
func TestOwnLeftoverChainsRemoved(t *testing.T) {
	tp := testbed.New(t, testbed.WithIPv6())
	testbed.Needs(t, testbed.IPTables)
	before4, before6 := tp.SavedRules(t, false), tp.SavedRules(t, true)
	manifests := webService(t, tp)

	px := runUproxy(t, tp, manifests, launch{want: -1, flags: []string{"--proxy-mode", "iptables", "--chain-prefix", "DOCKER"}})
	px.stop()
	for v6, want := range map[bool]string{false: "-A FORWARD -m comment --comment \"uproxy forwarding rules\" -j DOCKER-FORWARD", true: ":DOCKER-FORWARD "} {
		if got := tp.SavedRules(t, v6); !strings.Contains(got, want) {
			t.Fatalf("rules after the iptables-mode run (v6=%v) lack %q:\n%s", v6, want, got)
		}
	}

	px = startProxy(t, tp, manifests, 1, "--chain-prefix", "DOCKER")
	px.stop()
	if got := tp.SavedRules(t, false); strings.Contains(got, "DOCKER-FORWARD") || !strings.Contains(got, ":DOCKER-PORTALS-CONTAINER ") {
		t.Errorf("rules after the userspace run: want its portals and no DOCKER-FORWARD, got:\n%s", got)
	}

	if out, err := tp.Exec(testbed.Node, uproxyBin, "cleanup", "--chain-prefix", "DOCKER"); err != nil {
		t.Fatalf("uproxy cleanup --chain-prefix DOCKER: %v: %s", err, out)
	}
	if got := tp.SavedRules(t, false); got != before4 {
		t.Errorf("iptables-save after cleanup:\n%s\nwant as before:\n%s", got, before4)
	}
	if got := tp.SavedRules(t, true); got != before6 {
		t.Errorf("ip6tables-save after cleanup:\n%s\nwant as before:\n%s", got, before6)
	}
}

// TestOtherPrefixLeavesSharedReplyRoute: the policy route of the replies to
// dials from a client's address (priority and table 21840) carries no chain
// prefix. Beside a running userspace uproxy that uses it, `uproxy cleanup
// --chain-prefix OTHER` and a start in the iptables mode under OTHER (its
// removal of other modes' leftovers) leave it, saying which uproxy uses it;
// once that uproxy has stopped, `uproxy cleanup --chain-prefix OTHER` removes
// it.
func TestOtherPrefixLeavesSharedReplyRoute(t *testing.T) {
	tp := testbed.New(t)
	testbed.Needs(t, testbed.IPTables)
	manifests := webService(t, tp)
	px := startProxy(t, tp, manifests, 1)
	hasRoute := func() bool {
		rule, err := tp.Exec(testbed.Node, "ip", "-4", "rule")
		if err != nil {
			t.Fatal(err)
		}
		route, err := tp.Exec(testbed.Node, "ip", "-4", "route", "show", "table", "21840")
		if err != nil {
			t.Fatal(err)
		}
		return strings.Contains(string(rule), "lookup 21840") && strings.Contains(string(route), "local default dev lo")
	}
	if !hasRoute() {
		t.Fatalf("the running userspace uproxy wrote no policy route of table 21840")
	}
	left := []string{"Left the policy route", fmt.Sprintf("process %d with --chain-prefix UPROXY", px.cmd.Process.Pid)}

	out, err := tp.Exec(testbed.Node, uproxyBin, "cleanup", "--chain-prefix", "OTHER")
	if err != nil {
		t.Fatalf("uproxy cleanup --chain-prefix OTHER: %v: %s", err, out)
	}
	if !hasRoute() {
		t.Errorf("after uproxy cleanup --chain-prefix OTHER beside the running uproxy: the policy route is gone, want it left")
	}
	for _, want := range left {
		if !strings.Contains(string(out), want) {
			t.Errorf("uproxy cleanup --chain-prefix OTHER: output lacks %q:\n%s", want, out)
		}
	}

	other := runUproxy(t, tp, manifests, launch{want: -1, flags: []string{"--proxy-mode", "iptables", "--chain-prefix", "OTHER",
		"--metrics-bind-address", "127.0.0.1:10259", "--healthz-bind-address", "127.0.0.1:10266"}})
	other.stop()
	if !hasRoute() {
		t.Errorf("after a start in the iptables mode under OTHER beside the running uproxy: the policy route is gone, want it left")
	}
	for _, want := range left {
		if !strings.Contains(other.logText(), want) {
			t.Errorf("the iptables-mode uproxy's log lacks %q:\n%s", want, other.logText())
		}
	}
	if name, err := whoTCP(tp, testbed.Pod, "10.96.0.10:80"); err != nil || !strings.HasPrefix(name, "web-") {
		t.Errorf("the running uproxy's Service afterwards: got %q (%v), want a web backend", name, err)
	}

	px.stop()
	if out, err := tp.Exec(testbed.Node, uproxyBin, "cleanup", "--chain-prefix", "OTHER"); err != nil {
		t.Fatalf("uproxy cleanup --chain-prefix OTHER once uproxy has stopped: %v: %s", err, out)
	}
	if hasRoute() {
		t.Errorf("after uproxy cleanup --chain-prefix OTHER with no uproxy running: the policy route is still there, want it removed")
	}
	if out, err := tp.Exec(testbed.Node, uproxyBin, "cleanup"); err != nil {
		t.Fatalf("uproxy cleanup: %v: %s", err, out)
	}
}
