package integration

import (
	"fmt"
	"net"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// TestCleanupWithoutRootSaysSoOnce: uproxy cleanup (and --cleanup) without
// CAP_NET_ADMIN says once that it needs root, instead of every step's
// permission error, and exits non-zero.
func TestCleanupWithoutRootSaysSoOnce(t *testing.T) {
	tp := testbed.New(t)
	bin, _ := worldReadableCopy(t)
	for _, args := range [][]string{{"cleanup"}, {"--cleanup"}} {
		out, err := tp.Exec(testbed.Node, append([]string{"setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
			"--inh-caps=-all", "--bounding-set=-all", bin}, args...)...)
		if code := exitCode(err); code == 0 || code == -1 {
			t.Errorf("uproxy %s as nobody: exit %d (%v), want a refusal", args[0], code, err)
		}
		msg := strings.TrimSpace(string(out))
		want := "uproxy: cleanup needs root (CAP_NET_ADMIN) to remove rules, tables and links; nothing was removed"
		if msg != want {
			t.Errorf("uproxy %s as nobody: got\n%s\nwant the one line %q", args[0], msg, want)
		}
	}
}

// TestShutdownAfterTheGraceIsNoFailure: connections still open when
// --shutdown-grace ends are reset, which is what the flag asks for: it is
// logged as that, at info level with how many, not as a failed shutdown.
func TestShutdownAfterTheGraceIsNoFailure(t *testing.T) {
	tp := testbed.New(t)
	pod := tp.NS(testbed.Pod)
	ln := echoTCP(t, tp, testbed.Pod, pod.IPv4.String()+":0")
	px := runUproxy(t, tp, svc{name: "web", proto: "TCP", clusterIPs: []string{"10.96.0.10"}, port: 80,
		endpoints: []string{pod.IPv4.String()}, endpointPorts: []int{ln.Addr().(*net.TCPAddr).Port}}.yaml(),
		launch{want: 1, flags: []string{"--rules", "iptables", "--shutdown-grace", "500ms"}})
	// Two connections stay open (closed at the test's end) into the shutdown.
	for range 2 {
		c, err := tp.Dial(testbed.Pod, "tcp", "10.96.0.10:80")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if err := checkedRoundTrip(c, 1024); err != nil {
			t.Fatal(err)
		}
	}
	px.signal(syscall.SIGTERM)
	if code := px.awaitExit(20 * time.Second); code != 0 {
		t.Errorf("exit code: got %d, want 0", code)
	}
	log := px.logText()
	want := `"Shutdown grace period over: the connections still open were reset" grace="500ms" connections=2`
	if !strings.Contains(log, want) {
		t.Errorf("log lacks %q:\n%s", want, tail(log, 20))
	}
	for _, line := range strings.Split(log, "\n") {
		if strings.HasPrefix(line, "E") {
			t.Errorf("error logged at shutdown: %s", line)
		}
	}
}

// TestManifestProblemChanged: a problem that replaces another of the same
// object is logged as changed, naming the one it replaces, not as that one
// fixed and a new one.
func TestManifestProblemChanged(t *testing.T) {
	tp := testbed.New(t)
	svcWithPort := func(port int) string {
		return fmt.Sprintf("apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: it}\nspec:\n  clusterIP: 10.96.0.10\n  ports:\n  - {name: p, port: %d}\n", port)
	}
	px := runUproxy(t, tp, svcWithPort(80), launch{want: 1, flags: []string{"--rules", "none"}})
	px.write("services.yaml", svcWithPort(70000))
	testbed.Await(t, 10*time.Second, "the problem", func() bool { return strings.Contains(px.logText(), "70000 is out of range") })
	px.write("services.yaml", svcWithPort(70001))
	testbed.Await(t, 10*time.Second, "the next problem", func() bool { return strings.Contains(px.logText(), "70001 is out of range") })
	log := px.logText()
	for _, want := range []string{`"Manifest problem changed"`, `err="` + px.dir + `/services.yaml: document 1 (line 1): Service it/web: spec.ports[0].port: 70001 is out of range 1-65535"`,
		`was="` + px.dir + `/services.yaml: document 1 (line 1): Service it/web: spec.ports[0].port: 70000 is out of range 1-65535"`} {
		if !strings.Contains(log, want) {
			t.Errorf("log lacks %q:\n%s", want, tail(log, 20))
		}
	}
	if strings.Contains(log, `"Manifest problem fixed"`) {
		t.Errorf("the replaced problem is logged as fixed:\n%s", tail(log, 20))
	}
}

// TestPortRangeOfOneServesTCPAndUDP: TCP and UDP ports are separate, so a
// --proxy-port-range of one port holds a TCP and a UDP Service port.
func TestPortRangeOfOneServesTCPAndUDP(t *testing.T) {
	tp := testbed.New(t)
	pod := tp.NS(testbed.Pod)
	manifests := join(
		svc{name: "web", proto: "TCP", clusterIPs: []string{"10.96.0.10"}, port: 80, endpoints: []string{pod.IPv4.String()}, endpointPorts: []int{8080}}.yaml(),
		svc{name: "dns", proto: "UDP", clusterIPs: []string{"10.96.0.11"}, port: 53, endpoints: []string{pod.IPv4.String()}, endpointPorts: []int{5353}}.yaml(),
	)
	px := runUproxy(t, tp, manifests, launch{want: 2, flags: []string{"--rules", "none", "--proxy-port-range", "40000-40000"}})
	for _, name := range []string{"it/web:p", "it/dns:p"} {
		if got := px.proxyPortOf(name); got != 40000 {
			t.Errorf("%s: proxy port %d, want 40000", name, got)
		}
	}
	if strings.Contains(px.logText(), "in use") {
		t.Errorf("log says a port is in use:\n%s", tail(px.logText(), 20))
	}
}

// TestExplainWithoutDestination: uproxy explain without its argument prints
// its usage and says what it takes.
func TestExplainWithoutDestination(t *testing.T) {
	testbed.Needs(t, testbed.Build)
	out, err := exec.Command(uproxyBin, "explain").CombinedOutput()
	if exitCode(err) != 1 {
		t.Errorf("uproxy explain: exit %v, want 1", err)
	}
	for _, want := range []string{"Usage:\n  uproxy explain IP:PORT[/tcp|udp|sctp] [flags]", "Examples:", "uproxy: explain takes one destination, IP:PORT[/tcp|udp|sctp]; got 0 arguments"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("uproxy explain: output lacks %q:\n%s", want, out)
		}
	}
}
