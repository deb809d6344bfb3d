package main

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/affinity"
	"github.com/uproxy/uproxy/kernelmodes/ipvs"
	"github.com/uproxy/uproxy/netfilter/conntrack"
	"github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/proxier"
	"github.com/uproxy/uproxy/proxyconfig"
	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/proxymode/registry"
	"github.com/uproxy/uproxy/rules"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/socket"
	"github.com/uproxy/uproxy/source/kube"
)

// options are the command-line flags, named as kube-proxy names them where it has them.
type options struct {
	services           string
	rules              string
	bindAddress        string
	proxyPortRange     string
	udpTimeout         time.Duration
	udpMaxClients      int
	dialTimeouts       string
	tcpKeepAlive       time.Duration
	tcpIdleTimeout     time.Duration
	scheduler          string
	proxyMode          string
	metricsBindAddress string
	healthzBindAddress string
	syncPeriod         time.Duration
	minSyncPeriod      time.Duration
	chainPrefix        string
	nodePortAddresses  []string
	localhostNodePorts bool
	clusterCIDR        string
	masqueradeAll      bool
	hostnameOverride   string
	nodeLabels         map[string]string
	shutdownGrace      time.Duration
	cleanup            bool
	cleanupOnExit      bool
	debug              bool
	profiling          bool
	events             int
	ejectAfter         int
	eventLoops         int
	dialMarkBit        int
	keepClientAddress  bool
	clientMarkBit      int
	dialHedge          time.Duration
	retryBudget        string
	conntrack          conntrackOptions

	// The Kubernetes source, used when --services is not given.
	kubeconfig         string
	master             string
	kubeAPIQPS         float32
	kubeAPIBurst       int
	kubeAPIContentType string
	serviceProxyName   string
	configSyncPeriod   time.Duration
	// configFile is a KubeProxyConfiguration that decides the flags standing
	// for its fields (applyConfigFile).
	configFile string
	// configFields maps the flags configFile set to the settings of their
	// fields, for errors.
	configFields map[string]proxyconfig.Setting
	// configNotes are applyConfigFile's log lines, until logConfigNotes.
	configNotes []configNote
	flags       *pflag.FlagSet // the flags, to tell given from default ones
}

func defaultOptions() *options {
	return &options{
		rules:              "auto",
		bindAddress:        "0.0.0.0",
		udpTimeout:         250 * time.Millisecond,
		udpMaxClients:      4096,
		dialTimeouts:       "250ms,500ms,1s,2s",
		tcpKeepAlive:       socket.DefaultKeepAlive,
		scheduler:          "rr",
		proxyMode:          "userspace",
		metricsBindAddress: "127.0.0.1:10249",
		healthzBindAddress: "0.0.0.0:10256",
		syncPeriod:         30 * time.Second,
		minSyncPeriod:      time.Second,
		chainPrefix:        "UPROXY",
		shutdownGrace:      5 * time.Second,
		debug:              true,
		events:             256,
		kubeAPIQPS:         kube.DefaultQPS,
		kubeAPIBurst:       kube.DefaultBurst,
		kubeAPIContentType: kube.DefaultContentType,
		configSyncPeriod:   15 * time.Minute,
		ejectAfter:         3,
		dialMarkBit:        13,
		keepClientAddress:  true,
		clientMarkBit:      12,
		localhostNodePorts: true,
		conntrack:          defaultConntrackOptions(),
	}
}

