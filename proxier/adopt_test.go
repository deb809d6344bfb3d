package proxier

import (
	"context"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/service"
)

// A successor adopts the proxy sockets its predecessor hands over: the same
// proxy ports, served while the predecessor still holds its copies and after
// it has shut down; a socket of a Service port it does not have is closed at
// the end of the adoption.
func TestAdoptHandedProxySockets(t *testing.T) {
	w := newWorld(t)
	a := w.tcpBackend("a", "127.0.0.2")
	u := w.udpBackend("u", "127.0.0.4")
	old := newProxier(t, Config{})
	mustSync(t, old, snapshot(port("tcp", service.TCP, a), port("udp", service.UDP, u), port("gone", service.TCP, a)))
	tcpName := service.PortName{Namespace: "default", Name: "tcp", Port: "p"}
	udpName := service.PortName{Namespace: "default", Name: "udp", Port: "p"}
	wantTCP, wantUDP := old.ProxyPort(tcpName), old.ProxyPort(udpName)

	handed, err := old.HandOver()
	if err != nil {
		t.Fatal(err)
	}
	if len(handed) != 3 {
		t.Fatalf("handed %d sockets, want 3", len(handed))
	}
	successor := newProxier(t, Config{})
	successor.Adopt(handed)
	mustSync(t, successor, snapshot(port("tcp", service.TCP, a), port("udp", service.UDP, u)))
	if adopted, closed := successor.EndAdoption(); adopted != 2 || closed != 1 {
		t.Errorf("EndAdoption: got %d adopted, %d closed; want 2, 1", adopted, closed)
	}
	if got := successor.ProxyPort(tcpName); got != wantTCP {
		t.Errorf("TCP proxy port of the successor: got %d, want the predecessor's %d", got, wantTCP)
	}
	if got := successor.ProxyPort(udpName); got != wantUDP {
		t.Errorf("UDP proxy port of the successor: got %d, want the predecessor's %d", got, wantUDP)
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	old.Shutdown(ctx) // closes its copies: the sockets stay open through the successor's
	for i := range 5 {
		if got, err := getTCP(t, wantTCP); err != nil || got != "a" {
			t.Fatalf("connection %d after the predecessor shut down: got %q, %v; want a", i, got, err)
		}
	}
	if got, err := pingUDP(t, wantUDP); err != nil || got != "u:ping" {
		t.Errorf("UDP reply through the successor: got %q, %v; want %q", got, err, "u:ping")
	}
}

// A handed socket that is not a TCP listener on its proxy port (a UDP socket, a
// TCP socket that does not listen, one listening on another port) is not
// adopted: it is closed, and the Service port opens a proxy port of its own and
// serves.
func TestAdoptRefusesWhatIsNoListener(t *testing.T) {
	w := newWorld(t)
	a := w.tcpBackend("a", "127.0.0.2")
	name := service.PortName{Namespace: "default", Name: "tcp", Port: "p"}
	mustFD := func(fd int, err error) int {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return fd
	}
	listening := func(port int) int {
		fd := mustFD(unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0))
		if err := unix.Bind(fd, &unix.SockaddrInet4{Port: port, Addr: [4]byte{127, 0, 0, 1}}); err != nil {
			t.Fatal(err)
		}
		if err := unix.Listen(fd, 8); err != nil {
			t.Fatal(err)
		}
		return fd
	}
	for _, tc := range []struct {
		name string
		fd   func() (fd, proxyPort int)
	}{
		{"a UDP socket", func() (int, int) {
			return mustFD(unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)), 40000
		}},
		{"a TCP socket that does not listen", func() (int, int) {
			return mustFD(unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)), 40000
		}},
		{"a listener on another port", func() (int, int) {
			fd := listening(0)
			sa, err := unix.Getsockname(fd)
			if err != nil {
				t.Fatal(err)
			}
			return fd, sa.(*unix.SockaddrInet4).Port + 1
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fd, pp := tc.fd()
			var was unix.Stat_t
			if err := unix.Fstat(fd, &was); err != nil {
				t.Fatal(err)
			}
			p := newProxier(t, Config{})
			p.Adopt([]HandedSocket{{Service: name, Protocol: service.TCP, ProxyPort: pp, FD: fd}})
			mustSync(t, p, snapshot(port("tcp", service.TCP, a)))
			if adopted, closed := p.EndAdoption(); adopted != 0 || closed != 0 {
				t.Errorf("EndAdoption: got %d adopted, %d closed; want 0, 0 (refused when tried)", adopted, closed)
			}
			// Closed: the number is free, or reused by another socket.
			var now unix.Stat_t
			if err := unix.Fstat(fd, &now); err == nil && now.Ino == was.Ino {
				t.Errorf("the refused descriptor %d is still open", fd)
			}
			got := p.ProxyPort(name)
			if got == 0 || got == pp {
				t.Fatalf("proxy port %d, want one of its own", got)
			}
			if name, err := getTCP(t, got); err != nil || name != "a" {
				t.Errorf("through proxy port %d: got %q, %v; want a", got, name, err)
			}
		})
	}
}
