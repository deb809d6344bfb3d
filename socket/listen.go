package socket

import (
	"errors"
	"fmt"
	"math"
	"net"
	"net/netip"
	"os"
	"slices"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// A proxier opening 10k Service ports opens 10k listening sockets in its first
// sync. Through Go's net.ListenConfig and Start each took about twenty system
// calls: the socket, its options (the listener options twice), bind, listen,
// getsockname, Go's poller taking the socket and giving it back (epoll_ctl twice),
// and the duplicate that moved it out of there (and another that checked one was
// possible). OpenListener and StartFD take nine, and never enter Go's poller,
// which the socket never needed: the event loops serve it.

// noIPv6 is set once a socket of every address could not be IPv6 (a kernel
// booted with ipv6.disable=1): those sockets are IPv4 alone from then on.
var noIPv6 atomic.Bool

// OpenListener opens a TCP socket listening on port of host, for StartFD, with
// the options every socket it accepts inherits (as Listen). host is an address,
// or the zero Addr for every address of both families: one IPv6 socket that
// takes IPv4 too, as Go's "tcp" listener on ":port", or an IPv4 one where the
// kernel has no IPv6. Its errors read as net.Listen's ("listen tcp :40001:
// bind: address already in use") and wrap the errno.
func (p *TCPProxy) OpenListener(host netip.Addr, port uint16) (int, error) {
	host = host.Unmap()
	if host.IsValid() && host.IsUnspecified() {
		host = netip.Addr{} // 0.0.0.0 and :: listen everywhere, as with net.Listen
	}
	addr := netip.AddrPortFrom(host, port)
	opErr := func(call string, err error) error {
		return &net.OpError{Op: "listen", Net: "tcp", Addr: net.TCPAddrFromAddrPort(addr), Err: os.NewSyscallError(call, err)}
	}
	family, dual := unix.AF_INET6, !host.IsValid()
	if host.Is4() || (dual && noIPv6.Load()) {
		family = unix.AF_INET
	}
	fd, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, unix.IPPROTO_TCP)
	if err != nil && dual && family == unix.AF_INET6 && errors.Is(err, unix.EAFNOSUPPORT) {
		noIPv6.Store(true)
		family = unix.AF_INET
		fd, err = unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, unix.IPPROTO_TCP)
	}
	if err != nil {
		return -1, opErr("socket", err)
	}
	fail := func(call string, err error) (int, error) {
		unix.Close(fd)
		return -1, opErr(call, err)
	}
	// As Go's listeners: a port whose last connections wait in TIME_WAIT can be
	// listened on again at once.
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); err != nil {
		return fail("setsockopt", err)
	}
	if family == unix.AF_INET6 {
		v6only := 1
		if dual {
			v6only = 0
		}
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, v6only); err != nil {
			return fail("setsockopt", err)
		}
	}
	if err := p.setListenerOptions(fd); err != nil {
		unix.Close(fd)
		return -1, &net.OpError{Op: "listen", Net: "tcp", Addr: net.TCPAddrFromAddrPort(addr), Err: err}
	}
	bind := host
	if dual {
		bind = netip.IPv6Unspecified()
		if family == unix.AF_INET {
			bind = netip.IPv4Unspecified()
		}
	}
	if err := unix.Bind(fd, sockaddrOf(netip.AddrPortFrom(bind, port))); err != nil {
		return fail("bind", err)
	}
	// The kernel takes at most net.core.somaxconn of the socket's namespace,
	// which is what Go asks for.
	if err := unix.Listen(fd, math.MaxInt32); err != nil {
		return fail("listen", err)
	}
	return fd, nil
}

// ApplyListenerOptions gives listening socket fd, which another process
// opened, the options OpenListener gives its own (TCP_NODELAY and the
// proxy's keepalive, which every socket it accepts inherits).
func (p *TCPProxy) ApplyListenerOptions(fd int) error { return p.setListenerOptions(fd) }

// StartFD is Start for listening socket fd, which OpenListener opened (or
// another process handed over; addr names it in errors). The proxy owns fd
// from the call on, and closes it when serving ends, or at once when it
// cannot be served.
func (p *TCPProxy) StartFD(fd int, addr string, done func(error)) error {
	p.init()
	if p.Loops == nil {
		unix.Close(fd)
		return fmt.Errorf("serve %s: TCPProxy.Loops is nil, want the event loops to run on", p.Service)
	}
	tl := &tcpListener{p: p, fd: fd, addr: addr, done: make(chan struct{})}
	// Set before anyone can close tl: register, or Close once tl is listed.
	tl.finished = func() {
		p.mu.Lock()
		p.listeners = slices.DeleteFunc(p.listeners, func(l *tcpListener) bool { return l == tl })
		p.serving--
		p.checkDrainedLocked()
		closed := p.closed
		p.mu.Unlock()
		if tl.err != nil && !closed {
			done(fmt.Errorf("accept on %s for %s: %w", tl.addr, p.Service, tl.err))
			return
		}
		done(nil)
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		unix.Close(tl.fd)
		go done(nil)
		return nil
	}
	p.listeners = append(p.listeners, tl)
	p.serving++
	p.mu.Unlock()

	tl.register(p.Loops.Loops())
	return nil
}
