// Package conformance builds a real Kubernetes cluster on one machine and runs
// upstream's end-to-end network suite against it, with kube-proxy or uproxy as the
// nodes' service proxy.
//
// Every node is a network namespace of its own (uconf-node1, uconf-node2, ...) with
// its own containerd (Debian's, with runc and the CNI plugins) and kubelet sharing a
// private mount namespace; the control plane (etcd, kube-apiserver,
// kube-controller-manager, kube-scheduler) runs on the first node; the nodes meet on
// a bridge in a namespace of their own (uconf-ext), which is also "outside the
// cluster", where the suite runs. Pod networks are routed between nodes as a real
// cluster's are. Every process is started in a cgroup under /uconf, so Teardown finds
// and kills all of them, containers included, even after an interrupted run.
//
//	c, err := conformance.Up(conformance.Config{Nodes: 3, ...})
//	defer conformance.Teardown(logf)
package conformance

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/uproxy/uproxy/measure/topology"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// Names of the cluster. They are fixed for a prefix so that Teardown can find
// what an interrupted run left; a lock keeps two runs of one prefix apart. The
// prefix is "uconf", or PrefixEnv's value: two clusters of different prefixes run
// side by side (their addresses are the same, each in namespaces of its own).
var (
	Prefix     = prefix()
	ExtNS      = Prefix + "-ext"
	bridge     = Prefix + "-br"
	cgroupRoot = "/" + Prefix
	StateDir   = "/var/lib/" + Prefix
	RunDir     = "/run/" + Prefix
	lockPath   = "/run/" + Prefix + ".lock"
)

// PrefixEnv names the environment variable that sets Prefix.
const PrefixEnv = "UPROXY_CONFORMANCE_PREFIX"

func prefix() string {
	if p := os.Getenv(PrefixEnv); p != "" {
		return p
	}
	return "uconf"
}

// Addresses of the cluster.
const (
	ClusterCIDR = "10.244.0.0/16"
	ServiceCIDR = "10.96.0.0/16"
	DNSIP       = "10.96.0.10"
	apiPort     = 6443
)

// lan is the nodes' network: the bridge in ExtNS is .1, node i is .(10+i).
var lan = netip.MustParsePrefix("10.250.0.0/24")

// NodeName is the name of node i (from 1), also its network namespace's name.
func NodeName(i int) string { return fmt.Sprintf("%s-node%d", Prefix, i) }

// NodeIP is node i's address on the nodes' network.
func NodeIP(i int) string { return fmt.Sprintf("10.250.0.%d", 10+i) }

// PodCIDR is node i's share of ClusterCIDR.
func PodCIDR(i int) string { return fmt.Sprintf("10.244.%d.0/24", i) }

// APIServer is the control plane's address as every node and the suite reach it.
func APIServer() string { return "https://" + net.JoinHostPort(NodeIP(1), strconv.Itoa(apiPort)) }

// Config says what Up builds.
type Config struct {
	Nodes  int    // at least 1; the control plane runs on the first
	BinDir string // etcd, kube-apiserver, kubelet, ... (hack/build-kube.sh BINDIR cluster)
	Images string // the docker-archive of BuildImages, imported into every node
	// KubeProxyMode, when set (iptables or nftables), runs kube-proxy on every node
	// as a node process; otherwise the nodes have no service proxy until one is
	// deployed (DeployUProxy).
	KubeProxyMode string
	Logf          func(format string, args ...any)
}

// Cluster is a running cluster.
type Cluster struct {
	cfg        Config
	Kubeconfig string // admin credentials, for processes in ExtNS (kubectl, the suite)
	Client     kubernetes.Interface
	token      string
	lock       *os.File
	agents     map[int]int // node -> pid of the process that holds its mount namespace
}

