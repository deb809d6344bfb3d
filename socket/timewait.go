package socket

import (
	"encoding/binary"
	"net/netip"
	"sync"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

// A dial from the client's address (source.go) that sends the first FIN leaves
// its pair of addresses in TIME_WAIT on the node for a minute. The node's kernel
// matches an arriving packet to a local socket before it routes it, and drops a
// packet it would forward once a socket claimed it: the endpoint's replies to
// the client's own connection from that address and port (a pod reaching the
// endpoint directly, its port picked by its own kernel, which knows nothing of
// the node's sockets) would be dropped for that minute. The kernel creates the
// TIME_WAIT when the endpoint's FIN arrives, whatever the socket's linger, so it
// is ended afterwards, as `ss -K` does: a SOCK_DESTROY request over sock_diag.
// The client keeps the TIME_WAIT of its own connection, as it does through
// kube-proxy's DNAT; only the node's copy goes.

// sockDestroy is SOCK_DESTROY of linux/sock_diag.h.
const sockDestroy = 21

// timeWaitEnder sends the requests; one netlink socket serves every loop.
type timeWaitEnder struct {
	mu     sync.Mutex
	opened bool
	fd     int // -1 once opening failed or the kernel refused a request
	buf    [unix.SizeofNlMsghdr + 56]byte
	in     [512]byte
}

var timeWaits timeWaitEnder

// endTimeWait ends the TIME_WAIT of the TCP socket from local to remote. It
// costs two system calls (the request, and a read of the kernel's answer, which
// is queued before the request returns) under a process-wide lock. The first
// refusal (a kernel without CONFIG_INET_DIAG_DESTROY, no CAP_NET_ADMIN) is
// logged and ends the attempts; a socket already gone is no refusal.
func endTimeWait(local, remote netip.AddrPort) {
	tw := &timeWaits
	tw.mu.Lock()
	defer tw.mu.Unlock()
	if !tw.opened {
		tw.opened = true
		fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, unix.NETLINK_INET_DIAG)
		if err != nil {
			klog.ErrorS(err, "Cannot open sock_diag: dials from clients' addresses leave their TIME_WAIT on the node, where it can take the client's own connections from the same port")
			tw.fd = -1
			return
		}
		tw.fd = fd
	}
	if tw.fd < 0 {
		return
	}
	b := tw.buf[:]
	ne := binary.NativeEndian
	ne.PutUint32(b[0:], uint32(len(b)))
	ne.PutUint16(b[4:], sockDestroy)
	ne.PutUint16(b[6:], unix.NLM_F_REQUEST|unix.NLM_F_ACK)
	ne.PutUint32(b[8:], 0)
	ne.PutUint32(b[12:], 0)
	r := b[unix.SizeofNlMsghdr:]
	clear(r)
	r[0] = unix.AF_INET6
	if local.Addr().Unmap().Is4() {
		r[0] = unix.AF_INET
	}
	r[1] = unix.IPPROTO_TCP
	ne.PutUint32(r[4:], 1<<unix.BPF_TCP_TIME_WAIT) // states
	id := r[8:]
	binary.BigEndian.PutUint16(id[0:], local.Port())
	binary.BigEndian.PutUint16(id[2:], remote.Port())
	putDiagAddr(id[4:20], local.Addr())
	putDiagAddr(id[20:36], remote.Addr())
	ne.PutUint32(id[40:], ^uint32(0)) // no cookie
	ne.PutUint32(id[44:], ^uint32(0))
	if err := unix.Sendto(tw.fd, b, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		tw.refused(err)
		return
	}
	n, _, err := unix.Recvfrom(tw.fd, tw.in[:], unix.MSG_DONTWAIT)
	if err != nil || n < unix.SizeofNlMsghdr+4 || ne.Uint16(tw.in[4:]) != unix.NLMSG_ERROR {
		return
	}
	switch errno := unix.Errno(-int32(ne.Uint32(tw.in[unix.SizeofNlMsghdr:]))); errno {
	case 0, unix.ENOENT:
		// Ended, or gone already.
	default:
		tw.refused(errno)
	}
}

// refused stops the requests after the first refusal, and says why.
func (tw *timeWaitEnder) refused(err error) {
	klog.ErrorS(err, "The kernel refused to end a TIME_WAIT on the node (SOCK_DESTROY): dials from clients' addresses leave theirs, where it can take the client's own connections from the same port")
	unix.Close(tw.fd)
	tw.fd = -1
}

// putDiagAddr writes a as sock_diag spells an address: IPv4 in the first four
// bytes, IPv6 in all sixteen.
func putDiagAddr(b []byte, a netip.Addr) {
	a = a.Unmap()
	if a.Is4() {
		v := a.As4()
		copy(b, v[:])
		return
	}
	v := a.As16()
	copy(b, v[:])
}
