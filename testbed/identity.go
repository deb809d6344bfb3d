package testbed

import (
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

// MustExec runs args in role's namespace and fails t with their output if
// they fail.
func (tp *Topology) MustExec(t testing.TB, role string, args ...string) {
	t.Helper()
	if out, err := tp.Exec(role, args...); err != nil {
		t.Fatalf("%s: %v: %s", strings.Join(args, " "), err, out)
	}
}

// ServeIdentity answers every connection on ln with "local|remote\n" and
// closes it: which endpoint served it, and which client address it saw.
func ServeIdentity(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		fmt.Fprintf(c, "%s|%s\n", c.LocalAddr(), c.RemoteAddr())
		c.Close()
	}
}

// ServeUDPIdentity answers every datagram on pc with "local|payload".
func ServeUDPIdentity(pc net.PacketConn) {
	buf := make([]byte, 64<<10)
	local := pc.LocalAddr().String()
	for {
		n, from, err := pc.ReadFrom(buf)
		if err != nil {
			return
		}
		pc.WriteTo([]byte(local+"|"+string(buf[:n])), from)
	}
}

// Ask connects from role to addr, served by ServeIdentity, and returns the
// endpoint that answered and the client address it saw.
func (tp *Topology) Ask(role, addr string) (endpoint, client string, err error) {
	c, err := tp.Dial(role, "tcp", addr)
	if err != nil {
		return "", "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(DialTimeout))
	line, err := io.ReadAll(c)
	if err != nil {
		return "", "", err
	}
	endpoint, client, ok := strings.Cut(strings.TrimSpace(string(line)), "|")
	if !ok {
		return "", "", fmt.Errorf("reply %q: want local|remote", line)
	}
	return endpoint, client, nil
}

// DialQuick dials addr from role with a one-second timeout, for paths that
// must not connect.
func (tp *Topology) DialQuick(role, addr string) error {
	return tp.Run(role, func() error {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
		}
		return err
	})
}
