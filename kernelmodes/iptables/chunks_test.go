package iptables

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	ipt "github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/test/testbed"
)

// failingKernel fails its restore number failAt (counted from 1, both families).
type failingKernel struct {
	*fakeKernel
	n, failAt int
}

func (k *failingKernel) Restore(v6 bool, input []byte) error {
	if k.n++; k.n == k.failAt {
		return errors.New("restore failed on purpose")
	}
	return k.fakeKernel.Restore(v6, input)
}

// manyPorts returns n Service ports, each with a ClusterIP and the endpoints
// given, every third with a NodePort (so an EXT chain); tag varies the
// endpoints' port so a second call with another tag changes every port.
func manyPorts(n int, tag uint16, endpoints ...string) *service.Snapshot {
	ports := make([]*service.Port, n)
	for i := range ports {
		sp := svcPort("many", fmt.Sprintf("svc-%04d", i), "", service.TCP, 80)
		sp.ClusterIPs = []netip.Addr{netip.AddrFrom4([4]byte{10, 97, byte(i >> 8), byte(i)})}
		for _, e := range endpoints {
			a := netip.MustParseAddrPort(e)
			sp.Endpoints = append(sp.Endpoints, ep(netip.AddrPortFrom(a.Addr(), a.Port()+tag).String(), false))
		}
		if i%3 == 0 {
			sp.NodePort = 30000 + i
		}
		ports[i] = sp
	}
	return &service.Snapshot{Ports: ports}
}

