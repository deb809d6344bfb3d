package main

import (
	"fmt"
	"net/netip"
	"os"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

const (
	opAccept   = 13
	opConnect  = 16
	opClose    = 19
	opSend     = 26
	opRecv     = 27
	opShutdown = 34
	opSocket   = 45

	setupCoopTaskrun  = 1 << 8
	setupSingleIssuer = 1 << 12
	setupDeferTaskrun = 1 << 13
	enterGetEvents    = 1
	acceptMultishot   = 1
	cqeFMore          = 1 << 1
)

type sqOffsets struct {
	head, tail, ringMask, ringEntries, flags, dropped, array, resv1 uint32
	userAddr                                                        uint64
}
type cqOffsets struct {
	head, tail, ringMask, ringEntries, overflow, cqes, flags, resv1 uint32
	userAddr                                                        uint64
}
type params struct {
	sqEntries, cqEntries, flags, sqThreadCPU, sqThreadIdle, features, wqFD uint32
	resv                                                                   [3]uint32
	sq                                                                     sqOffsets
	cq                                                                     cqOffsets
}
type sqe struct {
	opcode, flags uint8
	ioprio        uint16
	fd            int32
	off           uint64
	addr          uint64
	len           uint32
	opFlags       uint32
	userData      uint64
	bufIndex      uint16
	personality   uint16
	spliceFDIn    int32
	addr3, pad2   uint64
}
type cqe struct {
	userData uint64
	res      int32
	flags    uint32
}

type ring struct {
	fd                     int
	sqHead, sqTail, sqMask *uint32
	sqArray                []uint32
	sqes                   []sqe
	cqHead, cqTail, cqMask *uint32
	cqes                   []cqe
	tail                   uint32 // local SQ tail
	submitted              uint32
	enters                 uint64
}

func newRing(entries uint32) *ring {
	var p params
	p.flags = setupSingleIssuer | setupDeferTaskrun | setupCoopTaskrun
	fd, _, e := unix.Syscall(unix.SYS_IO_URING_SETUP, uintptr(entries), uintptr(unsafe.Pointer(&p)), 0)
	if e != 0 {
		panic(fmt.Sprintf("io_uring_setup: %v", e))
	}
	r := &ring{fd: int(fd)}
	sqSize := int(p.sq.array + p.sqEntries*4)
	cqSize := int(p.cq.cqes + p.cqEntries*uint32(unsafe.Sizeof(cqe{})))
	size := max(sqSize, cqSize) // IORING_FEAT_SINGLE_MMAP
	mem, err := unix.Mmap(r.fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		panic(err)
	}
	sqesMem, err := unix.Mmap(r.fd, 0x10000000, int(p.sqEntries)*64, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		panic(err)
	}
	u32 := func(off uint32) *uint32 { return (*uint32)(unsafe.Pointer(&mem[off])) }
	r.sqHead, r.sqTail, r.sqMask = u32(p.sq.head), u32(p.sq.tail), u32(p.sq.ringMask)
	r.sqArray = unsafe.Slice((*uint32)(unsafe.Pointer(&mem[p.sq.array])), p.sqEntries)
	r.sqes = unsafe.Slice((*sqe)(unsafe.Pointer(&sqesMem[0])), p.sqEntries)
	r.cqHead, r.cqTail, r.cqMask = u32(p.cq.head), u32(p.cq.tail), u32(p.cq.ringMask)
	r.cqes = unsafe.Slice((*cqe)(unsafe.Pointer(&mem[p.cq.cqes])), p.cqEntries)
	r.tail = *r.sqTail
	return r
}

// get returns the next free SQE, submitting first when the ring is full.
func (r *ring) get() *sqe {
	if r.tail-atomic.LoadUint32(r.sqHead) > *r.sqMask {
		r.enter(0)
	}
	i := r.tail & *r.sqMask
	r.sqArray[i] = i
	r.tail++
	s := &r.sqes[i]
	*s = sqe{}
	return s
}

// enter submits what was queued and waits for at least wait completions.
func (r *ring) enter(wait uint32) {
	atomic.StoreUint32(r.sqTail, r.tail)
	n := r.tail - r.submitted
	flags := uintptr(0)
	if wait > 0 {
		flags = enterGetEvents
	}
	for {
		r.enters++
		done, _, e := unix.RawSyscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(n), uintptr(wait), flags, 0, 0)
		if e == unix.EINTR {
			continue
		}
		if e != 0 {
			panic(fmt.Sprintf("io_uring_enter: %v", e))
		}
		r.submitted += uint32(done)
		return
	}
}

