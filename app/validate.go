package app

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/uproxy/uproxy/affinity"
	"github.com/uproxy/uproxy/app/registry"
	"github.com/uproxy/uproxy/kernelmodes/ipvs"
	"github.com/uproxy/uproxy/netfilter/conntrack"
	"github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/proxier"
	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/rules"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/source/kube"
)

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
	// waitAfterHandover: once handed over, wait for a signal rather than exit.
	waitAfterHandover bool
}

// inPod reports whether the process runs in a Kubernetes pod: the kubelet
// gives every container KUBERNETES_SERVICE_HOST, host network or not.
func inPod() bool { return os.Getenv("KUBERNETES_SERVICE_HOST") != "" }

// maxEventLoops bounds --event-loops: more threads than this only contend.
const maxEventLoops = 256

// maxEvents bounds --events: the ring of recent connections is allocated
// whole at start (about 200 bytes an event with its attempts), so a bound of a
// hundred thousand keeps it near 20 MB.
const maxEvents = 100_000

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
	switch o.afterHandover {
	case "exit", "wait":
		c.waitAfterHandover = o.afterHandover == "wait"
	case "auto":
		c.waitAfterHandover = inPod()
	default:
		return nil, fmt.Errorf("--after-handover %q: want exit, wait or auto", o.afterHandover)
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
