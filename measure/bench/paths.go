package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// Path names, as --paths takes them.
const (
	Direct       = "direct"        // client to backend, routed by the node: no proxy
	Userspace    = "userspace"     // uproxy's userspace mode through the ClusterIP portal (iptables)
	UserspaceNFT = "userspace-nft" // the same through nftables portals (--rules nftables)
	// UserspaceNFTNode is UserspaceNFT dialing from the node's address
	// (--preserve-client-address=false): beside UserspaceNFT, whose dials keep
	// the client pod's address, it prices that.
	UserspaceNFTNode = "userspace-nft-node"
	IPTables         = "iptables" // uproxy's iptables kernel mode (DNAT)
	NFTables         = "nftables" // uproxy's nftables kernel mode (DNAT from maps)
	IPVS             = "ipvs"     // uproxy's IPVS kernel mode
	HAProxy          = "haproxy"  // HAProxy, tcp mode with forced splice
	Nginx            = "nginx"    // nginx stream
)

// The loopback topology's paths: client, proxy and backends in one namespace
// on 127.0.0.1, the client dialing each proxy's own port (uproxy's proxy port
// with --rules none): no routing and no netfilter rule on the way.
const (
	loPrefix    = "lo-"
	LoDirect    = loPrefix + Direct
	LoUserspace = loPrefix + Userspace
	LoHAProxy   = loPrefix + HAProxy
	LoNginx     = loPrefix + Nginx
)

// Paths lists every path in the order the report shows them.
var Paths = []string{Direct, Userspace, UserspaceNFT, UserspaceNFTNode, IPTables, NFTables, IPVS, HAProxy, Nginx,
	LoDirect, LoUserspace, LoHAProxy, LoNginx}

// loopbackPath reports whether the path is in the loopback topology.
func loopbackPath(name string) bool { return strings.HasPrefix(name, loPrefix) }

// baseName is the path's name without its topology: lo-nginx is nginx.
func baseName(name string) string { return strings.TrimPrefix(name, loPrefix) }

// topologyOf names the topology a path runs in, to compare it only with the
// paths of the same one.
func topologyOf(name string) string {
	if loopbackPath(name) {
		return loPrefix
	}
	return ""
}

// userspacePath reports whether the path is uproxy's userspace mode, whose
// process is on the data path.
func userspacePath(name string) bool {
	return baseName(name) == Userspace || name == UserspaceNFT || name == UserspaceNFTNode
}

// uproxyPath reports whether uproxy programs the path's rules (its control
// plane can be measured).
func uproxyPath(name string) bool {
	return name == Userspace || name == UserspaceNFT || name == UserspaceNFTNode || name == IPTables || name == NFTables || name == IPVS
}

// peers are the other userspace proxies uproxy is judged against.
var peers = []string{HAProxy, Nginx}

func isPeer(name string) bool { b := baseName(name); return b == HAProxy || b == Nginx }

// Virtual IPs of the benchmark's Services; they exist only in the benchmark's
// namespaces.
var (
	echoVIP = netip.MustParseAddrPort("10.96.0.10:80")
	bulkVIP = netip.MustParseAddrPort("10.96.0.11:80")
	flipVIP = netip.MustParseAddrPort("10.96.0.12:80")
	// The backend servers that close first and that wait for the client's
	// reset (ServerClose, ClientReset).
	closeVIP = netip.MustParseAddrPort("10.96.0.13:80")
	replyVIP = netip.MustParseAddrPort("10.96.0.14:80")
	udpVIP   = netip.MustParseAddrPort("10.96.0.53:53")
)

// Listening ports of the peers on the node's client-facing address. The node
// namespace is the benchmark's own, so nothing else can hold them.
const (
	haproxyBase = 18080
	nginxBase   = 19080
	// peerPorts bounds the listeners of one peer from its base.
	peerPorts = 16
)