// Up tears down whatever a previous run left and builds a cluster. On error the
// caller still calls Teardown (and may read the logs in StateDir/logs first).
func Up(ctx context.Context, cfg Config) (*Cluster, error) {
	if cfg.Nodes < 1 {
		return nil, fmt.Errorf("conformance: Nodes is %d, want at least 1", cfg.Nodes)
	}
	if cfg.Logf == nil {
		cfg.Logf = func(string, ...any) {}
	}
	lock, err := Lock()
	if err != nil {
		return nil, err
	}
	c := &Cluster{cfg: cfg, lock: lock, agents: map[int]int{}}
	if err := Teardown(cfg.Logf); err != nil {
		return c, fmt.Errorf("teardown of an earlier run: %w", err)
	}
	steps := []struct {
		name string
		fn   func(context.Context) error
	}{
		{"directories and cgroups", c.makeDirs},
		{"network", c.makeNetwork},
		{"control plane", c.startControlPlane},
		{"nodes", c.startNodes},
		{"cluster DNS", c.deployDNS},
	}
	for _, s := range steps {
		start := time.Now()
		if err := s.fn(ctx); err != nil {
			return c, fmt.Errorf("%s: %w", s.name, err)
		}
		cfg.Logf("cluster: %s ready in %s", s.name, time.Since(start).Round(100*time.Millisecond))
	}
	return c, nil
}

// Close releases the lock; Teardown removes the cluster.
func (c *Cluster) Close() {
	if c.lock != nil {
		c.lock.Close()
	}
}

func (c *Cluster) nodes() []int {
	n := make([]int, c.cfg.Nodes)
	for i := range n {
		n[i] = i + 1
	}
	return n
}

func (c *Cluster) makeDirs(context.Context) error {
	for _, d := range []string{StateDir + "/logs", RunDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	groups := []string{cgroupRoot, cgroupRoot + "/control", cgroupRoot + "/agents"}
	for _, i := range c.nodes() {
		groups = append(groups, cgroupRoot+"/"+NodeName(i), cgroupRoot+"/agents/"+NodeName(i))
	}
	hierarchies, err := cgroupHierarchies()
	if err != nil {
		return err
	}
	for _, h := range hierarchies {
		for _, g := range groups {
			dir := filepath.Join(h, g)
			if err := os.MkdirAll(dir, 0o755); err != nil {
				return fmt.Errorf("cgroup %s: %w", dir, err)
			}
			// A new cpuset has no CPUs or memory nodes until given its parent's.
			if filepath.Base(h) == "cpuset" {
				for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
					v, err := os.ReadFile(filepath.Join(filepath.Dir(dir), f))
					if err == nil {
						os.WriteFile(filepath.Join(dir, f), v, 0o644)
					}
				}
			}
		}
	}
	return nil
}

// cgroupHierarchies lists the mounted cgroup hierarchies (v1 controllers, the
// named systemd one and the unified one of a hybrid host).
func cgroupHierarchies() ([]string, error) {
	entries, err := os.ReadDir("/sys/fs/cgroup")
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range entries {
		if p := filepath.Join("/sys/fs/cgroup", e.Name()); e.IsDir() {
			if _, err := os.Stat(filepath.Join(p, "cgroup.procs")); err == nil {
				out = append(out, p)
			}
		}
	}
	if len(out) == 0 {
		return nil, errors.New("no cgroup hierarchy under /sys/fs/cgroup")
	}
	return out, nil
}

