package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"runtime"
	"slices"

	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/affinity"
	"github.com/uproxy/uproxy/kernelmodes"
	kiptables "github.com/uproxy/uproxy/kernelmodes/iptables"
	"github.com/uproxy/uproxy/kernelmodes/ipvs"
	knftables "github.com/uproxy/uproxy/kernelmodes/nftables"
	"github.com/uproxy/uproxy/nodeaddr"
	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/proxier"
	"github.com/uproxy/uproxy/rules"
	"github.com/uproxy/uproxy/socket/poll"
	"github.com/uproxy/uproxy/syncloop"
)

// proxyMode is what runProxy drives: the userspace proxier or a kernel mode.
type proxyMode interface {
	syncloop.Mode
	observe.ServicesView
	// Cleanup removes what the mode programmed into the kernel.
	Cleanup() error
}

// newProxyMode resolves --proxy-mode, builds the chosen mode and removes what
// other modes left behind. px is the proxier when the mode is userspace, else
// nil. Everything that can fail is checked before any rule is touched: a start
// that fails leaves the node's rules as they were. lock, when not nil, holds this
// node's rules for the process (see lockRules); the caller closes it at exit.
func newProxyMode(o *options, cfg *config, events *observe.Events) (name string, mode proxyMode, px *proxier.Proxier, lock *rulesLock, err error) {
	name, reason, err := kernelmodes.Choose(o.proxyMode, o.scheduler)
	if err != nil {
		return "", nil, nil, nil, err
	}
	klog.InfoS("Proxy mode", "mode", name, "reason", reason)
	if err := o.checkModeFlags(name); err != nil {
		return "", nil, nil, nil, err
	}
	ips := nodeIPs(cfg.proxier.BindAddress)
	if err := resolveNodePortAddresses(cfg, name, ips, primaryIPs(cfg.proxier.BindAddress, ips)); err != nil {
		return "", nil, nil, nil, err
	}
	if name == kernelmodes.Userspace {
		cfg.rules = chooseRules(cfg.rules, o.chainPrefix, ips)
	}
	// --rules none runs unprivileged and touches no rule; everything else
	// programs the node's rules, which one uproxy at a time may do.
	touchesRules := name != kernelmodes.Userspace || cfg.rules != "none"
	if touchesRules {
		if lock, err = lockRules(o.chainPrefix); err != nil {
			return "", nil, nil, nil, err
		}
	}
	defer func() {
		if err != nil {
			lock.Close()
			lock = nil
		}
	}()
	if mode, px, err = buildMode(name, o, cfg, events, ips); err != nil {
		return "", nil, nil, nil, err
	}
	// kube-proxy sets the conntrack sysctls in every mode; the userspace mode
	// without rules runs unprivileged and needs none of them.
	if touchesRules {
		if err = o.setConntrackSysctls(cfg.conntrack); err != nil {
			if px != nil {
				px.Shutdown(context.Background()) // its event loops; it has no port yet
			}
			return "", nil, nil, nil, err
		}
	}

	// Switching modes, or the userspace mode's portal backend, must not leave
	// the previous rules steering traffic.
	if touchesRules {
		if err := kernelmodes.CleanupOthers(name, o.chainPrefix); err != nil {
			klog.ErrorS(err, "Removing other modes' leftovers", "mode", name)
		}
	}
	if name == kernelmodes.Userspace && cfg.rules != "none" {
		if err := rules.CleanupExcept(cfg.rules, o.chainPrefix); err != nil {
			klog.ErrorS(err, "Removing the other portal backend's leftovers", "rules", cfg.rules)
		}
	}
	return name, mode, px, lock, nil
}

