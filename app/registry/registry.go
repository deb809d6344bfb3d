// Package registry is the registry of proxy modes: it resolves --proxy-mode
// (Choose), fills in what a mode's configuration takes from the node (Resolve),
// builds the mode a name asks for from the configuration every mode shares and
// its own section (New), and removes what the other modes left (CleanupOthers,
// CleanupAll). The program asks it for a mode and runs that; nothing above it
// names a mode's constructor.
//
//	name, reason, err := registry.Choose(requested, scheduler)
//	err = registry.Resolve(name, &common, &specific, &nodePorts)
//	mode, err := registry.New(name, common, specific)
//	registry.CleanupOthers(name, specific.Userspace.Rules, common.ChainPrefix)
package registry

import (
	"fmt"
	"io"

	"github.com/uproxy/uproxy/kernelmodes"
	"github.com/uproxy/uproxy/kernelmodes/iptables"
	"github.com/uproxy/uproxy/kernelmodes/ipvs"
	"github.com/uproxy/uproxy/kernelmodes/nftables"
	"github.com/uproxy/uproxy/proxier"
	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/rules"
)

// Specific holds each mode's own section of the configuration, as a
// KubeProxyConfiguration has one per mode. Only the chosen mode's is read;
// the Common each section embeds is set by New from its common argument.
type Specific struct {
	Userspace Userspace
	IPTables  iptables.Config
	NFTables  NFTables
	IPVS      ipvs.Config
}

// Userspace is the userspace mode's section: the proxier's configuration and
// what its portals are built from.
type Userspace struct {
	// Config is the proxier's; New sets its Portals and KeepClientAddress, and
	// clears its DialMark where the process may not set one.
	proxier.Config
	// Rules is the portals' backend (--rules); Resolve turns auto into one,
	// and sets RulesChosen.
	Rules       rules.Backend
	RulesChosen bool
	// ClientAddressMark is the mark of the replies to dials from a client's
	// address (--client-address-mark-bit, with --preserve-client-address); 0:
	// endpoints see the node's address.
	ClientAddressMark uint32
	// NodePortListen holds a NodePort open (rules.Config.Listen); nil: the
	// portals' own. A uproxy taking over from another adopts its sockets here.
	NodePortListen func(network, address string) (io.Closer, error)
	// WrapPortals, when set, wraps the portals the mode writes through: a
	// uproxy taking over from another holds its first writes back.
	WrapPortals func(rules.Portals) rules.Portals
}

// NFTables is the nftables mode's section: its Config, and which loopback
// addresses (IPv4, IPv6) serve NodePorts through a relay in user space
// (package localnodeports), since its rules cannot. Resolve decides them.
type NFTables struct {
	nftables.Config
	LoopbackNodePorts [2]bool
}

// constructors build each mode from its section, Common already set in it.
var constructors = map[string]func(proxymode.Common, *Specific) (proxymode.Mode, error){
	proxymode.Userspace: newUserspace,
	proxymode.IPTables: func(c proxymode.Common, s *Specific) (proxymode.Mode, error) {
		cfg := s.IPTables
		cfg.Common = c
		return iptables.New(cfg)
	},
	proxymode.NFTables: newNFTables,
	proxymode.IPVS: func(c proxymode.Common, s *Specific) (proxymode.Mode, error) {
		cfg := s.IPVS
		cfg.Common = c
		return ipvs.New(cfg)
	},
}

// Choose resolves --proxy-mode: auto (or "") picks ipvs when the kernel runs
// it, else nftables, else iptables, else userspace, and reason says why; an
// explicit kernel mode the kernel cannot run is an error naming what is
// missing. scheduler is the IPVS scheduler ("" for rr).
func Choose(requested, scheduler string) (name, reason string, err error) {
	return kernelmodes.Choose(requested, scheduler)
}

// New builds mode name from the configuration every mode takes and its own
// section of specific. No constructor touches the kernel's rules: that is the
// first Sync's.
func New(name string, common proxymode.Common, specific Specific) (proxymode.Mode, error) {
	build, ok := constructors[name]
	if !ok {
		return nil, fmt.Errorf("--proxy-mode %q: want userspace, iptables, nftables or ipvs", name)
	}
	m, err := build(common, &specific)
	if err != nil && name != proxymode.Userspace {
		// The userspace mode's errors name their own flag (--rules, --scheduler).
		return nil, fmt.Errorf("--proxy-mode %s: %w", name, err)
	}
	return m, err
}

// TouchesRules reports whether mode name, configured by specific, programs
// the node's rules: every mode does but the userspace mode with --rules none,
// which runs unprivileged. Only such a mode needs the node's rules lock and
// the conntrack sysctls.
func TouchesRules(name string, specific *Specific) bool {
	return name != proxymode.Userspace || specific.Userspace.Rules != rules.BackendNone
}
