package nftables

import (
	"fmt"
	"io"
	"math"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// This file measures a layout for the nftables kernel mode before the mode is
// built on it (docs/nftables-kernel-mode.md): Service traffic is DNATed by one
// map lookup keyed by the Service port and a random slot, with no chain per
// Service or per endpoint. Two ways to give a Service port its slots are
// compared:
//
//	slots=N  one map, numgen random mod N; every Service port has N elements,
//	         filled round-robin from its endpoints (skew below k/N for k endpoints)
//	exact    one map per endpoint count k, numgen random mod k; a Service port has
//	         one element per endpoint (no skew), and one rule per count in use
//
// The tables are written as nft -f files and loaded by the nft command in a
// namespace, as knftables would load them.

const (
	benchTable = "uproxy-kernel"
	// podCIDR is the cluster's pod range: traffic to a Service from outside it
	// is masqueraded.
	podCIDR = "10.244.0.0/15"
	// maxExact is the largest endpoint count with a map of its own in the
	// exact layout.
	maxExact = 16
	// masqMark is the packet mark bit that asks for masquerading.
	masqMark = "0x4000"
)

// layout writes the table and its element changes for one way of filling slots.
type layout interface {
	name() string
	// table writes the table without elements, replacing any older one.
	table(w io.Writer)
	// add and del write the elements of one Service port.
	add(w io.Writer, sp benchPort)
	del(w io.Writer, sp benchPort)
}

// benchPort is one Service port: ClusterIP . protocol . port and its endpoints.
type benchPort struct {
	ip        netip.Addr
	proto     string
	port      int
	endpoints []netip.AddrPort
}

func (sp benchPort) key() string { return fmt.Sprintf("%s . %s . %d", sp.ip, sp.proto, sp.port) }

// benchPorts returns n Service ports, alternating TCP and UDP, each with two
// endpoints; gen changes the endpoint addresses, as a rollout would.
func benchPorts(n, gen int) []benchPort {
	ports := make([]benchPort, n)
	for i := range ports {
		proto := "tcp"
		if i%2 == 1 {
			proto = "udp"
		}
		ports[i] = benchPort{
			ip:    netip.AddrFrom4([4]byte{10, 96 + byte(i>>16), byte(i >> 8), byte(i)}),
			proto: proto, port: 80,
			endpoints: []netip.AddrPort{
				netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 244, byte(i >> 8), byte(i)}), uint16(8080+gen)),
				netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 245, byte(i >> 8), byte(i)}), uint16(8080+gen)),
			},
		}
	}
	return ports
}

// common writes what both layouts share: the table, the base chains, the set of
// Service ports with endpoints (for masquerading) and the set of those without
// (rejected). dnatRules are the rules of the prerouting and output nat chains.
func common(w io.Writer, dnatRules []string, maps string) {
	fmt.Fprintf(w, "table ip %s\ndelete table ip %s\n", benchTable, benchTable)
	fmt.Fprintf(w, "table ip %s {\n%s", benchTable, maps)
	fmt.Fprint(w, "\tset services { typeof ip daddr . meta l4proto . th dport; }\n")
	fmt.Fprint(w, "\tset no-endpoints { typeof ip daddr . meta l4proto . th dport; }\n")
	for _, hook := range []string{"prerouting", "output"} {
		// nft 1.0.6 names the dstnat priority only in prerouting.
		fmt.Fprintf(w, "\tchain nat-%s {\n\t\ttype nat hook %s priority -100; policy accept;\n", hook, hook)
		// Mark what comes from outside the pod range for masquerading; the
		// mark stays on the packet until postrouting.
		fmt.Fprintf(w, "\t\tip saddr != %s ip daddr . meta l4proto . th dport @services meta mark set meta mark | %s\n", podCIDR, masqMark)
		for _, r := range dnatRules {
			fmt.Fprintf(w, "\t\t%s\n", r)
		}
		fmt.Fprint(w, "\t}\n")
	}
	fmt.Fprintf(w, "\tchain nat-postrouting {\n\t\ttype nat hook postrouting priority srcnat; policy accept;\n"+
		"\t\tmeta mark & %s != 0 masquerade\n\t}\n", masqMark)
	// reject is a filter statement: a Service port without endpoints is
	// refused where its packets go, forwarded or sent by the node.
	for _, hook := range []string{"forward", "output"} {
		fmt.Fprintf(w, "\tchain filter-%s {\n\t\ttype filter hook %s priority filter - 1; policy accept;\n"+
			"\t\tip daddr . meta l4proto . th dport @no-endpoints reject\n\t}\n", hook, hook)
	}
	fmt.Fprint(w, "}\n")
}

