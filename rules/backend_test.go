package rules

import (
	"errors"
	"net/netip"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/test/testbed"
)

// --rules takes each backend by name, and "" as auto.
func TestParseBackend(t *testing.T) {
	for in, want := range map[string]Backend{"nftables": BackendNFTables, "iptables": BackendIPTables, "none": BackendNone, "auto": BackendAuto, "": BackendAuto} {
		if got, err := ParseBackend(in); got != want || err != nil {
			t.Errorf("ParseBackend(%q): got %q, %v; want %q", in, got, err, want)
		}
	}
	if got, err := ParseBackend("ipvs"); err == nil {
		t.Errorf("ParseBackend(ipvs): got %q, want an error", got)
	}
}

// New builds the backend it is given; none programs nothing.
func TestNewBackend(t *testing.T) {
	if p, err := New(BackendNone, Config{}); err != nil || p != (None{}) {
		t.Errorf("New(none): got %v, %v; want None", p, err)
	}
	if _, err := New(BackendAuto, Config{}); err == nil {
		t.Errorf("New(auto): got no error, want one (auto is resolved first)")
	}
	_, err := New(BackendIPTables, Config{})
	if _, ok := errors.AsType[*NoNodeIPError](err); !ok {
		t.Errorf("New(iptables) without a node IP: got %v, want the missing node IP", err)
	}
	// The flag is named as the user gave it.
	if !strings.HasPrefix(err.Error(), "--rules iptables: ") {
		t.Errorf("New(iptables): got %q, want it to begin with the flag", err)
	}
	_, err = New(BackendIPTables, Config{Chosen: true})
	if err == nil || !strings.HasPrefix(err.Error(), "--rules auto, which chose iptables: ") {
		t.Errorf("New(iptables) chosen by auto: got %v, want it to say auto chose it", err)
	}
}

var backendNodeIPs = []netip.Addr{netip.MustParseAddr("192.0.2.10")}

// ChooseBackend keeps an explicit backend and, for auto, takes nftables where
// the kernel and nft run the portals' layout, else iptables.
func TestChooseBackend(t *testing.T) {
	for _, b := range []Backend{BackendNFTables, BackendIPTables, BackendNone} {
		if got := ChooseBackend(b, "UPROXY", backendNodeIPs); got != b {
			t.Errorf("ChooseBackend(%q): got %q, want it kept", b, got)
		}
	}
	t.Run("no IPv4 node address", func(t *testing.T) {
		for _, ips := range [][]netip.Addr{nil, {netip.MustParseAddr("fd00::1")}, {netip.MustParseAddr("127.0.0.1")}} {
			if got := ChooseBackend(BackendAuto, "UPROXY", ips); got != BackendNone {
				t.Errorf("ChooseBackend(auto) with node IPs %v: got %q, want none (the node's own portals need an IPv4 address)", ips, got)
			}
		}
	})
	t.Run("nft missing", func(t *testing.T) {
		t.Setenv("PATH", t.TempDir())
		if got := ChooseBackend(BackendAuto, "UPROXY", backendNodeIPs); got != BackendIPTables {
			t.Errorf("ChooseBackend(auto) without nft: got %q, want iptables", got)
		}
	})
	t.Run("nft and the kernel support it", func(t *testing.T) {
		testbed.Needs(t, testbed.NFTables)
		if got := ChooseBackend(BackendAuto, "UPROXY", backendNodeIPs); got != BackendNFTables {
			t.Errorf("ChooseBackend(auto) as root with nft: got %q, want nftables", got)
		}
	})
}
