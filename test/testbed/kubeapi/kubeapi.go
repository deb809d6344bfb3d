// Package kubeapi runs a real etcd and kube-apiserver on loopback for tests.
//
// The binaries come from hack/build-kube.sh (`make kube-bins`), which builds the
// versions pinned in tools/. A test starts its own server and talks to it
// with client-go:
//
//	func TestSomething(t *testing.T) {
//		srv := kubeapi.Start(t)
//		client := srv.Client(t)
//		_, err := client.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{})
//		...
//	}
//
// Only the API server runs: no controller manager, scheduler or kubelet, so
// nothing creates Pods, EndpointSlices, default ServiceAccounts or garbage
// collection on its own; a test creates what it needs through the API.
package kubeapi

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/uproxy/uproxy/test/testbed"
)

const (
	// ServiceClusterIPRange is the range kube-apiserver allocates ClusterIPs
	// from; 10.96.0.1 in it goes to the "kubernetes" Service.
	ServiceClusterIPRange = "10.96.0.0/16"

	// ServiceAccountIssuer is the issuer of the ServiceAccount tokens the
	// server signs, and so also the audience it accepts by default.
	ServiceAccountIssuer = "https://kubernetes.default.svc.cluster.local"

	// readyTimeout bounds how long Start and Restart wait for a server. It is
	// generous because tests share two cores with whatever else builds or runs.
	readyTimeout = 3 * time.Minute

	// stopGrace is how long a server has to exit after SIGTERM before it is killed.
	stopGrace = 30 * time.Second

	// startAttempts bounds retries when a chosen port is taken by another
	// program between choosing it and the server binding it.
	startAttempts = 3

	logTailLines = 60
)

// Server is a running etcd and kube-apiserver pair owned by one test.
//
// The exported fields are fixed for the life of the Server, across Restart.
// Restart must not be called concurrently with itself or with the test's end.
type Server struct {
	// URL is the kube-apiserver address, https://127.0.0.1:PORT.
	URL string
	// AdminToken is a bearer token for user "admin" in group system:masters,
	// which RBAC allows everything.
	AdminToken string
	// CertDir is kube-apiserver's --cert-dir. The server writes its
	// self-signed serving certificate there (apiserver.crt, which also holds
	// the CA that signed it) and keeps it across restarts.
	CertDir string
	// Kubeconfig is the path of a kubeconfig file for the admin user, for
	// programs that take --kubeconfig.
	Kubeconfig string
	// EtcdURL is the client URL of the etcd that backs the server.
	EtcdURL string
	// Dir holds the server's state and logs (etcd.log, kube-apiserver.log);
	// it is removed when the test ends.
	Dir string

	binDir    string
	apiArgs   []string
	extra     []string // added to apiArgs
	caData    []byte
	etcd      *process
	apiserver *process
}

// Start runs etcd and kube-apiserver on 127.0.0.1 with free ports and fresh
// directories, and returns once kube-apiserver reports ready on /readyz. Both
// are stopped and their directories removed when the test ends.
//
// It needs testbed.APIServer: without the binaries (testbed.KubeBinEnv) the
// test is skipped, or fails when CI=true, so that a CI run never passes by
// skipping it; under -short it is skipped.
//
// extraArgs are added to kube-apiserver's flags (and kept across Restart), for
// a test that needs a server configured otherwise, such as an older cluster's
// feature gates.
func Start(t testing.TB, extraArgs ...string) *Server {
	t.Helper()
	binDir := testbed.KubeBin(t, "etcd", "kube-apiserver")
	dir := t.TempDir()
	s := &Server{
		Dir:     dir,
		CertDir: filepath.Join(dir, "certs"),
		binDir:  binDir,
		extra:   extraArgs,
	}
	// Registered after TempDir, so it runs before the directory is removed.
	t.Cleanup(func() { s.shutdown(t) })

	began := time.Now()
	if err := s.writeCredentials(); err != nil {
		t.Fatalf("kubeapi: %v", err)
	}
	if err := s.startEtcd(); err != nil {
		t.Fatalf("kubeapi: %v", err)
	}
	etcdReady := time.Since(began)
	if err := s.startAPIServer(); err != nil {
		t.Fatalf("kubeapi: %v", err)
	}
	if err := s.writeKubeconfig(); err != nil {
		t.Fatalf("kubeapi: %v", err)
	}
	t.Logf("kubeapi: etcd ready after %v, kube-apiserver at %s ready after %v",
		etcdReady.Round(time.Millisecond), s.URL, time.Since(began).Round(time.Millisecond))
	return s
}

