// Package rules programs the portals of the userspace mode: nat rules that steer
// a Service's virtual IPs and NodePorts to the local proxy port serving it, and
// filter rules that refuse them while the Service port has no endpoint to go to.
// It has two backends behind one interface, Portals: IPTables (a rule per
// Service port, as the legacy userspace proxy had) and NFTables (one nftables
// table whose maps hold the Service ports, so neither a new connection nor a
// sync costs more with more Services; see NFTables for its layout), and None
// for --rules none; New builds the one a Backend names. The nftables layout
// mirrors the nftables kernel mode's on purpose (nftlayout.go, nftlookup.go
// beside kernelmodes/nftables/layout.go, find.go): each its own table.
//
// A Service port's addresses of one family whose balancer has no endpoint of
// that family (Portal.Refuse, from RefusalOf) are not steered but refused, as
// kube-proxy refuses a Service without endpoints: a connection's first packet
// gets a TCP reset or ICMP port unreachable from the filter hooks (input,
// forward, output), before any socket, so a TCP connect fails with
// ECONNREFUSED instead of succeeding and being reset, and a UDP client's
// connected socket gets ECONNREFUSED instead of silence. Its proxy port stays
// open, and the portal steers to it again from the sync that brings an
// endpoint.
//
// The proxier opens one proxy listener per Service port and hands the whole desired
// state to Sync on every sync:
//
//	p, err := rules.NewNFTables(rules.Config{NodeIPs: []netip.Addr{nodeIP}}) // or NewIPTables
//	...
//	err = p.Sync([]rules.Portal{{Port: port, ProxyPort: 40123}})
//
// IPTables' chains (prefix P, "UPROXY" by default), nat table of each family:
//
//	P-PORTALS-CONTAINER   first in PREROUTING: VIP:port -> REDIRECT to the proxy port
//	P-PORTALS-HOST        first in OUTPUT: VIP:port -> DNAT to node IP:proxy port
//	P-NODEPORT-CONTAINER  last in PREROUTING, local destinations only: REDIRECT
//	P-NODEPORT-HOST       last in OUTPUT, local destinations only: DNAT
//	P-CANARY              one rule; its loss means someone flushed the table
//
// and in the filter table of each family:
//
//	P-NODEPORT-NON-LOCAL  first in INPUT: accepts traffic redirected from a
//	                      NodePort to its proxy port
//	P-NO-ENDPOINTS        first in INPUT, FORWARD and OUTPUT, for a connection's
//	                      first packet: VIP:port and NodePort without endpoints ->
//	                      REJECT (tcp-reset for TCP, port unreachable for UDP)
//	P-CANARY              the same canary, for a flush of the filter table
//
// IPTables writes everything except the jump rules with one iptables-restore
// --noflush per family, and only when the text differs from the last
// successful write: portals that come and go are deleted and appended in place
// (at most 64 rules deleted); any other change, and the first write, declares
// each chain (and so flushes it) and rewrites it whole.
// NFTables writes only the map elements that changed, in one nft transaction.
// This package renders the rules and decides when to write them;
// netfilter/iptables and netfilter/nftables write them, read them back and
// remove them, as they do for every mode.
package rules

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"strings"

	"github.com/uproxy/uproxy/netfilter/conntrack"
	"github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/netfilter/nftables"
	"github.com/uproxy/uproxy/service"
)

// Portal is one Service port as the proxier serves it.
type Portal struct {
	// Port is the Service port: its virtual IPs, port, NodePort and protocol.
	Port *service.Port
	// ProxyPort is the local port the proxy listens on for it.
	ProxyPort int
	// ExternalProxyPort, when not 0, is the proxy port of the NodePort,
	// ExternalIPs and LoadBalancer IPs, whose endpoints may differ from the
	// ClusterIPs' (externalTrafficPolicy: Local); 0: they go to ProxyPort.
	ExternalProxyPort int
	// Refuse says which of the port's addresses are refused rather than
	// steered, for want of endpoints (RefusalOf); the zero value steers all.
	Refuse Refusal
}

// Refusal is what the portals refuse of one Service port: by address family
// (index 0 IPv4, 1 IPv6), its ClusterIPs (Cluster) and its NodePort,
// ExternalIPs and LoadBalancer IPs (External). A refused address gets a TCP
// reset or ICMP port unreachable at the portal instead of reaching the proxy
// port. The zero Refusal refuses nothing.
type Refusal struct {
	Cluster, External [2]bool
}