func TestManyPortsWrittenInChunks(t *testing.T) {
	newPair := func(t *testing.T, k ipt.Kernel, ref *fakeKernel) (*Proxier, *Proxier) {
		p, err := New(Config{IPTables: k, Conntrack: &ref.ct})
		if err != nil {
			t.Fatal(err)
		}
		p.portsPerRestore = 2
		q, err := New(Config{IPTables: ref.Fake, Conntrack: &ref.ct})
		if err != nil {
			t.Fatal(err)
		}
		return p, q
	}
	// saved returns k's IPv4 rules with those of the chains whose order does
	// not matter sorted (the Service ports' jumps in P-SERVICES and
	// P-NODEPORTS, in any table), after checking that P-SERVICES ends with the
	// NodePorts rule.
	saved := func(t *testing.T, k *fakeKernel) string {
		t.Helper()
		b, err := k.Save(false)
		if err != nil {
			t.Fatal(err)
		}
		services, nodePorts := "-A "+ipt.DefaultChainPrefix+"-SERVICES ", "-A "+ipt.DefaultChainPrefix+"-NODEPORTS "
		var kept, free []string
		last := ""
		for line := range strings.Lines(string(b)) {
			switch {
			case strings.HasPrefix(line, services) && strings.HasSuffix(line, "-j "+ipt.DefaultChainPrefix+"-NODEPORTS\n"):
				last = line
				kept = append(kept, line)
			case strings.HasPrefix(line, services) || strings.HasPrefix(line, nodePorts):
				if last != "" && strings.HasPrefix(line, services) {
					t.Errorf("%q after the NodePorts rule %q", line, last)
				}
				free = append(free, line)
			default:
				kept = append(kept, line)
			}
		}
		slices.Sort(free)
		return strings.Join(kept, "") + strings.Join(free, "")
	}
	// declaringRestore returns, for each chain, the index of the last restore of
	// rs that declares it; a port chain declared twice fails the test.
	declaringRestore := func(t *testing.T, p *Proxier, rs []string) map[string]int {
		t.Helper()
		at := map[string]int{}
		for i, in := range rs {
			for _, line := range strings.Split(in, "\n") {
				name, ok := strings.CutPrefix(line, ":")
				if !ok {
					continue
				}
				name, _, _ = strings.Cut(name, " ")
				if prev, dup := at[name]; dup && p.n.isPortChain(name) {
					t.Errorf("chain %s declared in restores %d and %d", name, prev, i)
				}
				at[name] = i
			}
		}
		return at
	}
	eps := []string{"10.244.1.2:8080", "10.244.2.3:8080"}

	t.Run("whole syncs of five ports in three chunks of whole ports; the same rules as one restore", func(t *testing.T) {
		k, ref := newFakeKernel(), newFakeKernel()
		p, q := newPair(t, k.Fake, ref)
		s := manyPorts(5, 0, eps...)
		for _, st := range []struct {
			name string
			// first is the restore holding the first chunk; shared the one
			// writing the shared chains.
			first, shared int
		}{
			// Nothing of ours in the kernel: the shared chains first, without
			// jumps to port chains, then the chunks with their ports' jumps.
			{"first sync", 1, 0},
			// Our chains in the kernel, as after a restart: the chunks first,
			// then the shared chains; the kernel already holds every jump.
			{"whole sync over our own chains", 0, 3},
		} {
			n := len(k.restores(0))
			for _, px := range []*Proxier{p, q} {
				for _, fam := range px.fams {
					fam.written = nil
				}
				if err := px.Sync(s); err != nil {
					t.Fatal(err)
				}
			}
			rs := k.restores(0)[n:]
			if len(rs) != 4 {
				t.Fatalf("%s: got %d restores, want 4", st.name, len(rs))
			}
			at := declaringRestore(t, p, rs)
			for i, sp := range s.Ports {
				for _, c := range p.fams[0].written[portKey{sp.Name, sp.Protocol}].chains {
					if got, want := at[c], st.first+i/2; got != want {
						t.Errorf("%s: port %d's chain %s: declared in restore %d, want %d", st.name, i, c, got, want)
					}
				}
			}
			// The first sync writes P-SERVICES whole, without jumps to port
			// chains; a whole sync over our own rules edits it in place.
			_, nat, _ := strings.Cut(rs[st.shared], "*nat\n")
			if declared := strings.Contains(nat, ":"+p.n.services+" "); declared != (st.first == 1) || !strings.Contains(nat, ":"+p.n.markMasq+" ") || strings.Contains(nat, "-j "+p.n.prefix+"-SVC-") {
				t.Errorf("%s: restore %d: want the shared chains, P-SERVICES declared %v, no jump to a port chain:\n%s", st.name, st.shared, st.first == 1, rs[st.shared])
			}
			if got, want := saved(t, k), saved(t, ref); got != want {
				t.Errorf("%s: rules after the chunked sync differ from one restore's:\n%s\nwant:\n%s", st.name, got, want)
			}
		}
	})

	t.Run("partial syncs: many changed ports in chunks, a few in one restore; many stale chains flushed, then deleted, after", func(t *testing.T) {
		k, ref := newFakeKernel(), newFakeKernel()
		p, q := newPair(t, k.Fake, ref)
		steps := []struct {
			name     string
			s        *service.Snapshot
			restores int
		}{
			{"first", manyPorts(5, 0, eps...), 4},
			// Three chunks of ports, then ten stale SEP chains (six a
			// restore) flushed in two restores and deleted in two. The shared
			// chains jump to the same SVC chains: they are not rewritten.
			{"every port's endpoints move", manyPorts(5, 1, eps...), 7},
			// Two chunks, the shared chains; ten stale chains (two ports' SVC,
			// EXT and SEPs, three ports' second SEP) in four restores.
			{"one endpoint fewer, two ports gone", manyPorts(3, 1, eps[0]), 7},
			{"a port back", manyPorts(4, 1, eps[0]), 1},
			{"a port gone: its two chains deleted inline", manyPorts(3, 1, eps[0]), 1},
		}
		for _, st := range steps {
			n := len(k.restores(0))
			for _, px := range []*Proxier{p, q} {
				if err := px.Sync(st.s); err != nil {
					t.Fatalf("%s: %v", st.name, err)
				}
			}
			if got := len(k.restores(0)) - n; got != st.restores {
				t.Errorf("%s: got %d restores, want %d", st.name, got, st.restores)
			}
			if got, want := saved(t, k), saved(t, ref); got != want {
				t.Errorf("%s: rules differ from one restore's:\n%s\nwant:\n%s", st.name, got, want)
			}
		}
	})

	t.Run("a failed chunk: an error, and the next sync rewrites everything", func(t *testing.T) {
		// Restores 1-4 write the first snapshot (the shared chains, then three
		// chunks); of the second sync's seven, 5-7 are chunks of ports, 8-11
		// delete the stale chains.
		for _, failAt := range []int{1, 2, 4, 6, 8, 11} {
			k, ref := newFakeKernel(), newFakeKernel()
			fk := &failingKernel{fakeKernel: k, failAt: failAt}
			p, q := newPair(t, fk, ref)
			s := manyPorts(5, 1, eps...)
			if err := p.Sync(manyPorts(5, 0, eps...)); (err != nil) != (failAt <= 4) {
				t.Errorf("restore %d failing: first sync's error: %v", failAt, err)
			}
			if failAt > 4 {
				if err := p.Sync(s); err == nil {
					t.Errorf("restore %d failing: got no error", failAt)
				}
			}
			for _, px := range []*Proxier{p, q} {
				if err := px.Sync(s); err != nil {
					t.Fatal(err)
				}
			}
			if !p.fams[0].lastWasFull {
				t.Errorf("restore %d failing: the next sync was partial, want full", failAt)
			}
			if got, want := saved(t, k), saved(t, ref); got != want {
				t.Errorf("restore %d failing, then a sync: rules differ from one restore's:\n%s\nwant:\n%s", failAt, got, want)
			}
		}
	})
}