func addService(w io.Writer, sp benchPort) {
	fmt.Fprintf(w, "add element ip %s services { %s }\n", benchTable, sp.key())
}

func delService(w io.Writer, sp benchPort) {
	fmt.Fprintf(w, "delete element ip %s services { %s }\n", benchTable, sp.key())
}

// slotLayout has one map with n slots per Service port.
type slotLayout struct{ n int }

func (l slotLayout) name() string { return fmt.Sprintf("slots=%d", l.n) }

func (l slotLayout) table(w io.Writer) {
	common(w,
		[]string{fmt.Sprintf("meta l4proto { tcp, udp } dnat ip to ip daddr . meta l4proto . th dport . numgen random mod %d map @backends", l.n)},
		fmt.Sprintf("\tmap backends { typeof ip daddr . meta l4proto . th dport . numgen random mod %d : ip daddr . th dport; }\n", l.n))
}

func (l slotLayout) add(w io.Writer, sp benchPort) {
	addService(w, sp)
	fmt.Fprintf(w, "add element ip %s backends {", benchTable)
	for i, ep := range slotEndpoints(sp.endpoints, l.n) {
		sep := ","
		if i == 0 {
			sep = ""
		}
		fmt.Fprintf(w, "%s %s . %d : %s . %d", sep, sp.key(), i, ep.Addr(), ep.Port())
	}
	fmt.Fprint(w, " }\n")
}

func (l slotLayout) del(w io.Writer, sp benchPort) {
	delService(w, sp)
	fmt.Fprintf(w, "delete element ip %s backends {", benchTable)
	for i := range l.n {
		sep := ","
		if i == 0 {
			sep = ""
		}
		fmt.Fprintf(w, "%s %s . %d", sep, sp.key(), i)
	}
	fmt.Fprint(w, " }\n")
}

// slotEndpoints fills n slots round-robin: with k endpoints, each holds
// floor(n/k) or ceil(n/k) of them.
func slotEndpoints(eps []netip.AddrPort, n int) []netip.AddrPort {
	slots := make([]netip.AddrPort, n)
	for i := range slots {
		slots[i] = eps[i%len(eps)]
	}
	return slots
}

// maxSkew is the largest deviation from the fair share 1/k, relative to it,
// when k endpoints fill n slots: the busiest gets ceil(n/k)·k/n − 1 more, the
// idlest 1 − floor(n/k)·k/n less; both are below k/n, and 0 when k divides n.
func maxSkew(n, k int) float64 {
	over := float64((n+k-1)/k*k)/float64(n) - 1
	under := 1 - float64(n/k*k)/float64(n)
	return max(over, under)
}

// exactLayout has one map per endpoint count: a Service port with k endpoints
// sits in backends-k, looked up with numgen random mod k. A packet passes the
// rules of the counts in use until one map holds its key; a miss leaves the
// rule unmatched.
type exactLayout struct{}

func (exactLayout) name() string { return "exact" }

func (exactLayout) table(w io.Writer) {
	var rules []string
	var maps strings.Builder
	for k := 1; k <= maxExact; k++ {
		rules = append(rules, fmt.Sprintf("meta l4proto { tcp, udp } dnat ip to ip daddr . meta l4proto . th dport . numgen random mod %d map @backends-%d", k, k))
		fmt.Fprintf(&maps, "\tmap backends-%d { typeof ip daddr . meta l4proto . th dport . numgen random mod %d : ip daddr . th dport; }\n", k, k)
	}
	common(w, rules, maps.String())
}

func (exactLayout) add(w io.Writer, sp benchPort) {
	addService(w, sp)
	fmt.Fprintf(w, "add element ip %s backends-%d {", benchTable, len(sp.endpoints))
	for i, ep := range sp.endpoints {
		sep := ","
		if i == 0 {
			sep = ""
		}
		fmt.Fprintf(w, "%s %s . %d : %s . %d", sep, sp.key(), i, ep.Addr(), ep.Port())
	}
	fmt.Fprint(w, " }\n")
}

