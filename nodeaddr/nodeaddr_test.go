package nodeaddr

import (
	"net/netip"
	"slices"
	"testing"

	"github.com/uproxy/uproxy/test/testbed"
)

func addrs(s ...string) []netip.Addr {
	out := make([]netip.Addr, len(s))
	for i, a := range s {
		out[i] = netip.MustParseAddr(a)
	}
	return out
}

// List reads the test's own namespace: it always has loopback, and gives IPv4
// addresses unmapped, so that a Prefix of either family can contain them.
func TestList(t *testing.T) {
	t.Parallel()
	got, err := List()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(got, netip.MustParseAddr("127.0.0.1")) {
		t.Errorf("got %v, want 127.0.0.1 among them", got)
	}
	for _, a := range got {
		if a.Is4In6() {
			t.Errorf("got %v, want IPv4 addresses unmapped", a)
		}
	}
}

func TestIn(t *testing.T) {
	t.Parallel()
	node := addrs("127.0.0.1", "192.168.50.7", "10.0.0.1", "fd00::7", "fe80::1")
	tests := []struct {
		name     string
		prefixes []string
		want     []netip.Addr
	}{
		{"no prefix, no address", nil, nil},
		{"one prefix", []string{"192.168.50.0/24"}, addrs("192.168.50.7")},
		{"both families, node order", []string{"fd00::/64", "10.0.0.0/8", "192.168.0.0/16"}, addrs("192.168.50.7", "10.0.0.1", "fd00::7")},
		{"overlapping prefixes count once", []string{"10.0.0.0/8", "10.0.0.1/32"}, addrs("10.0.0.1")},
		{"outside every prefix", []string{"172.16.0.0/12"}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var prefixes []netip.Prefix
			for _, p := range tt.prefixes {
				prefixes = append(prefixes, netip.MustParsePrefix(p))
			}
			if got := In(node, prefixes); !slices.Equal(got, tt.want) {
				t.Errorf("got %v, want %v", got, tt.want)
			}
		})
	}
}

func TestPrimary(t *testing.T) {
	tests := []struct {
		name  string
		addrs []netip.Addr
		want  []netip.Addr
	}{
		{"first global unicast of each family, IPv4 first", addrs("127.0.0.1", "fe80::1", "fd00::7", "192.168.50.7", "10.0.0.1", "fd00::8"), addrs("192.168.50.7", "fd00::7")},
		{"IPv4 only", addrs("127.0.0.1", "10.0.0.1"), addrs("10.0.0.1")},
		{"loopback and link-local only", addrs("127.0.0.1", "::1", "fe80::1", "169.254.0.1"), nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Primary(tt.addrs); !slices.Equal(got, tt.want) {
				t.Errorf("got %v, want %v", got, tt.want)
			}
		})
	}
}

// Routed gives the source of the default route, not the first address: in a
// node whose first interface is toward a pod, the address toward the outside.
func TestRouted(t *testing.T) {
	tp := testbed.New(t, testbed.WithIPv6())
	node := tp.NS(testbed.Node)
	var listed, routed []netip.Addr
	if err := tp.Run(testbed.Node, func() (err error) {
		routed = Routed()
		listed, err = List()
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if want := []netip.Addr{node.IPv4, node.IPv6}; !slices.Equal(routed, want) {
		t.Errorf("Routed: got %v, want the addresses toward the default routes %v", routed, want)
	}
	if first := Primary(listed); slices.Equal(first, routed) {
		t.Logf("the first global addresses are the routed ones here (%v): the test shows less than it could", first)
	}
	// Without a default route a family has no routed address.
	tp.MustExec(t, testbed.Node, "ip", "-6", "route", "del", "default")
	if err := tp.Run(testbed.Node, func() error { routed = Routed(); return nil }); err != nil {
		t.Fatal(err)
	}
	if want := []netip.Addr{node.IPv4}; !slices.Equal(routed, want) {
		t.Errorf("Routed without an IPv6 default route: got %v, want %v", routed, want)
	}
}