// path is one way from the client to the backends.
type path struct {
	name    string
	w       *world
	version string
	echo    netip.AddrPort // TCP echo target as the client dials it
	bulk    netip.AddrPort // TCP bulk source
	close   netip.AddrPort // TCP: one reply, then the server's FIN (backendPorts.Close)
	reply   netip.AddrPort // TCP: a reply per request, never closing first (backendPorts.Reply)
	udp     netip.AddrPort // UDP echo; zero when the path has none
	noUDP   string         // why udp is zero
	// proxy is the process whose CPU and memory are the proxy's; nil when the
	// work happens in the kernel (direct, kernel modes).
	proxy *process
	// ctl drives the control-plane workload; nil unless uproxy programs the path.
	ctl *uproxyCtl
	// uproxy reaches the HTTP addresses of the path's proxy when it is
	// uproxy's userspace mode (its memory, its sessions); nil otherwise.
	uproxy *uproxyCtl
}

// probe says why a path cannot run on this machine, or "" when it can.
func probe(name, uproxy string) string {
	if loopbackPath(name) && baseName(name) == Userspace {
		return "" // --rules none: no rule tool needed
	}
	switch baseName(name) {
	case Direct:
		return ""
	case Userspace:
		if _, err := exec.LookPath("iptables-restore"); err != nil {
			return "iptables-restore not installed (make deps)"
		}
		return ""
	case UserspaceNFT, UserspaceNFTNode:
		if _, err := exec.LookPath("nft"); err != nil {
			return "nft not installed (make deps)"
		}
		return ""
	case IPTables:
		return proxyModeProbe(uproxy, "iptables")
	case NFTables:
		if _, err := exec.LookPath("nft"); err != nil {
			return "nft not installed (make deps)"
		}
		return proxyModeProbe(uproxy, "nftables")
	case IPVS:
		if reason := ipvsKernelProbe(); reason != "" {
			return reason
		}
		return proxyModeProbe(uproxy, "ipvs")
	case HAProxy:
		if _, err := exec.LookPath("haproxy"); err != nil {
			return "not installed (make bench-deps)"
		}
		return ""
	case Nginx:
		if _, err := exec.LookPath("nginx"); err != nil {
			return "not installed (make bench-deps)"
		}
		if _, err := nginxStreamModule(); err != nil {
			return err.Error()
		}
		return ""
	}
	return "unknown path"
}

// proxyModeProbe checks that the uproxy binary's --proxy-mode flag offers
// mode; the kernel modes are selected with it.
func proxyModeProbe(uproxy, mode string) string {
	out, err := exec.Command(uproxy, "--help").CombinedOutput()
	if err != nil {
		return fmt.Sprintf("%s --help: %v", uproxy, err)
	}
	for _, line := range strings.Split(string(out), "\n") {
		if strings.Contains(line, "--proxy-mode") {
			if strings.Contains(line, mode) {
				return ""
			}
			break
		}
	}
	return fmt.Sprintf("this uproxy binary's --proxy-mode does not offer %s", mode)
}

// ipvsKernelProbe reports a kernel without IPVS: /proc/net/ip_vs appears once
// the ip_vs module is loaded or built in.
func ipvsKernelProbe() string {
	if _, err := os.Stat("/proc/net/ip_vs"); err == nil {
		return ""
	}
	out, err := exec.Command("modprobe", "ip_vs").CombinedOutput()
	if _, serr := os.Stat("/proc/net/ip_vs"); serr == nil {
		return ""
	}
	msg := strings.TrimSpace(string(out))
	if err != nil && msg == "" {
		msg = err.Error()
	}
	return fmt.Sprintf("kernel has no IPVS (no /proc/net/ip_vs; CONFIG_IP_VS off; modprobe ip_vs: %s)", msg)
}

// nginxStreamModule returns the load_module line nginx needs for stream, or ""
// when stream is built in.
func nginxStreamModule() (string, error) {
	out, err := exec.Command("nginx", "-V").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("nginx -V: %v", err)
	}
	v := string(out)
	if strings.Contains(v, "--with-stream ") || strings.HasSuffix(strings.TrimSpace(v), "--with-stream") {
		return "", nil
	}
	for _, dir := range []string{"/usr/lib/nginx/modules", "/usr/lib64/nginx/modules", "/usr/share/nginx/modules"} {
		so := filepath.Join(dir, "ngx_stream_module.so")
		if _, err := os.Stat(so); err == nil {
			return "load_module " + so + ";", nil
		}
	}
	return "", fmt.Errorf("nginx has no stream module (make bench-deps)")
}

