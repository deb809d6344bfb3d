// Package integration runs the uproxy binary end to end, as root, inside network
// namespaces built by testbed: real iptables, real clients, real backends.
package integration

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// uproxyBin is the binary under test, built once by TestMain. Under -short
// nothing is built: every test that runs it needs testbed.Build or a tier
// above, and is skipped.
var uproxyBin = "uproxy-not-built-under-short"

func TestMain(m *testing.M) {
	flag.Parse()
	if testing.Short() {
		os.Exit(m.Run())
	}
	dir, err := os.MkdirTemp("", "uproxy-integration-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	uproxyBin = filepath.Join(dir, "uproxy")
	build := exec.Command("go", "build", "-o", uproxyBin, "..")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building uproxy:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// proxy is a uproxy process running in a topology's node namespace.
type proxy struct {
	t        testing.TB
	tp       *testbed.Topology
	dir      string // manifests
	cmd      *exec.Cmd
	log      string
	exited   chan struct{}
	metrics  string // metrics address inside the node namespace
	client   *http.Client
	stopOnce bool
}

// startProxy runs uproxy's userspace mode with iptables portals in the node
// namespace on the given manifests, with extra flags, and waits until a sync
// has programmed want Service ports.
func startProxy(t *testing.T, tp *testbed.Topology, manifests string, want int, flags ...string) *proxy {
	t.Helper()
	return runUproxy(t, tp, manifests, launch{want: want,
		flags: append([]string{"--rules", "iptables", "--shutdown-grace", "1s"}, flags...)})
}

// waitSynced waits until a sync has completed after t, read from
// kubeproxy_sync_proxy_rules_last_timestamp_seconds: proxy ports appear before
// the sync that opened them has written the portals, and a client that raced
// the rules would pin an un-NATed conntrack entry.
func (p *proxy) waitSynced(t time.Time) {
	p.t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		metrics, err := p.get("/metrics")
		if err == nil {
			for _, line := range strings.Split(metrics, "\n") {
				if v, ok := strings.CutPrefix(line, "kubeproxy_sync_proxy_rules_last_timestamp_seconds "); ok {
					var ts float64
					if _, err := fmt.Sscan(v, &ts); err == nil && ts > float64(t.UnixNano())/1e9 {
						return
					}
				}
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	p.t.Fatalf("no sync completed after %v within 15s", t)
}

func tail(s string, lines int) string {
	l := strings.Split(s, "\n")
	if len(l) > lines {
		l = l[len(l)-lines:]
	}
	return strings.Join(l, "\n")
}

// write replaces a manifest file atomically (write, then rename over).
func (p *proxy) write(name, content string) {
	p.t.Helper()
	tmp := filepath.Join(p.dir, "."+name+".tmp")
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		p.t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(p.dir, name)); err != nil {
		p.t.Fatal(err)
	}
}

// stop sends SIGTERM and waits for the process to end.
func (p *proxy) stop() {
	if p.stopOnce {
		return
	}
	p.stopOnce = true
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(10 * time.Second):
		p.cmd.Process.Kill()
		<-p.exited
		p.t.Errorf("uproxy did not exit within 10s of SIGTERM")
	}
}

type serviceState struct {
	Name      string `json:"name"`
	ProxyPort int    `json:"proxyPort"`
	Endpoints []struct {
		Address           string `json:"address"`
		Usable            bool   `json:"usable"`
		ActiveConnections int    `json:"activeConnections"`
	} `json:"endpoints"`
	Affinity []struct {
		Client   string `json:"client"`
		Endpoint string `json:"endpoint"`
	} `json:"affinity"`
}

func (p *proxy) services() ([]serviceState, error) {
	resp, err := p.client.Get("http://" + p.metrics + "/debug/services")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var body struct {
		Services []serviceState `json:"services"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return nil, err
	}
	return body.Services, nil
}

// get fetches a path on the metrics address.
func (p *proxy) get(path string) (string, error) {
	resp, err := p.client.Get("http://" + p.metrics + path)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// waitFor polls /debug/services until ok, or fails the test after 15s.
func (p *proxy) waitFor(ok func([]serviceState) bool, what string) []serviceState {
	p.t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	var last []serviceState
	var lastErr error
	for time.Now().Before(deadline) {
		select {
		case <-p.exited:
			b, _ := os.ReadFile(p.log)
			p.t.Fatalf("uproxy exited while waiting for %s:\n%s", what, tail(string(b), 40))
		default:
		}
		last, lastErr = p.services()
		if lastErr == nil && ok(last) {
			return last
		}
		time.Sleep(50 * time.Millisecond)
	}
	p.t.Fatalf("waiting for %s: last state %+v, last error %v", what, last, lastErr)
	return nil
}

// namedTCP starts a TCP backend in role's namespace that answers every
// connection with "name\n", then echoes until the client closes. It returns the
// listener so a test can kill the backend.
func namedTCP(t testing.TB, tp *testbed.Topology, role, addr, name string) net.Listener {
	ln := tp.Listen(role, "tcp", addr)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				io.WriteString(c, name+"\n")
				io.Copy(c, c)
			}()
		}
	}()
	return ln
}

// namedUDP answers every datagram with "name:" + datagram.
func namedUDP(t *testing.T, tp *testbed.Topology, role, addr, name string) net.PacketConn {
	pc := tp.ListenPacket(role, "udp", addr)
	go func() {
		buf := make([]byte, 65536)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			pc.WriteTo(append([]byte(name+":"), buf[:n]...), from)
		}
	}()
	return pc
}

// whoTCP connects from role to addr and returns the backend's name.
func whoTCP(tp *testbed.Topology, role, addr string) (string, error) {
	c, err := tp.Dial(role, "tcp", addr)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line), err
}

// whoUDP sends one datagram from role to addr and returns the backend's name.
func whoUDP(tp *testbed.Topology, role, addr string) (string, error) {
	c, err := tp.Dial(role, "udp", addr)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := c.Write([]byte("hi")); err != nil {
		return "", err
	}
	buf := make([]byte, 256)
	n, err := c.Read(buf)
	if err != nil {
		return "", err
	}
	name, _, _ := strings.Cut(string(buf[:n]), ":")
	return name, nil
}

// svc renders a Service with one port and one EndpointSlice per backend port
// (a slice's endpoints share their ports).
type svc struct {
	name, proto   string
	clusterIPs    []string
	port          int
	nodePort      int
	externalIPs   []string
	lbIP          string
	affinity      bool
	family        string // "IPv4" (default) or "IPv6"
	endpoints     []string
	endpointPorts []int
}

func (s svc) yaml() string {
	var b strings.Builder
	fmt.Fprintf(&b, "apiVersion: v1\nkind: Service\nmetadata: {name: %s, namespace: it}\nspec:\n", s.name)
	typ := "ClusterIP"
	if s.nodePort != 0 {
		typ = "NodePort"
	}
	if s.lbIP != "" {
		typ = "LoadBalancer"
	}
	fmt.Fprintf(&b, "  type: %s\n  clusterIP: %s\n  clusterIPs: [%s]\n", typ, s.clusterIPs[0], strings.Join(s.clusterIPs, ", "))
	if len(s.clusterIPs) > 1 || s.family == "IPv6" {
		b.WriteString("  ipFamilyPolicy: PreferDualStack\n")
	}
	if len(s.externalIPs) > 0 {
		fmt.Fprintf(&b, "  externalIPs: [%s]\n", strings.Join(s.externalIPs, ", "))
	}
	if s.affinity {
		b.WriteString("  sessionAffinity: ClientIP\n")
	}
	fmt.Fprintf(&b, "  ports:\n  - {name: p, protocol: %s, port: %d", s.proto, s.port)
	if s.nodePort != 0 {
		fmt.Fprintf(&b, ", nodePort: %d", s.nodePort)
	}
	b.WriteString("}\n")
	if s.lbIP != "" {
		fmt.Fprintf(&b, "status:\n  loadBalancer:\n    ingress: [{ip: %s}]\n", s.lbIP)
	}
	fam := s.family
	if fam == "" {
		fam = "IPv4"
	}
	for i, ep := range s.endpoints {
		fmt.Fprintf(&b, `---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: %s-%d, namespace: it, labels: {kubernetes.io/service-name: %s}}
addressType: %s
ports: [{name: p, protocol: %s, port: %d}]
endpoints: [{addresses: [%q], conditions: {ready: true}}]
`, s.name, i, s.name, fam, s.proto, s.endpointPorts[i], ep)
	}
	return b.String()
}

func join(docs ...string) string { return strings.Join(docs, "---\n") }
