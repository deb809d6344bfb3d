package proxier

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

// A Service port's proxy socket can fail for good while the port lives on (a
// listening socket shut down under the proxy: accept then says EINVAL). Its
// Serve returns the error, which marks the Proxier; the next Sync takes the long
// way and reopens the socket, on the same proxy port while that is free, and
// serves it with the same proxy, so the connections the dead socket accepted
// carry on and the port keeps its balancer, affinity and metrics.

// listenerState is a Service port's proxy socket and what befell the ones
// before it. It is never changed once stored: a reopen stores a new one.
type listenerState struct {
	proxyPort int
	serving   *serving
	// reopens counts the sockets of the port that failed for good and were
	// replaced; lastFailure is why the latest of them failed.
	reopens     int
	lastFailure error
}

// serving is one Serve of a proxy socket. err, set before done is closed, is
// why the socket failed for good (nil when it was closed).
type serving struct {
	done chan struct{}
	err  error
}

// failed returns why the socket failed for good, or nil while it serves or
// after it was closed.
func (sv *serving) failed() error {
	select {
	case <-sv.done:
		return sv.err
	default:
		return nil
	}
}

func (p *Proxier) listenHost() string {
	if !p.listenAddr().IsValid() {
		return "" // every address, both families
	}
	return p.cfg.BindAddress.String()
}

// listenAddr is the address the proxy sockets listen on; the zero Addr for
// every address of both families.
func (p *Proxier) listenAddr() netip.Addr {
	if !p.cfg.BindAddress.IsValid() || p.cfg.BindAddress.IsUnspecified() {
		return netip.Addr{}
	}
	return p.cfg.BindAddress
}

// listen opens the proxy socket of sp's route r on proxy port pp and starts
// serving it.
func (p *Proxier) listen(sp *servicePort, r *route, pp int) (*serving, error) {
	addr := net.JoinHostPort(p.listenHost(), strconv.Itoa(pp))
	sv := &serving{done: make(chan struct{})}
	if r.tcp != nil {
		// Nine system calls, outside Go's poller: the first sync of 10k
		// Service ports opens 10k of these (socket/listen.go).
		fd, err := r.tcp.OpenListener(p.listenAddr(), uint16(pp))
		if err != nil {
			return nil, err
		}
		if err := r.tcp.StartFD(fd, addr, func(err error) { p.served(sp, sv, err) }); err != nil {
			p.served(sp, sv, err)
		}
	} else {
		pc, err := new(net.ListenConfig).ListenPacket(context.Background(), "udp", addr)
		if err != nil {
			return nil, err
		}
		if err := spareDescriptor(pc.(*net.UDPConn)); err != nil {
			pc.Close()
			return nil, err
		}
		if err := r.udp.Start(pc.(*net.UDPConn), func(err error) { p.served(sp, sv, err) }); err != nil {
			p.served(sp, sv, err)
		}
	}
	p.own.add(sp.protocol, pp)
	return sv, nil
}

// releasePort gives back proxy port pp of sp, whose socket is closed.
func (p *Proxier) releasePort(sp *servicePort, pp int) {
	p.alloc.release(sp.protocol, pp)
	p.own.remove(sp.protocol, pp)
}

// spareDescriptor checks that the process can open one more descriptor, as
// Serve does to take the socket over from Go's poller, so that running out of
// descriptors fails the open here, where Sync sees it, rather than in Serve a
// moment later (where each failed socket would cost the next sync a reopen).
func spareDescriptor(c syscall.Conn) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var dupErr error
	if err := rc.Control(func(fd uintptr) {
		var dup int
		if dup, dupErr = unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0); dupErr == nil {
			unix.Close(dup)
		}
	}); err != nil {
		return err
	}
	if dupErr != nil {
		return os.NewSyscallError("fcntl", dupErr)
	}
	return nil
}

// listenAnywhere opens the proxy socket of sp's route r on a free port of the
// range, or serves the socket a predecessor handed for it (adopt.go).
func (p *Proxier) listenAnywhere(sp *servicePort, r *route) (*listenerState, error) {
	if ls, ok := p.adopted(sp, r); ok {
		return ls, nil
	}
	var ls *listenerState
	var lastErr error
	ok := p.alloc.each(sp.protocol, func(pp int) (bool, bool) {
		sv, err := p.listen(sp, r, pp)
		if err != nil {
			// Out of descriptors, every other port would fail alike.
			lastErr = err
			return false, fdStarved(err)
		}
		ls = &listenerState{proxyPort: pp, serving: sv}
		return true, false
	})
	if !ok {
		if lastErr == nil {
			held := "in use"
			if p.alloc.reserved != nil {
				held = "in use or reserved (net.ipv4.ip_local_reserved_ports)"
			}
			lastErr = fmt.Errorf("every %s port of range %s is %s", sp.protocol, p.alloc.r, held)
		}
		return nil, lastErr
	}
	return ls, nil
}

// served records how serving sp's proxy socket ended: err is what Serve
// would have returned. Sockets are served with Start, not a goroutine each in
// Serve: 10k Service ports would hold 10k goroutines, each with its stack.
func (p *Proxier) served(sp *servicePort, sv *serving, err error) {
	if err != nil && !errors.Is(err, net.ErrClosed) {
		klog.ErrorS(err, "Proxy socket failed; the next sync reopens it", "service", sp.name)
		sv.err = err
	}
	close(sv.done)
	if sv.err != nil {
		p.socketFailed.Store(true)
	}
}

// reopenFailed replaces each proxy socket of sp that has failed for good: on
// the same proxy port while that is free (clients and portals keep it), else
// on another of the range. While no port can be had the dead socket's port
// stays held, to be tried first by the next Sync.
func (p *Proxier) reopenFailed(sp *servicePort) error {
	for _, r := range sp.routes() {
		if err := p.reopenRoute(sp, r); err != nil {
			return err
		}
	}
	return nil
}

func (p *Proxier) reopenRoute(sp *servicePort, r *route) error {
	old := r.listener.Load()
	failure := old.serving.failed()
	if failure == nil {
		return nil
	}
	ls := &listenerState{proxyPort: old.proxyPort, reopens: old.reopens + 1, lastFailure: failure}
	sv, err := p.listen(sp, r, old.proxyPort)
	if err != nil {
		moved, err := p.listenAnywhere(sp, r)
		if err != nil {
			return fmt.Errorf("reopen proxy port %d of %s after %v: %w", old.proxyPort, sp.name, failure, err)
		}
		p.releasePort(sp, old.proxyPort)
		ls.proxyPort, sv = moved.proxyPort, moved.serving
	}
	ls.serving = sv
	r.listener.Store(ls)
	p.hold(sp, r, ls)
	sp.observer.Reopened(old.proxyPort, ls.proxyPort, failure)
	return nil
}
