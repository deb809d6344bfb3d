package affinity

import (
	"encoding/json"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

var (
	clientA = netip.MustParseAddr("192.0.2.1")
	clientB = netip.MustParseAddr("192.0.2.2")
	clientC = netip.MustParseAddr("192.0.2.3")
)

func addrs(s ...string) []netip.AddrPort {
	out := make([]netip.AddrPort, len(s))
	for i, a := range s {
		out[i] = netip.MustParseAddrPort(a)
	}
	return out
}

// affinityStep is one action in a scripted affinity test. Exactly one of pick,
// reset, release, update is meaningful per step; advance moves the clock first.
type affinityStep struct {
	advance time.Duration
	// pick: Pick(pick, tried) must return want; wantHit says whether it must count
	// as an affinity hit.
	pick    netip.Addr
	tried   []string
	want    string
	wantHit bool
	reset   netip.Addr
	release string
	// update: Update(update, ..., true, timeout).
	update  []string
	timeout time.Duration
}

func TestAffinity(t *testing.T) {
	t.Parallel()
	const timeout = 10 * time.Second
	abc := []string{epA, epB, epC}
	for _, tc := range []struct {
		name  string
		steps []affinityStep
		// wantEntries, if set, is the affinity table after the steps, as
		// "client=endpoint".
		wantEntries []string
		want        Counters
	}{
		{
			name: "client sticks while rr would rotate",
			steps: []affinityStep{
				{pick: clientA, want: epA},
				{pick: clientA, want: epA, wantHit: true},
				{pick: clientB, want: epB},
				{pick: clientA, want: epA, wantHit: true},
				{pick: clientC, want: epC},
				{pick: clientB, want: epB, wantHit: true},
			},
			wantEntries: []string{"192.0.2.1=" + epA, "192.0.2.2=" + epB, "192.0.2.3=" + epC},
			want:        Counters{AffinityHits: 3, AffinityMisses: 3},
		},
		{
			name: "expiry slides with each pick",
			steps: []affinityStep{
				{pick: clientA, want: epA},
				{advance: 9 * time.Second, pick: clientA, want: epA, wantHit: true},
				{advance: 9 * time.Second, pick: clientA, want: epA, wantHit: true},
				// Exactly the timeout since the last pick: expired.
				{advance: timeout, pick: clientA, want: epB},
				{advance: timeout - time.Nanosecond, pick: clientA, want: epB, wantHit: true},
			},
			want: Counters{AffinityHits: 3, AffinityMisses: 2, AffinityExpired: 1},
		},
		{
			name: "shorter timeout applies to existing entries",
			steps: []affinityStep{
				{pick: clientA, want: epA},
				{advance: 5 * time.Second, update: abc, timeout: 3 * time.Second},
				{pick: clientA, want: epB},
			},
			wantEntries: []string{"192.0.2.1=" + epB},
			want:        Counters{AffinityMisses: 2, AffinityExpired: 1},
		},
		{
			name: "longer timeout applies to existing entries",
			steps: []affinityStep{
				{pick: clientA, want: epA},
				{advance: 2 * time.Second, update: abc, timeout: 30 * time.Second},
				{advance: 20 * time.Second, pick: clientA, want: epA, wantHit: true},
			},
			want: Counters{AffinityHits: 1, AffinityMisses: 1},
		},
		{
			name: "reset forgets the client only",
			steps: []affinityStep{
				{pick: clientA, want: epA},
				{pick: clientB, want: epB},
				{reset: clientA},
				{reset: clientC}, // no entry: not counted
				{pick: clientA, want: epC},
				{pick: clientB, want: epB, wantHit: true},
			},
			want: Counters{AffinityHits: 1, AffinityMisses: 3, AffinityResets: 1},
		},
		{
			name: "tried endpoint is not sticky, entry moves",
			steps: []affinityStep{
				{pick: clientA, want: epA},
				{pick: clientA, tried: []string{epA}, want: epB},
				{pick: clientA, want: epB, wantHit: true},
				// All tried: the entry's endpoint is allowed again.
				{pick: clientA, tried: abc, want: epB, wantHit: true},
			},
			wantEntries: []string{"192.0.2.1=" + epB},
			want:        Counters{AffinityHits: 2, AffinityMisses: 2},
		},
		{
			name: "removed endpoint drops its entries, others keep theirs",
			steps: []affinityStep{
				{pick: clientA, want: epA},
				{pick: clientB, want: epB},
				{pick: clientC, want: epC},
				{update: []string{epC, epA, epD}, timeout: timeout},
				{pick: clientA, want: epA, wantHit: true},
				{pick: clientC, want: epC, wantHit: true},
				// rr resumes at index 0 of the new set (next was 3 == len).
				{pick: clientB, want: epC},
			},
			wantEntries: []string{"192.0.2.1=" + epA, "192.0.2.2=" + epC, "192.0.2.3=" + epC},
			want:        Counters{AffinityHits: 2, AffinityMisses: 4},
		},
		{
			name: "mapped IPv4 client is the same client",
			steps: []affinityStep{
				{pick: clientA, want: epA},
				{pick: netip.AddrFrom16(clientA.As16()), want: epA, wantHit: true},
				{reset: netip.AddrFrom16(clientA.As16())},
			},
			want: Counters{AffinityHits: 1, AffinityMisses: 1, AffinityResets: 1},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, clock := mkBalancer(t, "rr", addrs(abc...), true, timeout)
			for i, s := range tc.steps {
				clock.advance(s.advance)
				switch {
				case s.update != nil:
					b.Update(addrs(s.update...), netip.Addr{}, true, s.timeout)
				case s.reset.IsValid():
					b.ResetAffinity(s.reset)
				case s.release != "":
					b.Release(netip.MustParseAddrPort(s.release))
				default:
					hits := b.State().Counters.AffinityHits
					got := mustPick(t, b, s.pick, addrs(s.tried...))
					if got.String() != s.want {
						t.Fatalf("step %d: Pick(%v, %v): got %v, want %v", i, s.pick, s.tried, got, s.want)
					}
					if hit := b.State().Counters.AffinityHits > hits; hit != s.wantHit {
						t.Fatalf("step %d: Pick(%v, %v): got hit %v, want %v", i, s.pick, s.tried, hit, s.wantHit)
					}
				}
			}
			st := b.State()
			if st.Counters != tc.want {
				t.Errorf("counters: got %+v, want %+v", st.Counters, tc.want)
			}
			if tc.wantEntries != nil {
				var got []string
				for _, e := range st.Affinity {
					got = append(got, e.Client.String()+"="+e.Endpoint.String())
				}
				if !slices.Equal(got, tc.wantEntries) {
					t.Errorf("entries: got %v, want %v", got, tc.wantEntries)
				}
			}
		})
	}
}

