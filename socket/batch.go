package socket

import (
	"net"
	"net/netip"
	"strconv"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// UDP sockets are read with recvmmsg(2): one call takes every datagram queued (up
// to batchLen), and a call that returns fewer than it asked for has seen the queue
// empty. The loops watch sockets edge-triggered, so a handler must read until the
// queue is empty, and a datagram that arrives afterwards is a new event: after a
// short batch the reader stops at once instead of asking again only to hear
// EAGAIN - one syscall fewer per event, the common case for request/response
// traffic. Each event's first read always asks (begin).

// batchLen is how many datagrams one read of a Service socket takes at most; an
// endpoint socket, which carries one client's replies, is read replyBatchLen at a
// time (two are enough to learn that the queue is empty).
const (
	batchLen      = 8
	replyBatchLen = 2
)

// mmsghdr is struct mmsghdr; golang.org/x/sys/unix has no such type. The
// compiler pads it as C does (to the alignment of the pointers in Msghdr).
type mmsghdr struct {
	hdr unix.Msghdr
	n   uint32
}

// datagramBatch holds the buffers of one batched read. Batches are lent by
// datagramBatches for the span of a read and the writes of what it read, so idle
// sockets hold none.
type datagramBatch struct {
	hdrs  [batchLen]mmsghdr
	iovs  [batchLen]unix.Iovec
	names [batchLen]unix.RawSockaddrInet6
	oob   [batchLen][controlSpace]byte
	// buf holds len(buf)/maxDatagram datagrams, one per maxDatagram bytes.
	buf []byte
}

func newDatagramBatch(n int) *datagramBatch {
	return &datagramBatch{buf: make([]byte, n*maxDatagram)}
}

// controlSpace is the control-message room of one datagram: a pktinfo (IPv4 or
// IPv6; the larger, with its aligned header, takes 40 bytes on 64-bit Linux) and
// the segment size of a coalesced run (24, see gso.go). A truncated segment size
// would merge the run's datagrams, so the room is generous. A constant, for
// array sizes.
const controlSpace = 128

// Batches for Service sockets and for endpoint sockets.
var (
	serviceBatches = sync.Pool{New: func() any { return newDatagramBatch(batchLen) }}
	replyBatches   = sync.Pool{New: func() any { return newDatagramBatch(replyBatchLen) }}
)

// batchReader reads a socket in batches, for the handler of one event at a time;
// each loop has one per kind of socket (see loop).
type batchReader struct {
	batch *datagramBatch // nil while waiting
	pool  *sync.Pool
	// max is the batch length: batchLen with addresses, else replyBatchLen.
	max int
	// withAddrs asks for each datagram's source (the Service socket); a
	// connected endpoint socket needs none. Control messages are asked for on
	// both: they carry the segment size of a coalesced run (gso.go).
	withAddrs bool
	// n datagrams were read, or errno ended the read.
	n     int
	errno error
	// drained says the last read saw the queue empty: the next one stops.
	drained bool
}

func newBatchReader(withAddrs bool) *batchReader {
	r := &batchReader{withAddrs: withAddrs, pool: &replyBatches, max: replyBatchLen}
	if withAddrs {
		r.pool, r.max = &serviceBatches, batchLen
	}
	return r
}

// begin readies r for a new event, whose first read must not be skipped: the
// event says something arrived after the last read saw the queue empty.
func (r *batchReader) begin() { r.drained = false }

// read reads the next batch from socket fd: true with n datagrams or errno,
// false once the queue is empty (the handler is done until the next event).
func (r *batchReader) read(fd int) bool {
	if r.drained {
		r.drained = false
		r.release()
		return false
	}
	if r.batch == nil {
		r.batch = r.pool.Get().(*datagramBatch)
	}
	b := r.batch
	for i := range r.max {
		h := &b.hdrs[i]
		b.iovs[i].Base = &b.buf[i*maxDatagram]
		b.iovs[i].SetLen(maxDatagram)
		h.hdr = unix.Msghdr{Iov: &b.iovs[i], Iovlen: 1, Control: &b.oob[i][0]}
		h.hdr.SetControllen(controlSpace)
		if r.withAddrs {
			h.hdr.Name = (*byte)(unsafe.Pointer(&b.names[i]))
			h.hdr.Namelen = unix.SizeofSockaddrInet6
		}
	}
	for {
		n, _, e := unix.Syscall6(unix.SYS_RECVMMSG, uintptr(fd), uintptr(unsafe.Pointer(&b.hdrs[0])), uintptr(r.max), unix.MSG_DONTWAIT, 0, 0)
		switch e {
		case 0:
			r.n, r.errno = int(n), nil
			r.drained = r.n < r.max
			return true
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			r.release()
			return false
		}
		r.n, r.errno = 0, e
		return true
	}
}

// release gives the batch back; its datagrams must have been handled.
func (r *batchReader) release() {
	if r.batch != nil {
		r.pool.Put(r.batch)
		r.batch = nil
	}
}

// datagram returns the i-th datagram read.
func (r *batchReader) datagram(i int) []byte {
	off := i * maxDatagram
	return r.batch.buf[off : off+int(r.batch.hdrs[i].n)]
}

// segmentSize returns the size of the datagrams the i-th read holds when it is a
// coalesced run, 0 when it is one datagram.
func (r *batchReader) segmentSize(i int) int {
	h := &r.batch.hdrs[i].hdr
	if h.Controllen == 0 {
		return 0
	}
	_, size := parseControl(r.batch.oob[i][:h.Controllen])
	return size
}

// source returns the i-th datagram's source address as Go's UDP reads report it
// (IPv4 clients of a dual-stack socket in their IPv4-mapped form), the
// destination it was sent to when the control messages carry it, and the
// segment size of a coalesced run (0 for one datagram).
func (r *batchReader) source(i int) (from netip.AddrPort, local netip.Addr, size int) {
	b := r.batch
	h := &b.hdrs[i].hdr
	sa := &b.names[i]
	// Ports are in network byte order.
	port := func(p *uint16) uint16 {
		b := (*[2]byte)(unsafe.Pointer(p))
		return uint16(b[0])<<8 | uint16(b[1])
	}
	if sa.Family == unix.AF_INET {
		sa4 := (*unix.RawSockaddrInet4)(unsafe.Pointer(sa))
		from = netip.AddrPortFrom(netip.AddrFrom4(sa4.Addr), port(&sa4.Port))
	} else {
		addr := netip.AddrFrom16(sa.Addr)
		if sa.Scope_id != 0 {
			addr = addr.WithZone(zoneName(sa.Scope_id))
		}
		from = netip.AddrPortFrom(addr, port(&sa.Port))
	}
	if h.Controllen > 0 {
		local, size = parseControl(b.oob[i][:h.Controllen])
	}
	return from, local, size
}

// zoneName names an IPv6 scope as net does: the interface's name, else its index.
func zoneName(index uint32) string {
	if ifi, err := net.InterfaceByIndex(int(index)); err == nil {
		return ifi.Name
	}
	return strconv.FormatUint(uint64(index), 10)
}