// Config returns a new client configuration for the admin user.
func (s *Server) Config() *rest.Config {
	return s.ConfigForToken(s.AdminToken)
}

// ConfigForToken returns a new client configuration that authenticates with
// the bearer token, such as one from TokenFor.
func (s *Server) ConfigForToken(token string) *rest.Config {
	return &rest.Config{
		Host:            s.URL,
		BearerToken:     token,
		TLSClientConfig: rest.TLSClientConfig{CAData: append([]byte(nil), s.caData...)},
		// client-go's default of 5 requests per second would make tests
		// wait on the client rather than on the server.
		QPS:   1000,
		Burst: 2000,
	}
}

// Client returns an admin clientset.
func (s *Server) Client(t testing.TB) kubernetes.Interface {
	t.Helper()
	c, err := kubernetes.NewForConfig(s.Config())
	if err != nil {
		t.Fatalf("kubeapi: admin client: %v", err)
	}
	return c
}

// TokenFor returns a token for the ServiceAccount namespace/name, creating
// the Namespace and the ServiceAccount if they do not exist. The token comes
// from the TokenRequest API, is valid for an hour and carries the default
// audience, so the server accepts it. The ServiceAccount is allowed only what
// RBAC grants it; the test adds Roles and bindings as it needs.
func (s *Server) TokenFor(t testing.TB, namespace, name string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	token, err := s.serviceAccountToken(ctx, namespace, name)
	if err != nil {
		t.Fatalf("kubeapi: token for ServiceAccount %s/%s: %v", namespace, name, err)
	}
	return token
}

func (s *Server) serviceAccountToken(ctx context.Context, namespace, name string) (string, error) {
	client, err := kubernetes.NewForConfig(s.Config())
	if err != nil {
		return "", fmt.Errorf("admin client: %w", err)
	}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}
	if _, err := client.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return "", fmt.Errorf("create namespace: %w", err)
	}
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name}}
	if _, err := client.CoreV1().ServiceAccounts(namespace).Create(ctx, sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return "", fmt.Errorf("create service account: %w", err)
	}
	expiry := int64(time.Hour / time.Second)
	req := &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &expiry}}
	resp, err := client.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, name, req, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("request token: %w", err)
	}
	return resp.Status.Token, nil
}

// Restart stops kube-apiserver and starts it again with the same flags, port
// and certificates on the same etcd, returning once it is ready. Clients keep
// working across it, as clients of a real cluster do across an API server
// restart: requests in flight fail and watches end.
func (s *Server) Restart(t testing.TB) {
	t.Helper()
	began := time.Now()
	if err := s.apiserver.stop(stopGrace); err != nil {
		t.Fatalf("kubeapi: restart: %v", err)
	}
	p, err := s.runAPIServer()
	if err != nil {
		t.Fatalf("kubeapi: restart: %v", err)
	}
	s.apiserver = p
	t.Logf("kubeapi: kube-apiserver restarted, ready after %v", time.Since(began).Round(time.Millisecond))
}

// shutdown stops both servers, kube-apiserver first since it depends on
// etcd, and shows the end of their logs when the test failed, which is also
// how a failed Start or Restart shows why.
func (s *Server) shutdown(t testing.TB) {
	if s.apiserver != nil {
		if err := s.apiserver.stop(stopGrace); err != nil {
			t.Errorf("kubeapi: %v", err)
		}
	}
	if s.etcd != nil {
		if err := s.etcd.stop(stopGrace); err != nil {
			t.Errorf("kubeapi: %v", err)
		}
	}
	if t.Failed() {
		for _, p := range []*process{s.apiserver, s.etcd} {
			if p != nil {
				t.Logf("kubeapi: last lines of %s:\n%s", p.logPath, p.tail(logTailLines))
			}
		}
	}
}