func run(args ...string) error {
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %w: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

func (c *Cluster) makeNetwork(context.Context) error {
	bridgeAddr := netip.PrefixFrom(lan.Addr().Next(), lan.Bits()).String()
	cmds := [][]string{
		{"ip", "netns", "add", ExtNS},
		{"ip", "-n", ExtNS, "link", "set", "lo", "up"},
		{"ip", "-n", ExtNS, "link", "add", bridge, "type", "bridge"},
		{"ip", "-n", ExtNS, "addr", "add", bridgeAddr, "dev", bridge},
		{"ip", "-n", ExtNS, "link", "set", bridge, "up"},
	}
	for _, i := range c.nodes() {
		node, peer := NodeName(i), fmt.Sprintf("n%d", i)
		cmds = append(cmds,
			[]string{"ip", "netns", "add", node},
			[]string{"ip", "-n", node, "link", "set", "lo", "up"},
			[]string{"ip", "-n", ExtNS, "link", "add", peer, "type", "veth", "peer", "name", "eth0", "netns", node},
			[]string{"ip", "-n", ExtNS, "link", "set", peer, "master", bridge, "up"},
			[]string{"ip", "-n", node, "addr", "add", NodeIP(i) + "/24", "dev", "eth0"},
			[]string{"ip", "-n", node, "link", "set", "eth0", "up"},
			[]string{"ip", "netns", "exec", node, "sysctl", "-qw", "net.ipv4.ip_forward=1"},
			// A node has a default route, as real ones do: a Service's virtual IP is
			// routed somewhere before the proxy's rules rewrite it (a connect to an
			// unroutable address fails before netfilter sees it). The bridge's side
			// does not forward, so nothing leaves the nodes' network this way.
			[]string{"ip", "-n", node, "route", "add", "default", "via", lan.Addr().Next().String()},
			// Outside reaches every pod network through its node, as a routed pod network allows.
			[]string{"ip", "-n", ExtNS, "route", "add", PodCIDR(i), "via", NodeIP(i)},
		)
		for _, j := range c.nodes() {
			if j != i {
				cmds = append(cmds, []string{"ip", "-n", node, "route", "add", PodCIDR(j), "via", NodeIP(j)})
			}
		}
	}
	for _, cmd := range cmds {
		if err := run(cmd...); err != nil {
			return err
		}
	}
	return nil
}

// proc is a process of the cluster, started in a cgroup under /uconf so that
// Teardown reaches it and everything it starts.
type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// start runs argv in network namespace ns (or, with mountOf, in the network,
// mount and UTS namespaces of that process), in cgroup group (of the pids and freezer
// hierarchies), with its output in StateDir/logs/NAME.log.
func (c *Cluster) start(name, group, ns string, mountOf int, argv ...string) (*proc, error) {
	logf, err := os.OpenFile(filepath.Join(StateDir, "logs", name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	join := ""
	for _, h := range []string{"pids", "freezer"} {
		join += fmt.Sprintf("echo $$ > /sys/fs/cgroup/%s%s/cgroup.procs || exit 1; ", h, group)
	}
	enter := []string{"nsenter", "--net=/run/netns/" + ns, "--"}
	if mountOf > 0 {
		enter = []string{"nsenter", "--target", strconv.Itoa(mountOf), "--mount", "--uts", "--net", "--"}
	}
	full := append([]string{"sh", "-c", join + `exec "$@"`, "sh"}, append(enter, argv...)...)
	cmd := exec.Command(full[0], full[1:]...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		logf.Close()
		close(p.done)
	}()
	return p, nil
}

// await polls ready until it succeeds, the process exits or the time is up.
func (p *proc) await(ctx context.Context, within time.Duration, ready func() error) error {
	ctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	var last error
	for {
		if last = ready(); last == nil {
			return nil
		}
		select {
		case <-p.done:
			return fmt.Errorf("%s exited (%v); its log: %s\n%s", p.name, p.err, LogPath(p.name), LogTail(p.name, 30))
		case <-ctx.Done():
			return fmt.Errorf("%s not ready within %s: %v; its log: %s\n%s", p.name, within, last, LogPath(p.name), LogTail(p.name, 30))
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// LogPath is where a cluster process's output goes.
func LogPath(name string) string { return filepath.Join(StateDir, "logs", name+".log") }

// LogTail returns the last n lines of a cluster process's log.
func LogTail(name string, n int) string {
	data, _ := os.ReadFile(LogPath(name))
	return tail(data, n)
}

func randomToken() string {
	b := make([]byte, 16)
	rand.Read(b)
	return hex.EncodeToString(b)
}

func (c *Cluster) startControlPlane(ctx context.Context) error {
	dir := filepath.Join(StateDir, "control")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	c.token = randomToken()
	if err := os.WriteFile(filepath.Join(dir, "tokens.csv"), []byte(c.token+",admin,admin,system:masters\n"), 0o600); err != nil {
		return err
	}
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return err
	}
	pub, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return err
	}
	os.WriteFile(filepath.Join(dir, "sa.key"), pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}), 0o600)
	os.WriteFile(filepath.Join(dir, "sa.pub"), pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub}), 0o644)
	c.Kubeconfig = filepath.Join(dir, "admin.kubeconfig")
	kubeconfig := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: %[1]s
  cluster: {server: %[2]q, insecure-skip-tls-verify: true}
users:
- name: admin
  user: {token: %[3]q}
contexts:
- name: %[1]s
  context: {cluster: %[1]s, user: admin}
current-context: %[1]s
`, Prefix, APIServer(), c.token)
	if err := os.WriteFile(c.Kubeconfig, []byte(kubeconfig), 0o600); err != nil {
		return err
	}
	bin := func(name string) string { return filepath.Join(c.cfg.BinDir, name) }
	node1 := NodeName(1)
	group := cgroupRoot + "/control"

	etcd, err := c.start("etcd", group, node1, 0, bin("etcd"),
		"--name=uconf", "--data-dir="+filepath.Join(dir, "etcd"),
		"--listen-client-urls=http://127.0.0.1:2379", "--advertise-client-urls=http://127.0.0.1:2379",
		"--listen-peer-urls=http://127.0.0.1:2380", "--initial-advertise-peer-urls=http://127.0.0.1:2380",
		"--initial-cluster=uconf=http://127.0.0.1:2380", "--log-level=warn", "--unsafe-no-fsync")
	if err != nil {
		return err
	}
	if err := etcd.await(ctx, 30*time.Second, func() error { return nodeHealthy(1, "http://127.0.0.1:2379/health") }); err != nil {
		return err
	}
	api, err := c.start("kube-apiserver", group, node1, 0, bin("kube-apiserver"),
		"--etcd-servers=http://127.0.0.1:2379",
		"--bind-address=0.0.0.0", "--advertise-address="+NodeIP(1), "--secure-port="+strconv.Itoa(apiPort),
		"--cert-dir="+filepath.Join(dir, "certs"),
		"--token-auth-file="+filepath.Join(dir, "tokens.csv"),
		"--service-account-key-file="+filepath.Join(dir, "sa.pub"),
		"--service-account-signing-key-file="+filepath.Join(dir, "sa.key"),
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--authorization-mode=Node,RBAC",
		"--service-cluster-ip-range="+ServiceCIDR,
		"--allow-privileged=true",
		"--kubelet-preferred-address-types=InternalIP",
		"--profiling=false")
	if err != nil {
		return err
	}
	restCfg := &rest.Config{
		Host:            APIServer(),
		BearerToken:     c.token,
		TLSClientConfig: rest.TLSClientConfig{Insecure: true},
		Dial:            DialIn(ExtNS),
		QPS:             50, Burst: 100,
	}
	c.Client, err = kubernetes.NewForConfig(restCfg)
	if err != nil {
		return err
	}
	if err := api.await(ctx, 90*time.Second, func() error {
		body, err := c.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		if err != nil {
			return fmt.Errorf("%v: %s", err, body)
		}
		return nil
	}); err != nil {
		return err
	}
	kcm, err := c.start("kube-controller-manager", group, node1, 0, bin("kube-controller-manager"),
		"--kubeconfig="+c.Kubeconfig,
		"--service-account-private-key-file="+filepath.Join(dir, "sa.key"),
		"--root-ca-file="+filepath.Join(dir, "certs", "apiserver.crt"),
		"--use-service-account-credentials=true",
		"--leader-elect=false",
		"--bind-address=127.0.0.1",
		"--cluster-cidr="+ClusterCIDR, "--service-cluster-ip-range="+ServiceCIDR)
	if err != nil {
		return err
	}
	sched, err := c.start("kube-scheduler", group, node1, 0, bin("kube-scheduler"),
		"--kubeconfig="+c.Kubeconfig, "--leader-elect=false", "--bind-address=127.0.0.1")
	if err != nil {
		return err
	}
	// The controller manager publishes the root CA in every namespace; pods need it.
	if err := kcm.await(ctx, 60*time.Second, func() error {
		_, err := c.Client.CoreV1().ConfigMaps("default").Get(ctx, "kube-root-ca.crt", metav1.GetOptions{})
		return err
	}); err != nil {
		return err
	}
	return sched.await(ctx, 30*time.Second, func() error {
		_, err := c.Client.CoreV1().ServiceAccounts("default").Get(ctx, "default", metav1.GetOptions{})
		return err
	})
}

// DialIn returns a dialer whose sockets are made in network namespace ns: the
// harness reaches the cluster from the host without an address of its own there.
func DialIn(ns string) func(ctx context.Context, network, address string) (net.Conn, error) {
	return func(ctx context.Context, network, address string) (net.Conn, error) {
		var conn net.Conn
		errc := make(chan error, 1)
		go func() {
			errc <- topology.RunIn(ns, func() (err error) {
				var d net.Dialer
				conn, err = d.DialContext(ctx, network, address)
				return err
			})
		}()
		return conn, <-errc
	}
}

// ownOOMScoreAdjRestricted reports whether this process may not lower its
// oom_score_adj (no CAP_SYS_RESOURCE): runc then fails every container unless
// containerd stops asking it to.
func ownOOMScoreAdjRestricted() bool {
	cur, err := os.ReadFile("/proc/self/oom_score_adj")
	if err != nil {
		return true
	}
	v, _ := strconv.Atoi(strings.TrimSpace(string(cur)))
	if err := os.WriteFile("/proc/self/oom_score_adj", []byte(strconv.Itoa(v-1)), 0o644); err != nil {
		return true
	}
	os.WriteFile("/proc/self/oom_score_adj", cur, 0o644)
	return false
}

func (c *Cluster) startNodes(ctx context.Context) error {
	restrictOOM := ownOOMScoreAdjRestricted()
	c.cfg.Logf("cluster: containerd restrict_oom_score_adj=%v (whether this host denies lowering oom_score_adj)", restrictOOM)
	for _, i := range c.nodes() {
		node := &v1.Node{
			ObjectMeta: metav1.ObjectMeta{Name: NodeName(i), Labels: map[string]string{
				"kubernetes.io/hostname": NodeName(i), "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}},
			Spec: v1.NodeSpec{PodCIDR: PodCIDR(i), PodCIDRs: []string{PodCIDR(i)}},
		}
		if _, err := c.Client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("node %s: %w", node.Name, err)
		}
	}
	errs := make(chan error, c.cfg.Nodes)
	for _, i := range c.nodes() {
		if err := c.startContainerd(ctx, i, restrictOOM); err != nil {
			return err
		}
		go func() { errs <- importImages(c.containerdSocket(i), c.cfg.Images) }()
	}
	for range c.nodes() {
		if err := <-errs; err != nil {
			return err
		}
	}
	for _, i := range c.nodes() {
		if err := c.startKubelet(ctx, i); err != nil {
			return err
		}
		if c.cfg.KubeProxyMode != "" {
			if err := c.startKubeProxy(ctx, i); err != nil {
				return err
			}
		}
	}
	return wait.PollUntilContextTimeout(ctx, time.Second, 3*time.Minute, true, func(ctx context.Context) (bool, error) {
		nodes, err := c.Client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		ready := 0
		for _, n := range nodes.Items {
			for _, cond := range n.Status.Conditions {
				if cond.Type == v1.NodeReady && cond.Status == v1.ConditionTrue {
					ready++
				}
			}
		}
		return ready == c.cfg.Nodes, nil
	})
}

func nodeDir(i int) string { return filepath.Join(StateDir, NodeName(i)) }
func (c *Cluster) containerdSocket(i int) string {
	return filepath.Join(RunDir, NodeName(i), "containerd.sock")
}

// nodeMountPoints are the host paths each node mounts a tmpfs of its own on:
// what containerd and kubelet keep there is the node's, not the host's.
var nodeMountPoints = []string{"/run/containerd", "/var/log/containers", "/var/log/pods"}

func (c *Cluster) startContainerd(ctx context.Context, i int, restrictOOM bool) error {
	dir, rundir := nodeDir(i), filepath.Join(RunDir, NodeName(i))
	for _, d := range []string{dir + "/cni", dir + "/logs", rundir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	cni := fmt.Sprintf(`{"cniVersion": "0.4.0", "name": "uconf", "plugins": [
  {"type": "ptp", "ipMasq": false, "mtu": 1500,
   "ipam": {"type": "host-local", "dataDir": %q, "ranges": [[{"subnet": %q}]], "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
`, filepath.Join(dir, "ipam"), PodCIDR(i))
	if err := os.WriteFile(filepath.Join(dir, "cni", "10-uconf.conflist"), []byte(cni), 0o644); err != nil {
		return err
	}
	config := fmt.Sprintf(`version = 2
root = %[1]q
state = %[2]q
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.internal.v1.opt", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = %[3]q
[ttrpc]
  address = %[4]q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %[5]q
  restrict_oom_score_adj = %[6]v
  disable_apparmor = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = %[7]q
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = %[8]q
`, filepath.Join(dir, "containerd"), filepath.Join(rundir, "state"), c.containerdSocket(i), c.containerdSocket(i)+".ttrpc",
		PauseImage, restrictOOM, filepath.Join(rundir, "runc"), filepath.Join(dir, "cni"))
	if err := os.WriteFile(filepath.Join(dir, "containerd.toml"), []byte(config), 0o644); err != nil {
		return err
	}
	// The node's own mount and UTS namespaces: containerd, its shims and kubelet share them, and
	// what they mount (overlays, volumes, the pods' network namespaces) goes away with
	// it. /run/containerd and the container log directories are the node's own too.
	// Its own host name too: a host-network pod's hostname is its node's name.
	setup := "hostname " + NodeName(i) + " && "
	for _, d := range nodeMountPoints {
		setup += "mkdir -p " + d + " && mount -t tmpfs tmpfs " + d + " && "
	}
	setup += "exec containerd --config " + filepath.Join(dir, "containerd.toml")
	p, err := c.start(NodeName(i)+"-containerd", cgroupRoot+"/agents/"+NodeName(i), NodeName(i), 0,
		"unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", setup)
	if err != nil {
		return err
	}
	c.agents[i] = p.cmd.Process.Pid
	return p.await(ctx, 30*time.Second, func() error {
		return run("ctr", "--address", c.containerdSocket(i), "version")
	})
}

func (c *Cluster) startKubelet(ctx context.Context, i int) error {
	dir := nodeDir(i)
	resolv := filepath.Join(dir, "resolv.conf")
	// The nodes have no resolver of their own; nothing is looked up off the machine.
	if err := os.WriteFile(resolv, []byte("nameserver "+NodeIP(i)+"\n"), 0o644); err != nil {
		return err
	}
	config := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: %[1]s
containerRuntimeEndpoint: unix://%[2]s
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
address: %[3]s
healthzBindAddress: 127.0.0.1
readOnlyPort: 0
clusterDNS: [%[4]s]
clusterDomain: cluster.local
resolvConf: %[5]s
failSwapOn: false
podLogsDir: /var/log/pods
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 100Mi, nodefs.available: "1%%", imagefs.available: "1%%", nodefs.inodesFree: "1%%"}
protectKernelDefaults: false
`, cgroupRoot+"/"+NodeName(i), c.containerdSocket(i), NodeIP(i), DNSIP, resolv)
	if err := os.WriteFile(filepath.Join(dir, "kubelet.yaml"), []byte(config), 0o644); err != nil {
		return err
	}
	p, err := c.start(NodeName(i)+"-kubelet", cgroupRoot+"/agents/"+NodeName(i), NodeName(i), c.agents[i],
		filepath.Join(c.cfg.BinDir, "kubelet"),
		"--config="+filepath.Join(dir, "kubelet.yaml"),
		"--kubeconfig="+c.Kubeconfig,
		"--hostname-override="+NodeName(i),
		"--node-ip="+NodeIP(i),
		"--root-dir="+filepath.Join(dir, "kubelet"),
		"--cert-dir="+filepath.Join(dir, "kubelet-pki"))
	if err != nil {
		return err
	}
	return p.await(ctx, 60*time.Second, func() error {
		return nodeHealthy(i, "http://127.0.0.1:10248/healthz")
	})
}

// nodeHealthy asks a health endpoint on node i's loopback for a 200.
func nodeHealthy(i int, url string) error {
	client := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{DialContext: DialIn(NodeName(i))}}
	resp, err := client.Get(url)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", url, resp.Status)
	}
	return nil
}

// startKubeProxy runs upstream's kube-proxy on node i as a node process.
func (c *Cluster) startKubeProxy(ctx context.Context, i int) error {
	dir := nodeDir(i)
	config := fmt.Sprintf(`apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: %s
clusterCIDR: %s
hostnameOverride: %s
clientConnection: {kubeconfig: %s}
conntrack: {maxPerCore: 0}
`, c.cfg.KubeProxyMode, ClusterCIDR, NodeName(i), c.Kubeconfig)
	path := filepath.Join(dir, "kube-proxy.yaml")
	if err := os.WriteFile(path, []byte(config), 0o644); err != nil {
		return err
	}
	p, err := c.start(NodeName(i)+"-kube-proxy", cgroupRoot+"/agents/"+NodeName(i), NodeName(i), 0,
		filepath.Join(c.cfg.BinDir, "kube-proxy"), "--config="+path)
	if err != nil {
		return err
	}
	return p.await(ctx, 60*time.Second, func() error {
		// 503 until the first sync, which needs the nodes Ready: any answer will do.
		err := nodeHealthy(i, "http://127.0.0.1:10256/healthz")
		if err != nil && strings.Contains(err.Error(), "connection refused") {
			return err
		}
		return nil
	})
}

// Teardown removes every trace of a cluster, whether it came up, failed half way
// or was interrupted: the processes in its cgroups (containers included), the
// cgroups, the network namespaces (and the rules in them), its mounts and its
// directories. It is harmless when there is nothing to remove.
func Teardown(logf func(string, ...any)) error {
	var errs []error
	freezer := "/sys/fs/cgroup/freezer" + cgroupRoot
	if _, err := os.Stat(freezer); err == nil {
		os.WriteFile(filepath.Join(freezer, "freezer.state"), []byte("FROZEN"), 0o644)
	}
	hierarchies, _ := cgroupHierarchies()
	for attempt := 0; ; attempt++ {
		n := 0
		for _, h := range hierarchies {
			for _, pid := range cgroupPids(filepath.Join(h, cgroupRoot)) {
				syscall.Kill(pid, syscall.SIGKILL)
				n++
			}
		}
		for _, pid := range pidsInNamespaces() {
			syscall.Kill(pid, syscall.SIGKILL)
			n++
		}
		if attempt == 0 && n > 0 {
			logf("teardown: killing %d processes", n)
		}
		os.WriteFile(filepath.Join(freezer, "freezer.state"), []byte("THAWED"), 0o644)
		if n == 0 {
			break
		}
		if attempt == 50 {
			errs = append(errs, fmt.Errorf("%d processes still in %s after 10s", n, cgroupRoot))
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	for _, h := range hierarchies {
		if err := removeCgroupTree(filepath.Join(h, cgroupRoot)); err != nil {
			errs = append(errs, err)
		}
	}
	for _, m := range mountsUnder(StateDir, RunDir) {
		if err := syscall.Unmount(m, syscall.MNT_DETACH); err != nil {
			errs = append(errs, fmt.Errorf("unmount %s: %w", m, err))
		}
	}
	for _, ns := range namespaces() {
		if err := run("ip", "netns", "del", ns); err != nil {
			errs = append(errs, err)
		}
	}
	for _, d := range []string{StateDir, RunDir} {
		if err := os.RemoveAll(d); err != nil {
			errs = append(errs, err)
		}
	}
	// The nodes' mount points for their own /run/containerd and log directories,
	// made on the host's file system; removed only while empty.
	for _, d := range nodeMountPoints {
		os.Remove(d)
	}
	return errors.Join(errs...)
}

// Leftovers lists what Teardown should have removed and is still there: network
// namespaces, cgroups, processes, mounts and directories of a cluster.
func Leftovers() []string {
	var out []string
	for _, ns := range namespaces() {
		out = append(out, "network namespace "+ns)
	}
	hierarchies, _ := cgroupHierarchies()
	for _, h := range hierarchies {
		if _, err := os.Stat(filepath.Join(h, cgroupRoot)); err == nil {
			out = append(out, "cgroup "+filepath.Join(h, cgroupRoot))
		}
	}
	for _, m := range mountsUnder(StateDir, RunDir) {
		out = append(out, "mount "+m)
	}
	for _, d := range []string{StateDir, RunDir} {
		if _, err := os.Stat(d); err == nil {
			out = append(out, "directory "+d)
		}
	}
	return out
}

// Lock takes the lock a cluster holds while it runs, so that nothing tears down
// a cluster in use; release it with Close on the returned file.
func Lock() (*os.File, error) {
	lock, err := os.OpenFile(lockPath, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		lock.Close()
		return nil, fmt.Errorf("a conformance cluster is in use (%s is locked): %w", lockPath, err)
	}
	return lock, nil
}

func cgroupPids(root string) []int {
	var pids []int
	filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return nil
		}
		data, _ := os.ReadFile(filepath.Join(path, "cgroup.procs"))
		for _, f := range strings.Fields(string(data)) {
			if pid, err := strconv.Atoi(f); err == nil {
				pids = append(pids, pid)
			}
		}
		return nil
	})
	return pids
}

