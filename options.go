package main

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/uproxy/uproxy/affinity"
	"github.com/uproxy/uproxy/proxier"
	"github.com/uproxy/uproxy/socket"
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
	scheduler          string
	metricsBindAddress string
	healthzBindAddress string
	syncPeriod         time.Duration
	minSyncPeriod      time.Duration
	chainPrefix        string
	nodePortAddresses  []string
	hostnameOverride   string
	shutdownGrace      time.Duration
	cleanup            bool
	cleanupOnExit      bool
	debug              bool
	events             int
	ejectAfter         int
}

func defaultOptions() *options {
	return &options{
		rules:              "auto",
		bindAddress:        "0.0.0.0",
		udpTimeout:         250 * time.Millisecond,
		udpMaxClients:      4096,
		dialTimeouts:       "250ms,500ms,1s,2s",
		scheduler:          "rr",
		metricsBindAddress: "127.0.0.1:10249",
		healthzBindAddress: "0.0.0.0:10256",
		syncPeriod:         30 * time.Second,
		minSyncPeriod:      time.Second,
		chainPrefix:        "UPROXY",
		shutdownGrace:      5 * time.Second,
		debug:              true,
		events:             256,
		ejectAfter:         3,
	}
}

func (o *options) addFlags(cmd *cobra.Command) {
	f := cmd.Flags()
	f.StringVar(&o.services, "services", o.services, "Service and EndpointSlice manifests (a YAML/JSON file or a directory of them), reloaded on change")
	f.StringVar(&o.rules, "rules", o.rules, "how virtual IPs reach the proxy ports: iptables, none, or auto (iptables when running as root)")
	f.StringVar(&o.bindAddress, "bind-address", o.bindAddress, "address the proxy ports listen on (0.0.0.0: every address of both families)")
	f.StringVar(&o.proxyPortRange, "proxy-port-range", o.proxyPortRange, "range of proxy ports, FIRST-LAST or FIRST+OFFSET (empty: chosen by the kernel)")
	f.DurationVar(&o.udpTimeout, "udp-timeout", o.udpTimeout, "how long an idle UDP client keeps its backend")
	f.IntVar(&o.udpMaxClients, "udp-max-clients", o.udpMaxClients, "most UDP clients tracked per Service port")
	f.StringVar(&o.dialTimeouts, "dial-timeouts", o.dialTimeouts, "per-attempt TCP dial timeouts; one attempt per entry, each to another endpoint while any remains")
	f.StringVar(&o.scheduler, "scheduler", o.scheduler, "backend scheduler: "+strings.Join(affinity.Schedulers, ", "))
	f.StringVar(&o.metricsBindAddress, "metrics-bind-address", o.metricsBindAddress, "address of /metrics and /debug (empty: off)")
	f.StringVar(&o.healthzBindAddress, "healthz-bind-address", o.healthzBindAddress, "address of /healthz and /livez (empty: off)")
	f.DurationVar(&o.syncPeriod, "sync-period", o.syncPeriod, "most time between two syncs")
	f.DurationVar(&o.minSyncPeriod, "min-sync-period", o.minSyncPeriod, "least time between two syncs")
	f.StringVar(&o.chainPrefix, "chain-prefix", o.chainPrefix, "prefix of every iptables chain uproxy owns")
	f.StringSliceVar(&o.nodePortAddresses, "nodeport-addresses", o.nodePortAddresses, "CIDRs of the node addresses NodePorts answer on (empty: all)")
	f.StringVar(&o.hostnameOverride, "hostname-override", o.hostnameOverride, "this node's name (default: the hostname)")
	f.DurationVar(&o.shutdownGrace, "shutdown-grace", o.shutdownGrace, "on SIGTERM, how long open connections may finish before they are closed")
	f.BoolVar(&o.cleanup, "cleanup", o.cleanup, "remove every rule and chain uproxy installs, then exit")
	f.BoolVar(&o.cleanupOnExit, "cleanup-on-exit", o.cleanupOnExit, "remove the portal rules when the proxy exits (by default they stay: while no proxy runs, connections to Service IPs are refused at once instead of leaving the node unproxied, and a restarted proxy takes over at its first sync)")
	f.BoolVar(&o.debug, "debug-handlers", o.debug, "serve /debug/services and /debug/events on the metrics address")
	f.IntVar(&o.events, "events", o.events, "how many recent connections (and ejections) /debug/events keeps")
	f.IntVar(&o.ejectAfter, "eject-after", o.ejectAfter, "consecutive failed dials that eject an endpoint from new picks for a while (1s, doubling up to 30s while it keeps failing; never the last endpoint); 0: off")
}