func TestUpdateKeepsActiveCounts(t *testing.T) {
	t.Parallel()
	b, _ := mkBalancer(t, "lc", addrs(epA, epB, epC), true, time.Minute)
	for _, c := range []netip.Addr{clientA, clientB, clientC, clientAddr(4), clientAddr(5)} {
		mustPick(t, b, c, nil) // a=2 b=2 c=1
	}
	b.Update(addrs(epD, epC, epA), netip.Addr{}, true, time.Minute)
	want := []EndpointState{
		{Addr: netip.MustParseAddrPort(epD), Active: 0},
		{Addr: netip.MustParseAddrPort(epC), Active: 1},
		{Addr: netip.MustParseAddrPort(epA), Active: 2},
	}
	if got := b.State().Endpoints; !slices.Equal(got, want) {
		t.Fatalf("endpoints after update: got %+v, want %+v", got, want)
	}
	// Releasing a removed endpoint is harmless; releasing below zero is clamped.
	b.Release(netip.MustParseAddrPort(epB))
	b.Release(netip.MustParseAddrPort(epD))
	b.Release(netip.MustParseAddrPort(epC))
	want[1].Active = 0
	if got := b.State().Endpoints; !slices.Equal(got, want) {
		t.Fatalf("endpoints after releases: got %+v, want %+v", got, want)
	}
	// lc now sees the kept counts: d and c idle, a busy.
	for i, wantEp := range []string{epD, epC, epD} {
		if got := mustPick(t, b, clientAddr(100+i), nil); got.String() != wantEp {
			t.Fatalf("got %v, want %v", got, wantEp)
		}
	}
}

