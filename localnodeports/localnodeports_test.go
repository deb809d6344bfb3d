package localnodeports

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/service/servicetest"
	"github.com/uproxy/uproxy/test/testbed"
)

// serveName answers every TCP connection with name and the client's address.
func serveName(t *testing.T, addr, name string) {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Write([]byte(name + "\n"))
			c.Close()
		}
	}()
}

// serveNameUDP answers every datagram with name.
func serveNameUDP(t *testing.T, addr, name string) {
	t.Helper()
	pc, err := net.ListenPacket("udp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	go func() {
		buf := make([]byte, 1500)
		for {
			_, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			pc.WriteTo([]byte(name), from)
		}
	}()
}

func askTCP(addr string) (string, error) {
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line), err
}

func askUDP(addr string) (string, error) {
	c, err := net.Dial("udp", addr)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write([]byte("q")); err != nil {
		return "", err
	}
	buf := make([]byte, 100)
	n, err := c.Read(buf)
	return string(buf[:n]), err
}

// TestRelay runs in a network namespace of its own, whose fixed NodePorts and
// addresses no other test shares, with every thread in it (the relay's event
// loop dials from its own thread). Stand-ins for ClusterIPs listen on lo: the
// relay dials them as it dials a ClusterIP, which a kernel mode's rules would
// DNAT.
func TestRelay(t *testing.T) {
	if !testbed.InOwnNetns(t) {
		return
	}

	for _, cmd := range [][]string{
		{"ip", "link", "set", "lo", "up"},
		{"ip", "addr", "add", "fd00:96::10/128", "dev", "lo", "nodad"},
	} {
		if out, err := exec.Command(cmd[0], cmd[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v: %s", cmd, err, out)
		}
	}
	serveName(t, "127.0.0.77:8080", "web-v4")
	serveName(t, "127.0.0.78:8080", "web-v4-moved")
	serveName(t, "[fd00:96::10]:8080", "web-v6")
	serveNameUDP(t, "127.0.0.77:5353", "dns-v4")
	// The kernel routes a new IPv6 address only once its address work has
	// run, a moment after `ip addr add` returns (nodad or not): until then a
	// connect says "network is unreachable".
	testbed.AwaitNoError(t, 5*time.Second, "the IPv6 stand-in [fd00:96::10]:8080", func() error {
		if got, err := askTCP("[fd00:96::10]:8080"); err != nil || got != "web-v6" {
			return fmt.Errorf("got %q, %v; want web-v6", got, err)
		}
		return nil
	})

	web := servicetest.Port("shop", "web", "http", service.TCP, 8080)
	web.ClusterIPs = servicetest.Addrs("127.0.0.77", "fd00:96::10")
	web.NodePort = 30080
	dns := servicetest.Port("kube-system", "dns", "", service.UDP, 5353)
	dns.ClusterIPs = servicetest.Addrs("127.0.0.77")
	dns.NodePort = 30053
	noNodePort := servicetest.Port("shop", "internal", "", service.TCP, 8080)
	noNodePort.ClusterIPs = servicetest.Addrs("127.0.0.77")

	r, err := New(Config{IPv4: true, IPv6: true})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(context.Background())
	if err := r.Sync(servicetest.Snapshot(web, dns, noNodePort)); err != nil {
		t.Fatalf("Sync: %v", err)
	}
	for _, c := range []struct{ addr, want string }{
		{"127.0.0.1:30080", "web-v4"},
		{"[::1]:30080", "web-v6"},
	} {
		if got, err := askTCP(c.addr); err != nil || got != c.want {
			t.Errorf("TCP %s: got %q (%v), want %q", c.addr, got, err, c.want)
		}
	}
	if got, err := askUDP("127.0.0.1:30053"); err != nil || got != "dns-v4" {
		t.Errorf("UDP 127.0.0.1:30053: got %q (%v), want dns-v4", got, err)
	}
	// dns has no IPv6 ClusterIP: nothing listens on [::1]:30053.
	if got, err := askUDP("[::1]:30053"); err == nil {
		t.Errorf("UDP [::1]:30053 of a Service without an IPv6 ClusterIP: got %q, want no answer", got)
	}

	t.Run("a new ClusterIP takes the next connections", func(t *testing.T) {
		moved := *web
		moved.ClusterIPs = servicetest.Addrs("127.0.0.78", "fd00:96::10")
		if err := r.Sync(servicetest.Snapshot(&moved, dns)); err != nil {
			t.Fatal(err)
		}
		if got, err := askTCP("127.0.0.1:30080"); err != nil || got != "web-v4-moved" {
			t.Errorf("TCP 127.0.0.1:30080: got %q (%v), want web-v4-moved", got, err)
		}
	})

	t.Run("a NodePort another process holds is reported, the others served", func(t *testing.T) {
		taken, err := net.Listen("tcp", "127.0.0.1:30081")
		if err != nil {
			t.Fatal(err)
		}
		defer taken.Close()
		other := servicetest.Port("shop", "other", "", service.TCP, 8080)
		other.ClusterIPs = servicetest.Addrs("127.0.0.77")
		other.NodePort = 30081
		err = r.Sync(servicetest.Snapshot(web, dns, other))
		if err == nil || !strings.Contains(err.Error(), "127.0.0.1:30081/TCP of shop/other") || !strings.Contains(err.Error(), "address already in use") {
			t.Errorf("Sync with 127.0.0.1:30081 taken: got %v, want an error naming it and the Service", err)
		}
		if got, err := askTCP("127.0.0.1:30080"); err != nil || got != "web-v4" {
			t.Errorf("TCP 127.0.0.1:30080 beside the failure: got %q (%v), want web-v4", got, err)
		}
		taken.Close()
		if err := r.Sync(servicetest.Snapshot(web, dns, other)); err != nil {
			t.Errorf("Sync once the port is free: %v", err)
		}
		if got, err := askTCP("127.0.0.1:30081"); err != nil || got != "web-v4" {
			t.Errorf("TCP 127.0.0.1:30081 once free: got %q (%v), want web-v4", got, err)
		}
	})

	t.Run("a Service gone stops its listeners", func(t *testing.T) {
		if err := r.Sync(servicetest.Snapshot(dns)); err != nil {
			t.Fatal(err)
		}
		for _, addr := range []string{"127.0.0.1:30080", "[::1]:30080", "127.0.0.1:30081"} {
			if _, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
				t.Errorf("TCP %s after its Service went: got a connection, want refused", addr)
			}
		}
	})

	t.Run("IPv6 off: ::1 serves nothing", func(t *testing.T) {
		r4, err := New(Config{IPv4: true})
		if err != nil {
			t.Fatal(err)
		}
		defer r4.Close(context.Background())
		if err := r4.Sync(servicetest.Snapshot(web)); err != nil {
			t.Fatal(err)
		}
		if _, err := net.DialTimeout("tcp", "[::1]:30080", time.Second); err == nil {
			t.Errorf("TCP [::1]:30080 with IPv6 off: got a connection, want refused")
		}
		if got, err := askTCP("127.0.0.1:30080"); err != nil || got != "web-v4" {
			t.Errorf("TCP 127.0.0.1:30080: got %q (%v), want web-v4", got, err)
		}
	})

	t.Run("Close stops everything", func(t *testing.T) {
		if err := r.Close(context.Background()); err != nil {
			t.Fatal(err)
		}
		if _, err := askUDP("127.0.0.1:30053"); err == nil {
			t.Errorf("UDP 127.0.0.1:30053 after Close: answered, want nothing")
		}
		if err := r.Sync(servicetest.Snapshot(dns)); err == nil {
			t.Errorf("Sync after Close: got nil, want an error")
		}
	})
}
