package testbed

import (
	"bytes"
	"io"
	"net"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netns"
)

func roundTrip(c net.Conn, msg string) (string, error) {
	defer c.Close()
	c.SetDeadline(time.Now().Add(DialTimeout))
	if _, err := c.Write([]byte(msg)); err != nil {
		return "", err
	}
	buf := make([]byte, len(msg))
	_, err := io.ReadFull(c, buf)
	return string(buf), err
}

func TestTopologyConnectivity(t *testing.T) {
	tp := New(t, WithIPv6())
	echoNode := tp.EchoTCP(Node, ":0")
	echoPod := tp.EchoTCP(Pod, ":0")
	echoExtUDP := tp.EchoUDP(External, ":0")
	port := func(a netip.AddrPort, ip netip.Addr) string {
		return netip.AddrPortFrom(ip, a.Port()).String()
	}
	tests := []struct {
		name, from, network, to string
	}{
		{"pod to node gateway", Pod, "tcp", port(echoNode, tp.NS(Pod).GatewayIPv4)},
		{"pod to node IP", Pod, "tcp", port(echoNode, tp.NS(Node).IPv4)},
		{"external to node IP", External, "tcp", port(echoNode, tp.NS(Node).IPv4)},
		{"external to pod through node", External, "tcp", port(echoPod, tp.NS(Pod).IPv4)},
		{"node to pod", Node, "tcp", port(echoPod, tp.NS(Pod).IPv4)},
		{"pod to external udp", Pod, "udp", port(echoExtUDP, tp.NS(External).IPv4)},
		{"pod to node IPv6", Pod, "tcp", port(echoNode, tp.NS(Node).IPv6)},
		{"external to pod IPv6", External, "tcp", port(echoPod, tp.NS(Pod).IPv6)},
		{"node to external udp IPv6", Node, "udp", port(echoExtUDP, tp.NS(External).IPv6)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := tp.Dial(tt.from, tt.network, tt.to)
			if err != nil {
				t.Fatalf("dial %s from %s: %v", tt.to, tt.from, err)
			}
			got, err := roundTrip(c, "hello "+tt.name)
			if err != nil || got != "hello "+tt.name {
				t.Errorf("echo via %s: got %q (%v), want %q", tt.to, got, err, "hello "+tt.name)
			}
		})
	}
}

func TestRunRestoresNamespace(t *testing.T) {
	tp := New(t)
	before, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	defer before.Close()
	var inside string
	err = tp.Run(Pod, func() error {
		out, err := exec.Command("ip", "-br", "addr", "show", "dev", "eth0").CombinedOutput()
		inside = string(out)
		return err
	})
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if !strings.Contains(inside, tp.NS(Pod).IPv4.String()) {
		t.Errorf("eth0 inside pod: got %q, want it to hold %s", inside, tp.NS(Pod).IPv4)
	}
	// The calling goroutine never left its namespace.
	after, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	defer after.Close()
	if !after.Equal(before) {
		t.Errorf("namespace after Run: got %v, want %v", after, before)
	}
	out, err := tp.Exec(Node, "ip", "-br", "link", "show", "veth-pod")
	if err != nil || !bytes.Contains(out, []byte("veth-pod")) {
		t.Errorf("Exec in node: got %q (%v), want veth-pod listed", out, err)
	}
}

func TestCleanupRemovesNamespaces(t *testing.T) {
	Needs(t, Netns)
	var names []string
	t.Run("build", func(t *testing.T) {
		tp := New(t)
		for _, r := range []string{Node, Pod, External} {
			names = append(names, tp.NS(r).Name)
		}
	})
	out, err := exec.Command("ip", "netns", "list").CombinedOutput()
	if err != nil {
		t.Fatalf("ip netns list: %v: %s", err, out)
	}
	for _, n := range names {
		if strings.Contains(string(out), n) {
			t.Errorf("namespace %s still exists after its test ended", n)
		}
	}
}

func TestParallelTopologiesDoNotClash(t *testing.T) {
	Needs(t, Netns)
	for i := range 3 {
		t.Run(string(rune('a'+i)), func(t *testing.T) {
			t.Parallel()
			tp := New(t)
			echo := tp.EchoTCP(Node, ":0")
			c, err := tp.Dial(Pod, "tcp", netip.AddrPortFrom(tp.NS(Pod).GatewayIPv4, echo.Port()).String())
			if err != nil {
				t.Fatalf("dial: %v", err)
			}
			if got, err := roundTrip(c, "x"); got != "x" {
				t.Errorf("echo: got %q (%v), want %q", got, err, "x")
			}
		})
	}
}