func (o *options) addFlags(cmd *cobra.Command) {
	f := cmd.Flags()
	o.flags = f
	f.StringVar(&o.services, "services", o.services, "Service and EndpointSlice manifests (a YAML/JSON file or a directory of them), reloaded on change")
	f.StringVar(&o.rules, "rules", o.rules, "how virtual IPs reach the proxy ports: nftables (one table of maps), iptables (a rule per Service port), none, or auto (as root: nftables where nft and the kernel support it, else iptables; otherwise none)")
	f.StringVar(&o.bindAddress, "bind-address", o.bindAddress, "address the proxy ports listen on (0.0.0.0: every address of both families)")
	f.StringVar(&o.proxyPortRange, "proxy-port-range", o.proxyPortRange, "range of proxy ports, FIRST-LAST or FIRST+OFFSET (empty: the kernel's ephemeral port range, less the ports the node reserves in net.ipv4.ip_local_reserved_ports)")
	f.DurationVar(&o.udpTimeout, "udp-timeout", o.udpTimeout, "how long an idle UDP client keeps its backend")
	f.IntVar(&o.udpMaxClients, "udp-max-clients", o.udpMaxClients, "most UDP clients tracked per Service port")
	f.StringVar(&o.dialTimeouts, "dial-timeouts", o.dialTimeouts, "per-attempt TCP dial timeouts; one attempt per entry, each to another endpoint while any remains")
	f.DurationVar(&o.tcpKeepAlive, "tcp-keepalive", o.tcpKeepAlive, "TCP keepalive on both sockets of every proxied connection: probes after this long without a packet, then every this long, until net.ipv4.tcp_keepalive_probes go unanswered (whole seconds, up to 32767s); 0: off")
	f.DurationVar(&o.tcpIdleTimeout, "tcp-idle-timeout", o.tcpIdleTimeout, "reset both sides of a proxied TCP connection once no byte has moved either way for this long; 0: never, as kube-proxy")
	f.StringVar(&o.scheduler, "scheduler", o.scheduler, "backend scheduler: "+strings.Join(affinity.Schedulers, ", ")+" (ipvs mode: also wrr, wlc)")
	f.StringVar(&o.proxyMode, "proxy-mode", o.proxyMode, "userspace (proxy ports, retries), nftables or iptables (kernel DNAT), ipvs, or auto (ipvs, else nftables, else iptables, else userspace)")
	f.StringVar(&o.metricsBindAddress, "metrics-bind-address", o.metricsBindAddress, "address of /metrics and /debug (empty: off)")
	f.StringVar(&o.healthzBindAddress, "healthz-bind-address", o.healthzBindAddress, "address of /healthz and /livez (empty: off)")
	f.DurationVar(&o.syncPeriod, "sync-period", o.syncPeriod, "most time between two syncs")
	f.DurationVar(&o.minSyncPeriod, "min-sync-period", o.minSyncPeriod, "least time between two syncs")
	f.StringVar(&o.chainPrefix, "chain-prefix", o.chainPrefix, chainPrefixHelp)
	f.StringSliceVar(&o.nodePortAddresses, "nodeport-addresses", o.nodePortAddresses, "CIDRs of the node addresses NodePorts answer on, or the single word primary: the node's primary IP of each family (--bind-address when given, else the first global address of each family). Empty: every address, but primary in the nftables mode, as kube-proxy")
	f.BoolVar(&o.localhostNodePorts, "iptables-localhost-nodeports", o.localhostNodePorts, "iptables mode: NodePorts also answer on 127.0.0.0/8 (IPv4 only), as kube-proxy's: sets net.ipv4.conf.all.route_localnet=1 and drops packets to 127.0.0.0/8 from other hosts; false leaves route_localnet alone and NodePorts off loopback")
	f.StringVar(&o.clusterCIDR, "cluster-cidr", o.clusterCIDR, "the pods' network, one CIDR per address family (comma-separated for dual stack). Traffic to cluster IPs from outside it is masqueraded (the userspace mode dials its endpoints from the node), and the kernel modes send pods' traffic to a Service's external addresses to all its endpoints whatever its externalTrafficPolicy, as kube-proxy")
	f.BoolVar(&o.masqueradeAll, "masquerade-all", o.masqueradeAll, "masquerade all traffic to cluster IPs, whatever its source (the userspace mode: dial every endpoint from the node)")
	f.StringVar(&o.hostnameOverride, "hostname-override", o.hostnameOverride, "this node's name (default: the hostname)")
	f.StringToStringVar(&o.nodeLabels, "node-labels", o.nodeLabels, "this node's labels, KEY=VALUE,... (with --services only; the API server's Node has its own): topology.kubernetes.io/zone sets the zone for topology hints")
	f.DurationVar(&o.shutdownGrace, "shutdown-grace", o.shutdownGrace, "on SIGTERM, how long open connections may finish before they are closed")
	f.BoolVar(&o.cleanup, "cleanup", o.cleanup, "remove every rule and chain uproxy installs, then exit (as uproxy cleanup, which has --force for the rules of a running uproxy)")
	f.BoolVar(&o.cleanupOnExit, "cleanup-on-exit", o.cleanupOnExit, "remove the portal rules when the proxy exits (by default they stay: while no proxy runs, connections to Service IPs are refused at once instead of leaving the node unproxied, and a restarted proxy takes over at its first sync)")
	f.BoolVar(&o.debug, "debug-handlers", o.debug, "serve the /debug/ page, /debug/services and /debug/events on the metrics address")
	f.BoolVar(&o.profiling, "profiling", o.profiling, "serve Go's profiles (CPU, heap, goroutines) under /debug/pprof/ on the metrics address, as kube-proxy")
	f.StringVar(&o.kubeconfig, "kubeconfig", o.kubeconfig, "kubeconfig file of the API server to follow Services and EndpointSlices from (without --services; neither this nor --master: in-cluster config)")
	f.StringVar(&o.master, "master", o.master, "address of the API server (overrides the kubeconfig's)")
	f.Float32Var(&o.kubeAPIQPS, "kube-api-qps", o.kubeAPIQPS, "requests per second to the API server")
	f.IntVar(&o.kubeAPIBurst, "kube-api-burst", o.kubeAPIBurst, "burst of requests to the API server")
	f.StringVar(&o.kubeAPIContentType, "kube-api-content-type", o.kubeAPIContentType, "content type of requests to the API server")
	f.StringVar(&o.serviceProxyName, "service-proxy-name", o.serviceProxyName, "handle only the Services labelled "+kube.LabelServiceProxyName+"=NAME (empty: only those without the label, as kube-proxy)")
	f.DurationVar(&o.configSyncPeriod, "config-sync-period", o.configSyncPeriod, "how often the Service and EndpointSlice caches are replayed (0: never)")
	f.StringVar(&o.configFile, "config", o.configFile, "KubeProxyConfiguration file (kubeproxy.config.k8s.io/v1alpha1): as in kube-proxy, it decides every flag that stands for one of its fields (a field left out or zero: kube-proxy's default) and those flags are ignored on the command line, except --hostname-override")
	f.IntVar(&o.events, "events", o.events, "how many recent connections (and ejections) /debug/events keeps, at most 100000; 0: none (connections are not recorded)")
	f.IntVar(&o.dialMarkBit, "dial-mark-bit", o.dialMarkBit, "with --rules iptables or nftables: bit of the packet mark on uproxy's own connections to endpoints, which skip the portal rules instead of trying one per Service port (0-31, distinct from kube-proxy's 14 and 15); -1: none")
	f.BoolVar(&o.keepClientAddress, "preserve-client-address", o.keepClientAddress, "with --rules iptables or nftables: dial endpoints from the client's own address where kube-proxy would not masquerade (a pod to a ClusterIP, anyone to an externalTrafficPolicy Local Service), so endpoints and network policies see the client; needs --dial-mark-bit and --client-address-mark-bit")
	f.IntVar(&o.clientMarkBit, "client-address-mark-bit", o.clientMarkBit, "with --preserve-client-address: bit of the packet and conntrack mark that brings the replies to a dial from a client's address back to uproxy, through a policy route (table and priority "+strconv.Itoa(rules.ClientAddressTable)+") (0-31, distinct from --dial-mark-bit and kube-proxy's 14 and 15); -1: none, which turns --preserve-client-address off")
	f.IntVar(&o.eventLoops, "event-loops", o.eventLoops, "event loops (threads) carrying the userspace mode's TCP connections and UDP flows; 0: one per CPU but one, at least one")
	f.DurationVar(&o.dialHedge, "dial-hedge", o.dialHedge, "hedge TCP dials: when an attempt has not connected after this long, start the next one to another endpoint while it stays pending; the first to connect serves (Service annotation "+service.AnnotationDialHedge+" overrides); 0: off")
	f.StringVar(&o.retryBudget, "retry-budget", o.retryBudget, "cap TCP retries and hedges at this percentage of first attempts per Service port, a token bucket of 10 (Service annotation "+service.AnnotationRetryBudget+" overrides); empty or 0: no cap")
	o.conntrack.addFlags(f)
	f.IntVar(&o.ejectAfter, "eject-after", o.ejectAfter, "consecutive failed dials that eject an endpoint from new picks for a while (1s, doubling up to 30s while it keeps failing; never the last endpoint); 0: off")
}

