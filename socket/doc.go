// Package socket is the data path of the userspace mode: a TCPProxy or UDPProxy per
// Service port accepts clients on a proxy socket, picks a backend through a Picker,
// dials it (retrying other endpoints on failure) and moves bytes both ways.
//
// Usage:
//
//	ln, err := socket.ListenTCP(ctx, netip.MustParseAddrPort("0.0.0.0:0"))
//	if err != nil { ... }
//	p := &socket.TCPProxy{Service: "ns/web:http", Picker: balancer, Observer: metrics}
//	go p.Serve(ln)
//	...
//	err = p.Shutdown(ctx) // stop accepting, let connections finish, reset the rest
//
// Every field of TCPProxy and UDPProxy has a working zero value except Picker.
//
// Costs are part of the contract: the TCP copy splices between the raw sockets (no
// user-space copy; see spliceStream, which holds a pipe only while data is in
// flight, so an idle connection costs two descriptors), a connection uses at most
// two goroutines,
// and no socket option is set beyond what Go sets on its own (TCP_NODELAY) - in
// particular keepalive is off on both sockets (see ListenTCP).
package socket
