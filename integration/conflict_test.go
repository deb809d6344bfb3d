package integration

import (
	"encoding/json"
	"net"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// TestAddressConflict: a second Service with a working Service's ClusterIP and
// port, appended to the manifest without endpoints, must not take the address
// (its portal rule would match first and the working Service's clients would
// be reset). It is left out, with the problem logged once, listed in
// /debug/services, counted, and noted by `uproxy explain`.
func TestAddressConflict(t *testing.T) {
	tp := testbed.New(t)
	pod := tp.NS(testbed.Pod)
	ln := echoTCP(t, tp, testbed.Pod, pod.IPv4.String()+":0")
	web := svc{name: "web", proto: "TCP", clusterIPs: []string{"10.96.0.10"}, port: 80,
		endpoints: []string{pod.IPv4.String()}, endpointPorts: []int{ln.Addr().(*net.TCPAddr).Port}}.yaml()
	px := runUproxy(t, tp, web, launch{want: 1, flags: []string{"--rules", "iptables"}})

	// "api" sorts before "web": by name alone, it would be the one served.
	px.write("services.yaml", join(web, svc{name: "api", proto: "TCP", clusterIPs: []string{"10.96.0.10"}, port: 80}.yaml()))
	problem := "it/api port p: 10.96.0.10:80/TCP is already served by it/web port p"
	testbed.Await(t, 15*time.Second, "the conflict logged", func() bool { return strings.Contains(px.logText(), problem) })
	px.waitSynced(time.Now())

	for i := range 5 {
		if err := dialRoundTrip(tp, testbed.Pod, "10.96.0.10:80", 16<<10); err != nil {
			t.Fatalf("connection %d to the working Service: %v", i, err)
		}
	}
	var body struct {
		Services  []serviceState
		Conflicts []struct{ Address, ServedBy, LeftOut string }
	}
	js, err := px.get("/debug/services")
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal([]byte(js), &body); err != nil {
		t.Fatalf("decode /debug/services: %v\n%s", err, js)
	}
	if len(body.Services) != 1 || body.Services[0].Name != "it/web:p" {
		t.Errorf("/debug/services: got services %+v, want it/web:p alone", body.Services)
	}
	if len(body.Conflicts) != 1 || body.Conflicts[0] != (struct{ Address, ServedBy, LeftOut string }{"10.96.0.10:80/TCP", "it/web:p", "it/api:p"}) {
		t.Errorf("/debug/services: got conflicts %+v, want 10.96.0.10:80/TCP served by it/web:p, it/api:p left out", body.Conflicts)
	}
	if metrics, err := px.get("/metrics"); err != nil || !strings.Contains(metrics, "\nuproxy_service_port_conflicts 1\n") {
		t.Errorf("/metrics: want uproxy_service_port_conflicts 1 (err %v)", err)
	}
	if n := strings.Count(px.logText(), problem); n != 1 {
		t.Errorf("got the conflict logged %d times, want once", n)
	}

	out, err := exec.Command("ip", "netns", "exec", tp.NS(testbed.Node).Name, uproxyBin, "explain", "10.96.0.10:80", "--metrics-address", px.metrics).Output()
	if err != nil {
		t.Fatalf("uproxy explain: %v: %s", err, stderrOf(err))
	}
	if want := "Note: 10.96.0.10:80/TCP is claimed by two Service ports: it/web:p serves it; it/api:p is left out"; !strings.Contains(string(out), want) {
		t.Errorf("uproxy explain: missing %q:\n%s", want, out)
	}
}