// TestRealIPTablesManyPorts writes 1100 Service ports into real iptables, in
// three chunks, reaches the first and the last port through them, and deletes
// all but one.
func TestRealIPTablesManyPorts(t *testing.T) {
	testbed.Needs(t, testbed.IPTables)
	w := newWorld(t)
	var p *Proxier
	if err := w.tp.Run(testbed.Node, func() (err error) {
		p, err = New(Config{})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	s := manyPorts(1100, 0, w.extV4...)
	w.sync(t, p, s)
	saved := w.tp.SavedRules(t, false)
	for _, sp := range s.Ports {
		if c := p.n.portChain("SVC", sp.Name, sp.Protocol, ""); !strings.Contains(saved, "-A "+c+" ") {
			t.Fatalf("%s: no rule in its chain %s", sp.Name, c)
		}
	}
	for _, i := range []int{0, 1099} {
		to := netip.AddrPortFrom(s.Ports[i].ClusterIPs[0], 80).String()
		got, _, err := w.tp.Ask(testbed.Pod, to)
		if err != nil || !strings.HasPrefix(got, "192.168.50.") {
			t.Errorf("port %d (%s) from the pod: got endpoint %q (%v), want one of %q", i, to, got, err, w.extV4)
		}
	}
	// Two ports more, then two fewer: their jumps are inserted into the shared
	// chains, then deleted, in place; the NodePorts rule stays last.
	more := manyPorts(1102, 0, w.extV4...)
	w.sync(t, p, more)
	last := more.Ports[1101]
	for _, to := range []struct{ from, addr string }{
		{testbed.Pod, netip.AddrPortFrom(last.ClusterIPs[0], 80).String()},
		{testbed.External, netip.AddrPortFrom(w.nodeIPv4, uint16(last.NodePort)).String()},
	} {
		if got, _, err := w.tp.Ask(to.from, to.addr); err != nil || !strings.HasPrefix(got, "192.168.50.") {
			t.Errorf("added port %s from %s: got endpoint %q (%v), want one of %q", to.addr, to.from, got, err, w.extV4)
		}
	}
	saved = w.tp.SavedRules(t, false)
	services := "\n-A " + p.n.services + " "
	if i := strings.LastIndex(saved, services); i < 0 || !strings.Contains(strings.SplitN(saved[i+1:], "\n", 2)[0], "-j "+p.n.nodePorts) {
		t.Errorf("the last rule of %s is not the NodePorts jump:\n%s", p.n.services, saved)
	}
	w.sync(t, p, s)
	saved = w.tp.SavedRules(t, false)
	if c := p.n.portChain("SVC", last.Name, last.Protocol, ""); strings.Contains(saved, c) {
		t.Errorf("removed port %s: its chain %s is still there", last.Name, c)
	}
	if got, want := strings.Count(saved, services), 1100+1; got != want {
		t.Errorf("rules in %s after the two went: got %d, want %d", p.n.services, got, want)
	}

	// A restart: a new Proxier's whole sync rewrites every port's chains and
	// edits P-SERVICES against what the kernel holds, here nothing to change.
	rec := &recordingKernel{Kernel: ipt.Commands{}}
	if err := w.tp.Run(testbed.Node, func() (err error) {
		p, err = New(Config{IPTables: rec})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	w.sync(t, p, s)
	for i, in := range rec.inputs {
		if _, nat, _ := strings.Cut(in, "*nat\n"); strings.Contains(nat, ":"+p.n.services+" ") {
			t.Errorf("restart: restore %d rewrites %s:\n%.500s", i, p.n.services, in)
		}
	}
	saved = w.tp.SavedRules(t, false)
	if got, want := strings.Count(saved, services), 1100+1; got != want {
		t.Errorf("rules in %s after the restart: got %d, want %d", p.n.services, got, want)
	}
	if got, _, err := w.tp.Ask(testbed.Pod, netip.AddrPortFrom(s.Ports[7].ClusterIPs[0], 80).String()); err != nil || !strings.HasPrefix(got, "192.168.50.") {
		t.Errorf("port 7 after the restart: got endpoint %q (%v)", got, err)
	}

	// All but one go: their 4800 chains are flushed, then deleted, in chunks.
	w.sync(t, p, manyPorts(1, 0, w.extV4...))
	saved = w.tp.SavedRules(t, false)
	if got := strings.Count(saved, "\n:"+p.n.prefix+"-SEP-"); got != len(w.extV4) {
		t.Errorf("SEP chains after all ports but one went: got %d, want %d:\n%s", got, len(w.extV4), saved)
	}
	if err := w.tp.Run(testbed.Node, p.Cleanup); err != nil {
		t.Fatal(err)
	}
}

func TestSharedNATEditedInPlace(t *testing.T) {
	t.Parallel()
	k := newFakeKernel()
	p, err := New(Config{IPTables: k.Fake, Conntrack: &k.ct})
	if err != nil {
		t.Fatal(err)
	}
	eps := []string{"10.244.1.2:8080"}
	// rules returns the nat table's rules of chain as a set, and its last rule.
	rules := func(chain string) (map[string]bool, string) {
		set, last := map[string]bool{}, ""
		for _, c := range k.State(false).Chains("nat") {
			if c.Name != chain {
				continue
			}
			for _, r := range c.Rules {
				set[r.Text] = true
				last = r.Text
			}
		}
		return set, last
	}
	for _, st := range []struct {
		name string
		s    *service.Snapshot
		edit bool // the shared chains edited in place, not rewritten
	}{
		{"first", manyPorts(6, 0, eps...), false},
		// Port 6 has a NodePort: a jump in SERVICES and one in NODEPORTS.
		{"two ports more", manyPorts(8, 0, eps...), true},
		{"one port fewer", manyPorts(7, 0, eps...), true},
		{"unchanged", manyPorts(7, 0, eps...), false},
		// 70 ports more, 24 of them with a NodePort: 94 rules inserted.
		{"many more", manyPorts(77, 0, eps...), true},
		// 66 ports fewer, 22 with a NodePort: 88 rules to delete, over 64.
		{"many fewer: a rewrite", manyPorts(11, 0, eps...), false},
		// The chunks (two ports each) insert their ports' jumps.
		{"many more with small chunks", manyPorts(40, 0, eps...), true},
	} {
		if st.name == "many more with small chunks" {
			p.portsPerRestore = 2
		}
		n := len(k.restores(0))
		if err := p.Sync(st.s); err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		if st.name == "many more with small chunks" {
			// 29 new ports, two a chunk: every chunk inserts its own jumps.
			with := 0
			for _, in := range k.restores(0)[n:] {
				if strings.Contains(in, "-I "+p.n.services+" 1 ") {
					with++
				}
			}
			if with != 15 {
				t.Errorf("%s: %d restores insert jumps, want 15 (one per chunk)", st.name, with)
			}
		}
		in := strings.Join(k.restores(0)[n:], "")
		if got := strings.Contains(in, "-I "+p.n.services+" 1 ") || strings.Contains(in, "-D "+p.n.services+" "); got != st.edit {
			t.Errorf("%s: shared chains edited in place: got %v, want %v:\n%s", st.name, got, st.edit, in)
		}
		if rewritten := strings.Contains(in, ":"+p.n.services+" "); rewritten == st.edit && st.name != "unchanged" {
			t.Errorf("%s: shared chains rewritten: got %v, want %v", st.name, rewritten, !st.edit)
		}
		// The kernel holds what a rewrite would write, in some order, and the
		// NodePorts rule last.
		var sh shared
		for _, sp := range st.s.Ports {
			p.fams[0].r.port(sp, &sh)
		}
		for _, c := range []struct {
			chain string
			want  []byte
		}{{p.n.services, sh.natServices}, {p.n.nodePorts, sh.natNodePorts}} {
			got, last := rules(c.chain)
			want := map[string]bool{}
			for line := range strings.Lines(string(c.want)) {
				want[strings.TrimSuffix(line, "\n")] = true
			}
			if c.chain == p.n.services {
				if !strings.HasSuffix(last, "-j "+p.n.nodePorts) {
					t.Errorf("%s: last rule of %s: got %q, want the NodePorts jump", st.name, c.chain, last)
				}
				delete(got, last)
			}
			if len(got) != len(want) {
				t.Errorf("%s: %s holds %d port rules, want %d", st.name, c.chain, len(got), len(want))
			}
			for r := range want {
				if !got[r] {
					t.Errorf("%s: %s lacks %q", st.name, c.chain, r)
				}
			}
		}
	}
}

// recordingKernel is the real iptables, keeping every restore input.
type recordingKernel struct {
	ipt.Kernel
	inputs []string
}

func (k *recordingKernel) Restore(v6 bool, input []byte) error {
	k.inputs = append(k.inputs, string(input))
	return k.Kernel.Restore(v6, input)
}

// editFailingKernel fails the first restore that deletes a rule.
type editFailingKernel struct {
	*fakeKernel
	failed bool
}

func (k *editFailingKernel) Restore(v6 bool, input []byte) error {
	if !k.failed && strings.Contains(string(input), "\n-D ") {
		k.failed = true
		return errors.New("restore failed on purpose")
	}
	return k.fakeKernel.Restore(v6, input)
}

func TestFailedEditRewritesNext(t *testing.T) {
	t.Parallel()
	k, ref := newFakeKernel(), newFakeKernel()
	p, err := New(Config{IPTables: &editFailingKernel{fakeKernel: k}, Conntrack: &k.ct})
	if err != nil {
		t.Fatal(err)
	}
	q, err := New(Config{IPTables: ref.Fake, Conntrack: &ref.ct})
	if err != nil {
		t.Fatal(err)
	}
	eps := []string{"10.244.1.2:8080"}
	if err := p.Sync(manyPorts(3, 0, eps...)); err != nil {
		t.Fatal(err)
	}
	// A port goes: its jump's deletion in place fails.
	if err := p.Sync(manyPorts(2, 0, eps...)); err == nil {
		t.Fatal("sync whose edit fails: got no error")
	}
	// The next sync, a whole one (the kernel is unknown), does not edit again:
	// it rewrites the shared chains.
	n := len(k.restores(0))
	for _, px := range []*Proxier{p, q} {
		if err := px.Sync(manyPorts(2, 0, eps...)); err != nil {
			t.Fatal(err)
		}
	}
	in := strings.Join(k.restores(0)[n:], "")
	if _, nat, _ := strings.Cut(in, "*nat\n"); !strings.Contains(nat, ":"+p.n.services+" ") || strings.Contains(in, "\n-D ") {
		t.Errorf("sync after a failed edit: want %s rewritten, no deletion in place:\n%s", p.n.services, in)
	}
	got, err := k.Save(false)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := ref.Save(false)
	if string(got) != string(want) {
		t.Errorf("rules after the rewrite:\n%s\nwant:\n%s", got, want)
	}
	// Then edits resume.
	if err := p.Sync(manyPorts(1, 0, eps...)); err != nil {
		t.Fatal(err)
	}
	if last := k.last(0); !strings.Contains(last, "-D "+p.n.services+" ") {
		t.Errorf("the sync after: want the jump deleted in place:\n%s", last)
	}
}
