package iptables

import (
	"net"
	"net/netip"
	"strings"

	"github.com/vishvananda/netlink"

	"github.com/uproxy/uproxy/netfilter/conntrack/conntracktest"
	"github.com/uproxy/uproxy/netfilter/iptables/iptablestest"
)

// fakeKernel is the kernel of the unit tests: iptables in memory, which refuses
// what iptables refuses, and a conntrack that records the stale-flow filters.
type fakeKernel struct {
	*iptablestest.Fake
	ct conntracktest.Recorder
}

func newFakeKernel() *fakeKernel { return &fakeKernel{Fake: iptablestest.New()} }

func idx(v6 bool) int {
	if v6 {
		return 1
	}
	return 0
}

// restores returns the restore inputs of family f (0 IPv4, 1 IPv6) that succeeded.
func (k *fakeKernel) restores(f int) []string { return k.Restores(f == 1) }

// last returns the last restore input of family f, "" when there is none.
func (k *fakeKernel) last(f int) string {
	rs := k.restores(f)
	if len(rs) == 0 {
		return ""
	}
	return rs[len(rs)-1]
}

// inserts counts the rules family f got one by one (the jumps).
func (k *fakeKernel) inserts(f int) int {
	n := 0
	for _, c := range k.Calls(f == 1) {
		if strings.HasPrefix(c, "insert ") {
			n++
		}
	}
	return n
}

// jumps returns the rules of family f in built-in chains, as "table rule".
func (k *fakeKernel) jumps(f int) []string {
	var out []string
	for _, t := range k.State(f == 1).Tables {
		for _, c := range t.Chains {
			if c.Policy == "-" {
				continue
			}
			for _, r := range c.Rules {
				out = append(out, t.Name+" "+r.Text)
			}
		}
	}
	return out
}

// natChains returns the chains of family f's nat table.
func (k *fakeKernel) natChains(f int) map[string]bool {
	out := map[string]bool{}
	for _, c := range k.State(f == 1).Chains("nat") {
		out[c.Name] = true
	}
	return out
}

// netlinkFlow builds a UDP conntrack flow: original destination dst, reply
// source reply (the endpoint after DNAT).
type netlinkFlow struct{ dst, reply netip.AddrPort }

func newFlow(dst, reply string) *netlinkFlow {
	return &netlinkFlow{netip.MustParseAddrPort(dst), netip.MustParseAddrPort(reply)}
}

func (f *netlinkFlow) flow() *netlink.ConntrackFlow {
	c := &netlink.ConntrackFlow{}
	c.Forward.Protocol = 17
	c.Forward.SrcIP = net.ParseIP("10.244.9.9")
	c.Forward.DstIP = net.IP(f.dst.Addr().AsSlice())
	c.Forward.DstPort = f.dst.Port()
	c.Reverse.SrcIP = net.IP(f.reply.Addr().AsSlice())
	c.Reverse.SrcPort = f.reply.Port()
	return c
}