func firstLine(b []byte) string {
	s, _, _ := strings.Cut(strings.TrimSpace(string(b)), "\n")
	return s
}

// setupDirect: the client dials the backends themselves.
func setupDirect(w *world, name string) *path {
	version := "kernel forwarding"
	if w.loopback {
		version = "loopback"
	}
	return &path{
		name: name, w: w, version: version,
		echo:  w.backendAddr(w.ports.Echo),
		bulk:  w.backendAddr(w.ports.Bulk),
		close: w.backendAddr(w.ports.Close),
		reply: w.backendAddr(w.ports.Reply),
		udp:   w.backendAddr(w.ports.UDP),
	}
}

// setupUproxy starts uproxy in the node namespace on the benchmark's Services
// and waits until they carry traffic. mode "" is the userspace mode, with its
// portals written by rules (--rules).
func setupUproxy(ctx context.Context, w *world, name, mode, rules, exe string) (*path, error) {
	ctl := &uproxyCtl{w: w, dir: filepath.Join(w.dir, w.name+"-"+name+"-services"), metrics: "127.0.0.1:10249"}
	if err := os.MkdirAll(ctl.dir, 0o755); err != nil {
		return nil, err
	}
	if err := ctl.writeBase('a'); err != nil {
		return nil, err
	}
	ctl.tag = 'a'
	args := []string{exe,
		"--services", ctl.dir,
		"--metrics-bind-address", ctl.metrics,
		"--healthz-bind-address", "127.0.0.1:10256",
		// The control-plane workload forces a GC to read the live heap.
		"--profiling",
		// Only changes sync: a periodic resync during a measurement would be noise.
		"--sync-period", "1h",
		"--min-sync-period", "0",
		"--shutdown-grace", "1s",
		// Only the initial network namespace may size the conntrack table;
		// uproxy sets the node namespace's timeouts, as kube-proxy would.
		"--conntrack-max-per-core", "0",
	}
	if w.loopback {
		// The backends listen on 127.0.0.1: endpoints uproxy takes only when
		// its proxy ports listen on loopback alone.
		args = append(args, "--bind-address", "127.0.0.1")
	}
	if mode == "" {
		args = append(args, "--rules", rules)
		if name == UserspaceNFTNode {
			args = append(args, "--preserve-client-address=false")
		}
	} else {
		args = append(args, "--proxy-mode", mode)
	}
	p, err := w.start("uproxy-"+name, nodeRole, true, nil, nil, nil, args...)
	if err != nil {
		return nil, err
	}
	ctl.p = p
	ctl.http = &http.Client{
		Timeout: 30 * time.Second,
		Transport: &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			return w.tp.Dial(nodeRole, network, addr)
		}},
	}
	pt := &path{name: name, w: w, echo: echoVIP, bulk: bulkVIP, close: closeVIP, reply: replyVIP, udp: udpVIP, ctl: ctl}
	if mode == "" {
		pt.proxy, pt.uproxy = p, ctl
	}
	if out, err := exec.Command(exe, "version").Output(); err == nil {
		pt.version = firstLine(out)
	}
	if rules == "none" {
		// No portal: the client dials the proxy ports, and no Service IP
		// works, so the control plane cannot be timed by traffic.
		pt.ctl = nil
		ports, err := ctl.proxyPorts(ctx, 20*time.Second, "bench/echo:p", "bench/bulk:p", "bench/udp:p", "bench/close:p", "bench/reply:p")
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		for i, a := range []*netip.AddrPort{&pt.echo, &pt.bulk, &pt.udp, &pt.close, &pt.reply} {
			*a = netip.AddrPortFrom(w.ip.node, uint16(ports[i]))
		}
	}
	if err := w.waitTraffic(ctx, p, 20*time.Second, target{"tcp", pt.echo}, target{"udp", pt.udp}); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	w.tuneConntrack()
	return pt, nil
}

