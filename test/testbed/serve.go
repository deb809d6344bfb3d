package testbed

import (
	"errors"
	"io"
	"net"
	"net/netip"
)

// Listen opens a listener inside the namespace (network "tcp", "tcp4" or "tcp6";
// address as for net.Listen). t.Cleanup closes it.
func (tp *Topology) Listen(role, network, address string) net.Listener {
	tp.t.Helper()
	var ln net.Listener
	err := tp.Run(role, func() (err error) {
		ln, err = net.Listen(network, address)
		return err
	})
	if err != nil {
		tp.t.Fatalf("listen %s %s in %s: %v", network, address, role, err)
	}
	tp.t.Cleanup(func() { ln.Close() })
	return ln
}

// ListenPacket opens a packet socket inside the namespace. t.Cleanup closes it.
func (tp *Topology) ListenPacket(role, network, address string) net.PacketConn {
	tp.t.Helper()
	var pc net.PacketConn
	err := tp.Run(role, func() (err error) {
		pc, err = net.ListenPacket(network, address)
		return err
	})
	if err != nil {
		tp.t.Fatalf("listen %s %s in %s: %v", network, address, role, err)
	}
	tp.t.Cleanup(func() { pc.Close() })
	return pc
}

// EchoTCP starts a TCP server inside the namespace that writes back what it
// reads, and returns its address. t.Cleanup stops it.
func (tp *Topology) EchoTCP(role, address string) netip.AddrPort {
	tp.t.Helper()
	ln := tp.Listen(role, "tcp", address)
	go serveEchoTCP(ln)
	return ln.Addr().(*net.TCPAddr).AddrPort()
}

func serveEchoTCP(ln net.Listener) {
	ServeEach(ln, func(c net.Conn) { io.Copy(c, c) })
}

// ServeEach accepts from ln until it is closed, and runs handle on each
// connection on a goroutine of its own, closing the connection after it.
func ServeEach(ln net.Listener, handle func(net.Conn)) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			handle(c)
		}()
	}
}

// EchoUDP starts a UDP server inside the namespace that sends every datagram back
// to its sender, and returns its address. t.Cleanup stops it.
func (tp *Topology) EchoUDP(role, address string) netip.AddrPort {
	tp.t.Helper()
	pc := tp.ListenPacket(role, "udp", address)
	go serveEchoUDP(pc)
	return pc.LocalAddr().(*net.UDPAddr).AddrPort()
}

func serveEchoUDP(pc net.PacketConn) {
	buf := make([]byte, 64<<10)
	for {
		n, from, err := pc.ReadFrom(buf)
		if errors.Is(err, net.ErrClosed) {
			return
		}
		if err != nil {
			continue
		}
		pc.WriteTo(buf[:n], from)
	}
}