// RefusalOf returns the Refusal of a Service port whose ClusterIPs lead to a
// balancer picking from cluster and whose NodePort, ExternalIPs and
// LoadBalancer IPs lead to one picking from external (the same endpoints when
// they share a proxy port): in each family, the addresses whose balancer has
// no endpoint of that family. The proxier hands each balancer the port's
// ClusterEndpoints or ExternalEndpoints (usable: ready, else serving and
// terminating; this node's only under a Local traffic policy), split by
// family, so the portals refuse exactly the connections the proxy would have
// nothing to dial for.
func RefusalOf(cluster, external []netip.AddrPort) Refusal {
	r := Refusal{Cluster: [2]bool{true, true}, External: [2]bool{true, true}}
	for _, ep := range cluster {
		if ep.Addr().IsValid() {
			r.Cluster[familyOf(ep.Addr())] = false
		}
	}
	for _, ep := range external {
		if ep.Addr().IsValid() {
			r.External[familyOf(ep.Addr())] = false
		}
	}
	return r
}

// Refused reports whether r refuses the ClusterIPs (external false) or the
// NodePort, ExternalIPs and LoadBalancer IPs (external true) of IPv6 (ipv6
// true) or IPv4.
func (r Refusal) Refused(external, ipv6 bool) bool {
	f := v4
	if ipv6 {
		f = v6
	}
	if external {
		return r.External[f]
	}
	return r.Cluster[f]
}

// Config configures IPTables and NFTables. The zero value needs only NodeIPs.
type Config struct {
	// Chosen says --rules auto chose the backend New builds: its errors say so.
	Chosen bool
	// ChainPrefix names the chains; iptables.DefaultChainPrefix when empty.
	// NFTables names its table after it, lower-cased (nftables.TableName).
	ChainPrefix string
	// NodeIPs holds the node's address per family: the HOST chains DNAT to
	// nodeIP:proxyPort, because REDIRECT from OUTPUT rewrites the destination to
	// 127.0.0.1 and replies to a UDP client on another address would not match.
	// An IPv4 address is required, an IPv6 one when IPv6 is set.
	NodeIPs []netip.Addr
	// NodePortAddresses limits NodePorts to the node's addresses inside these
	// prefixes (--nodeport-addresses); empty means every local address. A family
	// with no prefix here gets no NodePorts.
	NodePortAddresses []netip.Prefix
	// IPv6 also programs the Services' IPv6 addresses (ip6tables, or the
	// nftables table's IPv6 maps).
	IPv6 bool
	// DialMark is the packet mark of the proxy's own connections to endpoints
	// (socket.TCPProxy.DialMark); the portals of the node's own connections (the
	// HOST chains, the nftables output chain) return at once for packets
	// carrying it rather than trying every portal. 0: no such rule.
	DialMark uint32
	// ClientAddressMark, when not 0, is the one bit of the packet mark and the
	// conntrack mark with which the portals bring the replies to the proxy's
	// transparent dials (socket.TCPProxy.KeepClientAddress) back to it: rules
	// that mark such a connection and its replies, and a policy route for the
	// marked replies (clientaddress.go). It needs DialMark, which is how the
	// rules tell the proxy's own connections; without it nothing is added.
	ClientAddressMark uint32
	// ProxyPortsOnNodeIP says the proxy ports listen on the node IP of their
	// family only (a specific --bind-address), not on every address. The portals
	// of traffic from outside the node then DNAT to node IP:proxy port, as those of
	// its own connections do: REDIRECT sends a packet to the address of the
	// interface it arrived on, where nothing would listen.
	ProxyPortsOnNodeIP bool

	// The kernel, as the portals reach it. Every call happens on the goroutine
	// that called Sync or Cleanup, so a caller that locked its thread into a
	// network namespace programs that namespace.

	// IPTables is iptables and ip6tables; nil runs the commands (iptables.Commands).
	IPTables iptables.Kernel
	// NFTables is the nftables table NFTables owns, the one ChainPrefix names;
	// nil runs nft and reads rules over netlink (nftables.New).
	NFTables nftables.Kernel
	// Conntrack deletes stale UDP flows; nil uses netlink (conntrack.Netlink).
	Conntrack conntrack.Deleter
	// Listen holds a NodePort open: network is tcp4, tcp6, udp4 or udp6; nil
	// uses net.Listen and net.ListenPacket.
	Listen func(network, address string) (io.Closer, error)
}

// familyNodeIPs returns, for each family the portals program (IPv4, and IPv6
// when IPv6 is set), the first usable node IP of that family in NodeIPs; the
// entry of a family not programmed is the zero Addr.
// NoNodeIPError says the node has no address of Family the portals can send
// connections to: every family programmed needs one outside loopback.
type NoNodeIPError struct {
	Family string
	IPs    []netip.Addr // the node IPs looked at
}