// writeCredentials writes the admin token file and the ServiceAccount signing
// key that kube-apiserver reads at start.
func (s *Server) writeCredentials() error {
	if err := os.MkdirAll(s.CertDir, 0o700); err != nil {
		return fmt.Errorf("create cert dir: %w", err)
	}
	s.AdminToken = rand.Text()
	// Token file columns: token, user name, user UID, then groups in one quoted field.
	tokens := fmt.Sprintf("%s,admin,admin,\"system:masters\"\n", s.AdminToken)
	if err := os.WriteFile(s.path("tokens.csv"), []byte(tokens), 0o600); err != nil {
		return fmt.Errorf("write token file: %w", err)
	}

	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return fmt.Errorf("generate service account key: %w", err)
	}
	priv, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return fmt.Errorf("encode service account key: %w", err)
	}
	pub, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return fmt.Errorf("encode service account public key: %w", err)
	}
	if err := os.WriteFile(s.path("sa.key"), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: priv}), 0o600); err != nil {
		return fmt.Errorf("write service account key: %w", err)
	}
	if err := os.WriteFile(s.path("sa.pub"), pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub}), 0o644); err != nil {
		return fmt.Errorf("write service account public key: %w", err)
	}
	return nil
}

func (s *Server) startEtcd() error {
	var errs []error
	for range startAttempts {
		ports, err := freePorts(2)
		if err != nil {
			return err
		}
		client := "http://127.0.0.1:" + strconv.Itoa(ports[0])
		peer := "http://127.0.0.1:" + strconv.Itoa(ports[1])
		dataDir := s.path("etcd")
		// A failed attempt may have left a data dir naming its peer URL.
		if err := os.RemoveAll(dataDir); err != nil {
			return fmt.Errorf("clear etcd data dir: %w", err)
		}
		args := []string{
			"--name=kubeapi",
			"--data-dir=" + dataDir,
			"--listen-client-urls=" + client,
			"--advertise-client-urls=" + client,
			"--listen-peer-urls=" + peer,
			"--initial-advertise-peer-urls=" + peer,
			"--initial-cluster=kubeapi=" + peer,
			"--log-level=warn",
			// The store dies with its test, so durability buys nothing, and
			// fsync on a shared disk would dominate every write's latency.
			"--unsafe-no-fsync",
		}
		p, err := startProcess("etcd", filepath.Join(s.binDir, "etcd"), args, s.path("etcd.log"))
		if err != nil {
			return err
		}
		s.etcd = p
		err = awaitReady(p, func() error { return etcdHealthy(client) })
		if err == nil {
			s.EtcdURL = client
			return nil
		}
		errs = append(errs, err)
		if !p.addrInUse() {
			return err
		}
		if err := p.stop(stopGrace); err != nil {
			errs = append(errs, err)
		}
	}
	return fmt.Errorf("etcd: every port choice was taken: %w", errors.Join(errs...))
}

func (s *Server) startAPIServer() error {
	var errs []error
	for range startAttempts {
		ports, err := freePorts(1)
		if err != nil {
			return err
		}
		s.URL = "https://127.0.0.1:" + strconv.Itoa(ports[0])
		s.apiArgs = []string{
			"--etcd-servers=" + s.EtcdURL,
			"--bind-address=127.0.0.1",
			// Otherwise kube-apiserver advertises, and names in its serving
			// certificate, the address of the host's default route, which
			// clients here do not use and a host may not have.
			"--advertise-address=127.0.0.1",
			"--secure-port=" + strconv.Itoa(ports[0]),
			"--cert-dir=" + s.CertDir,
			"--token-auth-file=" + s.path("tokens.csv"),
			"--service-account-key-file=" + s.path("sa.pub"),
			"--service-account-signing-key-file=" + s.path("sa.key"),
			"--service-account-issuer=" + ServiceAccountIssuer,
			"--authorization-mode=RBAC",
			"--service-cluster-ip-range=" + ServiceClusterIPRange,
			// The reconciler would publish 127.0.0.1 as the endpoint of the
			// "kubernetes" Service, which endpoint validation rejects as
			// loopback; nothing here needs that endpoint.
			"--endpoint-reconciler-type=none",
			// Otherwise an open watch (any informer) holds SIGTERM for the
			// whole request timeout (60s), longer than stopGrace: with it, the
			// server closes remaining connections 2s after draining requests.
			"--shutdown-send-retry-after=true",
			// As kubeadm's: a node proxy's DaemonSet (kube-proxy's,
			// deploy/uproxy.yaml) is privileged, to write sysctls.
			"--allow-privileged=true",
		}
		s.apiArgs = append(s.apiArgs, s.extra...)
		p, err := s.runAPIServer()
		if err == nil {
			s.apiserver = p
			return nil
		}
		errs = append(errs, err)
		if p == nil || !p.addrInUse() {
			return err
		}
		// The port went to another program: fresh ports, fresh process.
		if err := p.stop(stopGrace); err != nil {
			errs = append(errs, err)
		}
	}
	return fmt.Errorf("kube-apiserver: every port choice was taken: %w", errors.Join(errs...))
}