// removeCgroupTree removes a cgroup and its descendants, deepest first.
func removeCgroupTree(root string) error {
	var dirs []string
	filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			dirs = append(dirs, path)
		}
		return nil
	})
	sort.Slice(dirs, func(a, b int) bool { return len(dirs[a]) > len(dirs[b]) })
	var errs []error
	for _, d := range dirs {
		if err := syscall.Rmdir(d); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("remove cgroup %s: %w", d, err))
		}
	}
	return errors.Join(errs...)
}

// namespaces lists the network namespaces a cluster made.
func namespaces() []string {
	entries, _ := os.ReadDir("/run/netns")
	var out []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), Prefix+"-") {
			out = append(out, e.Name())
		}
	}
	return out
}

// pidsInNamespaces lists processes in a cluster's network namespaces that are
// outside its cgroups (a process started by hand there, say).
func pidsInNamespaces() []int {
	inodes := map[uint64]bool{}
	for _, ns := range namespaces() {
		var st syscall.Stat_t
		if syscall.Stat("/run/netns/"+ns, &st) == nil {
			inodes[st.Ino] = true
		}
	}
	if len(inodes) == 0 {
		return nil
	}
	entries, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		var st syscall.Stat_t
		if syscall.Stat("/proc/"+e.Name()+"/ns/net", &st) == nil && inodes[st.Ino] {
			pids = append(pids, pid)
		}
	}
	return pids
}

// mountsUnder lists this mount namespace's mount points under the directories,
// deepest first.
func mountsUnder(dirs ...string) []string {
	data, _ := os.ReadFile("/proc/self/mountinfo")
	var out []string
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		for _, d := range dirs {
			if f[4] == d || strings.HasPrefix(f[4], d+"/") {
				out = append(out, f[4])
			}
		}
	}
	sort.Slice(out, func(a, b int) bool { return len(out[a]) > len(out[b]) })
	return out
}