// config is the validated form of options: what every mode takes, each mode's
// own section, and what the program itself needs.
type config struct {
	// common has the flags' part of what every mode takes (--chain-prefix,
	// --nodeport-addresses CIDRs, --cluster-cidr, --masquerade-all); the
	// node's IPs and primary NodePorts are added at start (startMode).
	common proxymode.Common
	// specific has each mode's own flags; the userspace mode's --rules is
	// auto only as root, resolved at start.
	specific registry.Specific
	// nodePorts says --nodeport-addresses is the word primary.
	nodePorts   registry.NodePorts
	nodeName    string
	zone        string // from --node-labels
	metricsAddr string
	healthzAddr string
	// conntrack are the sysctls set at start where rules are programmed.
	conntrack conntrack.Sysctls
}

// maxEventLoops bounds --event-loops: more threads than this only contend.
const maxEventLoops = 256

// maxEvents bounds --events: the ring of recent connections is allocated
// whole at start (about 200 bytes an event with its attempts), so a bound of a
// hundred thousand keeps it near 20 MB.
const maxEvents = 100_000

const chainPrefixHelp = "prefix of every iptables chain uproxy owns; lower-cased, the name of its nftables table (--rules nftables). uproxy marks its tables, and its jumps to its chains, with comments: another program's table or chain of uproxy's names (e.g. inet filter for FILTER, Docker's DOCKER-FORWARD for DOCKER) is never changed or deleted, and a start that would write the table, or under a prefix with such a chain, is refused"

