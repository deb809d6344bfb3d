package registry

import (
	"errors"
	"net/netip"

	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/rules"
)

// NodePorts is --nodeport-addresses as given: its CIDRs are in
// Common.NodePortAddresses; Primary is the one word primary, the node's
// primary IPs (PrimaryIPs: --bind-address when given, else for each family the
// source of the route beyond the node, else its first global address).
// Resolve sets Primary where the mode's default is primary too.
type NodePorts struct {
	Primary    bool
	PrimaryIPs []netip.Addr
}

// Resolve fills in what mode name's configuration takes from the node, before
// anything is built or locked: the userspace mode's portal backend for --rules
// auto (rules.ChooseBackend), and the NodePort addresses (resolveNodePorts).
func Resolve(name string, c *proxymode.Common, s *Specific, np *NodePorts) error {
	if err := resolveNodePorts(name, c, s, np); err != nil {
		return err
	}
	if name == proxymode.Userspace && s.Userspace.Rules == rules.BackendAuto {
		s.Userspace.Rules = rules.ChooseBackend(s.Userspace.Rules, c.ChainPrefix, c.NodeIPs)
		s.Userspace.RulesChosen = true
	}
	return nil
}

// resolveNodePorts turns --nodeport-addresses primary into the node's primary
// IPs, one prefix each, as kube-proxy turns it into its Node's addresses; so it
// does when the flag is left empty in the nftables mode, kube-proxy's default
// there (every other mode's is every address). Primary without a node IP is an
// error; the nftables mode's default then falls back to every address, as
// kube-proxy's does.
//
// It also decides where the nftables mode's loopback addresses serve NodePorts
// (s.NFTables.LoopbackNodePorts), through a relay in user space since its rules
// cannot: by default on both, as upstream's KEP-6032 makes that mode's default
// "primary and localhost"; with CIDRs, on the loopback addresses they hold;
// with primary, on none. IPv6 only where the mode programs IPv6 (c.IPv6).
func resolveNodePorts(name string, c *proxymode.Common, s *Specific, np *NodePorts) error {
	implicit := len(c.NodePortAddresses) == 0 && !np.Primary && name == proxymode.NFTables
	if name == proxymode.NFTables {
		lo := &s.NFTables.LoopbackNodePorts
		loopbacks := [2]netip.Addr{netip.MustParseAddr("127.0.0.1"), netip.IPv6Loopback()}
		for f, addr := range loopbacks {
			for _, p := range c.NodePortAddresses {
				lo[f] = lo[f] || p.Contains(addr)
			}
			lo[f] = lo[f] || implicit
		}
		lo[1] = lo[1] && c.IPv6
	}
	if !np.Primary && !implicit {
		return nil
	}
	np.Primary = true
	for _, ip := range np.PrimaryIPs {
		c.NodePortAddresses = append(c.NodePortAddresses, netip.PrefixFrom(ip, ip.BitLen()))
	}
	switch {
	case len(c.NodePortAddresses) > 0:
		klog.InfoS("NodePorts answer on the node's primary IPs", "nodePortAddresses", c.NodePortAddresses, "default", implicit)
	case implicit:
		np.Primary = false
		klog.InfoS("NodePorts answer on every address: the node has no primary IP (no global unicast address)", "mode", name)
	default:
		return errors.New("--nodeport-addresses primary: the node has no primary IP (no global unicast address, and no --bind-address)")
	}
	return nil
}
