package integration

import (
	"context"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/utils/ptr"

	"github.com/uproxy/uproxy/test/testbed"
	"github.com/uproxy/uproxy/test/testbed/kubeapi"
)

// kubeNode is the node name uproxy runs as in these tests.
const kubeNode = "node-a"

// kubeWorld is a kube-apiserver on the host, a testbed topology, and a relay
// that makes the API server reachable from the node namespace (which has its
// own loopback) at the same 127.0.0.1 address family its certificate names.
type kubeWorld struct {
	srv        *kubeapi.Server
	tp         *testbed.Topology
	apiURL     string // the API server as seen from the node namespace
	kubeconfig string // admin, valid in the node namespace
}

func newKubeWorld(t testing.TB, apiArgs ...string) *kubeWorld {
	t.Helper()
	tp := testbed.New(t)
	srv := kubeapi.Start(t, apiArgs...)
	w := &kubeWorld{srv: srv, tp: tp}
	w.apiURL = "https://" + relay(t, tp, strings.TrimPrefix(srv.URL, "https://"))
	w.kubeconfig = writeKubeconfig(t, srv, w.apiURL, srv.AdminToken)
	return w
}

// relay listens on 127.0.0.1 in the node namespace and forwards every
// connection to target on the host. Connections made while target is down fail
// like a refused connection would.
func relay(t testing.TB, tp *testbed.Topology, target string) string {
	ln := tp.Listen(testbed.Node, "tcp", "127.0.0.1:0")
	go func() {
		for {
			in, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer in.Close()
				out, err := net.DialTimeout("tcp", target, 5*time.Second)
				if err != nil {
					return
				}
				defer out.Close()
				done := make(chan struct{}, 2)
				go func() { io.Copy(out, in); out.(*net.TCPConn).CloseWrite(); done <- struct{}{} }()
				go func() { io.Copy(in, out); in.(*net.TCPConn).CloseWrite(); done <- struct{}{} }()
				<-done
				<-done
			}()
		}
	}()
	t.Cleanup(func() { ln.Close() })
	return ln.Addr().String()
}

// startKubeProxy runs uproxy in the node namespace following the API server
// through kubeconfig, with iptables portals, and returns once the first sync
// has programmed want Service ports.
func (w *kubeWorld) startKubeProxy(t testing.TB, kubeconfig string, want int, flags ...string) *proxy {
	t.Helper()
	return runUproxy(t, w.tp, "", launch{
		source: []string{"--kubeconfig", kubeconfig, "--hostname-override", kubeNode},
		flags: append([]string{"--rules", "iptables", "--sync-period", "10s", "--dial-timeouts", "200ms",
			"--shutdown-grace", "1s"}, flags...),
		ready: func(s []serviceState) bool { return len(withProxyPorts(s)) == want },
	})
}

// withProxyPorts names the Service ports that have a proxy port, leaving out
// default/kubernetes, which every API server makes (without endpoints here).
func withProxyPorts(s []serviceState) []string {
	var names []string
	for _, st := range s {
		if st.ProxyPort != 0 && st.Name != "default/kubernetes:https" {
			names = append(names, st.Name)
		}
	}
	return names
}

// logContains reports whether uproxy's log holds s so far.
func (p *proxy) logContains(s string) bool {
	b, _ := os.ReadFile(p.log)
	return strings.Contains(string(b), s)
}

// backend is a TCP server in the pod namespace that answers every connection
// with its name (see namedTCP).
type backend struct {
	name string
	ip   string
	port int32
}

func (w *kubeWorld) backend(t testing.TB, name string) *backend {
	ln := namedTCP(t, w.tp, testbed.Pod, w.tp.NS(testbed.Pod).IPv4.String()+":0", name)
	t.Cleanup(func() { ln.Close() })
	a := ln.Addr().(*net.TCPAddr)
	return &backend{name: name, ip: a.IP.String(), port: int32(a.Port)}
}

