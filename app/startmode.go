package app

import (
	"cmp"
	"context"
	"errors"
	"net/netip"
	"runtime"
	"slices"

	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/app/registry"
	"github.com/uproxy/uproxy/nodeaddr"
	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/socket/poll"
)

// startMode resolves --proxy-mode, completes the configuration with the node's
// addresses, and asks the registry for the mode; then it removes what other
// modes left behind. Everything that can fail is checked before any rule is
// touched: a start that fails leaves the node's rules as they were. lock, when
// not nil, holds this node's rules for the process (see lockRules); the caller
// closes it at exit. A uproxy holding the lock is taken over from when pred is
// not nil (takeover.go): its sockets are received (NodePort ones into
// nodePorts), the lock comes later, and pred is returned; pred is nil when
// the lock was free after all.
func startMode(o *options, cfg *config, pred *predecessor, nodePorts *nodePortSockets) (name string, mode proxymode.Mode, lock *rulesLock, _ *predecessor, err error) {
	defer func() {
		if err != nil {
			pred.close()
		}
	}()
	name, reason, err := registry.Choose(o.proxyMode, o.scheduler)
	if err != nil {
		return "", nil, nil, nil, err
	}
	klog.InfoS("Proxy mode", "mode", name, "reason", reason)
	// A mode asked for had the flags it does not use refused with the other
	// flags (validate); one chosen by auto refuses none.
	o.warnModeFlags(name)
	bind := cfg.specific.Userspace.BindAddress
	cfg.common.NodeIPs = nodeIPs(bind)
	cfg.common.IPv6 = proxymode.HasIPv6(cfg.common.NodeIPs)
	cfg.nodePorts.PrimaryIPs = primaryIPs(bind, cfg.common.NodeIPs)
	if err := registry.Resolve(name, &cfg.common, &cfg.specific, &cfg.nodePorts); err != nil {
		return "", nil, nil, nil, err
	}
	// Every mode but the userspace one without portals programs the node's
	// rules, which one uproxy at a time may do.
	touchesRules := registry.TouchesRules(name, &cfg.specific)
	if touchesRules {
		lock, err = lockRules(o.chainPrefix)
		var held *rulesHeldError
		switch {
		case err == nil:
			pred.close() // it went away meanwhile
			pred = nil
		case pred != nil && errors.As(err, &held) && !held.notUproxy:
			if err = pred.takeOver(identityOf(o, cfg, name), nodePorts); err != nil {
				return "", nil, nil, nil, err
			}
		default:
			return "", nil, nil, nil, err
		}
	} else {
		pred.close()
		pred = nil
	}
	defer func() {
		if err != nil {
			lock.Close()
			lock = nil
		}
	}()
	// A prefix whose chains another program has would have them flushed by
	// the mode's first write, or removed with the other modes' leftovers.
	if touchesRules {
		if err = registry.ClaimChains(o.chainPrefix); err != nil {
			return "", nil, nil, nil, err
		}
	}
	if mode, err = registry.New(name, cfg.common, cfg.specific); err != nil {
		return "", nil, nil, nil, err
	}
	if m, ok := mode.(interface{ EventLoops() int }); ok {
		reserveEventLoopProcs(m.EventLoops())
	}
	// kube-proxy sets the conntrack sysctls in every mode; the userspace mode
	// without rules runs unprivileged and needs none of them.
	if touchesRules {
		if err = o.setConntrackSysctls(cfg.conntrack); err != nil {
			if m, ok := mode.(interface{ Shutdown(context.Context) error }); ok {
				m.Shutdown(context.Background()) // its event loops; it serves nothing yet
			}
			return "", nil, nil, nil, err
		}
		// Switching modes, or the userspace mode's portal backend, must not
		// leave the previous rules steering traffic.
		if err := registry.CleanupOthers(name, cfg.specific.Userspace.Rules, o.chainPrefix); err != nil {
			klog.ErrorS(err, "Removing other modes' leftovers", "mode", name)
		}
	}
	return name, mode, lock, pred, nil
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

// nodeIPs returns the addresses the HOST portals DNAT to: the bind address when
// one is given, else the first global unicast address of each family.
func nodeIPs(bind netip.Addr) []netip.Addr {
	if bind.IsValid() && !bind.IsUnspecified() {
		return []netip.Addr{bind}
	}
	addrs, err := nodeaddr.List()
	if err != nil {
		klog.ErrorS(err, "Listing node addresses")
		return nil
	}
	return nodeaddr.Primary(addrs)
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
