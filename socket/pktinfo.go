package socket

import (
	"encoding/binary"
	"net"
	"net/netip"

	"golang.org/x/sys/unix"
)

// A UDP socket bound to a wildcard address answers from whatever source address
// the routing table picks for the client, which need not be the address the
// client wrote to. Behind a portal that breaks the reply: conntrack only
// translates a reply that comes from the address the request was DNATed or
// REDIRECTed to, and a connected client drops datagrams from any other source.
// So on wildcard sockets uproxy asks the kernel for each datagram's destination
// (IP_PKTINFO / IPV6_PKTINFO) and sends the client's replies from that address.

// enablePktinfo turns on destination-address reporting on a wildcard-bound conn.
// It reports whether replies need an explicit source address.
func enablePktinfo(conn *net.UDPConn) bool {
	la, ok := conn.LocalAddr().(*net.UDPAddr)
	if !ok || !la.IP.IsUnspecified() {
		return false
	}
	rc, err := conn.SyscallConn()
	if err != nil {
		return false
	}
	enabled := false
	rc.Control(func(fd uintptr) {
		// IP_PKTINFO also works on a dual-stack IPv6 socket, for its IPv4 traffic.
		if unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_PKTINFO, 1) == nil {
			enabled = true
		}
		if la.IP.To4() == nil && unix.SetsockoptInt(int(fd), unix.IPPROTO_IPV6, unix.IPV6_RECVPKTINFO, 1) == nil {
			enabled = true
		}
	})
	return enabled
}

// parseControl returns, from a datagram's control messages, the destination
// address it was sent to (invalid when they carry none) and the segment size of
// a coalesced run (0 when it is one datagram; see gso.go).
func parseControl(oob []byte) (dst netip.Addr, size int) {
	for len(oob) > 0 {
		hdr, data, rest, err := unix.ParseOneSocketControlMessage(oob)
		if err != nil {
			break
		}
		switch {
		case hdr.Level == unix.IPPROTO_IP && hdr.Type == unix.IP_PKTINFO && len(data) >= unix.SizeofInet4Pktinfo:
			// struct in_pktinfo: ifindex (4), spec_dst (4), addr (4): addr is the header's destination.
			dst = netip.AddrFrom4([4]byte(data[8:12]))
		case hdr.Level == unix.IPPROTO_IPV6 && hdr.Type == unix.IPV6_PKTINFO && len(data) >= unix.SizeofInet6Pktinfo:
			dst = netip.AddrFrom16([16]byte(data[0:16])).Unmap()
		case hdr.Level == unix.SOL_UDP && hdr.Type == unix.UDP_GRO && len(data) >= 4:
			size = int(int32(binary.NativeEndian.Uint32(data)))
		}
		oob = rest
	}
	return dst, size
}

// replySource returns the control message that makes a reply leave from src
// (nil when src is invalid: the kernel chooses).
func replySource(src netip.Addr) []byte {
	switch {
	case !src.IsValid():
		return nil
	case src.Is4():
		return unix.PktInfo4(&unix.Inet4Pktinfo{Spec_dst: src.As4()})
	default:
		return unix.PktInfo6(&unix.Inet6Pktinfo{Addr: src.As16()})
	}
}