// setupHAProxy runs HAProxy in the node namespace: tcp mode, splice forced both
// ways, one thread per CPU (its default, or per proxy CPU of a placement).
// HAProxy does not proxy UDP.
func setupHAProxy(ctx context.Context, w *world, name string) (*path, error) {
	listen := func(i int) netip.AddrPort { return netip.AddrPortFrom(w.ip.nodeClientSide, uint16(haproxyBase+i)) }
	// HAProxy sizes its file limit from maxconn (two sockets per connection) and
	// maxpipes (two descriptors per splice pipe, default maxconn/4), and refuses
	// to start above the hard limit. Pipes are needed only by connections
	// splicing at the same moment, so a fixed pool is plenty.
	const maxpipes = 1024
	maxconn := (w.fileLimit - 2*maxpipes - 500) / 2
	var cfg strings.Builder
	fmt.Fprintf(&cfg, `global
	maxconn %[1]d
	maxpipes %[2]d
%[3]sdefaults
	mode tcp
	maxconn %[1]d
	timeout connect 5s
	timeout client 1h
	timeout server 1h
	option splice-request
	option splice-response
`, maxconn, maxpipes, w.threads("\tnbthread %d\n", ""))
	for i, be := range []uint16{w.ports.Echo, w.ports.Bulk, w.ports.Close, w.ports.Reply} {
		fmt.Fprintf(&cfg, "listen l%d\n\tbind %s\n\tserver b %s\n", i, listen(i), w.backendAddr(be))
	}
	file := filepath.Join(w.dir, w.name+"-haproxy.cfg")
	if err := os.WriteFile(file, []byte(cfg.String()), 0o644); err != nil {
		return nil, err
	}
	p, err := w.start(name, nodeRole, true, nil, nil, nil, "haproxy", "-db", "-f", file)
	if err != nil {
		return nil, err
	}
	pt := &path{name: name, w: w, echo: listen(0), bulk: listen(1), close: listen(2), reply: listen(3), noUDP: "HAProxy does not proxy UDP", proxy: p}
	if out, err := exec.Command("haproxy", "-v").CombinedOutput(); err == nil {
		pt.version = firstLine(out)
	}
	if err := w.waitTraffic(ctx, p, 10*time.Second, target{"tcp", pt.echo}); err != nil {
		return nil, fmt.Errorf("haproxy: %w", err)
	}
	return pt, nil
}

// setupNginx runs nginx's stream proxy in the node namespace with one worker
// per CPU (or per proxy CPU of a placement). UDP listens with reuseport so
// every datagram of a client reaches the worker holding its session. The TCP
// servers pass a half-close on, as uproxy and HAProxy do: by default nginx
// closes both sides at the first FIN, which loses the reply of a client that
// half-closes after its request (setupPaths checks every path for that) and
// spares nginx a read, a shutdown and a wake-up per connection that the others
// make.
func setupNginx(ctx context.Context, w *world, name string) (*path, error) {
	module, err := nginxStreamModule()
	if err != nil {
		return nil, err
	}
	listen := func(i int) netip.AddrPort { return netip.AddrPortFrom(w.ip.nodeClientSide, uint16(nginxBase+i)) }
	prefix := filepath.Join(w.dir, w.name+"-nginx")
	if err := os.MkdirAll(filepath.Join(prefix, "logs"), 0o755); err != nil {
		return nil, err
	}
	var cfg strings.Builder
	fmt.Fprintf(&cfg, `%s
daemon off;
worker_processes %s;
worker_rlimit_nofile %d;
pid %s/nginx.pid;
error_log %s/logs/error.log warn;
events { worker_connections %d; }
stream {
	server { listen %s; proxy_pass %s; proxy_timeout 1h; proxy_half_close on; }
	server { listen %s; proxy_pass %s; proxy_timeout 1h; proxy_half_close on; }
	server { listen %s udp reuseport; proxy_pass %s; proxy_timeout 10s; }
	server { listen %s; proxy_pass %s; proxy_timeout 1h; proxy_half_close on; }
	server { listen %s; proxy_pass %s; proxy_timeout 1h; proxy_half_close on; }
}
`, module, w.threads("%d", "auto"), w.fileLimit, prefix, prefix, w.fileLimit-200,
		listen(0), w.backendAddr(w.ports.Echo),
		listen(1), w.backendAddr(w.ports.Bulk),
		listen(2), w.backendAddr(w.ports.UDP),
		listen(3), w.backendAddr(w.ports.Close),
		listen(4), w.backendAddr(w.ports.Reply))
	file := filepath.Join(prefix, "nginx.conf")
	if err := os.WriteFile(file, []byte(cfg.String()), 0o644); err != nil {
		return nil, err
	}
	p, err := w.start(name, nodeRole, true, nil, nil, nil, "nginx", "-p", prefix, "-e", filepath.Join(prefix, "logs", "error.log"), "-c", file)
	if err != nil {
		return nil, err
	}
	pt := &path{name: name, w: w, echo: listen(0), bulk: listen(1), udp: listen(2), close: listen(3), reply: listen(4), proxy: p}
	if out, err := exec.Command("nginx", "-v").CombinedOutput(); err == nil {
		pt.version = strings.TrimPrefix(firstLine(out), "nginx version: ")
	}
	if err := w.waitTraffic(ctx, p, 10*time.Second, target{"tcp", pt.echo}, target{"udp", pt.udp}); err != nil {
		return nil, fmt.Errorf("nginx: %w", err)
	}
	return pt, nil
}

