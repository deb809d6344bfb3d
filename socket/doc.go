// Package socket is the data path of the userspace mode: a TCPProxy or UDPProxy per
// Service port accepts clients on a proxy socket, picks a backend through a Picker,
// dials it (retrying other endpoints on failure) and moves bytes both ways, on
// event loops (package poll) that its owner starts and closes.
//
// Usage:
//
//	loops, err := poll.New(poll.Config{}) // shared by every proxy
//	if err != nil { ... }
//	p := &socket.TCPProxy{Service: "ns/web:http", Picker: balancer, Loops: loops, Observer: metrics}
//	ln, err := p.Listen(ctx, "tcp", ":0")
//	if err != nil { ... }
//	go p.Serve(ln)
//	...
//	err = p.Shutdown(ctx) // stop accepting, let connections finish, reset the rest
//	err = loops.Close()   // once every proxy on them has shut down
//
// Every field of TCPProxy and UDPProxy has a working zero value except Picker and
// Loops.
//
// A TCP connection dials by its proxy's DialPolicy: one attempt at a time by
// default, or hedged (the next attempt begins while a slow one is pending), and
// with a retry budget per proxy that bounds the attempts after the first
// (budget.go). However many attempts are in flight, a connection has one timer,
// due at the earliest of their deadlines and the next hedge; hedging allocates
// only for the attempts beyond the first in flight.
//
// Costs are part of the contract. Connections run on a few event loops (loop.go;
// what a loop costs, per event and per timer, is poll's contract), not on
// goroutines of their own: an open TCP connection is a small struct (664 bytes,
// in the heap's 704-byte class: TestSessionFitsItsAllocationClass) and its two
// sockets, with no stack, no pipe and no buffer while it is idle; its one timer
// (the dial timeout, then the idle timeout) lives inside it. Small transfers are
// read into the loop's buffer (one per loop, shared by every proxy on it) and
// written on at once; bulk ones splice through pooled pipes and never enter user
// space (session.go), unless no pipe can be had, when they go through the buffer.
//
// The system calls of a TCP connection, beyond those that move its bytes:
//
//   - client socket: accept4 and epoll_ctl (add). An event of the
//     (level-triggered) listener accepts up to a budget of connections and
//     does not look for one more: an accept4 that finds the queue empty costs
//     the kernel a socket and a file made and freed, about 4 µs. A connection
//     that arrives alone costs none; a burst, one, as its rounds double the
//     budget (tcp.go, listenHandle.Handle). The socket inherits TCP_NODELAY
//     and the keepalive settings from the listener, which Listen gives them
//     once.
//   - backend socket: socket, setsockopt TCP_NODELAY, setsockopt SO_MARK when a
//     dial mark is set (mark.go), for a dial from the client's address
//     (TCPProxy.KeepClientAddress, source.go) setsockopt IP_TRANSPARENT,
//     setsockopt IP_BIND_ADDRESS_NO_PORT and bind, connect, epoll_ctl (add); each failed attempt
//     adds a getsockopt SO_ERROR (or nothing, when the dial timer ends it) and a
//     close. While keepalive is on (TCPProxy.KeepAlive; TCP_KEEPCNT is the
//     node's), a connection still open KeepAlive after it connected adds, from
//     its timer, setsockopt SO_KEEPALIVE, TCP_KEEPIDLE and TCP_KEEPINTVL; one
//     that ends sooner never makes them, and the first probe goes when it would
//     have with the options set at dial (session.go, keepAliveDue). A hedge's
//     loser (DialPolicy.Hedge) costs a getsockopt TCP_INFO and a close, and a
//     setsockopt SO_LINGER before it when it had connected too; the winner's
//     socket changes handler without a system call (poll's Rehandle).
//   - end: shutdown SHUT_WR to pass on a half-close, a close per socket, and a
//     setsockopt SO_LINGER before the close of each socket that is reset.
//
// That is 6 calls to set a connection up with no dial mark, keepalive on (the
// default) or off; one that lives KeepAlive with it on makes 3 more, once.
// Before the keepalive options waited for the timer, a connection made those 3
// at dial: 9 (10 with the empty accept4 that every wake-up of the listener
// made until its budget). strace (perf trace -s) of
// BenchmarkTCPConnect's proxy counts 1 setsockopt per short connection either
// way, 4 before. A connection open with keepalive on has its timer armed (no
// system call: a place in the loop's heap); BenchmarkKeepAliveOptions compares
// arming and cancelling it with the 3 calls it spares. The idle timeout
// (TCPProxy.IdleTimeout) costs no system call: a reading of the loop's clock
// when bytes have moved. docs/data-path.md has the measurements.
//
// No descriptor the data path opens (accept4, socket, pipe2) is kept when its
// number is within the reserve left to the rest of the process (reserve.go): a
// comparison, no system call.
//
// A UDP datagram costs its share of a recvmmsg on the socket it arrived on (the
// Service socket's reads take up to 8 datagrams, an endpoint socket's 2, and a
// read that comes back short ends the event without another) and one send: a
// write on the client's connected endpoint socket, or a sendmsg on the Service
// socket for a reply (with the pktinfo of the address the client wrote to, on a
// wildcard socket). A client's first datagram adds socket, connect, setsockopt
// UDP_GRO and epoll_ctl; the end of its entry, a close. Every socket asks for
// coalesced runs (gso.go): a run of up to 64 datagrams that arrives as one
// buffer costs one read and one sendmsg with UDP_SEGMENT, and a datagram that
// arrives alone is sent as above.
package socket
