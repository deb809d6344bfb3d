// Package proxymode is what every proxy mode shares: the mode names as
// --proxy-mode spells them, the configuration every mode takes (Common, which
// each mode's Config embeds), and the interface the program drives (Mode).
// The modes themselves are proxier (userspace) and kernelmodes/iptables,
// nftables and ipvs; app/registry builds the one a name asks for.
package proxymode

import (
	"net/netip"

	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/service"
)

// Mode names, as --proxy-mode spells them. Auto is a request, never a mode.
const (
	Auto      = "auto"
	Userspace = "userspace"
	IPTables  = "iptables"
	NFTables  = "nftables"
	IPVS      = "ipvs"
)

// Names are the modes, in the order a cleanup of every mode goes through them.
var Names = []string{Userspace, IPTables, NFTables, IPVS}

// Common is the configuration every mode takes, as kube-proxy's configuration
// has fields shared by its modes beside a section per mode. Each mode's Config
// embeds it; its zero value is a mode of the default prefix, IPv4 only, with
// NodePorts on every address and no masquerading of its own.
type Common struct {
	// ChainPrefix names the mode's chains (and, lower-cased, its nftables
	// table); iptables.DefaultChainPrefix when empty.
	ChainPrefix string
	// NodeIPs are the node's addresses the modes program: one per family, the
	// --bind-address when given, else the first global address (the userspace
	// portals DNAT the node's own connections to them; the IPVS mode puts
	// NodePorts on them).
	NodeIPs []netip.Addr
	// IPv6 also programs the Services' IPv6 addresses; it is set where
	// NodeIPs has an IPv6 address.
	IPv6 bool
	// NodePortAddresses limits NodePorts to the node addresses inside these
	// prefixes (--nodeport-addresses, primary already resolved); empty means
	// every address but loopback. A family with no prefix here gets no NodePorts.
	NodePortAddresses []netip.Prefix
	// ClusterCIDRs are the pod networks (--cluster-cidr, at most one per
	// family): ClusterIP traffic from outside them is masqueraded (the
	// userspace mode dials from the node), and pods reach a Service's external
	// addresses ignoring its externalTrafficPolicy. Empty: neither.
	ClusterCIDRs []netip.Prefix
	// MasqueradeAll masquerades all ClusterIP traffic (--masquerade-all).
	MasqueradeAll bool
}

// HasIPv6 reports whether ips holds an IPv6 address: Common.IPv6 of NodeIPs ips.
func HasIPv6(ips []netip.Addr) bool {
	for _, ip := range ips {
		if ip.Is6() {
			return true
		}
	}
	return false
}

// A Mode is one proxy mode at work: the sync loop calls Sync with every new
// Snapshot, /debug/services reads DebugServices, and Cleanup removes what the
// mode programmed into the kernel. Optional abilities are smaller interfaces
// the program asks a Mode for (a canary: Intact() bool; a graceful end:
// Shutdown(context.Context) error; the protocols it cannot serve:
// Unserved() []service.Unserved).
type Mode interface {
	// Sync makes the running state match s; it is only ever called from one
	// goroutine. An error means the sync should be retried.
	Sync(s *service.Snapshot) error
	observe.ServicesView
	// Cleanup removes what the mode programmed into the kernel.
	Cleanup() error
}