// primaryIPs are the node's primary IPs, as kube-proxy's "primary" means its
// Node's addresses: --bind-address when given (kube-proxy's override too), else
// for each family the source of the route beyond the node (nodeaddr.Routed),
// else the family's node IP of ips (the first global address).
func primaryIPs(bind netip.Addr, ips []netip.Addr) []netip.Addr {
	if bind.IsValid() && !bind.IsUnspecified() {
		return []netip.Addr{bind}
	}
	routed := nodeaddr.Routed()
	out := routed
	for _, ip := range ips {
		if !slices.ContainsFunc(routed, func(r netip.Addr) bool { return r.Is6() == ip.Is6() }) {
			out = append(out, ip)
		}
	}
	slices.SortStableFunc(out, func(a, b netip.Addr) int { return cmp.Compare(boolInt(a.Is6()), boolInt(b.Is6())) })
	return out
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// resolveNodePortAddresses turns --nodeport-addresses primary into the node's
// primary IPs, one prefix each, as kube-proxy turns it into its Node's addresses;
// so it does when the flag is left empty in the nftables mode, kube-proxy's
// default there (every other mode's is every address). Primary without a node
// IP is an error; the nftables mode's default then falls back to every
// address, as kube-proxy's does.
//
// It also decides where the nftables mode's loopback addresses serve NodePorts
// (cfg.localhostRelay), through a relay in user space since its rules cannot:
// by default on both, as upstream's KEP-6032 makes that mode's default
// "primary and localhost"; with CIDRs, on the loopback addresses they hold;
// with primary, on none. IPv6 only where the mode programs IPv6.
// ips are the node IPs the modes program (nodeIPs): the nftables mode has IPv6
// where they do.
func resolveNodePortAddresses(cfg *config, mode string, ips, primary []netip.Addr) error {
	implicit := len(cfg.prefixes) == 0 && !cfg.primaryNodePorts && mode == kernelmodes.NFTables
	if mode == kernelmodes.NFTables {
		loopbacks := [2]netip.Addr{netip.MustParseAddr("127.0.0.1"), netip.IPv6Loopback()}
		for f, lo := range loopbacks {
			for _, p := range cfg.prefixes {
				cfg.localhostRelay[f] = cfg.localhostRelay[f] || p.Contains(lo)
			}
			cfg.localhostRelay[f] = cfg.localhostRelay[f] || implicit
		}
		cfg.localhostRelay[1] = cfg.localhostRelay[1] && hasIPv6(ips)
	}
	if !cfg.primaryNodePorts && !implicit {
		return nil
	}
	cfg.primaryNodePorts = true
	for _, ip := range primary {
		cfg.prefixes = append(cfg.prefixes, netip.PrefixFrom(ip, ip.BitLen()))
	}
	switch {
	case len(cfg.prefixes) > 0:
		klog.InfoS("NodePorts answer on the node's primary IPs", "nodePortAddresses", cfg.prefixes, "default", implicit)
	case implicit:
		cfg.primaryNodePorts = false
		klog.InfoS("NodePorts answer on every address: the node has no primary IP (no global unicast address)", "mode", mode)
	default:
		return errors.New("--nodeport-addresses primary: the node has no primary IP (no global unicast address, and no --bind-address)")
	}
	return nil
}

// buildMode builds the mode name; no constructor touches the kernel's rules.
func buildMode(name string, o *options, cfg *config, events *observe.Events, ips []netip.Addr) (proxyMode, *proxier.Proxier, error) {
	switch name {
	case kernelmodes.Userspace:
		if err := checkUserspaceScheduler(o.scheduler); err != nil {
			return nil, nil, err
		}
		portals, err := newPortals(cfg, o.chainPrefix, ips)
		if err != nil {
			return nil, nil, err
		}
		cfg.proxier.Portals = portals
		cfg.proxier.KeepClientAddress = cfg.clientMark != 0 && cfg.rules != "none"
		cfg.proxier.ClusterCIDRs, cfg.proxier.MasqueradeAll = cfg.clusterCIDRs, cfg.masqueradeAll
		cfg.proxier.Events = events
		cfg.proxier.EventLoops = reserveEventLoopProcs(cfg.eventLoops)
		px, err := proxier.New(cfg.proxier)
		if err != nil {
			return nil, nil, err
		}
		return px, px, nil
	case kernelmodes.IPTables:
		m, err := kiptables.New(kiptables.Config{
			ChainPrefix:        o.chainPrefix,
			IPv6:               hasIPv6(ips),
			NodePortAddresses:  cfg.prefixes,
			ClusterCIDRs:       cfg.clusterCIDRs,
			MasqueradeAll:      cfg.masqueradeAll,
			LocalhostNodePorts: cfg.localhostNodePorts,
		})
		if err != nil {
			return nil, nil, fmt.Errorf("--proxy-mode iptables: %w", err)
		}
		return m, nil, nil
	case kernelmodes.NFTables:
		m, err := knftables.New(knftables.Config{
			ChainPrefix:       o.chainPrefix,
			IPv6:              hasIPv6(ips),
			NodePortAddresses: cfg.prefixes,
			ClusterCIDRs:      cfg.clusterCIDRs,
			MasqueradeAll:     cfg.masqueradeAll,
		})
		if err != nil {
			return nil, nil, fmt.Errorf("--proxy-mode nftables: %w", err)
		}
		return m, nil, nil
	case kernelmodes.IPVS:
		m, err := ipvs.New(ipvs.Config{
			ChainPrefix:       o.chainPrefix,
			Scheduler:         o.scheduler,
			IPv6:              hasIPv6(ips),
			NodeIPs:           ips,
			NodePortAddresses: cfg.prefixes,
			ClusterCIDRs:      cfg.clusterCIDRs,
			MasqueradeAll:     cfg.masqueradeAll,
		})
		if err != nil {
			return nil, nil, fmt.Errorf("--proxy-mode ipvs: %w", err)
		}
		return m, nil, nil
	}
	return nil, nil, fmt.Errorf("--proxy-mode %q: unknown mode %q", o.proxyMode, name)
}

// reserveEventLoopProcs returns how many event loops the userspace mode runs
// (--event-loops; 0: poll.DefaultLoops) and makes sure there is a P (GOMAXPROCS)
// more than loops. A loop spends its idle time blocked in epoll_wait, holding a
// scheduler slot (P) that the runtime takes back only when no P is idle - and then
// on nearly every event, with its monitor thread polling ever more often
// (docs/decisions/2026-11-22-event-loops-and-the-go-scheduler.md). So there is
// always one P more than loops, which also runs the control plane.
func reserveEventLoopProcs(loops int) int {
	if loops <= 0 {
		loops = poll.DefaultLoops()
	}
	if runtime.GOMAXPROCS(0) < loops+1 {
		runtime.GOMAXPROCS(loops + 1)
	}
	klog.V(1).InfoS("Event loops", "loops", loops, "gomaxprocs", runtime.GOMAXPROCS(0))
	return loops
}

// runCleanup removes every mode's rules, links and virtual servers of
// --chain-prefix. Before it touches anything it checks the prefix as the run
// command does (kube-proxy's KUBE is refused) and takes the lock a running
// uproxy of that prefix holds: while one runs, cleanup is refused, naming it,
// unless force (its rules are then removed all the same, and it writes them
// back at its next sync or flush check).
func runCleanup(o *options, force bool) error {
	if err := checkChainPrefix(o.chainPrefix); err != nil {
		return err
	}
	// Without the capability every step fails alike (iptables-save, nft, netlink),
	// each with its own words: say it once.
	if !hasNetAdmin() {
		return errors.New("cleanup needs root (CAP_NET_ADMIN) to remove rules, tables and links; nothing was removed")
	}
	lock, err := lockRules(o.chainPrefix)
	var held *rulesHeldError
	switch {
	case errors.As(err, &held) && force:
		klog.InfoS("Removing the rules of a running uproxy (--force): it writes them back at its next sync", "holder", held.holder, "prefix", o.chainPrefix)
	case errors.As(err, &held):
		held.remedy = "stop it first, or run `uproxy cleanup --force` to remove its rules all the same (it writes them back at its next sync)"
		return held
	case err != nil:
		return err
	}
	defer lock.Close()
	if err := kernelmodes.CleanupAll(o.chainPrefix); err != nil {
		return fmt.Errorf("cleanup: %w", err)
	}
	klog.InfoS("Removed uproxy's rules of every mode", "prefix", o.chainPrefix)
	return nil
}

// checkUserspaceScheduler rejects the schedulers only IPVS has.
func checkUserspaceScheduler(name string) error {
	if err := affinity.ValidScheduler(name); err != nil {
		return fmt.Errorf("--scheduler %q is an IPVS-only scheduler; the userspace mode offers %v", name, affinity.Schedulers)
	}
	return nil
}