func TestAffinityToggle(t *testing.T) {
	t.Parallel()
	b, _ := mkBalancer(t, "rr", addrs(epA, epB), true, time.Minute)
	mustPick(t, b, clientA, nil)
	if got := len(b.State().Affinity); got != 1 {
		t.Fatalf("entries: got %d, want 1", got)
	}
	b.Update(addrs(epA, epB), netip.Addr{}, false, time.Minute)
	st := b.State()
	if st.ClientIPAffinity || len(st.Affinity) != 0 {
		t.Fatalf("affinity off: got affinity %v with %d entries, want off and none", st.ClientIPAffinity, len(st.Affinity))
	}
	if got := mustPick(t, b, clientA, nil); got.String() != epB {
		t.Fatalf("affinity off: got %v, want %v (rotation)", got, epB)
	}
	if got := b.State().Counters; got != (Counters{AffinityMisses: 1}) {
		t.Fatalf("affinity off: counters got %+v, want only the earlier miss", got)
	}
	b.Update(addrs(epA, epB), netip.Addr{}, true, time.Minute)
	if got := mustPick(t, b, clientA, nil); got.String() != epA {
		t.Fatalf("affinity back on: got %v, want %v (no old entry)", got, epA)
	}
	if got := b.State().Counters.AffinityMisses; got != 2 {
		t.Fatalf("misses: got %d, want 2", got)
	}
}

func TestDefaultTimeout(t *testing.T) {
	t.Parallel()
	b, clock := mkBalancer(t, "rr", addrs(epA, epB), true, 0)
	if got := b.State().AffinityTimeoutSeconds; got != 10800 {
		t.Fatalf("timeout: got %vs, want 10800s", got)
	}
	mustPick(t, b, clientA, nil)
	clock.advance(3 * time.Hour)
	if got := mustPick(t, b, clientA, nil); got.String() != epB {
		t.Fatalf("after 3h: got %v, want %v (expired)", got, epB)
	}
}

func TestAffinityState(t *testing.T) {
	t.Parallel()
	b, clock := mkBalancer(t, "rr", addrs(epA, epB), true, 10*time.Second)
	mustPick(t, b, clientB, nil)
	t1 := clock.now()
	clock.advance(4 * time.Second)
	mustPick(t, b, clientA, nil)
	clock.advance(4 * time.Second)
	mustPick(t, b, clientA, nil) // hit, slides
	t3 := clock.now()
	want := []Entry{
		{Client: clientA, Endpoint: netip.MustParseAddrPort(epB), LastUsed: t3},
		{Client: clientB, Endpoint: netip.MustParseAddrPort(epA), LastUsed: t1},
	}
	st := b.State()
	if !slices.Equal(st.Affinity, want) {
		t.Fatalf("entries: got %+v, want %+v", st.Affinity, want)
	}
	clock.advance(3 * time.Second) // clientB's entry is 11s old
	if got := b.State().Affinity; !slices.Equal(got, want[:1]) {
		t.Fatalf("entries after clientB expired: got %+v, want %+v", got, want[:1])
	}
	js, err := json.Marshal(b.State())
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{`"scheduler":"rr"`, `"client":"192.0.2.1"`, `"endpoint":"10.0.0.2:80"`, `"active":2`, `"affinityHits":1`} {
		if !strings.Contains(string(js), s) {
			t.Errorf("JSON %s: missing %s", js, s)
		}
	}
}

