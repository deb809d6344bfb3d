package socket

import (
	"fmt"
	"maps"
	"os"
	"slices"

	"golang.org/x/sys/unix"
)

// DupListeners returns a duplicate (close on exec) of each listening socket
// the proxy serves, for a successor to take over: the socket itself stays
// served here until Close. The caller closes the duplicates.
func (p *TCPProxy) DupListeners() ([]int, error) {
	p.init()
	p.mu.Lock()
	lns := slices.Clone(p.listeners)
	p.mu.Unlock()
	var fds []int
	for _, tl := range lns {
		// tl.mu orders this with close: a listener not closing has its
		// descriptor open.
		tl.mu.Lock()
		if !tl.closing {
			fd, err := unix.FcntlInt(uintptr(tl.fd), unix.F_DUPFD_CLOEXEC, 0)
			if err != nil {
				tl.mu.Unlock()
				closeFDs(fds)
				return nil, fmt.Errorf("duplicate listener %s of %s: %w", tl.addr, p.Service, os.NewSyscallError("fcntl", err))
			}
			fds = append(fds, fd)
		}
		tl.mu.Unlock()
	}
	return fds, nil
}

// DupSockets returns a duplicate (close on exec) of each socket the proxy
// serves, for a successor to take over: the socket itself stays served here
// until Close. The caller closes the duplicates.
func (p *UDPProxy) DupSockets() ([]int, error) {
	p.init()
	if p.l == nil {
		return nil, nil
	}
	l := p.l
	p.mu.Lock()
	sockets := slices.Collect(maps.Keys(p.sockets))
	p.mu.Unlock()
	var fds []int
	var dupErr error
	// A socket is stopped, and its descriptor closed, on the loop only.
	err := l.PostWait(func() {
		for _, s := range sockets {
			if s.stopped {
				continue
			}
			fd, err := unix.FcntlInt(uintptr(s.fd), unix.F_DUPFD_CLOEXEC, 0)
			if err != nil {
				dupErr = fmt.Errorf("duplicate socket %s of %s: %w", s.addr, p.Service, os.NewSyscallError("fcntl", err))
				return
			}
			fds = append(fds, fd)
		}
	})
	if err == nil {
		err = dupErr
	}
	if err != nil {
		closeFDs(fds)
		return nil, err
	}
	return fds, nil
}

func closeFDs(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}
