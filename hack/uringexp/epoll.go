package main

import (
	"net/netip"
	"unsafe"

	"golang.org/x/sys/unix"
)

// econn is one relayed connection: side 0 the client, 1 the backend.
type econn struct {
	fd        [2]int
	connected bool
	eof       [2]bool // side i's input ended
	rdhup     [2]bool // side i's FIN was queued when an event was taken
	closed    bool
	gen       int32
}

func relayEpoll(lfd int, to netip.AddrPort) {
	unix.SetNonblock(lfd, true)
	ep, _ := unix.EpollCreate1(0)
	unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, lfd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(lfd)})
	byFD := make([]*econn, 65536)
	sa := &unix.SockaddrInet4{Addr: to.Addr().As4(), Port: int(to.Port())}
	buf := make([]byte, 64<<10)
	events := make([]unix.EpollEvent, 256)
	var gen int32
	const evs = unix.EPOLLIN | unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET
	closeConn := func(c *econn) {
		c.closed = true
		for _, fd := range c.fd {
			byFD[fd] = nil
			unix.Close(fd)
		}
	}
	// pump moves side from's input to the other side (both directions).
	pump := func(c *econn) {
		for from := range 2 {
			if c.eof[from] {
				continue
			}
			for {
				r, _, errno := unix.RawSyscall(unix.SYS_READ, uintptr(c.fd[from]), uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf)))
				if errno == unix.EAGAIN {
					break
				}
				n := int(r)
				if errno != 0 {
					n = -1
				}
				if n <= 0 {
					c.eof[from] = true
					if !c.eof[1-from] {
						unix.Shutdown(c.fd[1-from], unix.SHUT_WR)
					}
					break
				}
				unix.RawSyscall(unix.SYS_WRITE, uintptr(c.fd[1-from]), uintptr(unsafe.Pointer(&buf[0])), uintptr(n)) // 64 B always fits
				if n < len(buf) {
					if c.rdhup[from] {
						// The short read reached the FIN.
						c.eof[from] = true
						if !c.eof[1-from] {
							unix.Shutdown(c.fd[1-from], unix.SHUT_WR)
						}
					}
					break
				}
			}
		}
		if c.eof[0] && c.eof[1] {
			closeConn(c)
		}
	}
	for {
		r, _, errno := unix.RawSyscall6(unix.SYS_EPOLL_PWAIT, uintptr(ep), uintptr(unsafe.Pointer(&events[0])), uintptr(len(events)), ^uintptr(0), 0, 0)
		if errno != 0 {
			continue
		}
		n := int(r)
		for i := range events[:n] {
			fd := int(events[i].Fd)
			if fd == lfd {
				for {
					r, _, errno := unix.RawSyscall6(unix.SYS_ACCEPT4, uintptr(lfd), 0, 0, unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0, 0)
					if errno != 0 {
						break
					}
					cfd := int(r)
					bfd, _ := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
					unix.Connect(bfd, sa)
					gen++
					c := &econn{fd: [2]int{cfd, bfd}, gen: gen}
					byFD[cfd], byFD[bfd] = c, c
					unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, cfd, &unix.EpollEvent{Events: evs, Fd: int32(cfd), Pad: gen})
					unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, bfd, &unix.EpollEvent{Events: evs, Fd: int32(bfd), Pad: gen})
				}
				continue
			}
			c := byFD[fd]
			if c == nil || c.closed || c.gen != events[i].Pad {
				continue
			}
			if events[i].Events&unix.EPOLLRDHUP != 0 {
				if fd == c.fd[0] {
					c.rdhup[0] = true
				} else {
					c.rdhup[1] = true
				}
			}
			if fd == c.fd[1] && !c.connected {
				if events[i].Events&unix.EPOLLOUT == 0 {
					continue
				}
				c.connected = true
			}
			if c.connected {
				pump(c)
			}
		}
	}
}
