// Package localnodeports serves NodePorts on the node's loopback addresses from
// user space, for a kernel mode whose rules cannot: a DNATed packet from
// 127.0.0.1 may leave the loopback device only with route_localnet (which
// exposes the node's loopback services to its neighbours, CVE-2020-8558), and
// IPv6 has nothing like it. A listener on 127.0.0.1:NodePort and [::1]:NodePort
// relays each TCP connection, or UDP flow, to the Service's ClusterIP of its
// family, and the kernel mode's rules DNAT that connection to an endpoint, as
// they would any of the node's. This is the small userspace proxy of upstream's
// KEP-6032 for kube-proxy's nftables mode.
//
//	r, err := localnodeports.New(localnodeports.Config{IPv4: true, IPv6: true})
//	...
//	err = r.Sync(snapshot) // after the kernel mode's own sync
//	...
//	err = r.Close(ctx)
//
// What it costs: per NodePort and family, a listening socket (and, for UDP, a
// socket per client flow while it lives); per relayed connection what a
// socket.TCPProxy connection costs (its package doc), on one event loop of its
// own. Nothing at all while no NodePort exists.
package localnodeports

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/socket"
	"github.com/uproxy/uproxy/socket/poll"
)

// DefaultDialTimeout bounds the relay's connect to a ClusterIP: one attempt,
// long enough for the kernel's own SYN retransmissions (1s, then 3s), since the
// endpoint behind the ClusterIP is chosen anew by the kernel mode's rules at
// each connect and a retry here would add nothing a client's retry does not.
const DefaultDialTimeout = 10 * time.Second

// Config configures a Relay; its zero value serves nothing.
type Config struct {
	// IPv4 and IPv6 say which loopback address serves NodePorts: 127.0.0.1,
	// ::1. A family serves only the Service ports with a ClusterIP of it.
	IPv4, IPv6 bool
	// DialTimeout bounds each connect to a ClusterIP; zero: DefaultDialTimeout.
	DialTimeout time.Duration
	// UDPTimeout is how long a UDP flow lives without a datagram; zero:
	// socket.DefaultUDPTimeout.
	UDPTimeout time.Duration
}

// Relay holds one listener per NodePort, protocol and family.
type Relay struct {
	cfg   Config
	loops *poll.Group

	// mu guards listeners and closed; once closed, stays closed.
	mu        sync.Mutex
	listeners map[key]*listener
	closed    bool
	// adopted are a predecessor's sockets (handover.go), until a Sync.
	adopted map[key]int
}

// key is one loopback NodePort.
type key struct {
	proto    service.Protocol
	v6       bool
	nodePort int
}

func (k key) address() string {
	host := "127.0.0.1"
	if k.v6 {
		host = "::1"
	}
	return net.JoinHostPort(host, strconv.Itoa(k.nodePort))
}

func (k key) network() string {
	n := "tcp"
	if k.proto == service.UDP {
		n = "udp"
	}
	if k.v6 {
		return n + "6"
	}
	return n + "4"
}

// listener is one loopback NodePort's socket and its proxy.
type listener struct {
	name   service.PortName
	target *target
	tcp    *socket.TCPProxy
	udp    *socket.UDPProxy
}

// New starts the relay's event loop. It listens on nothing until Sync.
func New(cfg Config) (*Relay, error) {
	// One loop: a node's own connections to its NodePorts are few.
	loops, err := poll.New(poll.Config{Loops: 1})
	if err != nil {
		return nil, fmt.Errorf("localhost NodePorts: %w", err)
	}
	return &Relay{cfg: cfg, loops: loops, listeners: map[key]*listener{}}, nil
}

// Sync listens on the loopback NodePorts of s and stops listening on the
// others. A Service port whose ClusterIP changed keeps its listener and relays
// its next connections to the new one. A port that cannot be listened on (held
// by another process) is reported and tried again at the next Sync; the others
// are served regardless.
func (r *Relay) Sync(s *service.Snapshot) error {
	want := map[key]*service.Port{}
	var order []key // want's keys, in the snapshot's order, so errors are stable
	for _, sp := range s.Ports {
		if sp.NodePort == 0 || (sp.Protocol != service.TCP && sp.Protocol != service.UDP) {
			continue
		}
		for _, v6 := range []bool{false, true} {
			if (v6 && !r.cfg.IPv6) || (!v6 && !r.cfg.IPv4) || !clusterIP(sp, v6).IsValid() {
				continue
			}
			k := key{sp.Protocol, v6, sp.NodePort}
			if _, dup := want[k]; !dup { // the snapshot leaves conflicts out: first wins
				want[k] = sp
				order = append(order, k)
			}
		}
	}

	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return errors.New("localhost NodePorts: relay closed")
	}
	var errs []error
	for k, l := range r.listeners {
		if _, ok := want[k]; !ok {
			l.close()
			delete(r.listeners, k)
		}
	}
	for _, k := range order {
		sp := want[k]
		dst := netip.AddrPortFrom(clusterIP(sp, k.v6), uint16(sp.Port))
		if l, ok := r.listeners[k]; ok {
			l.target.set(dst)
			l.name = sp.Name
			continue
		}
		l, err := r.listen(k, sp.Name, dst)
		if err != nil {
			errs = append(errs, fmt.Errorf("localhost NodePort %s/%s of %s: %w", k.address(), sp.Protocol, sp.Name, err))
			continue
		}
		r.listeners[k] = l
		klog.V(2).InfoS("Serving a NodePort on loopback", "address", k.address(), "protocol", sp.Protocol, "service", sp.Name, "clusterIP", dst)
	}
	r.endAdoption()
	return errors.Join(errs...)
}

