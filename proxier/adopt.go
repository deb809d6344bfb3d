package proxier

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/service"
)

// A uproxy that takes over from a running one is handed its proxy sockets
// (HandOver in the old process) and adopts each when its Sync opens the same
// route of the same Service port (Adopt): the socket keeps its proxy port, so
// the portals steer to the same ports, and it never closes in between, so no
// connection is refused. Both processes accept on such a socket until the old
// one closes its copy; whichever accepts a connection serves it.

// A HandedSocket is a proxy socket passed between processes: the route of a
// Service port it serves and its proxy port. FD is a descriptor of its own,
// which whoever holds the HandedSocket closes (or hands to Adopt).
type HandedSocket struct {
	Service   service.PortName
	Protocol  service.Protocol
	External  bool // the route of the NodePort, ExternalIPs and LoadBalancer IPs
	ProxyPort int
	FD        int
}

func (h HandedSocket) key() handedKey {
	return handedKey{h.Service, h.Protocol, h.External}
}

type handedKey struct {
	name     service.PortName
	protocol service.Protocol
	external bool
}

// adoption holds the sockets handed by a predecessor, until Sync adopts them
// or EndAdoption closes the rest. mu guards both fields.
type adoption struct {
	mu      sync.Mutex
	waiting map[handedKey]HandedSocket
	adopted int
}

// HandOver returns a duplicate of every proxy socket, for a successor to
// adopt; the proxier goes on serving its own copies until Shutdown. The
// caller closes the duplicates' FDs.
func (p *Proxier) HandOver() ([]HandedSocket, error) {
	var out []HandedSocket
	err := p.HandOverEach(func(socks []HandedSocket) error {
		out = append(out, socks...)
		return nil
	})
	if err != nil {
		CloseHanded(out)
		return nil, err
	}
	return out, nil
}

// HandOverEach is HandOver a route at a time: emit gets the duplicates of
// one route's sockets, and owns them, so that the caller may send and close
// them as it goes, never holding a second descriptor for every proxy socket
// at once (10,000 Service ports would need 10,000 more). An error of emit
// ends the walk and is returned.
func (p *Proxier) HandOverEach(emit func([]HandedSocket) error) error {
	p.mu.RLock()
	ports := make([]*servicePort, 0, len(p.ports))
	for _, sp := range p.ports {
		ports = append(ports, sp)
	}
	p.mu.RUnlock()
	for _, sp := range ports {
		for _, r := range sp.routes() {
			ls := r.listener.Load()
			if ls == nil || ls.serving.failed() != nil {
				continue
			}
			socks, err := dupRoute(sp, r, ls)
			if err != nil {
				return err
			}
			if err := emit(socks); err != nil {
				return err
			}
		}
	}
	return nil
}

// Adopt gives the proxier the sockets of a predecessor: each is served,
// instead of a new proxy port being opened, by the first Sync that opens
// its route. Call it before the first Sync; EndAdoption closes what was not
// adopted.
func (p *Proxier) Adopt(socks []HandedSocket) {
	p.adopt.mu.Lock()
	defer p.adopt.mu.Unlock()
	if p.adopt.waiting == nil {
		p.adopt.waiting = make(map[handedKey]HandedSocket, len(socks))
	}
	for _, h := range socks {
		if old, ok := p.adopt.waiting[h.key()]; ok {
			unix.Close(old.FD) // one socket per route; a second is a stale copy
		}
		p.adopt.waiting[h.key()] = h
	}
}

// EndAdoption closes the handed sockets no Sync adopted (their Service ports
// are gone, or changed protocol or route) and returns how many were adopted
// and how many closed.
func (p *Proxier) EndAdoption() (adopted, closed int) {
	p.adopt.mu.Lock()
	defer p.adopt.mu.Unlock()
	for k, h := range p.adopt.waiting {
		p.closeUnadopted(h)
		delete(p.adopt.waiting, k)
		closed++
	}
	return p.adopt.adopted, closed
}