// kube-proxy's packet mark bits (its --iptables-masquerade-bit default, and the
// drop mark of its iptables mode): the dial mark must not collide with them when
// both proxies run on a node.
const (
	kubeProxyMasqueradeBit = 14
	kubeProxyDropBit       = 15
)

// validate checks every flag and says which one is wrong and why.
func (o *options) validate() (*config, error) {
	c := &config{metricsAddr: o.metricsBindAddress, healthzAddr: o.healthzBindAddress}
	var err error
	if c.specific.Userspace.BindAddress, err = netip.ParseAddr(o.bindAddress); err != nil {
		return nil, fmt.Errorf("--bind-address %q: not an IP address", o.bindAddress)
	}
	if a := c.specific.Userspace.BindAddress; !a.IsUnspecified() && (a.IsMulticast() || a == netip.AddrFrom4([4]byte{255, 255, 255, 255})) {
		return nil, fmt.Errorf("--bind-address %s: a multicast or broadcast address, where no client connects; want an address of this node, or 0.0.0.0 / :: for every one", a)
	}
	if c.specific.Userspace.PortRange, err = proxier.ParsePortRange(o.proxyPortRange); err != nil {
		return nil, fmt.Errorf("--proxy-port-range: %w", err)
	}
	if o.udpTimeout <= 0 {
		return nil, fmt.Errorf("--udp-timeout %v: must be positive", o.udpTimeout)
	}
	c.specific.Userspace.UDPTimeout = o.udpTimeout
	if o.udpMaxClients <= 0 {
		return nil, fmt.Errorf("--udp-max-clients %d: must be positive", o.udpMaxClients)
	}
	c.specific.Userspace.UDPMaxClients = o.udpMaxClients
	if c.specific.Userspace.DialTimeouts, err = service.ParseDialTimeouts(o.dialTimeouts); err != nil {
		return nil, fmt.Errorf("--dial-timeouts: %w", err)
	}
	switch {
	case o.tcpKeepAlive == 0:
		c.specific.Userspace.TCPKeepAlive = -1 // off; the Config's zero is the default
	case o.tcpKeepAlive < time.Second || o.tcpKeepAlive > 32767*time.Second:
		return nil, fmt.Errorf("--tcp-keepalive %v: want 0 (off) or 1s to 32767s, the kernel's bounds", o.tcpKeepAlive)
	case o.tcpKeepAlive%time.Second != 0:
		return nil, fmt.Errorf("--tcp-keepalive %v: want whole seconds (the kernel counts keepalive times in seconds)", o.tcpKeepAlive)
	default:
		c.specific.Userspace.TCPKeepAlive = o.tcpKeepAlive
	}
	if o.tcpIdleTimeout < 0 {
		return nil, fmt.Errorf("--tcp-idle-timeout %v: must not be negative (0: never)", o.tcpIdleTimeout)
	}
	c.specific.Userspace.TCPIdleTimeout = o.tcpIdleTimeout
	if !slices.Contains(affinity.Schedulers, o.scheduler) && !slices.Contains(ipvs.Schedulers, o.scheduler) {
		return nil, fmt.Errorf("--scheduler %q: want one of %s (ipvs mode: also wrr, wlc)", o.scheduler, strings.Join(affinity.Schedulers, ", "))
	}
	c.specific.Userspace.Scheduler = o.scheduler
	c.specific.IPVS.Scheduler = o.scheduler
	switch o.proxyMode {
	case proxymode.Userspace:
		if err := registry.CheckScheduler(proxymode.Userspace, o.scheduler); err != nil {
			return nil, err
		}
	case proxymode.Auto, "", proxymode.IPTables, proxymode.NFTables, proxymode.IPVS:
	default:
		return nil, fmt.Errorf("--proxy-mode %q: want auto, userspace, iptables, nftables or ipvs", o.proxyMode)
	}
	if o.proxyMode != proxymode.Auto && o.proxyMode != "" {
		// A mode that is asked for is the one that runs, if any does: the
		// flags it does not use are refused now, before anything is logged.
		if err := o.checkModeFlags(o.proxyMode); err != nil {
			return nil, err
		}
	}
	if o.events < 0 || o.events > maxEvents {
		return nil, fmt.Errorf("--events %d: want 0 (none kept) to %d", o.events, maxEvents)
	}
	for _, a := range []struct{ flag, v string }{{"--metrics-bind-address", o.metricsBindAddress}, {"--healthz-bind-address", o.healthzBindAddress}} {
		if a.v == "" {
			continue
		}
		_, port, err := net.SplitHostPort(a.v)
		if err != nil {
			return nil, fmt.Errorf("%s %q: want HOST:PORT", a.flag, a.v)
		}
		if n, err := strconv.ParseUint(port, 10, 16); err != nil || (port != "0" && n == 0) {
			return nil, fmt.Errorf("%s %q: port %q is not a number from 0 to 65535", a.flag, a.v, port)
		}
	}
	if overlap(o.metricsBindAddress, o.healthzBindAddress) {
		return nil, fmt.Errorf("--metrics-bind-address %s and --healthz-bind-address %s: the same port on overlapping addresses; each needs its own", o.metricsBindAddress, o.healthzBindAddress)
	}
	if err := o.checkSyncPeriods(); err != nil {
		return nil, err
	}
	if err := checkChainPrefix(o.chainPrefix); err != nil {
		return nil, err
	}
	c.common.ChainPrefix = o.chainPrefix
	if c.common.NodePortAddresses, c.nodePorts.Primary, err = parseNodePortAddresses(o.nodePortAddresses); err != nil {
		return nil, err
	}
	c.specific.IPTables.LocalhostNodePorts = o.localhostNodePorts
	if c.common.ClusterCIDRs, err = parseClusterCIDRs(o.clusterCIDR); err != nil {
		return nil, err
	}
	c.common.MasqueradeAll = o.masqueradeAll
	if o.ejectAfter < 0 {
		return nil, fmt.Errorf("--eject-after %d: must not be negative", o.ejectAfter)
	}
	c.specific.Userspace.EjectAfter = o.ejectAfter
	if o.dialHedge < 0 {
		return nil, fmt.Errorf("--dial-hedge %v: must not be negative (0: off)", o.dialHedge)
	}
	c.specific.Userspace.DialHedge = o.dialHedge
	if o.retryBudget != "" {
		if c.specific.Userspace.RetryBudget, err = service.ParseRetryBudget(o.retryBudget); err != nil {
			return nil, fmt.Errorf("--retry-budget: %w", err)
		}
	}
	if o.eventLoops < 0 || o.eventLoops > maxEventLoops {
		return nil, fmt.Errorf("--event-loops %d: want 0 (automatic) to %d", o.eventLoops, maxEventLoops)
	}
	c.specific.Userspace.EventLoops = o.eventLoops
	if o.dialMarkBit < -1 || o.dialMarkBit > 31 {
		return nil, fmt.Errorf("--dial-mark-bit %d: want a bit number from 0 to 31, or -1 for none", o.dialMarkBit)
	}
	if o.dialMarkBit == kubeProxyMasqueradeBit || o.dialMarkBit == kubeProxyDropBit {
		return nil, fmt.Errorf("--dial-mark-bit %d: kube-proxy marks packets with bit %d (masquerade) and %d (drop); choose another bit, or -1 for none",
			o.dialMarkBit, kubeProxyMasqueradeBit, kubeProxyDropBit)
	}
	if o.dialMarkBit >= 0 {
		c.specific.Userspace.DialMark = 1 << o.dialMarkBit
	}
	if o.clientMarkBit < -1 || o.clientMarkBit > 31 {
		return nil, fmt.Errorf("--client-address-mark-bit %d: want a bit number from 0 to 31, or -1 for none", o.clientMarkBit)
	}
	if o.clientMarkBit == kubeProxyMasqueradeBit || o.clientMarkBit == kubeProxyDropBit {
		return nil, fmt.Errorf("--client-address-mark-bit %d: kube-proxy marks packets with bit %d (masquerade) and %d (drop); choose another bit, or -1 for none",
			o.clientMarkBit, kubeProxyMasqueradeBit, kubeProxyDropBit)
	}
	if o.clientMarkBit >= 0 && o.clientMarkBit == o.dialMarkBit {
		return nil, fmt.Errorf("--client-address-mark-bit %d: --dial-mark-bit uses that bit; choose another", o.clientMarkBit)
	}
	if o.keepClientAddress && o.clientMarkBit >= 0 {
		c.specific.Userspace.ClientAddressMark = 1 << o.clientMarkBit
	}
	if o.shutdownGrace < 0 {
		return nil, fmt.Errorf("--shutdown-grace %v: must not be negative", o.shutdownGrace)
	}
	if c.conntrack, err = o.conntrack.sysctls(); err != nil {
		return nil, err
	}
	if c.specific.Userspace.Rules, err = rules.ParseBackend(o.rules); err != nil {
		return nil, err
	}
	if c.specific.Userspace.Rules == rules.BackendAuto && os.Geteuid() != 0 {
		// Only root can have portals; as root the kernel decides, when the
		// proxy starts (rules.ChooseBackend).
		c.specific.Userspace.Rules = rules.BackendNone
	}
	if err := kube.ValidateProxyName(o.serviceProxyName); err != nil {
		return nil, fmt.Errorf("--service-proxy-name: %w", err)
	}
	if o.kubeAPIQPS <= 0 {
		return nil, fmt.Errorf("--kube-api-qps %v: must be positive", o.kubeAPIQPS)
	}
	if o.kubeAPIBurst <= 0 {
		return nil, fmt.Errorf("--kube-api-burst %d: must be positive", o.kubeAPIBurst)
	}
	if o.configSyncPeriod < 0 {
		return nil, fmt.Errorf("--config-sync-period %v: must not be negative", o.configSyncPeriod)
	}
	c.nodeName = o.hostnameOverride
	if c.nodeName == "" {
		if c.nodeName, err = os.Hostname(); err != nil {
			return nil, fmt.Errorf("--hostname-override not given and the hostname is unknown: %w", err)
		}
	}
	c.nodeName = strings.ToLower(strings.TrimSpace(c.nodeName))
	if c.zone, err = nodeZone(o.nodeLabels, o.services != ""); err != nil {
		return nil, err
	}
	if err := o.checkSourceFlags(); err != nil {
		return nil, err
	}
	return c, nil
}