func (e *NoNodeIPError) Error() string {
	if len(e.IPs) == 0 {
		return fmt.Sprintf("no %s node IP: the node has no %s address outside loopback, and the portals DNAT to node IP:proxy port", e.Family, e.Family)
	}
	return fmt.Sprintf("no %s node IP: none outside loopback among %v (--bind-address, when given, is the node IP), and the portals DNAT to node IP:proxy port", e.Family, e.IPs)
}

// CheckNodeIPs says why no portals can be built on the node IPs ips (IPv4 only;
// nil when they can): the requirement NewIPTables and NewNFTables check.
func CheckNodeIPs(ips []netip.Addr) error {
	c := Config{NodeIPs: ips}
	_, err := c.familyNodeIPs()
	return err
}

// familyNodeIPs skips loopback addresses: packets from other hosts cannot be
// sent to one.
func (c *Config) familyNodeIPs() ([2]netip.Addr, error) {
	var out [2]netip.Addr
	for f := v4; f <= v6; f++ {
		if f == v6 && !c.IPv6 {
			continue
		}
		for _, ip := range c.NodeIPs {
			if ip = ip.Unmap().WithZone(""); ip.IsValid() && familyOf(ip) == f && !ip.IsUnspecified() && !ip.IsLoopback() {
				out[f] = ip
				break
			}
		}
		if !out[f].IsValid() {
			return out, &NoNodeIPError{Family: familyName(f), IPs: c.NodeIPs}
		}
	}
	return out, nil
}

func (c *Config) listen(network, address string) (io.Closer, error) {
	if c.Listen != nil {
		return c.Listen(network, address)
	}
	if strings.HasPrefix(network, "udp") {
		return net.ListenPacket(network, address)
	}
	// A listening socket, never accepted from: a bound but idle TCP socket would
	// not stop another SO_REUSEADDR socket from binding the port.
	return net.Listen(network, address)
}

// Portals programs the portal rules of the userspace mode.
type Portals interface {
	// Sync makes the rules match portals, the whole desired state. It writes
	// nothing when nothing changed. Problems with single Services come back as
	// *PortalError values inside the returned error (a *multierror.Error); the
	// other Services are programmed regardless.
	Sync(portals []Portal) error
	// Cleanup removes every chain and jump rule the portals install, in both
	// families, ignoring whatever is already gone.
	Cleanup() error
	// Intact reports whether what the last Sync wrote is still in the kernel,
	// by the cheap check Sync makes first (a canary, rule handles); false also
	// before anything was written. The sync loop polls it between syncs, so an
	// external flush is repaired promptly, not a whole sync period later.
	Intact() bool
	// RepliesToClientAddress reports whether the replies to transparent
	// dials reach the proxy: Config.ClientAddressMark is set and the last
	// Sync put its rules and policy route in place. While it is false, a
	// dial from a client's address would never see its reply.
	RepliesToClientAddress() bool
}

// None is the Portals of --rules none: it programs nothing.
type None struct{}

func (None) Sync([]Portal) error { return nil }
func (None) Cleanup() error      { return nil }
func (None) Intact() bool        { return true }

// RepliesToClientAddress is false: without portals there are no rules for the
// replies, and no client address to keep (clients dial the proxy ports).
func (None) RepliesToClientAddress() bool { return false }

// ErrUnsupportedProtocol is the cause of a PortalError for a protocol the
// userspace mode has no proxy for (SCTP): such portals are skipped.
var ErrUnsupportedProtocol = errors.New("protocol not supported by the userspace mode")

// PortalError is a problem with the portals of one Service port. Port is the port
// concerned: the NodePort for a NodePort that another process holds.
type PortalError struct {
	Service  service.PortName
	Protocol service.Protocol
	Port     int
	Err      error
}

func (e *PortalError) Error() string {
	return fmt.Sprintf("portal %s port %d/%s: %v", e.Service, e.Port, e.Protocol, e.Err)
}

func (e *PortalError) Unwrap() error { return e.Err }

// chains names the chains for one prefix.
type chains struct {
	portalsContainer, portalsHost   string
	nodePortContainer, nodePortHost string
	nodePortNonLocal                string
	noEndpoints                     string
	// clientAddress is the mangle chain that marks transparent dials and
	// their replies (clientaddress.go); it exists, and the canary lives in
	// the mangle table too, only while withClientAddress is set.
	clientAddress     string
	withClientAddress bool
	// dialMark is the mangle chain, jumped to from POSTROUTING, that clears
	// the dial mark of the packets leaving the node (clientaddress.go); it
	// exists with clientAddress.
	dialMark string
	canary   iptables.Canary
}