// uproxyCtl is the control side of a uproxy process: its manifests and metrics.
type uproxyCtl struct {
	w       *world
	p       *process
	dir     string
	metrics string
	http    *http.Client
	// tag is the answer of the flip Service's endpoint, as last written.
	tag byte
}

// writeFile replaces a manifest atomically, so uproxy never reads half of one.
func (c *uproxyCtl) writeFile(name string, content []byte) error {
	tmp := filepath.Join(c.dir, "."+name+".tmp")
	if err := os.WriteFile(tmp, content, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(c.dir, name))
}

// writeBase writes the benchmark's Services; flip's endpoint is the backend that
// answers tag.
func (c *uproxyCtl) writeBase(tag byte) error {
	ports := c.w.ports
	flip := ports.TagA
	if tag == 'b' {
		flip = ports.TagB
	}
	var b bytes.Buffer
	be := c.w.ip.backend
	writeService(&b, "echo", "TCP", echoVIP, netip.AddrPortFrom(be, ports.Echo))
	writeService(&b, "bulk", "TCP", bulkVIP, netip.AddrPortFrom(be, ports.Bulk))
	writeService(&b, "flip", "TCP", flipVIP, netip.AddrPortFrom(be, flip))
	writeService(&b, "udp", "UDP", udpVIP, netip.AddrPortFrom(be, ports.UDP))
	writeService(&b, "close", "TCP", closeVIP, netip.AddrPortFrom(be, ports.Close))
	writeService(&b, "reply", "TCP", replyVIP, netip.AddrPortFrom(be, ports.Reply))
	return c.writeFile("base.yaml", b.Bytes())
}

// writeService renders a ClusterIP Service with one port and an EndpointSlice
// per endpoint (the port is a slice's), each endpoint ready.
func writeService(b *bytes.Buffer, name, proto string, vip netip.AddrPort, eps ...netip.AddrPort) {
	fmt.Fprintf(b, `---
apiVersion: v1
kind: Service
metadata: {name: %[1]s, namespace: bench}
spec: {type: ClusterIP, clusterIP: %[2]s, clusterIPs: [%[2]s], ports: [{name: p, protocol: %[3]s, port: %[4]d}]}
`, name, vip.Addr(), proto, vip.Port())
	for i, ep := range eps {
		fmt.Fprintf(b, `---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: %[1]s-%[2]d, namespace: bench, labels: {kubernetes.io/service-name: %[1]s}}
addressType: IPv4
ports: [{name: p, protocol: %[3]s, port: %[5]d}]
endpoints: [{addresses: ["%[4]s"], conditions: {ready: true}}]
`, name, i+1, proto, ep.Addr(), ep.Port())
	}
}

