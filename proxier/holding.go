package proxier

import (
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

// A uproxy run under a crash holder (app's --crash-holder) tells the holder of
// every proxy socket it serves and of each it stops serving. The holder is a
// small parent process that keeps a copy of each: when the serving process
// dies (a SIGKILL, an OOM kill, a panic), the sockets stay open, connections
// wait in their backlogs and datagrams in their buffers, and the restarted
// process adopts the holder's copies (Adopt) instead of opening new ports.

// Holding is told of the proxy sockets, as they change. The proxier calls it
// from Sync, once per route that opened, moved or closed: never a walk over
// every Service port.
type Holding interface {
	// Hold gives the holder copies of one route's sockets (all of the same
	// Service port, protocol and route; a reuseport group has several), which
	// replace any it had for that route. It owns the FDs.
	Hold(socks []HandedSocket)
	// Release says the route no longer serves (FD is -1): the holder closes
	// its copies.
	Release(h HandedSocket)
}

// hold tells the Holding of r's sockets, now served on ls's proxy port.
func (p *Proxier) hold(sp *servicePort, r *route, ls *listenerState) {
	if p.cfg.Holding == nil || ls == nil {
		return
	}
	socks, err := dupRoute(sp, r, ls)
	if err != nil {
		// The holder keeps what it had: an older copy of this route, or none.
		klog.ErrorS(err, "Could not give the crash holder a copy of a proxy socket", "service", sp.name, "proxyPort", ls.proxyPort)
		return
	}
	p.cfg.Holding.Hold(socks)
}

// dupRoute returns duplicates of the sockets r of sp serves on ls's proxy
// port, which the caller closes or hands on.
func dupRoute(sp *servicePort, r *route, ls *listenerState) ([]HandedSocket, error) {
	var fds []int
	var err error
	if r.tcp != nil {
		fds, err = r.tcp.DupListeners()
	} else {
		fds, err = r.udp.DupSockets()
	}
	if err != nil {
		return nil, err
	}
	socks := make([]HandedSocket, len(fds))
	for i, fd := range fds {
		socks[i] = HandedSocket{Service: sp.name, Protocol: sp.protocol, External: r.external, ProxyPort: ls.proxyPort, FD: fd}
	}
	return socks, nil
}

// release tells the Holding that r of sp serves no more.
func (p *Proxier) release(sp *servicePort, r *route, proxyPort int) {
	if p.cfg.Holding != nil {
		p.cfg.Holding.Release(HandedSocket{Service: sp.name, Protocol: sp.protocol, External: r.external, ProxyPort: proxyPort, FD: -1})
	}
}

// closeUnadopted closes a handed socket no Sync adopted, and tells the
// Holding, whose copy it may be.
func (p *Proxier) closeUnadopted(h HandedSocket) {
	unix.Close(h.FD)
	if p.cfg.Holding != nil {
		h.FD = -1
		p.cfg.Holding.Release(h)
	}
}
