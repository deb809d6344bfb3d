package proxier

import (
	"context"
	"testing"
	"time"

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