func (exactLayout) del(w io.Writer, sp benchPort) {
	delService(w, sp)
	fmt.Fprintf(w, "delete element ip %s backends-%d {", benchTable, len(sp.endpoints))
	for i := range sp.endpoints {
		sep := ","
		if i == 0 {
			sep = ""
		}
		fmt.Fprintf(w, "%s %s . %d", sep, sp.key(), i)
	}
	fmt.Fprint(w, " }\n")
}

// script writes fn's output to a file in dir and returns its path.
func script(tb testing.TB, dir, name string, fn func(w io.Writer)) string {
	tb.Helper()
	var b strings.Builder
	fn(&b)
	path := filepath.Join(dir, name+".nft")
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		tb.Fatal(err)
	}
	return path
}

// load runs nft -f path in the node namespace and returns how long it took,
// nft's start and parse included, as a mode using knftables would pay.
func load(tb testing.TB, tp *testbed.Topology, path string) time.Duration {
	tb.Helper()
	var took time.Duration
	err := tp.Run(testbed.Node, func() error {
		start := time.Now()
		out, err := exec.Command("nft", "-f", path).CombinedOutput()
		took = time.Since(start)
		if err != nil {
			return fmt.Errorf("nft -f %s: %w: %s", path, err, out)
		}
		return nil
	})
	if err != nil {
		tb.Fatal(err)
	}
	return took
}

// BenchmarkLayout loads the table with n Service ports of two endpoints each
// (full), then changes it by one Service port: added, its endpoints replaced,
// removed. Every iteration is one nft -f; min-ms and max-ms give the range.
//
//	go test -run '^$' -bench Layout -benchtime 3x ./kernelmodes/nftables/
func BenchmarkLayout(b *testing.B) {
	for _, l := range []layout{slotLayout{n: 64}, slotLayout{n: 8}, exactLayout{}} {
		for _, n := range []int{1000, 10000, 50000} {
			if sl, ok := l.(slotLayout); ok && sl.n*n > 1_000_000 {
				// 64 slots at 10k Service ports already load in 8–10 s;
				// 3.2M elements would take minutes and prove nothing more.
				continue
			}
			b.Run(fmt.Sprintf("%s/ports=%d", l.name(), n), func(b *testing.B) {
				testbed.Needs(b, testbed.NFTables)
				benchLayout(b, l, n)
			})
		}
	}
}

func benchLayout(b *testing.B, l layout, n int) {
	tp := testbed.New(b)
	dir := b.TempDir()
	ports := benchPorts(n, 0)
	extra := benchPorts(n+1, 0)[n] // the Service port added and removed
	rolled := benchPorts(n, 1)[n/2]
	full := script(b, dir, "full", func(w io.Writer) {
		l.table(w)
		for _, sp := range ports {
			l.add(w, sp)
		}
	})
	steps := []struct {
		name       string
		do, undo   string
		onlyAtFull bool
	}{
		{name: "full", do: full},
		{name: "add",
			do:   script(b, dir, "add", func(w io.Writer) { l.add(w, extra) }),
			undo: script(b, dir, "add-undo", func(w io.Writer) { l.del(w, extra) })},
		{name: "change",
			do:   script(b, dir, "change", func(w io.Writer) { l.del(w, ports[n/2]); l.add(w, rolled) }),
			undo: script(b, dir, "change-undo", func(w io.Writer) { l.del(w, rolled); l.add(w, ports[n/2]) })},
		{name: "remove",
			do:   script(b, dir, "remove", func(w io.Writer) { l.del(w, ports[n/2]) }),
			undo: script(b, dir, "remove-undo", func(w io.Writer) { l.add(w, ports[n/2]) })},
	}
	load(b, tp, full) // the first load creates the table; later ones replace it
	for _, st := range steps {
		b.Run(st.name, func(b *testing.B) {
			var runs []time.Duration
			for b.Loop() {
				runs = append(runs, load(b, tp, st.do))
				if st.undo != "" {
					b.StopTimer()
					load(b, tp, st.undo)
					b.StartTimer()
				}
			}
			b.ReportMetric(float64(slices.Min(runs).Microseconds())/1000, "min-ms")
			b.ReportMetric(float64(slices.Max(runs).Microseconds())/1000, "max-ms")
		})
	}
}

