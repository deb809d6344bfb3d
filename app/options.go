package app

import (
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/uproxy/uproxy/affinity"
	"github.com/uproxy/uproxy/proxyconfig"
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
	takeOver           bool
	crashHolder        bool
	afterHandover      string
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
		takeOver:           true,
		afterHandover:      "auto",
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
	f.BoolVar(&o.takeOver, "take-over", o.takeOver, "take over from a uproxy of the same --chain-prefix already running on the node: its listening sockets (proxy ports, NodePorts, metrics and healthz), its rules lock, its established TCP connections and its UDP clients move here with no connection refused, and it drains the dials in progress and exits; false: refuse to start beside it, as before")
	f.BoolVar(&o.crashHolder, "crash-holder", o.crashHolder, "run as two processes: a small holder that keeps a copy of every proxy socket, and the uproxy that serves, which the holder starts again at once when it crashes (a SIGKILL, an OOM kill, a panic): new connections wait in the proxy sockets' backlogs meanwhile instead of being refused; the holder passes SIGTERM and SIGINT on and exits with the server's code")
	f.StringVar(&o.afterHandover, "after-handover", o.afterHandover, "what a uproxy does once a successor has taken over from it and it has drained what stayed: exit (exit 0), wait (serve nothing, hold no socket, and exit 0 on SIGTERM: in a pod, whose container an exit would restart, and the restarted one take back over), or auto (wait when running in a Kubernetes pod, exit otherwise)")
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

const chainPrefixHelp = "prefix of every iptables chain uproxy owns; lower-cased, the name of its nftables table (--rules nftables). uproxy marks its tables, and its jumps to its chains, with comments: another program's table or chain of uproxy's names (e.g. inet filter for FILTER, Docker's DOCKER-FORWARD for DOCKER) is never changed or deleted, and a start that would write the table, or under a prefix with such a chain, is refused"
