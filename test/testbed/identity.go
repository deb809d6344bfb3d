package testbed

import (
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
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

// ProcessCPU is the CPU time, user and system, the calling process has used.
func ProcessCPU() time.Duration {
	var ru unix.Rusage
	unix.Getrusage(unix.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// ConnectAccept is one new TCP connection as the connection benchmarks make it,
// with raw system calls and nothing else: a socket (with SO_MARK when mark is not
// 0) connects to sa, the blocking listener lfd that sa leads to accepts it, and
// both ends close. Connect errors name sa's address.
func ConnectAccept(sa *unix.SockaddrInet4, lfd, mark int) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if mark != 0 {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, mark); err != nil {
			return err
		}
	}
	if err := unix.Connect(fd, sa); err != nil {
		return fmt.Errorf("connect %d.%d.%d.%d:%d: %w", sa.Addr[0], sa.Addr[1], sa.Addr[2], sa.Addr[3], sa.Port, err)
	}
	afd, _, err := unix.Accept(lfd)
	if err != nil {
		return err
	}
	return unix.Close(afd)
}

// BenchConns measures conn, one new connection (opened, accepted and closed
// by the caller), in role's namespace: 200 calls to warm conntrack and the
// routing caches, then b's loop, reported as the process's CPU per call
// (cpu-us/conn). The kernel's netfilter work for the connection runs in the
// process's system calls, on either end.
func (tp *Topology) BenchConns(b *testing.B, role string, conn func() error) {
	b.Helper()
	err := tp.Run(role, func() error {
		for range 200 {
			if err := conn(); err != nil {
				return err
			}
		}
		b.ResetTimer()
		start := ProcessCPU()
		for b.Loop() {
			if err := conn(); err != nil {
				return err
			}
		}
		b.ReportMetric(float64(ProcessCPU()-start)/float64(b.N)/1e3, "cpu-us/conn")
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
}