// TestSlotSkew states the slot arithmetic: k endpoints in n round-robin slots
// hold floor(n/k) or ceil(n/k) each, so the busiest gets less than k/n more
// than its share, and none when k divides n.
func TestSlotSkew(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		n, k int
		want float64
	}{
		{64, 1, 0}, {64, 2, 0}, {64, 3, 1.0 / 32}, {64, 5, 1.0 / 16}, {64, 7, 3.0 / 32}, {64, 9, 1.0 / 8}, {64, 33, 31.0 / 64},
		{8, 3, 1.0 / 4}, {8, 5, 3.0 / 8},
	} {
		t.Run(fmt.Sprintf("n=%d/k=%d", tc.n, tc.k), func(t *testing.T) {
			if got := maxSkew(tc.n, tc.k); math.Abs(got-tc.want) > 1e-9 {
				t.Errorf("maxSkew = %v, want %v", got, tc.want)
			}
			count := map[netip.AddrPort]int{}
			eps := make([]netip.AddrPort, tc.k)
			for i := range eps {
				eps[i] = netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 244, 0, byte(i + 1)}), 80)
			}
			for _, ep := range slotEndpoints(eps, tc.n) {
				count[ep]++
			}
			lo, hi := tc.n/tc.k, (tc.n+tc.k-1)/tc.k
			for ep, c := range count {
				if c < lo || c > hi {
					t.Errorf("%s holds %d slots, want %d..%d", ep, c, lo, hi)
				}
			}
			if len(count) != tc.k {
				t.Errorf("%d endpoints hold slots, want %d", len(count), tc.k)
			}
		})
	}
}

// TestLayoutDNAT checks the layouts on real nftables: a pod's connections to a
// ClusterIP reach its two endpoints (addresses on the node's lo) in about equal
// numbers, and a Service port without endpoints is refused.
func TestLayoutDNAT(t *testing.T) {
	testbed.Needs(t, testbed.NFTables)
	for _, l := range []layout{slotLayout{n: 64}, exactLayout{}} {
		t.Run(l.name(), func(t *testing.T) {
			tp := testbed.New(t)
			// The endpoints are outside the topology's subnets.
			eps := []netip.AddrPort{netip.MustParseAddrPort("10.250.0.1:8080"), netip.MustParseAddrPort("10.250.0.2:8080")}
			accepted := map[netip.AddrPort]int{}
			counts := make(chan netip.AddrPort, 64)
			for _, ep := range eps {
				if out, err := tp.Exec(testbed.Node, "ip", "addr", "add", ep.Addr().String()+"/32", "dev", "lo"); err != nil {
					t.Fatalf("%v: %s", err, out)
				}
				ln := tp.Listen(testbed.Node, "tcp", ep.String())
				go acceptAndClose(ln, ep, counts)
			}
			svc := benchPort{ip: netip.MustParseAddr("10.96.0.10"), proto: "tcp", port: 80, endpoints: eps}
			empty := netip.MustParseAddrPort("10.96.0.11:80")
			dir := t.TempDir()
			load(t, tp, script(t, dir, "table", func(w io.Writer) {
				l.table(w)
				l.add(w, svc)
				fmt.Fprintf(w, "add element ip %s no-endpoints { %s . tcp . %d }\n", benchTable, empty.Addr(), empty.Port())
			}))

			const conns = 1000
			for i := range conns {
				c, err := tp.Dial(testbed.Pod, "tcp", "10.96.0.10:80")
				if err != nil {
					t.Fatalf("connection %d: %v", i, err)
				}
				// Wait for the accept so that the count is complete.
				accepted[<-counts]++
				c.Close()
			}
			// 2 endpoints in 64 or 2 slots: an even split; a fair coin over
			// 1000 draws stays within 500±80 (5 standard deviations).
			for _, ep := range eps {
				if got := accepted[ep]; got < conns/2-80 || got > conns/2+80 {
					t.Errorf("%s accepted %d of %d connections, want %d±80", ep, got, conns, conns/2)
				}
			}
			t.Logf("split: %v", accepted)

			_, err := tp.Dial(testbed.Pod, "tcp", empty.String())
			if err == nil || !strings.Contains(err.Error(), "refused") {
				t.Errorf("dial a Service port without endpoints: got %v, want connection refused", err)
			}
		})
	}
}

func acceptAndClose(ln net.Listener, ep netip.AddrPort, counts chan<- netip.AddrPort) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		c.Close()
		counts <- ep
	}
}