// scaleVIP is the virtual IP of the i-th Service of the control-plane workload.
func scaleVIP(i int) netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 100, byte(i / 250), byte(i%250 + 1)}), 80)
}

// syncMetric reads the sum and count of kubeproxy_sync_proxy_rules_duration_seconds.
func (c *uproxyCtl) syncMetric() (sum float64, count uint64, err error) {
	resp, err := c.http.Get("http://" + c.metrics + "/metrics")
	if err != nil {
		return 0, 0, err
	}
	defer resp.Body.Close()
	return parseSyncMetric(resp.Body)
}

// liveHeap forces two GCs in the uproxy process (/debug/pprof/heap?gc=1, with
// --profiling) and returns the heap the second found live
// (go_gc_heap_live_bytes): what the process holds, without the garbage a
// reading of the heap would count beside it. One GC leaves what sync.Pools
// held before it (their victim caches: scrape and encoding buffers), which
// made the baseline of a reading swing by half a megabyte; the second frees it.
func (c *uproxyCtl) liveHeap() (int64, error) {
	for range 2 {
		resp, err := c.http.Get("http://" + c.metrics + "/debug/pprof/heap?gc=1")
		if err != nil {
			return 0, err
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return 0, fmt.Errorf("/debug/pprof/heap: %s (does uproxy take --profiling?)", resp.Status)
		}
	}
	resp, err := c.http.Get("http://" + c.metrics + "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	return parseGauge(resp.Body, "go_gc_heap_live_bytes")
}

// parseGauge reads the value of the metric name, which has no labels, from a
// /metrics page.
func parseGauge(r io.Reader, name string) (int64, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), " ")
		if !ok || k != name {
			continue
		}
		f, err := strconv.ParseFloat(v, 64)
		if err != nil {
			return 0, fmt.Errorf("%s: %w", sc.Text(), err)
		}
		return int64(f), nil
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, fmt.Errorf("no %s in /metrics", name)
}

func parseSyncMetric(r io.Reader) (sum float64, count uint64, err error) {
	const name = "kubeproxy_sync_proxy_rules_duration_seconds"
	found := 0
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		k, v, ok := strings.Cut(line, " ")
		if !ok {
			continue
		}
		switch k {
		case name + "_sum":
			sum, err = strconv.ParseFloat(v, 64)
			found++
		case name + "_count":
			count, err = strconv.ParseUint(v, 10, 64)
			found++
		}
		if err != nil {
			return 0, 0, fmt.Errorf("%s: %w", line, err)
		}
	}
	if err := sc.Err(); err != nil {
		return 0, 0, err
	}
	if found != 2 {
		return 0, 0, fmt.Errorf("no %s histogram in /metrics", name)
	}
	return sum, count, nil
}

// proxyPorts asks /debug/services for the proxy ports of the named Service
// ports, waiting until every one has one.
func (c *uproxyCtl) proxyPorts(ctx context.Context, timeout time.Duration, names ...string) ([]int, error) {
	deadline := time.Now().Add(timeout)
	for {
		ports, err := c.tryProxyPorts(names)
		if err == nil {
			return ports, nil
		}
		if !c.p.running() {
			return nil, c.w.exited(c.p)
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("proxy ports within %v: %w", timeout, err)
		}
		if !sleepCtx(ctx, 20*time.Millisecond) {
			return nil, ctx.Err()
		}
	}
}

func (c *uproxyCtl) tryProxyPorts(names []string) ([]int, error) {
	resp, err := c.http.Get("http://" + c.metrics + "/debug/services")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var body struct {
		Services []struct {
			Name      string `json:"name"`
			ProxyPort int    `json:"proxyPort"`
		} `json:"services"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return nil, fmt.Errorf("/debug/services: %w", err)
	}
	ports := make([]int, len(names))
	for i, n := range names {
		for _, s := range body.Services {
			if s.Name == n && s.ProxyPort > 0 {
				ports[i] = s.ProxyPort
			}
		}
		if ports[i] == 0 {
			return nil, fmt.Errorf("no proxy port for %s yet", n)
		}
	}
	return ports, nil
}
