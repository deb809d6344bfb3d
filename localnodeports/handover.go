package localnodeports

import (
	"fmt"
	"net"
	"os"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/service"
)

// A uproxy that takes over from a running one (app/takeover.go) is handed
// the relay's loopback NodePort sockets too: both processes accept on them
// until the old one closes its copies, so a connection to 127.0.0.1:NODEPORT
// is never refused, and the successor's relay needs no bind (which would
// fail while the old one holds the port).

// HandedSocket is a loopback NodePort's socket passed between processes.
// FD is a descriptor of its own, which whoever holds it closes (or hands to
// Adopt).
type HandedSocket struct {
	Protocol service.Protocol
	IPv6     bool
	NodePort int
	FD       int
}

func (h HandedSocket) key() key { return key{h.Protocol, h.IPv6, h.NodePort} }

// HandOver returns a duplicate of every loopback NodePort socket, for a
// successor; the relay goes on serving its own copies until Close.
func (r *Relay) HandOver() ([]HandedSocket, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []HandedSocket
	for k, l := range r.listeners {
		var fds []int
		var err error
		if l.tcp != nil {
			fds, err = l.tcp.DupListeners()
		} else {
			fds, err = l.udp.DupSockets()
		}
		if err != nil {
			CloseHanded(out)
			return nil, fmt.Errorf("localhost NodePort %s: %w", k.address(), err)
		}
		for _, fd := range fds {
			out = append(out, HandedSocket{Protocol: k.proto, IPv6: k.v6, NodePort: k.nodePort, FD: fd})
		}
	}
	return out, nil
}

// Adopt gives the relay a predecessor's sockets: the next Sync serves each
// instead of listening anew, and closes those it does not want. Call it
// before that Sync.
func (r *Relay) Adopt(socks []HandedSocket) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.adopted == nil {
		r.adopted = make(map[key]int, len(socks))
	}
	for _, h := range socks {
		if old, ok := r.adopted[h.key()]; ok {
			unix.Close(old) // one socket per key; a second is a stale copy
		}
		r.adopted[h.key()] = h.FD
	}
}

// CloseHanded closes the descriptors of socks.
func CloseHanded(socks []HandedSocket) {
	for _, h := range socks {
		unix.Close(h.FD)
	}
}

// adoptedSocket returns k's handed socket as a listener or a packet
// connection (nil, nil: none handed). r.mu is held.
func (r *Relay) adoptedSocket(k key) (*net.TCPListener, *net.UDPConn) {
	fd, ok := r.adopted[k]
	if !ok {
		return nil, nil
	}
	delete(r.adopted, k)
	f := os.NewFile(uintptr(fd), "localhost NodePort "+k.address())
	defer f.Close()
	if k.proto == service.TCP {
		ln, err := net.FileListener(f)
		if tl, ok := ln.(*net.TCPListener); err == nil && ok {
			return tl, nil
		}
		klog.ErrorS(err, "A handed localhost NodePort socket is no TCP listener; listening anew", "address", k.address())
		return nil, nil
	}
	pc, err := net.FilePacketConn(f)
	if uc, ok := pc.(*net.UDPConn); err == nil && ok {
		return nil, uc
	}
	klog.ErrorS(err, "A handed localhost NodePort socket is no UDP socket; listening anew", "address", k.address())
	return nil, nil
}

// endAdoption closes the handed sockets a Sync did not take. r.mu is held.
func (r *Relay) endAdoption() {
	for k, fd := range r.adopted {
		unix.Close(fd)
		delete(r.adopted, k)
	}
}