// checkSyncPeriods checks --sync-period, and --min-sync-period against it.
// --config sets both from one section of the file: the error then names the
// file's fields, and when minSyncPeriod is the default of a field the file
// leaves out, it is syncPeriod, the one field the file sets, that is wrong.
func (o *options) checkSyncPeriods() error {
	if o.syncPeriod <= 0 {
		return fmt.Errorf("--sync-period %v: must be positive", o.syncPeriod)
	}
	if o.minSyncPeriod >= 0 && o.minSyncPeriod <= o.syncPeriod {
		return nil
	}
	least, fromFile := o.configFields["min-sync-period"]
	most := o.configFields["sync-period"]
	switch {
	case !fromFile:
		return fmt.Errorf("--min-sync-period %v: must be between 0 and --sync-period (%v)", o.minSyncPeriod, o.syncPeriod)
	case least.Defaulted:
		return fmt.Errorf("--config %s: field %q %v: must be at least %v, the default value of %s (which the file leaves out or zero)",
			o.configFile, most.Field, o.syncPeriod, o.minSyncPeriod, least.Field)
	}
	of := fmt.Sprint(o.syncPeriod)
	if most.Defaulted {
		of += ", its default value"
	}
	return fmt.Errorf("--config %s: field %q %v: must be between 0 and %s (%s)", o.configFile, least.Field, o.minSyncPeriod, most.Field, of)
}