// adopted serves the handed socket of sp's route r, if there is one; ok is
// false when there is none, or it could not be served (it is closed then, and
// the caller opens a port as usual).
func (p *Proxier) adopted(sp *servicePort, r *route) (*listenerState, bool) {
	p.adopt.mu.Lock()
	h, ok := p.adopt.waiting[handedKey{sp.name, sp.protocol, r.external}]
	if ok {
		delete(p.adopt.waiting, h.key())
	}
	p.adopt.mu.Unlock()
	if !ok {
		return nil, false
	}
	sv, err := p.serveHanded(sp, r, h)
	if err != nil {
		klog.ErrorS(err, "Could not adopt a handed proxy socket; opening another port", "service", sp.name, "proxyPort", h.ProxyPort)
		return nil, false
	}
	p.adopt.mu.Lock()
	p.adopt.adopted++
	p.adopt.mu.Unlock()
	klog.V(1).InfoS("Adopted a handed proxy socket", "service", sp.name, "protocol", sp.protocol, "external", r.external, "proxyPort", h.ProxyPort)
	return &listenerState{proxyPort: h.ProxyPort, serving: sv}, true
}

// serveHanded serves handed socket h as sp's route r, holding its proxy port.
// h.FD is consumed either way.
func (p *Proxier) serveHanded(sp *servicePort, r *route, h HandedSocket) (*serving, error) {
	sv := &serving{done: make(chan struct{})}
	if r.tcp != nil {
		// Straight to the event loops, as a socket the proxier opens: a
		// successor of 10k Service ports adopts 10k of these before it serves.
		addr, err := handedListener(h)
		if err != nil {
			unix.Close(h.FD)
			return nil, err
		}
		// This process's options (--tcp-keepalive may differ from the
		// predecessor's); connections already queued keep theirs.
		if err := r.tcp.ApplyListenerOptions(h.FD); err != nil {
			unix.Close(h.FD)
			return nil, err
		}
		if err := r.tcp.StartFD(h.FD, addr, func(err error) { p.served(sp, sv, err) }); err != nil {
			p.served(sp, sv, err)
		}
	} else {
		f := os.NewFile(uintptr(h.FD), fmt.Sprintf("proxy port %d", h.ProxyPort))
		defer f.Close()
		pc, err := net.FilePacketConn(f)
		if err != nil {
			return nil, err
		}
		uc, ok := pc.(*net.UDPConn)
		if !ok {
			pc.Close()
			return nil, fmt.Errorf("handed socket of proxy port %d is no UDP socket", h.ProxyPort)
		}
		if err := r.udp.Start(uc, func(err error) { p.served(sp, sv, err) }); err != nil {
			p.served(sp, sv, err)
		}
	}
	p.alloc.hold(sp.protocol, h.ProxyPort)
	p.own.add(sp.protocol, h.ProxyPort)
	return sv, nil
}

// handedListener checks that handed socket h is a listening TCP socket on its
// proxy port, non-blocking as the event loops want it, and returns its address.
func handedListener(h HandedSocket) (string, error) {
	notListener := func(why string) error {
		return fmt.Errorf("handed socket of proxy port %d is no TCP listener: %s", h.ProxyPort, why)
	}
	if typ, err := unix.GetsockoptInt(h.FD, unix.SOL_SOCKET, unix.SO_TYPE); err != nil || typ != unix.SOCK_STREAM {
		return "", notListener(fmt.Sprintf("socket type %d, %v", typ, err))
	}
	if on, err := unix.GetsockoptInt(h.FD, unix.SOL_SOCKET, unix.SO_ACCEPTCONN); err != nil || on != 1 {
		return "", notListener(fmt.Sprintf("not listening (%v)", err))
	}
	sa, err := unix.Getsockname(h.FD)
	if err != nil {
		return "", notListener(err.Error())
	}
	var ap netip.AddrPort
	switch sa := sa.(type) {
	case *unix.SockaddrInet4:
		ap = netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), uint16(sa.Port))
	case *unix.SockaddrInet6:
		ap = netip.AddrPortFrom(netip.AddrFrom16(sa.Addr), uint16(sa.Port))
	default:
		return "", notListener("not an internet socket")
	}
	if int(ap.Port()) != h.ProxyPort {
		return "", notListener(fmt.Sprintf("it listens on port %d", ap.Port()))
	}
	if err := unix.SetNonblock(h.FD, true); err != nil {
		return "", os.NewSyscallError("fcntl", err)
	}
	return ap.String(), nil
}

// CloseHanded closes the descriptors of socks.
func CloseHanded(socks []HandedSocket) {
	for _, h := range socks {
		unix.Close(h.FD)
	}
}
