package registry

import (
	"errors"
	"slices"
	"testing"

	"github.com/uproxy/uproxy/netfilter/iptables/iptablestest"
)

// TestClaimChains: a start is refused under a prefix any of whose chains, in
// any mode, another program has; uproxy's own chains (an older run's
// uncommented guard jumps among them) are no reason to refuse one. The check
// only reads.
func TestClaimChains(t *testing.T) {
	t.Parallel()
	const (
		// Docker's forward chain is the iptables mode's of DOCKER.
		docker = "*filter\n:DOCKER-FORWARD - [0:0]\n-A FORWARD -j DOCKER-FORWARD\nCOMMIT\n"
		// A firewall's chains with the portals' and the IPVS mode's names of FW.
		firewall = "*filter\n:FW-NO-ENDPOINTS - [0:0]\n:FW-IPVS-FILTER - [0:0]\n" +
			"-A INPUT -j FW-NO-ENDPOINTS\n-A INPUT -m comment --comment \"fw\" -g FW-IPVS-FILTER\nCOMMIT\n"
		// uproxy's own, as each mode writes its jumps, and as the iptables
		// mode wrote its guard's before they had a comment.
		own = "*nat\n:UPROXY-PORTALS-HOST - [0:0]\n:UPROXY-SERVICES - [0:0]\n:UPROXY-IPVS-SERVICES - [0:0]\n" +
			"-A OUTPUT -m comment --comment \"uproxy service portals\" -j UPROXY-PORTALS-HOST\n" +
			"-A OUTPUT -m comment --comment \"uproxy kernel-mode service portals\" -j UPROXY-SERVICES\n" +
			"-A OUTPUT -m comment --comment \"uproxy ipvs service portals\" -j UPROXY-IPVS-SERVICES\nCOMMIT\n" +
			"*filter\n:UPROXY-BLOCK-LOCALNET - [0:0]\n-A INPUT -j UPROXY-BLOCK-LOCALNET\n-A OUTPUT -j UPROXY-BLOCK-LOCALNET\nCOMMIT\n"
	)
	for _, tc := range []struct {
		prefix string
		want   []string
	}{
		{"UPROXY", nil},
		{"DOCKER", []string{"IPv4 filter/DOCKER-FORWARD", "IPv6 filter/DOCKER-FORWARD"}},
		{"FW", []string{"IPv4 filter/FW-IPVS-FILTER", "IPv4 filter/FW-NO-ENDPOINTS", "IPv6 filter/FW-IPVS-FILTER", "IPv6 filter/FW-NO-ENDPOINTS"}},
	} {
		t.Run(tc.prefix, func(t *testing.T) {
			k := iptablestest.New()
			for _, v6 := range []bool{false, true} {
				for _, in := range []string{docker, firewall, own} {
					if err := k.Apply(v6, in); err != nil {
						t.Fatal(err)
					}
				}
			}
			named, others := iptablestest.NotOurs(claimChains(k, tc.prefix))
			if !slices.Equal(named, tc.want) || others != nil {
				t.Errorf("got errors naming %q and %v besides, want errors naming %q alone", named, others, tc.want)
			}
			for _, v6 := range []bool{false, true} {
				if calls := k.Calls(v6); !slices.Equal(calls, []string{"save"}) {
					t.Errorf("v6=%v: got calls %q, want one save", v6, calls)
				}
			}
		})
	}
}

// Rules that cannot be read refuse nothing (a node whose kernel has no
// iptables runs the nftables mode); another program's chain in the family
// that can be read still does.
func TestClaimChainsWithAnUnreadableFamily(t *testing.T) {
	k := iptablestest.New()
	if err := k.Apply(true, "*filter\n:DOCKER-FORWARD - [0:0]\n-A FORWARD -j DOCKER-FORWARD\nCOMMIT\n"); err != nil {
		t.Fatal(err)
	}
	k.FailSave(false, errors.New("iptables-save: Failed to initialize nft: Protocol not supported"))
	if err := claimChains(k, "UPROXY"); err != nil {
		t.Errorf("IPv4 unreadable, nothing taken in IPv6: got %v, want no refusal", err)
	}
	named, others := iptablestest.NotOurs(claimChains(k, "DOCKER"))
	if want := []string{"IPv6 filter/DOCKER-FORWARD"}; !slices.Equal(named, want) || others != nil {
		t.Errorf("IPv4 unreadable, Docker's chain in IPv6: got errors naming %q and %v besides, want %q alone", named, others, want)
	}
}
