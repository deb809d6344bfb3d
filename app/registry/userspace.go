package registry

import (
	"fmt"

	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/affinity"
	"github.com/uproxy/uproxy/proxier"
	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/rules"
	"github.com/uproxy/uproxy/socket"
)

// newUserspace builds the userspace mode: its portals of the backend
// s.Userspace.Rules (resolved), with the dial mark the process may set and
// the client-address rules where the kernel takes transparent sockets, then
// the proxier over them.
func newUserspace(c proxymode.Common, s *Specific) (proxymode.Mode, error) {
	u := s.Userspace
	if err := CheckScheduler(proxymode.Userspace, u.Scheduler); err != nil {
		return nil, err
	}
	cfg := u.Config
	cfg.Common = c
	if u.Rules == rules.BackendNone {
		cfg.DialMark = 0 // no portals to let the proxy's own connections pass
		cfg.Portals = rules.None{}
		return proxier.New(cfg)
	}
	if err := socket.CheckDialMark(cfg.DialMark); err != nil {
		// Connections still work; each of the proxy's own pays for the portal lookups.
		klog.ErrorS(err, "Proxy connections to endpoints go through the portals", "flag", "--dial-mark-bit")
		cfg.DialMark = 0
	}
	bind := cfg.BindAddress
	rc := rules.Config{
		ChainPrefix:        c.ChainPrefix,
		NodeIPs:            c.NodeIPs,
		NodePortAddresses:  c.NodePortAddresses,
		IPv6:               c.IPv6,
		DialMark:           cfg.DialMark,
		ClientAddressMark:  clientAddressMark(u.ClientAddressMark, cfg.DialMark),
		ProxyPortsOnNodeIP: bind.IsValid() && !bind.IsUnspecified(),
		Chosen:             u.RulesChosen,
		Listen:             u.NodePortListen,
	}
	if rc.ProxyPortsOnNodeIP {
		other := "IPv6"
		if bind.Is6() {
			other = "IPv4"
		}
		klog.InfoS("Proxy ports listen on --bind-address only: the portals DNAT to it, and Service addresses of the other family get none",
			"bindAddress", bind, "withoutPortals", other)
	}
	portals, err := rules.New(u.Rules, rc)
	if err != nil {
		return nil, err
	}
	cfg.Portals = portals
	if u.WrapPortals != nil {
		cfg.Portals = u.WrapPortals(portals)
	}
	cfg.KeepClientAddress = rc.ClientAddressMark != 0
	return proxier.New(cfg)
}

// CheckScheduler refuses a --scheduler mode name has not: the userspace mode
// has the schedulers of package affinity, not those only IPVS has. "" is rr.
func CheckScheduler(name, scheduler string) error {
	if name != proxymode.Userspace || scheduler == "" {
		return nil
	}
	if err := affinity.ValidScheduler(scheduler); err != nil {
		return fmt.Errorf("--scheduler %q is an IPVS-only scheduler; the userspace mode offers %v", scheduler, affinity.Schedulers)
	}
	return nil
}

// clientAddressMark returns the mark of the portals' rules for the replies to
// dials from a client's address (mark, --client-address-mark-bit), 0 (with
// the reason logged) when client addresses cannot be kept: no dial mark for
// the rules to tell the proxy's own connections by, or a kernel or a process
// that refuses transparent sockets.
func clientAddressMark(mark, dialMark uint32) uint32 {
	if mark == 0 {
		return 0
	}
	var why string
	if dialMark == 0 {
		why = "the rules tell uproxy's own connections by the dial mark, and there is none (--dial-mark-bit)"
	} else if err := socket.CheckTransparent(); err != nil {
		why = err.Error()
	}
	if why != "" {
		klog.InfoS("Endpoints see the node's address, not the client's, on every connection", "flag", "--preserve-client-address", "reason", why)
		return 0
	}
	klog.InfoS("Endpoints see the client's address where kube-proxy would keep it", "flag", "--preserve-client-address",
		"mark", fmt.Sprintf("%#x", mark), "routeTable", rules.ClientAddressTable)
	return mark
}