type uconn struct {
	id        uint64
	fd        [2]int32
	buf       [2][2048]byte
	n         [2]int32 // bytes waiting to be sent from side i's buffer
	connected bool
	eof       [2]bool
	pending   int // operations in flight
}

// user data: id<<8 | op<<1 | side
func ud(c *uconn, op uint8, side int) uint64 { return c.id<<8 | uint64(op)<<1 | uint64(side) }

func relayUring(lfd int, to netip.AddrPort) {
	r := newRing(4096)
	sa := &unix.RawSockaddrInet4{Family: unix.AF_INET, Addr: to.Addr().As4()}
	p := (*[2]byte)(unsafe.Pointer(&sa.Port))
	p[0], p[1] = byte(to.Port()>>8), byte(to.Port())
	conns := map[uint64]*uconn{}
	var nextID uint64 = 1

	submitAccept := func() {
		s := r.get()
		s.opcode, s.fd, s.ioprio = opAccept, int32(lfd), acceptMultishot
		s.opFlags = unix.SOCK_CLOEXEC
		s.userData = 0
	}
	recv := func(c *uconn, side int) {
		s := r.get()
		s.opcode, s.fd = opRecv, c.fd[side]
		s.addr, s.len = uint64(uintptr(unsafe.Pointer(&c.buf[side][0]))), uint32(len(c.buf[side]))
		s.userData = ud(c, opRecv, side)
		c.pending++
	}
	send := func(c *uconn, from int) {
		s := r.get()
		s.opcode, s.fd = opSend, c.fd[1-from]
		s.addr, s.len = uint64(uintptr(unsafe.Pointer(&c.buf[from][0]))), uint32(c.n[from])
		s.userData = ud(c, opSend, from)
		c.pending++
	}
	closeBoth := func(c *uconn) {
		for side := range 2 {
			s := r.get()
			s.opcode, s.fd = opClose, c.fd[side]
			s.userData = ud(c, opClose, side)
			c.pending++
		}
	}
	submitAccept()
	for {
		r.enter(1)
		head := *r.cqHead
		tail := atomic.LoadUint32(r.cqTail)
		for ; head != tail; head++ {
			e := r.cqes[head&*r.cqMask]
			if e.userData == 0 { // accept
				if e.flags&cqeFMore == 0 {
					submitAccept()
				}
				if e.res < 0 {
					continue
				}
				c := &uconn{id: nextID, fd: [2]int32{e.res, -1}}
				nextID++
				conns[c.id] = c
				s := r.get()
				s.opcode, s.fd, s.off = opSocket, unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC
				s.userData = ud(c, opSocket, 1)
				c.pending++
				recv(c, 0)
				continue
			}
			c := conns[e.userData>>8]
			op, side := uint8(e.userData>>1)&0x7f, int(e.userData&1)
			c.pending--
			switch op {
			case opSocket:
				if e.res < 0 {
					fmt.Fprintln(os.Stderr, "socket:", unix.Errno(-e.res))
					os.Exit(1)
				}
				c.fd[1] = e.res
				s := r.get()
				s.opcode, s.fd = opConnect, c.fd[1]
				s.addr, s.off = uint64(uintptr(unsafe.Pointer(sa))), unix.SizeofSockaddrInet4
				s.userData = ud(c, opConnect, 1)
				c.pending++
			case opConnect:
				if e.res < 0 {
					fmt.Fprintln(os.Stderr, "connect:", unix.Errno(-e.res))
					os.Exit(1)
				}
				c.connected = true
				recv(c, 1)
				if c.n[0] > 0 {
					send(c, 0)
				} else if c.eof[0] {
					s := r.get()
					s.opcode, s.fd, s.len = opShutdown, c.fd[1], unix.SHUT_WR
					s.userData = ud(c, opShutdown, 1)
					c.pending++
				}
			case opRecv:
				if e.res > 0 {
					c.n[side] = e.res
					if side == 1 || c.connected {
						send(c, side)
					}
					continue
				}
				c.eof[side] = true
				if c.eof[1-side] {
					closeBoth(c)
				} else if side == 1 || c.connected {
					s := r.get()
					s.opcode, s.fd, s.len = opShutdown, c.fd[1-side], unix.SHUT_WR
					s.userData = ud(c, opShutdown, 1-side)
					c.pending++
				}
			case opSend:
				c.n[side] = 0
				recv(c, side)
			case opClose:
				if c.pending == 0 {
					delete(conns, c.id)
				}
			}
		}
		atomic.StoreUint32(r.cqHead, head)
	}
}