// runAPIServer starts kube-apiserver with s.apiArgs and waits until it is
// ready. On failure the process, if it started, is returned too so the caller
// can look at its output.
func (s *Server) runAPIServer() (*process, error) {
	p, err := startProcess("kube-apiserver", filepath.Join(s.binDir, "kube-apiserver"), s.apiArgs, s.path("kube-apiserver.log"))
	if err != nil {
		return nil, err
	}
	s.apiserver = p
	if err := awaitReady(p, s.apiServerReady); err != nil {
		return p, err
	}
	return p, nil
}

// apiServerReady asks /readyz, trusting the certificate kube-apiserver wrote
// to CertDir; until that file exists the server is not ready either.
func (s *Server) apiServerReady() error {
	caData := s.caData
	if caData == nil {
		data, err := os.ReadFile(filepath.Join(s.CertDir, "apiserver.crt"))
		if err != nil {
			return fmt.Errorf("serving certificate not written yet: %w", err)
		}
		caData = data
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caData) {
		return fmt.Errorf("no certificate in %s yet", filepath.Join(s.CertDir, "apiserver.crt"))
	}
	client := &http.Client{
		Timeout:   5 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}},
	}
	defer client.CloseIdleConnections()
	req, err := http.NewRequest(http.MethodGet, s.URL+"/readyz?verbose", nil)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+s.AdminToken)
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("/readyz: %s: %s", resp.Status, failedChecks(string(body)))
	}
	// Kept only once a request verified against it, so a file caught half
	// written is never trusted for good.
	s.caData = caData
	return nil
}

// failedChecks keeps the lines of a verbose /readyz answer that name checks
// that did not pass.
func failedChecks(body string) string {
	var failed []string
	for _, line := range strings.Split(body, "\n") {
		if strings.HasPrefix(line, "[-]") {
			failed = append(failed, line)
		}
	}
	if len(failed) == 0 {
		return strings.TrimSpace(body)
	}
	return strings.Join(failed, "; ")
}

func etcdHealthy(clientURL string) error {
	client := &http.Client{Timeout: 5 * time.Second}
	defer client.CloseIdleConnections()
	resp, err := client.Get(clientURL + "/health")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), `"health":"true"`) {
		return fmt.Errorf("etcd /health: %s: %s", resp.Status, strings.TrimSpace(string(body)))
	}
	return nil
}

// awaitReady polls ready until it succeeds, the process exits, or
// readyTimeout passes.
func awaitReady(p *process, ready func() error) error {
	deadline := time.Now().Add(readyTimeout)
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		err := ready()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not ready after %v: %w", p.name, readyTimeout, err)
		}
		select {
		case <-p.done:
			return fmt.Errorf("%s exited before it was ready: %v", p.name, p.waitErr)
		case <-tick.C:
		}
	}
}

func (s *Server) writeKubeconfig() error {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["kubeapi"] = &clientcmdapi.Cluster{Server: s.URL, CertificateAuthorityData: s.caData}
	cfg.AuthInfos["admin"] = &clientcmdapi.AuthInfo{Token: s.AdminToken}
	cfg.Contexts["admin"] = &clientcmdapi.Context{Cluster: "kubeapi", AuthInfo: "admin", Namespace: "default"}
	cfg.CurrentContext = "admin"
	s.Kubeconfig = s.path("kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, s.Kubeconfig); err != nil {
		return fmt.Errorf("write kubeconfig: %w", err)
	}
	return nil
}

func (s *Server) path(name string) string { return filepath.Join(s.Dir, name) }