// config is the validated form of options.
type config struct {
	proxier     proxier.Config
	rules       string // "iptables" or "none"
	prefixes    []netip.Prefix
	nodeName    string
	metricsAddr string
	healthzAddr string
}

// validate checks every flag and says which one is wrong and why.
func (o *options) validate() (*config, error) {
	c := &config{metricsAddr: o.metricsBindAddress, healthzAddr: o.healthzBindAddress}
	var err error
	if c.proxier.BindAddress, err = netip.ParseAddr(o.bindAddress); err != nil {
		return nil, fmt.Errorf("--bind-address %q: not an IP address", o.bindAddress)
	}
	if c.proxier.PortRange, err = proxier.ParsePortRange(o.proxyPortRange); err != nil {
		return nil, fmt.Errorf("--proxy-port-range: %w", err)
	}
	if o.udpTimeout <= 0 {
		return nil, fmt.Errorf("--udp-timeout %v: must be positive", o.udpTimeout)
	}
	c.proxier.UDPTimeout = o.udpTimeout
	if o.udpMaxClients <= 0 {
		return nil, fmt.Errorf("--udp-max-clients %d: must be positive", o.udpMaxClients)
	}
	c.proxier.UDPMaxClients = o.udpMaxClients
	if c.proxier.DialTimeouts, err = socket.ParseDialTimeouts(o.dialTimeouts); err != nil {
		return nil, fmt.Errorf("--dial-timeouts: %w", err)
	}
	if err := affinity.ValidScheduler(o.scheduler); err != nil {
		return nil, fmt.Errorf("--scheduler: %w", err)
	}
	c.proxier.Scheduler = o.scheduler
	for _, a := range []struct{ flag, v string }{{"--metrics-bind-address", o.metricsBindAddress}, {"--healthz-bind-address", o.healthzBindAddress}} {
		if a.v == "" {
			continue
		}
		if _, _, err := net.SplitHostPort(a.v); err != nil {
			return nil, fmt.Errorf("%s %q: want HOST:PORT", a.flag, a.v)
		}
	}
	if o.syncPeriod <= 0 {
		return nil, fmt.Errorf("--sync-period %v: must be positive", o.syncPeriod)
	}
	if o.minSyncPeriod < 0 || o.minSyncPeriod > o.syncPeriod {
		return nil, fmt.Errorf("--min-sync-period %v: must be between 0 and --sync-period (%v)", o.minSyncPeriod, o.syncPeriod)
	}
	if o.chainPrefix == "" || len(o.chainPrefix) > 9 || strings.ContainsAny(o.chainPrefix, " \t\"'") {
		return nil, fmt.Errorf("--chain-prefix %q: want 1-9 characters without spaces or quotes (the longest chain, PREFIX-NODEPORT-NON-LOCAL, must fit iptables' 28)", o.chainPrefix)
	}
	if strings.HasPrefix(o.chainPrefix, "KUBE") {
		return nil, fmt.Errorf("--chain-prefix %q: KUBE* chains belong to kube-proxy", o.chainPrefix)
	}
	for _, s := range o.nodePortAddresses {
		p, err := netip.ParsePrefix(strings.TrimSpace(s))
		if err != nil {
			return nil, fmt.Errorf("--nodeport-addresses %q: not a CIDR", s)
		}
		c.prefixes = append(c.prefixes, p.Masked())
	}
	if o.ejectAfter < 0 {
		return nil, fmt.Errorf("--eject-after %d: must not be negative", o.ejectAfter)
	}
	c.proxier.EjectAfter = o.ejectAfter
	if o.shutdownGrace < 0 {
		return nil, fmt.Errorf("--shutdown-grace %v: must not be negative", o.shutdownGrace)
	}
	switch o.rules {
	case "iptables", "none":
		c.rules = o.rules
	case "auto", "":
		c.rules = "none"
		if os.Geteuid() == 0 {
			c.rules = "iptables"
		}
	default:
		return nil, fmt.Errorf("--rules %q: want iptables, none or auto", o.rules)
	}
	c.nodeName = o.hostnameOverride
	if c.nodeName == "" {
		if c.nodeName, err = os.Hostname(); err != nil {
			return nil, fmt.Errorf("--hostname-override not given and the hostname is unknown: %w", err)
		}
	}
	c.nodeName = strings.ToLower(strings.TrimSpace(c.nodeName))
	return c, nil
}