// overlap reports whether two HOST:PORT addresses (checked) would claim the
// same socket: one port other than 0, and the same host, or an unspecified
// one, which takes every address of the port.
func overlap(a, b string) bool {
	if a == "" || b == "" {
		return false
	}
	ha, pa, _ := net.SplitHostPort(a)
	hb, pb, _ := net.SplitHostPort(b)
	if pa != pb || pa == "0" {
		return false
	}
	unspecified := func(h string) bool {
		ip, err := netip.ParseAddr(h)
		return h == "" || err == nil && ip.IsUnspecified()
	}
	return ha == hb || unspecified(ha) || unspecified(hb)
}

// checkChainPrefix checks --chain-prefix, for every command that touches rules
// (run, cleanup) before it touches any. A prefix beginning with KUBE, in any
// case, is kube-proxy's: its chains are KUBE-* and its nftables table
// kube-proxy (the table of a prefix is its lower case); uproxy must never
// program, nor remove, any of them.
func checkChainPrefix(prefix string) error {
	if _, err := iptables.ChainPrefix(prefix); err != nil || prefix == "" {
		return fmt.Errorf("--chain-prefix %q: want 1 to 9 letters, digits, '_' or '-' (the longest chain, PREFIX-NODEPORT-NON-LOCAL, must fit iptables' 28 characters)", prefix)
	}
	if strings.HasPrefix(strings.ToUpper(prefix), "KUBE") {
		return fmt.Errorf("--chain-prefix %q: KUBE* chains (in any case) belong to kube-proxy", prefix)
	}
	return nil
}

