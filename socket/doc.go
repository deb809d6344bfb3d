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
// # Contract
//
// A TCP connection dials by its proxy's DialPolicy: one attempt at a time by
// default, or hedged (the next attempt begins while a slow one is pending), and
// with a retry budget per proxy that bounds the attempts after the first
// (budget.go). A failed attempt is recorded and the next goes to another
// endpoint while one is left; every attempt, failed, lost to a hedge or
// successful, reaches the Observer. When none succeeds the client is reset.
//
// Once connected, both directions are copied at once. The end of one side is
// passed on as it came: a FIN as a half-close of the other socket (shutdown
// SHUT_WR), the other direction still flowing until its own end; a reset, or an
// error, as a reset of both. The two sockets are closed when both directions
// have ended, whichever side ended first.
//
// An established TCP connection can move to another proxy, in another
// process, with no byte lost, duplicated or reordered (resume.go):
// TCPProxy.Detach takes up to a batch of relaying connections (never one
// still dialing) out of the proxy on their loops, each into a SessionState -
// its two sockets, a pipe's read end only while the pipe holds bytes, the
// bytes of a short write, each direction's end and shutdown, counters, record
// and idle time - which SessionItems sends as handover items (2 descriptors
// a connection, 4 at most) and SessionStates decodes; TCPProxy.Resume
// registers each where it stood, held bytes first, and the Picker counts it
// (Acquire). A detached connection is no longer the old proxy's (it neither
// counts nor reports it); one that cannot be resumed is reset. Detach costs
// two epoll_ctl a connection on its loop, which pauses once per batch;
// Resume two epoll_ctl and an ioctl per pipe; a batch of 64 idle connections
// takes about a millisecond from its Detach to its acknowledgement
// (BenchmarkHandover).
//
// # Cost
//
// Costs are part of the contract. Connections run on a few event loops (loop.go;
// what a loop costs, per event and per timer, is poll's contract), not on
// goroutines of their own: an open TCP connection is a small struct (664 bytes,
// in the heap's 704-byte class: TestSessionFitsItsAllocationClass) and its two
// sockets, with no stack, no pipe and no buffer while it is idle; its one timer
// (the dial timeout, then the idle timeout and the keepalive options) lives
// inside it. Small transfers are read into the loop's buffer (one per loop,
// shared by every proxy on it) and written on at once; a read that fills that
// buffer switches its direction to splice through pooled pipes, so bulk bytes
// never enter user space (session.go), unless no pipe can be had, when they go
// through the buffer. A connection that carries a short exchange never touches
// a pipe.
//
// The system calls of a short TCP connection (BenchmarkCloseOrders counts them
// in the proxy, per connection, in each close order, with -syscalls):
//
//   - set-up, 5: accept4 and epoll_ctl (add) for the client socket; socket,
//     connect and epoll_ctl (add) for the backend's. The client socket inherits
//     TCP_NODELAY and the keepalive settings from the listener, which Listen
//     gives them once. The backend socket is given TCP_NODELAY just before its
//     second write: Nagle's algorithm holds nothing back while nothing is in
//     flight, so its first write goes out at once without it (nagleState), and
//     a connection that writes its request in one call never makes the call.
//   - a request that waits when the client is accepted, 1 more: it is read
//     then, before the dial (that read is not an extra one: it would have come
//     after), and the dial makes a setsockopt TCP_DEFER_ACCEPT, so that the
//     last ACK of its handshake goes out with the request rather than alone
//     (early.go). A listener whose clients do not write first stops reading
//     early after a few connections that had nothing.
//   - bytes: a read and a write per arrival in each direction. A read that
//     comes back short after the event that brought the peer's FIN has reached
//     that FIN and ends its direction without reading again; its bytes are
//     written with MSG_MORE (sendto), and the shutdown or close right after
//     sends them and the FIN in one segment.
//   - client closes first, 5 more: the read of its EOF, shutdown SHUT_WR of the
//     backend socket, the read of the backend's EOF, a close per socket. A
//     100-byte request and a 150-byte reply make it 15 in all.
//   - server closes first, 4 more: shutdown SHUT_WR of the client socket after
//     the reply (the backend's FIN comes with it, or costs one more read), the
//     read of the client's EOF, a close per socket: 14 in all.
//   - client resets, 4 more: the read that returns ECONNRESET, setsockopt
//     SO_LINGER and close of the backend socket (the reset is passed on), and a
//     close of the client's, which needs no SO_LINGER: the kernel closed it
//     when the reset came. 14 in all.
//
// The segments the proxy sends are what a connection costs its peers as much
// as itself (on one node the receiver's work runs in the sender's call, and
// each segment that finds its receiver asleep wakes it). Toward the backend:
// the SYN, the request carrying the handshake's ACK, and the FIN or reset;
// toward the client: the reply, carrying the FIN when the backend's came with
// it, or the FIN alone (TestShortExchangeSegments). A plain copy sends one
// more each way: the handshake's ACK alone, and the FIN apart from the reply.
//   - on top, when configured: setsockopt SO_MARK for a dial mark (mark.go);
//     setsockopt IP_TRANSPARENT and bind for a dial
//     from the client's address (TCPProxy.KeepClientAddress, source.go), and
//     when its client closed first, getsockname and a sock_diag request and its
//     answer to end the TIME_WAIT the dial leaves on the node (timewait.go); with
//     keepalive on (TCPProxy.KeepAlive; TCP_KEEPCNT is the node's), setsockopt
//     SO_KEEPALIVE, TCP_KEEPIDLE and TCP_KEEPINTVL on the backend socket of a
//     connection still open KeepAlive after it connected, from its timer: one
//     that ends sooner never makes them, and the first probe goes when it would
//     have with the options set at dial (session.go, keepAliveDue;
//     BenchmarkKeepAliveOptions prices the timer against the calls).
//   - each failed attempt adds a getsockopt SO_ERROR (or nothing, when the dial
//     timer ends it) and a close; a hedge's loser (DialPolicy.Hedge) a
//     getsockopt TCP_INFO and a close, and a setsockopt SO_LINGER before it
//     when it had connected too; the winner's socket changes handler without a
//     system call (poll's Rehandle).
//
// A socket is never taken out of the epoll set (its close does that) nor
// re-armed (edge-triggered, loop.go), so a connection makes no epoll_ctl but
// its two adds. Its wake-ups are the epoll_wait returns that bring its events:
// one connection at a time needs three or four (the accept, the connect with the
// request, the reply, the end; the benchmark reports epoll_pwait/conn), and
// connections arriving together share them. An event of the (level-triggered)
// listener accepts one connection; the event right after one that took its
// whole budget reads the length of the accept queue (getsockopt TCP_INFO of
// the listener) and accepts that many, up to a batch (tcp.go,
// listenHandle.Handle). So no accept4 looks into an empty queue, which costs
// the kernel a socket and a file made and freed (BenchmarkEmptyAccept prices
// both calls), but when another loop took the connection first: a connection
// arriving alone costs one accept4, a burst one getsockopt per round after its
// first. The idle timeout (TCPProxy.IdleTimeout) costs no system
// call: a reading of the loop's clock when bytes have moved. The Go runtime's
// own calls (futex, the nanosleep of its monitor) come on top, a fraction of
// one per connection.
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