func TestSweep(t *testing.T) {
	t.Parallel()
	t.Run("explicit", func(t *testing.T) {
		b, clock := mkBalancer(t, "rr", addrs(epA, epB), true, 10*time.Second)
		for i := range 5 {
			mustPick(t, b, clientAddr(i), nil)
		}
		clock.advance(6 * time.Second)
		for i := 5; i < 8; i++ {
			mustPick(t, b, clientAddr(i), nil)
		}
		clock.advance(5 * time.Second)
		if got := b.Sweep(clock.now()); got != 5 {
			t.Fatalf("Sweep: got %d removed, want 5", got)
		}
		if got := len(b.clients); got != 3 {
			t.Fatalf("table: got %d entries, want 3", got)
		}
		if got := b.State().Counters.AffinityExpired; got != 5 {
			t.Fatalf("expired: got %d, want 5", got)
		}
	})
	t.Run("lazy on Pick keeps the table bounded", func(t *testing.T) {
		b, clock := mkBalancer(t, "rr", addrs(epA, epB), true, time.Second)
		// 20000 clients, one every 10ms: about 100 are live at any time.
		const clients = 20000
		peak := 0
		for i := range clients {
			mustPick(t, b, clientAddr(i), nil)
			clock.advance(10 * time.Millisecond)
			peak = max(peak, len(b.clients))
		}
		if peak > minSweep {
			t.Errorf("table peak: got %d entries, want at most %d", peak, minSweep)
		}
		if got := b.State().Counters.AffinityExpired; got < clients-minSweep {
			t.Errorf("expired: got %d, want at least %d", got, clients-minSweep)
		}
	})
	t.Run("lazy sweep scales with live clients", func(t *testing.T) {
		b, clock := mkBalancer(t, "rr", addrs(epA, epB), true, time.Minute)
		// 5000 live clients, then 5000 more after the first ones expired.
		for i := range 5000 {
			mustPick(t, b, clientAddr(i), nil)
		}
		clock.advance(2 * time.Minute)
		for i := 5000; i < 10000; i++ {
			mustPick(t, b, clientAddr(i), nil)
		}
		if got := len(b.clients); got > 2*5000 {
			t.Errorf("table: got %d entries, want at most %d", got, 2*5000)
		}
		if got := b.State().AffinityEntries; got != 5000 {
			t.Errorf("live entries: got %d, want 5000", got)
		}
	})
	t.Run("live entries are bounded, least recently used evicted", func(t *testing.T) {
		b, clock := mkBalancer(t, "rr", addrs(epA, epB), true, 3*time.Hour)
		// One new client a millisecond, all live: a table that only
		// expired entries would grow by every one.
		for i := range MaxAffinityEntries {
			mustPick(t, b, clientAddr(i), nil)
			clock.advance(time.Millisecond)
		}
		first := mustPick(t, b, clientAddr(0), nil) // the oldest, used again
		const more = 100
		for i := MaxAffinityEntries; i < MaxAffinityEntries+more; i++ {
			mustPick(t, b, clientAddr(i), nil)
			clock.advance(time.Millisecond)
		}
		st := b.State()
		if n := len(b.entries); n > MaxAffinityEntries || st.AffinityEntries != n {
			t.Errorf("table: got %d entries (State says %d), want at most %d", n, st.AffinityEntries, MaxAffinityEntries)
		}
		if got, want := st.Counters.AffinityEvicted, uint64(MaxAffinityEntries+more-len(b.entries)); got != want || got == 0 {
			t.Errorf("evicted: got %d, want %d", got, want)
		}
		if _, ok := b.clients[keyOfClient(clientAddr(1))]; ok {
			t.Errorf("client 1, the least recently used: still has an entry")
		}
		for _, i := range []int{0, MaxAffinityEntries + more - 1} {
			if _, ok := b.clients[keyOfClient(clientAddr(i))]; !ok {
				t.Errorf("client %d, recently used: no entry", i)
			}
		}
		if ep, sticky, err := b.Peek(clientAddr(0)); err != nil || !sticky || ep != first {
			t.Errorf("client 0: got %v sticky %v, %v, want %v sticky", ep, sticky, err, first)
		}
		// State lists a sample, the most recently used.
		if len(st.Affinity) != AffinitySample || !slices.ContainsFunc(st.Affinity, func(e Entry) bool { return e.Client == clientAddr(MaxAffinityEntries+more-1) }) {
			t.Errorf("State: got %d entries listed, want %d, the newest among them", len(st.Affinity), AffinitySample)
		}
	})
}

