package iptables

import (
	"errors"
	"net"
	"net/netip"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"

	"github.com/uproxy/uproxy/rules"
)

// fakeKernel stands in for iptables and conntrack: it records restore inputs and
// models what the proxier reads back (the canary chains, the jumps, the chains
// iptables-save would list).
type fakeKernel struct {
	restores [2][]string
	failNext [2]error
	// canary[f] is true while the family's canary chains hold their rule.
	canary [2]bool
	jumps  [2][]string
	// chains[f] are the nat chains the kernel holds.
	chains  [2]map[string]bool
	flows   [2][]staleFlows
	inserts int
}

func newFakeKernel() *fakeKernel {
	return &fakeKernel{chains: [2]map[string]bool{{}, {}}}
}

func idx(v6 bool) int {
	if v6 {
		return 1
	}
	return 0
}

func (k *fakeKernel) kernel() *rules.Kernel {
	return &rules.Kernel{
		Tables: func(v6 bool) (rules.Tables, error) { return &fakeTables{k: k, f: idx(v6)}, nil },
		Restore: func(v6 bool, input []byte) error {
			f := idx(v6)
			if err := k.failNext[f]; err != nil {
				k.failNext[f] = nil
				return err
			}
			k.restores[f] = append(k.restores[f], string(input))
			table := ""
			for _, line := range strings.Split(string(input), "\n") {
				switch {
				case strings.HasPrefix(line, "*"):
					table = line[1:]
				case strings.HasPrefix(line, ":") && table == "nat":
					c, _, _ := strings.Cut(line[1:], " ")
					k.chains[f][c] = true
				case strings.HasPrefix(line, "-X "):
					delete(k.chains[f], line[3:])
				}
			}
			if strings.Contains(string(input), "-PROXY-CANARY -m comment") {
				k.canary[f] = true
			}
			return nil
		},
		Save: func(v6 bool) ([]byte, error) {
			f := idx(v6)
			var b strings.Builder
			b.WriteString("*nat\n")
			var cs []string
			for c := range k.chains[f] {
				cs = append(cs, c)
			}
			slices.Sort(cs)
			for _, c := range cs {
				b.WriteString(":" + c + " - [0:0]\n")
			}
			b.WriteString("COMMIT\n")
			return []byte(b.String()), nil
		},
		Conntrack: fakeConntrack{k},
	}
}

// flush simulates `iptables -t nat -F` by someone else in family f.
func (k *fakeKernel) flush(f int) {
	k.canary[f] = false
	k.jumps[f] = nil
}

func (k *fakeKernel) last(f int) string {
	if len(k.restores[f]) == 0 {
		return ""
	}
	return k.restores[f][len(k.restores[f])-1]
}

type fakeTables struct {
	k *fakeKernel
	f int
}

func (t *fakeTables) Exists(table, chain string, spec ...string) (bool, error) {
	return slices.Contains(t.k.jumps[t.f], table+" "+chain+" "+strings.Join(spec, " ")), nil
}

func (t *fakeTables) Insert(table, chain string, pos int, spec ...string) error {
	t.k.inserts++
	t.k.jumps[t.f] = append(t.k.jumps[t.f], table+" "+chain+" "+strings.Join(spec, " "))
	return nil
}

func (t *fakeTables) Append(table, chain string, spec ...string) error {
	return errors.New("fake: the iptables mode only inserts")
}

func (t *fakeTables) List(table, chain string) ([]string, error) {
	if !t.k.canary[t.f] {
		return nil, errors.New("fake: chain does not exist")
	}
	return []string{"-N " + chain, canaryRule(namesOf(strings.TrimSuffix(chain, "-PROXY-CANARY")))}, nil
}

type fakeConntrack struct{ k *fakeKernel }

func (c fakeConntrack) ConntrackDeleteFilters(_ netlink.ConntrackTableType, fam netlink.InetFamily, filters ...netlink.CustomConntrackFilter) (uint, error) {
	f := 0
	if fam == 10 { // AF_INET6
		f = 1
	}
	for _, fl := range filters {
		c.k.flows[f] = append(c.k.flows[f], fl.(staleFlows))
	}
	return 0, nil
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