func chainNames(prefix string) chains {
	return chains{
		portalsContainer:  prefix + "-PORTALS-CONTAINER",
		portalsHost:       prefix + "-PORTALS-HOST",
		nodePortContainer: prefix + "-NODEPORT-CONTAINER",
		nodePortHost:      prefix + "-NODEPORT-HOST",
		nodePortNonLocal:  prefix + "-NODEPORT-NON-LOCAL",
		noEndpoints:       prefix + "-NO-ENDPOINTS",
		clientAddress:     prefix + "-CLIENT-ADDRESS",
		dialMark:          prefix + "-DIAL-MARK",
		// In both tables: `iptables -F` flushes the filter table alone.
		canary: iptables.Canary{Chain: prefix + "-CANARY", Tables: []string{"nat", "filter"}},
	}
}

// natChains are the chains in the nat table, in the order they are declared.
func (c chains) nat() []string {
	return []string{c.portalsContainer, c.portalsHost, c.nodePortContainer, c.nodePortHost, c.canary.Chain}
}

// filter are the chains in the filter table, in the order they are declared.
func (c chains) filter() []string { return []string{c.nodePortNonLocal, c.noEndpoints, c.canary.Chain} }

// mangle are the chains in the mangle table, in the order they are declared.
func (c chains) mangle() []string { return []string{c.clientAddress, c.dialMark, c.canary.Chain} }

// ours is every chain of the portals' names, the client-address chain
// whether or not c writes it.
func (c chains) ours() iptables.Ours {
	return iptables.Ours{Chains: iptables.ChainSet{"nat": c.nat(), "filter": c.filter(), "mangle": c.mangle()}.Has}
}

// withClientAddressChain returns c with the mangle chain of transparent dials,
// and the canary in the mangle table as well.
func (c chains) withClientAddressChain() chains {
	c.withClientAddress = true
	c.canary.Tables = append(slices.Clone(c.canary.Tables), "mangle")
	return c
}

// jumps lists the jump rules. PORTALS jumps go first so Service IPs win over
// anything else; NODEPORT jumps go last because they match every local
// destination. The INPUT accept goes first: appended after a firewall's final
// DROP it would never run. The NO-ENDPOINTS jumps go first in the three filter
// hooks a connection's first packet may take, as kube-proxy's no-endpoint
// rejects do: into the node (INPUT), through it (FORWARD: a pod or another
// host to a virtual IP), and out of it (OUTPUT: the node's own).
//
// Each comment begins with iptables.CommentPrefix, which tells the portals'
// chains from another program's of the same name.
func (c chains) jumps() []iptables.Jump {
	local := []string{"-m", "addrtype", "--dst-type", "LOCAL"}
	noEndpoints := func(chain string) iptables.Jump {
		return iptables.Jump{Table: "filter", Chain: chain,
			Spec: iptables.JumpSpec([]string{"-m", "conntrack", "--ctstate", "NEW"}, "Services without endpoints", c.noEndpoints)}
	}
	var clientAddress []iptables.Jump
	if c.withClientAddress {
		for _, hook := range []string{"PREROUTING", "OUTPUT"} {
			clientAddress = append(clientAddress, iptables.Jump{Table: "mangle", Chain: hook,
				Spec: iptables.JumpSpec(nil, "dials from client addresses and their replies", c.clientAddress)})
		}
		clientAddress = append(clientAddress, iptables.Jump{Table: "mangle", Chain: "POSTROUTING",
			Spec: iptables.JumpSpec(nil, "no later rule sees uproxy's dial mark", c.dialMark)})
	}
	return append([]iptables.Jump{
		{Table: "nat", Chain: "PREROUTING", Spec: iptables.JumpSpec(nil, "service portals", c.portalsContainer)},
		{Table: "nat", Chain: "OUTPUT", Spec: iptables.JumpSpec(nil, "service portals", c.portalsHost)},
		{Table: "nat", Chain: "PREROUTING", Last: true, Spec: iptables.JumpSpec(local, "NodePorts", c.nodePortContainer)},
		{Table: "nat", Chain: "OUTPUT", Last: true, Spec: iptables.JumpSpec(local, "NodePorts", c.nodePortHost)},
		{Table: "filter", Chain: "INPUT", Spec: iptables.JumpSpec(nil, "NodePorts", c.nodePortNonLocal)},
		noEndpoints("INPUT"),
		noEndpoints("FORWARD"),
		noEndpoints("OUTPUT"),
	}, clientAddress...)
}
