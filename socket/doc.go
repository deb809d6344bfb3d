// Package socket is the data path of the userspace mode: a TCPProxy or UDPProxy per
// Service port accepts clients on a proxy socket, picks a backend through a Picker,
// dials it (retrying other endpoints on failure) and moves bytes both ways, on
// event loops (package poll) that its owner starts and closes.
//
// Usage:
//
//	loops, err := poll.New(poll.Config{}) // shared by every proxy
//	if err != nil { ... }
//	ln, err := socket.ListenTCP(ctx, netip.MustParseAddrPort("0.0.0.0:0"))
//	if err != nil { ... }
//	p := &socket.TCPProxy{Service: "ns/web:http", Picker: balancer, Loops: loops, Observer: metrics}
//	go p.Serve(ln)
//	...
//	err = p.Shutdown(ctx) // stop accepting, let connections finish, reset the rest
//	err = loops.Close()   // once every proxy on them has shut down
//
// Every field of TCPProxy and UDPProxy has a working zero value except Picker and
// Loops.
//
// Costs are part of the contract. Connections run on a few event loops (loop.go;
// what a loop costs, per event and per timer, is poll's contract), not on
// goroutines of their own: an open TCP connection is a small struct and its two
// sockets, with no stack, no pipe and no buffer while it is idle. Small transfers
// are read into the loop's buffer (one per loop, shared by every proxy on it) and
// written on at once; bulk ones splice through pooled pipes and never enter user
// space (session.go). The only socket option set per connection is TCP_NODELAY on
// the backend socket (client sockets inherit it from the listener); keepalive is
// off on both sides, since the proxy relays bytes, not liveness, and the endpoints
// keep their own keepalive.
package socket