// Concurrent Pick, Release, Update, ResetAffinity and State; run with -race. Every
// pick must come from one of the sets ever installed, and once all activity is
// released every count must be back to zero.
func TestConcurrent(t *testing.T) {
	t.Parallel()
	for _, sched := range Schedulers {
		t.Run(sched, func(t *testing.T) {
			b, err := NewBalancer(sched)
			if err != nil {
				t.Fatal(err)
			}
			all := endpoints(8)
			setA, setB := all[:6], all[2:]
			dst := netip.MustParseAddr("10.96.0.1")
			b.Update(setA, dst, true, time.Second)

			var wg sync.WaitGroup
			stop := make(chan struct{})
			wg.Go(func() {
				for i := 0; ; i++ {
					select {
					case <-stop:
						return
					default:
					}
					set := setA
					if i%2 == 1 {
						set = setB
					}
					b.Update(set, dst, i%5 != 0, time.Duration(1+i%3)*time.Second)
					_ = b.State()
					b.ResetAffinity(clientAddr(i % 16))
				}
			})
			var pickers sync.WaitGroup
			errs := make(chan string, 8)
			for g := range 4 {
				pickers.Go(func() {
					rng := rand.New(rand.NewPCG(uint64(g), 1))
					var held []netip.AddrPort
					for range 3000 {
						client := clientAddr(rng.IntN(32))
						var tried []netip.AddrPort
						if rng.IntN(4) == 0 {
							tried = all[rng.IntN(len(all)):]
						}
						ep, err := b.Pick(client, tried)
						if err != nil {
							errs <- "Pick: " + err.Error()
							return
						}
						if !slices.Contains(all, ep) {
							errs <- "Pick returned unknown endpoint " + ep.String()
							return
						}
						held = append(held, ep)
						if len(held) > 5 {
							k := rng.IntN(len(held))
							b.Release(held[k])
							held = slices.Delete(held, k, k+1)
						}
					}
					for _, ep := range held {
						b.Release(ep)
					}
				})
			}
			pickers.Wait()
			close(stop)
			wg.Wait()
			close(errs)
			for e := range errs {
				t.Error(e)
			}
			for _, e := range b.State().Endpoints {
				if e.Active != 0 {
					t.Errorf("endpoint %v: got %d active after all releases, want 0", e.Addr, e.Active)
				}
			}
		})
	}
}

// SetScheduler switches the scheduler under a running Balancer: endpoints,
// their active counts and the affinity table stay.
func TestSetScheduler(t *testing.T) {
	t.Parallel()
	b, err := NewBalancer("rr")
	if err != nil {
		t.Fatal(err)
	}
	eps := addrs("10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80")
	b.Update(eps, netip.Addr{}, false, 0)
	client := netip.MustParseAddr("192.0.2.1")
	// rr hands out 1 and 2; both stay active.
	for _, want := range eps[:2] {
		if got, _ := b.Pick(client, nil); got != want {
			t.Fatalf("rr Pick: got %v, want %v", got, want)
		}
	}
	if err := b.SetScheduler("lc"); err != nil {
		t.Fatalf("SetScheduler(lc): %v", err)
	}
	if got := b.Scheduler(); got != "lc" {
		t.Errorf("Scheduler: got %q, want lc", got)
	}
	// lc: the one endpoint with no connection.
	if got, _ := b.Pick(client, nil); got != eps[2] {
		t.Errorf("lc Pick after the switch: got %v, want %v (the only idle one: active counts kept)", got, eps[2])
	}
	if err := b.SetScheduler("sh"); err != nil {
		t.Fatalf("SetScheduler(sh): %v", err)
	}
	first, _ := b.Pick(client, nil)
	for range 5 {
		if got, _ := b.Pick(client, nil); got != first {
			t.Fatalf("sh Pick: got %v then %v for one client, want the same (hash table built)", first, got)
		}
	}
	if err := b.SetScheduler("wrr"); err == nil {
		t.Errorf("SetScheduler(wrr): got nil, want an error (not a userspace scheduler)")
	}
	if got := b.Scheduler(); got != "sh" {
		t.Errorf("Scheduler after a refused switch: got %q, want sh", got)
	}
}

// TestAcquire: a connection resumed already connected (Acquire) counts as
// active as a Pick's does, so least-connections passes its endpoint over,
// and Release ends it; an endpoint outside the set is not counted.
func TestAcquire(t *testing.T) {
	t.Parallel()
	b, err := NewBalancer("lc")
	if err != nil {
		t.Fatal(err)
	}
	eps := addrs("10.0.0.1:80", "10.0.0.2:80")
	b.Update(eps, netip.Addr{}, false, 0)
	b.Acquire(eps[0])
	b.Acquire(netip.MustParseAddrPort("10.0.0.9:80"))
	active := func() []int {
		_, states := b.Stats()
		var out []int
		for _, s := range states {
			out = append(out, s.Active)
		}
		return out
	}
	if got := active(); !slices.Equal(got, []int{1, 0}) {
		t.Fatalf("active counts after Acquire: got %v, want [1 0]", got)
	}
	if got, _ := b.Pick(netip.MustParseAddr("192.0.2.1"), nil); got != eps[1] {
		t.Errorf("lc Pick: got %v, want %v (the other holds the resumed connection)", got, eps[1])
	}
	b.Release(eps[0])
	if got := active(); !slices.Equal(got, []int{0, 1}) {
		t.Errorf("active counts after Release: got %v, want [0 1]", got)
	}
}