// applyConfigFile applies --config as kube-proxy v1.36 does: every flag that
// stands for a field of the KubeProxyConfiguration takes the file's value, or
// kube-proxy's default when the file leaves the field out or zero, and the
// command line's value of such a flag is ignored (with a warning here; kube-proxy
// is silent). The one exception among them is --hostname-override, which wins
// when given, as in kube-proxy. Flags without a field (--master, -v, uproxy's
// own) apply as given. What it has to say is logged by logConfigNotes, once
// the flags are known to be good.
func (o *options) applyConfigFile() error {
	if o.configFile == "" || o.flags == nil {
		return nil
	}
	settings, ignored, err := proxyconfig.Load(o.configFile)
	if err != nil {
		return fmt.Errorf("--config %w", err) // "--config FILE: ...": Load's errors begin with the file
	}
	for _, field := range ignored {
		o.note("Ignoring a kube-proxy setting uproxy does not use", "config", o.configFile, "field", field)
	}
	o.configFields = map[string]proxyconfig.Setting{}
	for _, st := range settings {
		fl := o.flags.Lookup(st.Flag)
		if fl == nil {
			return fmt.Errorf("--config %s: field %q: %q is not supported (no --%s flag)", o.configFile, st.Field, st.Value, st.Flag)
		}
		if st.Flag == "hostname-override" && fl.Changed && o.hostnameOverride != "" {
			if strings.TrimSpace(o.hostnameOverride) == "" {
				return fmt.Errorf("--hostname-override %q: empty once spaces are trimmed", o.hostnameOverride)
			}
			continue
		}
		value := st.Value
		if st.Default {
			value = fl.DefValue
		}
		if fl.Changed {
			o.note("Ignoring a flag that --config sets, as kube-proxy does", "flag", "--"+st.Flag, "given", fl.Value.String(), "config", o.configFile, "field", st.Field, "value", value)
		}
		if err := o.flags.Set(st.Flag, value); err != nil {
			// The flag set's error names the flag: the value's own says
			// what is wrong with the field.
			if verr := fl.Value.Set(value); verr != nil {
				err = verr
			}
			return fmt.Errorf("--config %s: field %q: %w", o.configFile, st.Field, err)
		}
		o.configFields[st.Flag] = st
	}
	return nil
}

