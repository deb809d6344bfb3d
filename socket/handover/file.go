package handover

import (
	"fmt"
	"net"
	"os"

	"golang.org/x/sys/unix"
)

// File returns a duplicate of the listening socket, to be handed to another
// process (which makes a Listener of it with FileListener); the listener
// stays open. The caller closes the file.
func (l *Listener) File() (*os.File, error) {
	f, err := l.ln.File()
	if err != nil {
		return nil, fmt.Errorf("handover: duplicate the listener: %w", err)
	}
	return f, nil
}

// FileListener makes a Listener of a listening unix stream socket handed
// over from another process (Listener.File there). f is not closed: the
// Listener holds a duplicate of its own.
func FileListener(f *os.File) (*Listener, error) {
	ln, err := net.FileListener(f)
	if err != nil {
		return nil, fmt.Errorf("handover: a listener from a descriptor: %w", err)
	}
	ul, ok := ln.(*net.UnixListener)
	if !ok {
		ln.Close()
		return nil, fmt.Errorf("handover: a listener from a descriptor: %s, want a unix stream socket", ln.Addr().Network())
	}
	// The name belongs to the socket, not to this process's copy: a close
	// here never unlinks it (and an abstract name has nothing to unlink).
	ul.SetUnlinkOnClose(false)
	// A peer's SO_PEERCRED names the process that called listen on the
	// socket: listening again (the kernel allows it on a listening socket)
	// makes this process the one named, rather than the one that handed it.
	rc, err := ul.SyscallConn()
	if err == nil {
		var lerr error
		if err = rc.Control(func(fd uintptr) { lerr = unix.Listen(int(fd), unix.SOMAXCONN) }); err == nil {
			err = lerr
		}
	}
	if err != nil {
		ul.Close()
		return nil, fmt.Errorf("handover: listen on a handed listener: %w", err)
	}
	return &Listener{ln: ul}, nil
}