// served makes n connections from the pod namespace to addr and returns the
// backends that answered, with "error" standing for connections that failed.
func (w *kubeWorld) served(addr string, n int) []string {
	seen := map[string]bool{}
	for range n {
		name, err := whoTCP(w.tp, testbed.Pod, addr)
		if err != nil {
			name = "error"
		}
		seen[name] = true
	}
	var out []string
	for k := range seen {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// awaitServed polls until the connections to addr are answered by exactly want
// ("error" for failures), or fails the test.
func (w *kubeWorld) awaitServed(t testing.TB, addr string, want ...string) {
	t.Helper()
	slices.Sort(want)
	deadline := time.Now().Add(30 * time.Second)
	var got []string
	for time.Now().Before(deadline) {
		// Round robin shows every endpoint within two rounds. A Service that
		// nobody proxies makes each failing connection wait for its dial
		// timeout, so failures are checked with the fewest connections.
		if got = w.served(addr, max(2, 2*len(want))); slices.Equal(got, want) {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("connections to %s: got answers from %q, want %q", addr, got, want)
}

// cluster is a namespace of a test API server and the objects a test makes in it.
type cluster struct {
	t      testing.TB
	srv    *kubeapi.Server
	client kubernetes.Interface
	ns     string
}

func newCluster(t testing.TB, srv *kubeapi.Server, ns string) *cluster {
	t.Helper()
	client := srv.Client(t)
	if _, err := client.CoreV1().Namespaces().Create(context.Background(), &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create namespace %s: %v", ns, err)
	}
	return &cluster{t: t, srv: srv, client: client, ns: ns}
}

// service creates a ClusterIP Service with one TCP port "p" on 80; edit, if
// set, changes it first.
func (c *cluster) service(name string, edit func(*v1.Service)) *v1.Service {
	c.t.Helper()
	svc := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: c.ns},
		Spec:       v1.ServiceSpec{Ports: []v1.ServicePort{{Name: "p", Protocol: v1.ProtocolTCP, Port: 80}}},
	}
	if edit != nil {
		edit(svc)
	}
	out, err := c.client.CoreV1().Services(c.ns).Create(context.Background(), svc, metav1.CreateOptions{})
	if err != nil {
		c.t.Fatalf("create Service %s: %v", name, err)
	}
	return out
}

// endpoint describes one endpoint of a Service.
type endpoint struct {
	b           *backend
	notReady    bool // ready: false
	serving     *bool
	terminating bool
	node        string
}

// endpoints makes the EndpointSlices of Service svc hold exactly eps. The
// backends share the pod's address and differ by port, so each endpoint has a
// slice of its own (named after its backend), as a slice's endpoints share
// their ports; slices of backends not in eps are deleted.
func (c *cluster) endpoints(svc string, eps ...endpoint) {
	c.t.Helper()
	api := c.client.DiscoveryV1().EndpointSlices(c.ns)
	keep := map[string]bool{}
	for _, e := range eps {
		name := svc + "-" + e.b.name
		keep[name] = true
		s := &discoveryv1.EndpointSlice{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: c.ns, Labels: map[string]string{discoveryv1.LabelServiceName: svc},
				Annotations: map[string]string{v1.EndpointsLastChangeTriggerTime: time.Now().UTC().Format(time.RFC3339Nano)}},
			AddressType: discoveryv1.AddressTypeIPv4,
			Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("p"), Protocol: ptr.To(v1.ProtocolTCP), Port: ptr.To(e.b.port)}},
			Endpoints: []discoveryv1.Endpoint{{
				Addresses:  []string{e.b.ip},
				Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(!e.notReady), Serving: e.serving, Terminating: ptr.To(e.terminating)},
			}},
		}
		if e.node != "" {
			s.Endpoints[0].NodeName = ptr.To(e.node)
		}
		cur, err := api.Get(context.Background(), name, metav1.GetOptions{})
		if err == nil {
			s.ResourceVersion = cur.ResourceVersion
			if _, err := api.Update(context.Background(), s, metav1.UpdateOptions{}); err != nil {
				c.t.Fatalf("update EndpointSlice %s: %v", name, err)
			}
			continue
		}
		if _, err := api.Create(context.Background(), s, metav1.CreateOptions{}); err != nil {
			c.t.Fatalf("create EndpointSlice %s: %v", name, err)
		}
	}
	list, err := api.List(context.Background(), metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=" + svc})
	if err != nil {
		c.t.Fatalf("list EndpointSlices of %s: %v", svc, err)
	}
	for _, s := range list.Items {
		if !keep[s.Name] {
			if err := api.Delete(context.Background(), s.Name, metav1.DeleteOptions{}); err != nil {
				c.t.Fatalf("delete EndpointSlice %s: %v", s.Name, err)
			}
		}
	}
}

// clusterIP returns ClusterIP:80 of svc as allocated by the API server.
func clusterAddr(svc *v1.Service) string {
	return net.JoinHostPort(svc.Spec.ClusterIP, "80")
}

// writeKubeconfig writes a kubeconfig for srv that authenticates with token.
func writeKubeconfig(t testing.TB, srv *kubeapi.Server, server, token string) string {
	t.Helper()
	ca, err := os.ReadFile(filepath.Join(srv.CertDir, "apiserver.crt"))
	if err != nil {
		t.Fatal(err)
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["test"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: ca}
	cfg.AuthInfos["user"] = &clientcmdapi.AuthInfo{Token: token}
	cfg.Contexts["test"] = &clientcmdapi.Context{Cluster: "test", AuthInfo: "user"}
	cfg.CurrentContext = "test"
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
	return path
}
