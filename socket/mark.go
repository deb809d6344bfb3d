package socket

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// Every new connection a process on the node opens passes the nat table's OUTPUT
// chain once, and with it the portal rules: one per Service port, tried in turn.
// At 10k Service ports that costs about 400µs of CPU per connection, and the
// proxy opens one for every connection it proxies. Its own connections go to
// endpoints, never to virtual IPs, so the portal chains return at once for packets
// carrying the dial mark (rules.Config.DialMark), which the proxy sets on every
// socket it dials (TCPProxy.DialMark, UDPProxy.DialMark: SO_MARK, which needs
// CAP_NET_ADMIN).

// CheckDialMark says whether this process may put mark on its sockets (nil
// when it may, or when mark is 0, none): the check to make before giving a
// proxy a DialMark, whose every dial would otherwise fail.
func CheckDialMark(mark uint32) error {
	if mark != 0 {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return os.NewSyscallError("socket", err)
		}
		defer unix.Close(fd)
		if err := setMark(fd, mark); err != nil {
			return fmt.Errorf("set SO_MARK %#x on backend sockets: %w", mark, err)
		}
	}
	return nil
}

// setMark puts mark (if any) on socket fd.
func setMark(fd int, mark uint32) error {
	if mark == 0 {
		return nil
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, int(mark)); err != nil {
		return os.NewSyscallError("setsockopt", err)
	}
	return nil
}
