package socket

import (
	"fmt"
	"net/netip"
	"os"
	"sync/atomic"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/record"
)

// A proxy keeps its clients' addresses when its KeepClientAddress says so: the
// dial to the endpoint is then transparent, its socket given IP_TRANSPARENT
// (IPV6_TRANSPARENT) and bound to the client's address before it connects, so
// the endpoint sees the client, as it would behind kube-proxy's DNAT. The
// kernel lets the socket send from an address that is not the node's; the
// endpoint's replies, addressed to the client, reach the socket rather than the
// client only because the portals mark them and a policy route delivers them
// on this node (rules.Config.ClientAddressMark). A transparent socket carries
// the dial mark like every other, which is how those rules tell its packets.
//
// A dial never keeps the address of a client connecting to its own address (a
// pod reaching itself through its Service, record.SourceHairpin): the endpoint
// would answer itself. A transparent socket the kernel refuses (no
// CAP_NET_ADMIN, an address it will not bind) is closed and the attempt dials
// from the node instead (record.SourceFallback), never failing the client for
// a reason of the node; the first refusal of each proxy is logged.
//
// It costs a transparent dial two system calls more than a node one:
// setsockopt IP_TRANSPARENT and bind. The bind chooses the local port, not the
// connect (no IP_BIND_ADDRESS_NO_PORT): the kernel's choice at connect starts
// from a hash of the two addresses and the destination port that every network
// namespace shares, so the node's connect would pick the very port the client's
// own kernel picks for its next connection to the same endpoint, and the two
// flows, one tuple, would meet in conntrack and at the endpoint (one of them
// never answered). A port chosen at bind comes from the other half of the
// range (bind prefers odd ports, connect even ones), apart from the client's.
// The price: each dial holds its port whatever its destination, so one client
// address has at most the node's ephemeral range of dials open at a time (odd
// ports first, then even ones, where the client's may meet them again).

// sourceOf is the source a connection from client should dial ep from, and the
// address to bind for it (invalid for the node's). keep is the proxy's decision
// for the connection.
func sourceOf(keep bool, client netip.Addr, ep netip.AddrPort) (record.Source, netip.Addr) {
	if !keep {
		return record.SourceNode, netip.Addr{}
	}
	if ep.Addr().Unmap() == client {
		return record.SourceHairpin, netip.Addr{}
	}
	return record.SourceClient, client
}

// transparent makes socket fd (of src's family, of type sotype) send from
// src, not a local address, on a port the kernel chooses.
func transparent(fd, sotype int, src netip.Addr) error {
	var err error
	if src.Is4() {
		err = unix.SetsockoptInt(fd, unix.SOL_IP, unix.IP_TRANSPARENT, 1)
	} else {
		err = unix.SetsockoptInt(fd, unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
	}
	if err != nil {
		return os.NewSyscallError("setsockopt", err)
	}
	var sa unix.Sockaddr
	if src.Is4() {
		sa = &unix.SockaddrInet4{Addr: src.As4()}
	} else {
		sa = &unix.SockaddrInet6{Addr: src.As16()}
	}
	if err := unix.Bind(fd, sa); err != nil {
		return os.NewSyscallError("bind", err)
	}
	return nil
}

// fallbackLog logs the first transparent dial of a proxy that the kernel
// refused.
type fallbackLog struct{ logged atomic.Bool }

func (f *fallbackLog) refused(service string, client netip.Addr, err error) {
	if f.logged.Swap(true) {
		return
	}
	klog.ErrorS(err, "The kernel refused a dial from the client's address; dialing from the node's instead (counted in uproxy_dial_sources_total{source=\"fallback\"}, logged once per Service port)",
		"service", service, "client", client,
		"hint", "transparent dials need CAP_NET_ADMIN and, for the replies, the portals' client-address rules and policy route (uproxy explain says which are in place)")
}

// CheckTransparent says why this process cannot dial from a client's address
// (nil when it can): IP_TRANSPARENT needs CAP_NET_ADMIN (or CAP_NET_RAW).
func CheckTransparent() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return os.NewSyscallError("socket", err)
	}
	defer unix.Close(fd)
	if err := unix.SetsockoptInt(fd, unix.SOL_IP, unix.IP_TRANSPARENT, 1); err != nil {
		return fmt.Errorf("transparent sockets (IP_TRANSPARENT) refused: %w", err)
	}
	return nil
}
