package socket

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// openFreePort opens a listener with OpenListener on a port the kernel had
// free a moment before (a port it gives an ephemeral bind).
func openFreePort(t *testing.T, p *TCPProxy, host netip.Addr) (int, uint16) {
	t.Helper()
	for range 20 {
		probe, err := net.Listen("tcp", "[::]:0")
		if err != nil {
			t.Fatal(err)
		}
		port := uint16(probe.Addr().(*net.TCPAddr).Port)
		probe.Close()
		fd, err := p.OpenListener(host, port)
		if errors.Is(err, unix.EADDRINUSE) {
			continue
		}
		if err != nil {
			t.Fatalf("OpenListener(%v, %d): %v", host, port, err)
		}
		return fd, port
	}
	t.Fatal("no free port in 20 tries")
	return -1, 0
}

// A socket from OpenListener, served with StartFD, proxies as one from Listen
// and Start: on every address of both families when no host is given, on the
// host's family alone otherwise; it carries the listener options; and a port
// in use fails as net.Listen does, naming the call and wrapping the errno.
func TestOpenListenerServes(t *testing.T) {
	backend := startTCPServer(t, "127.0.0.1", echo).addr
	loops := newLoops(t, 1, nil)
	roundTrip := func(addr string) error {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write([]byte("ping")); err != nil {
			return err
		}
		buf := make([]byte, 4)
		if _, err := c.Read(buf); err != nil {
			return err
		}
		if string(buf) != "ping" {
			return fmt.Errorf("read %q, want the echo", buf)
		}
		return nil
	}
	for _, tc := range []struct {
		name       string
		host       netip.Addr
		reach, not []string // addresses, %d for the port
	}{
		{"every address", netip.Addr{}, []string{"127.0.0.1:%d", "[::1]:%d"}, nil},
		{"0.0.0.0", netip.IPv4Unspecified(), []string{"127.0.0.1:%d", "[::1]:%d"}, nil},
		{"127.0.0.1", netip.MustParseAddr("127.0.0.1"), []string{"127.0.0.1:%d"}, []string{"[::1]:%d", "127.0.0.2:%d"}},
		{"::1", netip.MustParseAddr("::1"), []string{"[::1]:%d"}, []string{"127.0.0.1:%d"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := &TCPProxy{Service: "ns/svc:tcp", Picker: newCyclePicker(backend), Loops: loops, KeepAlive: 42 * time.Second}
			fd, port := openFreePort(t, p, tc.host)
			for opt, want := range map[[2]int]int{
				{unix.IPPROTO_TCP, unix.TCP_NODELAY}:   1,
				{unix.SOL_SOCKET, unix.SO_KEEPALIVE}:   1,
				{unix.IPPROTO_TCP, unix.TCP_KEEPIDLE}:  42,
				{unix.IPPROTO_TCP, unix.TCP_KEEPINTVL}: 42,
				{unix.SOL_SOCKET, unix.SO_REUSEADDR}:   1,
				{unix.SOL_SOCKET, unix.SO_ACCEPTCONN}:  1,
			} {
				if got, err := unix.GetsockoptInt(fd, opt[0], opt[1]); err != nil || got != want {
					t.Errorf("socket option %d/%d: got %d, %v; want %d", opt[0], opt[1], got, err, want)
				}
			}
			done := make(chan error, 1)
			if err := p.StartFD(fd, fmt.Sprintf("%v:%d", tc.host, port), func(err error) { done <- err }); err != nil {
				t.Fatalf("StartFD: %v", err)
			}
			defer func() {
				// Shutdown waits for the proxied connections too: the loops
				// close when the test ends.
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				if err := p.Shutdown(ctx); err != nil {
					t.Errorf("Shutdown: %v", err)
				}
				if err := <-done; err != nil {
					t.Errorf("done after Close: %v, want nil", err)
				}
			}()
			for _, a := range tc.reach {
				if err := roundTrip(fmt.Sprintf(a, port)); err != nil {
					t.Errorf("through %s: %v", fmt.Sprintf(a, port), err)
				}
			}
			for _, a := range tc.not {
				if err := roundTrip(fmt.Sprintf(a, port)); err == nil {
					t.Errorf("through %s: proxied, want refused (the socket listens on %v alone)", fmt.Sprintf(a, port), tc.host)
				}
			}

			// The same port again, while it listens.
			_, err := p.OpenListener(tc.host, port)
			if !errors.Is(err, unix.EADDRINUSE) {
				t.Fatalf("OpenListener on a port in use: %v, want EADDRINUSE", err)
			}
			var op *net.OpError
			if !errors.As(err, &op) || op.Op != "listen" || !strings.Contains(err.Error(), fmt.Sprintf(":%d: bind: address already in use", port)) {
				t.Errorf("OpenListener on a port in use: %q, want net.Listen's form (listen tcp ...:%d: bind: address already in use)", err, port)
			}
		})
	}
}

// On a kernel without IPv6 (ipv6.disable=1, told here by noIPv6, which the
// first refused IPv6 socket sets) a socket of every address is IPv4 alone,
// bound to 0.0.0.0.
func TestOpenListenerWithoutIPv6(t *testing.T) {
	defer noIPv6.Store(noIPv6.Load())
	noIPv6.Store(true)
	p := &TCPProxy{Service: "ns/svc:tcp"}
	fd, port := openFreePort(t, p, netip.Addr{})
	defer unix.Close(fd)
	sa, err := unix.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	in4, ok := sa.(*unix.SockaddrInet4)
	if !ok || in4.Addr != [4]byte{} || in4.Port != int(port) {
		t.Errorf("socket of every address without IPv6: bound to %#v, want 0.0.0.0:%d", sa, port)
	}
}