// configNote is a line for the log, held until the flags are checked.
type configNote struct {
	msg           string
	keysAndValues []any
}

// note holds a line of applyConfigFile's for logConfigNotes.
func (o *options) note(msg string, keysAndValues ...any) {
	o.configNotes = append(o.configNotes, configNote{msg, keysAndValues})
}

// logConfigNotes logs what applyConfigFile had to say. The caller calls it
// once every flag is checked: a start that a bad flag refuses logs nothing
// before its error.
func (o *options) logConfigNotes() {
	for _, n := range o.configNotes {
		klog.InfoS(n.msg, n.keysAndValues...)
	}
	o.configNotes = nil
}

// configFieldError rewrites an error of validate about a flag that --config
// set so that it names the file and the field instead (validate's errors begin
// with the flag).
func (o *options) configFieldError(err error) error {
	msg := err.Error()
	for flag, st := range o.configFields {
		rest, ok := strings.CutPrefix(msg, "--"+flag)
		if ok && (rest == "" || rest[0] == ' ' || rest[0] == ':' || rest[0] == ',') {
			return &renamedError{msg: fmt.Sprintf("--config %s: field %q%s", o.configFile, st.Field, rest), err: err}
		}
	}
	return err
}

// renamedError is an error with another message, which still unwraps to it.
type renamedError struct {
	msg string
	err error
}

func (e *renamedError) Error() string { return e.msg }
func (e *renamedError) Unwrap() error { return e.err }

// nodePortAddressesPrimary is kube-proxy's word for "the node's primary IPs".
const nodePortAddressesPrimary = "primary"

// parseNodePortAddresses reads --nodeport-addresses as kube-proxy v1.36 takes
// it: CIDRs (an address with host bits set stands for its network), or the one
// word primary, alone.
func parseNodePortAddresses(values []string) (prefixes []netip.Prefix, primary bool, err error) {
	for _, v := range values {
		v = strings.TrimSpace(v)
		if v == nodePortAddressesPrimary {
			if len(values) != 1 {
				return nil, false, fmt.Errorf("--nodeport-addresses %q: primary stands alone, not beside CIDRs", strings.Join(values, ","))
			}
			return nil, true, nil
		}
		p, err := netip.ParsePrefix(v)
		if err != nil {
			return nil, false, fmt.Errorf("--nodeport-addresses %q: not a CIDR, nor primary", v)
		}
		prefixes = append(prefixes, p.Masked())
	}
	return prefixes, false, nil
}

// parseClusterCIDRs reads --cluster-cidr: empty, or one CIDR, or an IPv4 and an
// IPv6 one separated by a comma, as kube-proxy takes it. An address with host bits
// set stands for its network.
func parseClusterCIDRs(s string) ([]netip.Prefix, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var out []netip.Prefix
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		p, err := netip.ParsePrefix(part)
		if err != nil {
			return nil, fmt.Errorf("--cluster-cidr %q: %q is not a CIDR", s, part)
		}
		p = p.Masked()
		for _, q := range out {
			if q.Addr().Is6() == p.Addr().Is6() {
				return nil, fmt.Errorf("--cluster-cidr %q: %s and %s are both %s; want at most one CIDR per address family", s, q, p, iptables.FamilyName(p.Addr().Is6()))
			}
		}
		out = append(out, p)
	}
	return out, nil
}
