package app

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/service"
)

// demoUnused are the run flags the demo has no use for: it writes its own
// manifests (the source's flags), its Services have no NodePort, node-local
// endpoint or topology hint (the node's flags), and it always removes its rules
// on exit. The demo does not take them: given, one is an unknown flag, never
// accepted and ignored.
var demoUnused = []string{"services", "kubeconfig", "master", "kube-api-qps", "kube-api-burst",
	"kube-api-content-type", "config", "config-sync-period", "service-proxy-name", "cleanup",
	"cleanup-on-exit", "hostname-override", "node-labels", "nodeport-addresses"}

func newDemoCommand() *cobra.Command {
	// The demo's own flags: the run flags with the defaults it really uses, less
	// demoUnused.
	opts := defaultOptions()
	opts.rules = "none"
	opts.bindAddress = "127.0.0.1"
	opts.healthzBindAddress = "127.0.0.1:10256"
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Run the proxy on an embedded demo: backends on loopback, no root needed",
		Long: `demo starts a few backends on loopback addresses (127.0.0.2 and up), writes
Service and EndpointSlice manifests for them into a temporary directory and runs the
userspace proxy on it with --rules none, so the Services are reached on their proxy
ports. One endpoint of "web" is dead on purpose: watch uproxy retry around it.
Edit the manifests while it runs: they are reloaded.

As root, --rules iptables or nftables adds the portals (the Service addresses
reach the proxy ports), and --proxy-mode iptables, nftables or ipvs programs the
same Services into the kernel instead: the Service addresses work from this node,
and nothing retries. Whatever the demo programs, it removes when it stops.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return runDemo(cmd, opts)
		},
	}
	all := &cobra.Command{}
	opts.addFlags(all)
	unused := 0
	all.Flags().VisitAll(func(f *pflag.Flag) {
		if slices.Contains(demoUnused, f.Name) {
			unused++
			return
		}
		cmd.Flags().AddFlag(f)
	})
	if unused != len(demoUnused) {
		panic("demo flags: a flag of demoUnused was renamed without it") // a programming error, found by any test
	}
	opts.flags = cmd.Flags()
	return cmd
}

// demoBackends are the servers the demo runs; stop closes them.
type demoBackends struct {
	closers []func()
}

func (d *demoBackends) stop() {
	for _, c := range d.closers {
		c()
	}
}

// httpBackend serves "NAME says hello" on ip:0 and returns its port.
func (d *demoBackends) httpBackend(name, ip string) (int, error) {
	ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		return 0, fmt.Errorf("demo backend %s: %w", name, err)
	}
	srv := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			fmt.Fprintf(w, "%s (%s) answers %s %s from %s\n", name, ln.Addr(), r.Method, r.URL.Path, r.RemoteAddr)
		}),
		ReadHeaderTimeout: 5 * time.Second,
	}
	go srv.Serve(ln)
	d.closers = append(d.closers, func() { srv.Close() })
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// udpBackend echoes "NAME: <datagram>" on ip:0 and returns its port.
func (d *demoBackends) udpBackend(name, ip string) (int, error) {
	pc, err := net.ListenPacket("udp", net.JoinHostPort(ip, "0"))
	if err != nil {
		return 0, fmt.Errorf("demo backend %s: %w", name, err)
	}
	go func() {
		buf := make([]byte, 65536)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			pc.WriteTo(append([]byte(name+": "), buf[:n]...), from)
		}
	}()
	d.closers = append(d.closers, func() { pc.Close() })
	return pc.LocalAddr().(*net.UDPAddr).Port, nil
}

// deadPort returns a port on ip where nothing listens (bound, then closed).
func deadPort(ip string) (int, error) {
	ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

type demoEndpoint struct {
	ip   string
	port int
}

func runDemo(cmd *cobra.Command, opts *options) error {
	var backends demoBackends
	defer backends.stop()

	var web, sticky, dns []demoEndpoint
	for i, ip := range []string{"127.0.0.2", "127.0.0.3", "127.0.0.4"} {
		port, err := backends.httpBackend(fmt.Sprintf("web-%d", i+1), ip)
		if err != nil {
			return err
		}
		web = append(web, demoEndpoint{ip, port})
	}
	dead, err := deadPort("127.0.0.5")
	if err != nil {
		return err
	}
	web = append(web, demoEndpoint{"127.0.0.5", dead})
	for i, ip := range []string{"127.0.0.6", "127.0.0.7"} {
		port, err := backends.httpBackend(fmt.Sprintf("sticky-%d", i+1), ip)
		if err != nil {
			return err
		}
		sticky = append(sticky, demoEndpoint{ip, port})
	}
	for i, ip := range []string{"127.0.0.8", "127.0.0.9"} {
		port, err := backends.udpBackend(fmt.Sprintf("echo-%d", i+1), ip)
		if err != nil {
			return err
		}
		dns = append(dns, demoEndpoint{ip, port})
	}

	dir, err := os.MkdirTemp("", "uproxy-demo-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	manifests := demoService("web", "TCP", "10.96.0.10", 80, "", web) +
		"---\n" + demoService("sticky", "TCP", "10.96.0.11", 80, "ClientIP", sticky) +
		"---\n" + demoService("echo", "UDP", "10.96.0.12", 53, "", dns)
	path := filepath.Join(dir, "demo.yaml")
	if err := os.WriteFile(path, []byte(manifests), 0o644); err != nil {
		return err
	}

	opts.services = path
	// The demo's rules send the Service addresses to backends that stop with
	// it: they go with it too.
	opts.cleanupOnExit = opts.proxyMode != proxymode.Userspace || opts.rules != "none"
	out := cmd.OutOrStdout()
	var once sync.Once
	return runProxy(cmd.Context(), opts, func(r running, s *service.Snapshot) {
		once.Do(func() {
			v := demoView{mode: r.name, rules: string(r.rules), chainPrefix: opts.chainPrefix, path: path, metrics: opts.metricsBindAddress}
			if m, ok := r.mode.(interface{ ProxyPort(service.PortName) int }); ok {
				v.proxyPort = m.ProxyPort
			}
			printDemo(out, v, s)
		})
	})
}

// demoNotes describe the endpoints of the demo's Services.
var demoNotes = map[string]string{
	"web":    "3 live + 1 dead (127.0.0.5)",
	"sticky": "2, sessionAffinity ClientIP",
	"echo":   "2 echo servers",
}

// demoView is what the demo's table and hints are made of.
type demoView struct {
	mode  string // the proxy mode running
	rules string // the userspace mode's portals: none, iptables or nftables
	// proxyPort is the userspace mode's proxy port of a Service port; nil in
	// a kernel mode, which has none.
	proxyPort     func(service.PortName) int
	chainPrefix   string
	path, metrics string
}

// printDemo prints a table of the Service ports of s with what serves them,
// then what to try.
func printDemo(w io.Writer, v demoView, s *service.Snapshot) {
	kernel := v.proxyPort == nil
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	if kernel {
		fmt.Fprintln(tw, "\nSERVICE\tPROTOCOL\tSERVICE ADDRESSES\tENDPOINTS")
	} else {
		fmt.Fprintln(tw, "\nSERVICE\tPROTOCOL\tPROXY PORT\tSERVICE ADDRESSES\tENDPOINTS")
	}
	for _, p := range s.Ports {
		note := demoNotes[p.Name.Name]
		if p.Name.Namespace != "demo" || note == "" {
			note = fmt.Sprint(len(p.Endpoints))
		} else if p.Name.Name == "web" && kernel {
			note += ": not retried"
		} else if p.Name.Name == "web" {
			note += ": retried around"
		}
		if kernel {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", p.Name, p.Protocol, p.Claims(), note)
		} else {
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\n", p.Name, p.Protocol, v.proxyPort(p.Name), p.Claims(), note)
		}
	}
	tw.Flush()
	if kernel {
		printKernelDemo(w, v)
		return
	}
	port := func(name string) int {
		return v.proxyPort(service.PortName{Namespace: "demo", Name: name, Port: "main"})
	}
	if v.rules == "none" {
		fmt.Fprintln(w, "(--rules none: no rule steers the Service addresses; connect to the proxy ports on 127.0.0.1)")
	} else {
		fmt.Fprintf(w, "(--rules %s: the Service addresses reach the proxy ports too, e.g. curl -s 10.96.0.10/)\n", v.rules)
	}
	fmt.Fprintf(w, `
Try:
  # round robin over web's three live backends; the dead one is retried around
  for i in 1 2 3 4 5 6; do curl -s 127.0.0.1:%[1]d/; done
  # ClientIP affinity: each client address sticks to one backend
  for ip in 127.0.0.100 127.0.0.100 127.0.0.101 127.0.0.101; do curl -s --interface $ip 127.0.0.1:%[2]d/; done
  # UDP (without nc: bash -c 'exec 3<>/dev/udp/127.0.0.1/%[3]d; echo hello >&3; timeout 1 head -n1 <&3')
  echo hello | nc -u -w1 127.0.0.1 %[3]d
  # proxy ports, endpoints, affinity table; every dial attempt by result
  curl -s %[4]s/debug/services
  curl -s %[4]s/metrics | grep uproxy_dial_attempts_total
Manifests: %[5]s (edit it: uproxy reloads it). Ctrl-C stops%[6]s.
`, port("web"), port("sticky"), port("echo"), v.metrics, v.path, stopsWhat(v))
}

// printKernelDemo prints what to try in a kernel mode: the Service addresses
// themselves, from this node, and the rules that carry them.
func printKernelDemo(w io.Writer, v demoView) {
	fmt.Fprintf(w, "(--proxy-mode %s: the kernel sends the Service addresses to the endpoints; there are no proxy ports)\n", v.mode)
	var rules string
	switch v.mode {
	case proxymode.IPTables:
		rules = "iptables-save -t nat | grep " + v.chainPrefix
	case proxymode.NFTables:
		rules = "nft list table inet " + strings.ToLower(v.chainPrefix) + "-kernel"
	default:
		rules = "ipvsadm -Ln"
	}
	fmt.Fprintf(w, `
Try:
  # the kernel picks an endpoint per connection and retries nothing: those given the dead one are refused
  for i in 1 2 3 4 5 6; do curl -s -m1 10.96.0.10/ || echo refused; done
  # ClientIP affinity: this node's connections stick to one backend
  for i in 1 2 3 4; do curl -s 10.96.0.11/; done
  # UDP (without nc: bash -c 'exec 3<>/dev/udp/10.96.0.12/53; echo hello >&3; timeout 1 head -n1 <&3')
  echo hello | nc -u -w1 10.96.0.12 53
  # the rules that carry them, and the path of one connection
  %[1]s
  uproxy explain 10.96.0.10:80 --metrics-address %[2]s
Manifests: %[3]s (edit it: uproxy reloads it). Ctrl-C stops%[4]s.
`, rules, v.metrics, v.path, stopsWhat(v))
}

// stopsWhat completes "Ctrl-C stops" with what else stopping does.
func stopsWhat(v demoView) string {
	if v.mode == proxymode.Userspace && v.rules == "none" {
		return ""
	}
	return " and removes the rules"
}

// demoService renders a Service and its EndpointSlice as YAML.
func demoService(name, proto, clusterIP string, port int, affinity string, eps []demoEndpoint) string {
	var b strings.Builder
	fmt.Fprintf(&b, `apiVersion: v1
kind: Service
metadata:
  name: %s
  namespace: demo
spec:
  clusterIP: %s
  ports:
  - name: main
    protocol: %s
    port: %d
`, name, clusterIP, proto, port)
	if affinity != "" {
		fmt.Fprintf(&b, "  sessionAffinity: %s\n", affinity)
	}
	// Every backend listens on its own port, and a slice's endpoints share their
	// ports, so each endpoint gets a slice of its own.
	for i, e := range eps {
		fmt.Fprintf(&b, `---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: %s-%d
  namespace: demo
  labels:
    kubernetes.io/service-name: %s
addressType: IPv4
ports:
- name: main
  protocol: %s
  port: %d
endpoints:
- addresses: [%q]
  conditions: {ready: true}
`, name, i+1, name, proto, e.port, e.ip)
	}
	return b.String()
}
