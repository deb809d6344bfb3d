package rules

import (
	"fmt"
	"os/exec"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"
)

// fakeKernel stands in for iptables and netlink: it records what would be written
// and models just enough state (the canary, the jump rules) to answer reads.
type fakeKernel struct {
	restores [2][]string        // inputs per family, in order
	failNext [2]error           // returned by the next Restore of that family
	canary   [2]bool            // canary chain holds its rule
	jumps    [2]map[string]bool // "table chain spec" present
	ops      [2][]string        // Insert/Append calls, as "insert nat PREROUTING 1 -j X"
	lists    [2]int             // List calls
	saved    [2]string          // what Save returns
	saveErr  [2]error           // error Save returns
	deleted  [2][]staleFlows    // conntrack filters
}

func newFakeKernel() *fakeKernel {
	return &fakeKernel{jumps: [2]map[string]bool{{}, {}}}
}

func fam(ipv6 bool) int {
	if ipv6 {
		return v6
	}
	return v4
}

func (k *fakeKernel) kernel() *Kernel {
	return &Kernel{
		Tables: func(v6 bool) (Tables, error) { return &fakeTables{k: k, f: fam(v6)}, nil },
		Restore: func(v6 bool, input []byte) error {
			f := fam(v6)
			if err := k.failNext[f]; err != nil {
				k.failNext[f] = nil
				return err
			}
			k.restores[f] = append(k.restores[f], string(input))
			if strings.Contains(string(input), "-j RETURN") && strings.Contains(string(input), "-CANARY -m comment") {
				k.canary[f] = true
			}
			return nil
		},
		Save: func(v6 bool) ([]byte, error) {
			f := fam(v6)
			return []byte(k.saved[f]), k.saveErr[f]
		},
		Conntrack: &fakeConntrack{k: k},
	}
}

// flush simulates `iptables -t nat -F` by someone else.
func (k *fakeKernel) flush(f int) {
	k.canary[f] = false
	for j := range k.jumps[f] {
		if strings.HasPrefix(j, "nat ") {
			delete(k.jumps[f], j)
		}
	}
}

type fakeTables struct {
	k *fakeKernel
	f int
}

func key(table, chain string, spec []string) string {
	return table + " " + chain + " " + strings.Join(spec, " ")
}

func (t *fakeTables) Exists(table, chain string, spec ...string) (bool, error) {
	return t.k.jumps[t.f][key(table, chain, spec)], nil
}

func (t *fakeTables) Insert(table, chain string, pos int, spec ...string) error {
	t.k.jumps[t.f][key(table, chain, spec)] = true
	t.k.ops[t.f] = append(t.k.ops[t.f], fmt.Sprintf("insert %s %s %d %s", table, chain, pos, strings.Join(spec, " ")))
	return nil
}

func (t *fakeTables) Append(table, chain string, spec ...string) error {
	t.k.jumps[t.f][key(table, chain, spec)] = true
	t.k.ops[t.f] = append(t.k.ops[t.f], fmt.Sprintf("append %s %s %s", table, chain, strings.Join(spec, " ")))
	return nil
}

func (t *fakeTables) List(table, chain string) ([]string, error) {
	t.k.lists[t.f]++
	if table == "nat" && strings.HasSuffix(chain, "-CANARY") && t.k.canary[t.f] {
		return []string{"-N " + chain, canaryRule(chainNames(strings.TrimSuffix(chain, "-CANARY")))}, nil
	}
	return nil, fmt.Errorf("iptables: no chain %s in table %s", chain, table)
}

type fakeConntrack struct{ k *fakeKernel }

func (c *fakeConntrack) ConntrackDeleteFilters(table netlink.ConntrackTableType, family netlink.InetFamily, filters ...netlink.CustomConntrackFilter) (uint, error) {
	f := v4
	if family == 10 { // AF_INET6
		f = v6
	}
	for _, flt := range filters {
		c.k.deleted[f] = append(c.k.deleted[f], flt.(staleFlows))
	}
	return 0, nil
}

func (k *fakeKernel) allOps(f int) []string { return slices.Clone(k.ops[f]) }

func errExecNotFound() error { return exec.ErrNotFound }
