package proxier

import (
	"testing"

	"github.com/uproxy/uproxy/service"
)

// TCP and UDP ports are apart: a range of one port holds one TCP and one UDP
// proxy port, and a port released is free again for its protocol.
func TestAllocatorKeepsProtocolsApart(t *testing.T) {
	a := newAllocator(PortRange{First: 40000, Last: 40000})
	take := func(proto service.Protocol) int {
		got := 0
		a.each(proto, func(p int) (bool, bool) { got = p; return true, false })
		return got
	}
	if got := take(service.TCP); got != 40000 {
		t.Fatalf("first TCP port: got %d, want 40000", got)
	}
	if got := take(service.UDP); got != 40000 {
		t.Errorf("first UDP port beside a TCP one: got %d, want 40000 (TCP and UDP ports are separate)", got)
	}
	if got := take(service.TCP); got != 0 {
		t.Errorf("second TCP port of a range of one: got %d, want none", got)
	}
	a.release(service.TCP, 40000)
	if got := take(service.TCP); got != 40000 {
		t.Errorf("TCP port after its release: got %d, want 40000", got)
	}
}