// clusterIP returns sp's first ClusterIP of the family, or the zero Addr.
func clusterIP(sp *service.Port, v6 bool) netip.Addr {
	for _, ip := range sp.ClusterIPs {
		if ip = ip.Unmap(); ip.Is6() == v6 && !ip.IsUnspecified() {
			return ip
		}
	}
	return netip.Addr{}
}

// listen opens k's socket and serves it, relaying to dst.
func (r *Relay) listen(k key, name service.PortName, dst netip.AddrPort) (*listener, error) {
	l := &listener{name: name, target: &target{}}
	l.target.set(dst)
	if k.proto == service.TCP {
		timeout := r.cfg.DialTimeout
		if timeout <= 0 {
			timeout = DefaultDialTimeout
		}
		l.tcp = &socket.TCPProxy{Service: name.String(), Picker: l.target, Loops: r.loops, DialTimeouts: []time.Duration{timeout}}
		ln, _ := r.adoptedSocket(k)
		if ln == nil {
			var err error
			if ln, err = l.tcp.Listen(context.Background(), k.network(), k.address()); err != nil {
				return nil, err
			}
		}
		go serveTCP(l.tcp, ln, k)
		return l, nil
	}
	_, conn := r.adoptedSocket(k)
	if conn == nil {
		pc, err := new(net.ListenConfig).ListenPacket(context.Background(), k.network(), k.address())
		if err != nil {
			return nil, err
		}
		conn = pc.(*net.UDPConn)
	}
	l.udp = &socket.UDPProxy{Service: name.String(), Picker: l.target, Loops: r.loops, Timeout: r.cfg.UDPTimeout}
	go serveUDP(l.udp, conn, k)
	return l, nil
}

func serveTCP(p *socket.TCPProxy, ln *net.TCPListener, k key) {
	if err := p.Serve(ln); err != nil {
		klog.ErrorS(err, "Localhost NodePort stopped accepting", "address", k.address())
	}
}

func serveUDP(p *socket.UDPProxy, conn *net.UDPConn, k key) {
	if err := p.Serve(conn); err != nil {
		klog.ErrorS(err, "Localhost NodePort stopped reading", "address", k.address(), "protocol", "UDP")
	}
}

// close stops listening; connections already relayed carry on until their
// peers end them.
func (l *listener) close() {
	if l.tcp != nil {
		l.tcp.Close()
	} else {
		l.udp.Close()
	}
}

// Close stops listening, lets relayed TCP connections finish until ctx is
// done (then resets them), and stops the event loop.
func (r *Relay) Close(ctx context.Context) error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil
	}
	r.closed = true
	ls := r.listeners
	r.listeners = nil
	r.endAdoption()
	r.mu.Unlock()
	for _, l := range ls {
		if l.tcp != nil {
			var expired *socket.ShutdownExpiredError
			if err := l.tcp.Shutdown(ctx); err != nil && !errors.As(err, &expired) {
				klog.ErrorS(err, "Closing a localhost NodePort", "service", l.name)
			}
		} else {
			l.udp.Close()
		}
	}
	return r.loops.Close()
}

// target is the Picker of one loopback NodePort: always its ClusterIP, which
// the kernel mode balances. It keeps no state about endpoints: the kernel has it.
type target struct {
	dst atomic.Pointer[netip.AddrPort]
}

func (t *target) set(dst netip.AddrPort) { t.dst.Store(&dst) }

func (t *target) Pick(netip.Addr, []netip.AddrPort) (netip.AddrPort, error) {
	return *t.dst.Load(), nil
}
func (t *target) Release(netip.AddrPort)                {}
func (t *target) Acquire(netip.AddrPort)                {}
func (t *target) ResetAffinity(netip.Addr)              {}
func (t *target) DialSucceeded(netip.AddrPort)          {}
func (t *target) DialFailed(ep netip.AddrPort, _ error) {}
