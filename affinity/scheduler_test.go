package affinity

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// fakeClock is a settable clock; tests advance it instead of sleeping.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// withClock makes b read time from now.
func withClock(b *Balancer, now func() time.Time) { b.now = now }

// mkBalancer builds a Balancer on a fake clock with endpoints eps (dst 10.96.0.1).
func mkBalancer(t testing.TB, sched string, eps []netip.AddrPort, clientIP bool, timeout time.Duration) (*Balancer, *fakeClock) {
	t.Helper()
	b, err := NewBalancer(sched)
	if err != nil {
		t.Fatalf("NewBalancer(%q): %v", sched, err)
	}
	clock := &fakeClock{t: time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)}
	withClock(b, clock.now)
	b.Update(eps, netip.MustParseAddr("10.96.0.1"), clientIP, timeout)
	return b, clock
}

// endpoints returns n distinct endpoints 10.1.x.y:8080.
func endpoints(n int) []netip.AddrPort {
	eps := make([]netip.AddrPort, n)
	for i := range eps {
		eps[i] = netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)}), 8080)
	}
	return eps
}

// clientAddr returns the i-th of many distinct client IPs.
func clientAddr(i int) netip.Addr {
	return netip.AddrFrom4([4]byte{172, 16 + byte(i>>16), byte(i >> 8), byte(i)})
}

func mustPick(t testing.TB, b *Balancer, client netip.Addr, tried []netip.AddrPort) netip.AddrPort {
	t.Helper()
	ep, err := b.Pick(client, tried)
	if err != nil {
		t.Fatalf("Pick(%v, %v): %v", client, tried, err)
	}
	return ep
}

func TestValidScheduler(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		wantErr bool
	}{
		{"", false}, {"rr", false}, {"lc", false}, {"sh", false}, {"dh", false},
		{"sed", false}, {"nq", false},
		{"wrr", true}, {"RR", true}, {"mh", true}, {" rr", true},
	} {
		t.Run(fmt.Sprintf("%q", tc.name), func(t *testing.T) {
			err := ValidScheduler(tc.name)
			if (err != nil) != tc.wantErr {
				t.Fatalf("got error %v, want error: %v", err, tc.wantErr)
			}
			_, nerr := NewBalancer(tc.name)
			if (nerr != nil) != tc.wantErr {
				t.Fatalf("NewBalancer: got error %v, want error: %v", nerr, tc.wantErr)
			}
			if err == nil {
				return
			}
			for _, s := range Schedulers {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("error %q does not list valid scheduler %q", err, s)
				}
			}
		})
	}
	b, err := NewBalancer("")
	if err != nil {
		t.Fatal(err)
	}
	if got := b.Scheduler(); got != "rr" {
		t.Errorf("default scheduler: got %q, want rr", got)
	}
}

// step is one call in a scripted scheduler test: Release(release) if set, else a
// Pick from client (default clientA) with tried, expecting want.
type step struct {
	release string
	client  string
	tried   []string
	want    string
}

const (
	epA = "10.0.0.1:80"
	epB = "10.0.0.2:80"
	epC = "10.0.0.3:80"
	epD = "10.0.0.4:80"
)

func TestSchedulerSequence(t *testing.T) {
	t.Parallel()
	abc := []netip.AddrPort{netip.MustParseAddrPort(epA), netip.MustParseAddrPort(epB), netip.MustParseAddrPort(epC)}
	for _, tc := range []struct {
		name  string
		sched string
		// weights, if set, override the endpoints' weights (always 1 from Update) to
		// check that sed and nq divide by them.
		weights []int
		steps   []step
	}{
		{"rr rotates regardless of load", "rr", nil, []step{
			{want: epA}, {want: epB}, {want: epC}, {want: epA},
			{release: epB}, {release: epC}, {want: epB}, {want: epC}, {want: epA},
		}},
		{"rr skips tried without losing its place", "rr", nil, []step{
			{want: epA}, {tried: []string{epB}, want: epC}, {want: epA}, {want: epB},
		}},
		{"lc least active, ties after last pick", "lc", nil, []step{
			{want: epA}, {want: epB}, {want: epC}, // 1,1,1
			{release: epB}, {want: epB}, // b idle -> b; 1,1,1
			{want: epC}, // tie, first after b
			{want: epA}, // a=1 b=1 c=2: tie a,b; first after c is a
			{want: epB}, // a=2 b=1 c=2
			{release: epC}, {release: epC}, {want: epC},
		}},
		{"sed with equal weights follows lc", "sed", nil, []step{
			{want: epA}, {want: epB}, {want: epC},
			{release: epB}, {want: epB}, {want: epC}, {want: epA}, {want: epB},
			{release: epC}, {release: epC}, {want: epC},
		}},
		{"nq idle first in rotation order, then sed", "nq", nil, []step{
			{want: epA}, {want: epB}, {release: epA}, {want: epC}, // a and c idle: c is first after b
			{want: epA}, // a idle
			{want: epB}, // none idle: tie, first after a
			{release: epC}, {want: epC},
		}},
		{"sed divides by weight", "sed", []int{2, 1, 1}, []step{
			// (active+1)/weight: a 1/2 beats b and c at 1/1.
			{want: epA},                                 // a=1: 2/2=1
			{want: epB},                                 // tie 1,1,1 -> first after a
			{want: epC},                                 // a 1, b 2, c 1 -> c (after b)
			{want: epA},                                 // a 1, b 2, c 2 -> a; a=2: 3/2
			{tried: []string{epA}, want: epB},           // b 2 vs c 2: tie after a
			{release: epB}, {release: epB}, {want: epB}, // b idle: 1/1 < 3/2
		}},
		{"nq prefers an idle endpoint over a heavier-weighted busy one", "nq", []int{4, 1, 1}, []step{
			{want: epA}, {want: epB}, {want: epC},
			{release: epB},
			// sed alone would take a ((1+1)/4 < 1/1); nq takes idle b.
			{want: epB},
		}},
		{"sed picks the heavier-weighted busy endpoint", "sed", []int{4, 1, 1}, []step{
			{want: epA}, // 1/4
			{want: epA}, // a=1: 2/4 < 1
			{want: epA}, // a=2: 3/4 < 1
			{want: epB}, // a=3: 4/4 = 1 ties b and c; first after a
		}},
		{"lc ignores weights", "lc", []int{4, 1, 1}, []step{
			{want: epA}, {want: epB}, {want: epC}, {want: epA},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, _ := mkBalancer(t, tc.sched, abc, false, 0)
			for i, w := range tc.weights {
				b.eps[i].weight = w
			}
			runSteps(t, b, tc.steps)
		})
	}
}

func runSteps(t *testing.T, b *Balancer, steps []step) {
	t.Helper()
	for i, s := range steps {
		if s.release != "" {
			b.Release(netip.MustParseAddrPort(s.release))
			continue
		}
		client := "192.0.2.1"
		if s.client != "" {
			client = s.client
		}
		var tried []netip.AddrPort
		for _, tr := range s.tried {
			tried = append(tried, netip.MustParseAddrPort(tr))
		}
		got := mustPick(t, b, netip.MustParseAddr(client), tried)
		if got.String() != s.want {
			t.Fatalf("step %d: Pick(%s, %v): got %v, want %v (state %+v)", i, client, s.tried, got, s.want, b.State().Endpoints)
		}
	}
}

func TestSourceHashing(t *testing.T) {
	t.Parallel()
	eps := endpoints(4)
	b, _ := mkBalancer(t, "sh", eps, false, 0)
	const clients = 2000
	first := make([]netip.AddrPort, clients)
	perEndpoint := map[netip.AddrPort]int{}
	for i := range clients {
		first[i] = mustPick(t, b, clientAddr(i), nil)
		perEndpoint[first[i]]++
	}
	t.Run("sticky per client whatever the load", func(t *testing.T) {
		// The endpoints now carry unequal active counts; sh must not care.
		for i := range clients {
			if got := mustPick(t, b, clientAddr(i), nil); got != first[i] {
				t.Fatalf("client %v: got %v, want %v as before", clientAddr(i), got, first[i])
			}
		}
	})
	t.Run("spread over many clients", func(t *testing.T) {
		for _, ep := range eps {
			if n := perEndpoint[ep]; n < clients/len(eps)/2 {
				t.Errorf("endpoint %v: got %d of %d clients, want at least %d", ep, n, clients, clients/len(eps)/2)
			}
		}
	})
	t.Run("independent of endpoint order", func(t *testing.T) {
		rev := slices.Clone(eps)
		slices.Reverse(rev)
		r, _ := mkBalancer(t, "sh", rev, false, 0)
		for i := range clients {
			if got := mustPick(t, r, clientAddr(i), nil); got != first[i] {
				t.Fatalf("client %v with endpoints reversed: got %v, want %v", clientAddr(i), got, first[i])
			}
		}
	})
	t.Run("IPv6 clients spread", func(t *testing.T) {
		seen := map[netip.AddrPort]bool{}
		for i := range 256 {
			c := netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 15: byte(i)})
			ep := mustPick(t, b, c, nil)
			if again := mustPick(t, b, c, nil); again != ep {
				t.Fatalf("client %v: got %v then %v, want the same", c, ep, again)
			}
			seen[ep] = true
		}
		if len(seen) != len(eps) {
			t.Errorf("got %d endpoints used by 256 IPv6 clients, want %d", len(seen), len(eps))
		}
	})
	t.Run("IPv4-mapped client hashes as IPv4", func(t *testing.T) {
		c := clientAddr(7)
		mapped := netip.AddrFrom16(c.As16())
		if got := mustPick(t, b, mapped, nil); got != first[7] {
			t.Errorf("client %v: got %v, want %v as for %v", mapped, got, first[7], c)
		}
	})
}

func TestDestinationHashing(t *testing.T) {
	t.Parallel()
	eps := endpoints(4)
	b, err := NewBalancer("dh")
	if err != nil {
		t.Fatal(err)
	}
	perEndpoint := map[netip.AddrPort]int{}
	const dsts = 1000
	for d := range dsts {
		dst := netip.AddrFrom4([4]byte{10, 96, byte(d >> 8), byte(d)})
		b.Update(eps, dst, false, 0)
		want := mustPick(t, b, clientAddr(0), nil)
		perEndpoint[want]++
		for i := 1; i < 20; i++ {
			if got := mustPick(t, b, clientAddr(i), nil); got != want {
				t.Fatalf("dst %v client %v: got %v, want %v as for every client", dst, clientAddr(i), got, want)
			}
		}
	}
	for _, ep := range eps {
		if n := perEndpoint[ep]; n < dsts/len(eps)/2 {
			t.Errorf("endpoint %v: chosen for %d of %d destinations, want at least %d", ep, n, dsts, dsts/len(eps)/2)
		}
	}
	t.Run("zero dst is a fixed choice", func(t *testing.T) {
		b.Update(eps, netip.Addr{}, false, 0)
		want := mustPick(t, b, clientAddr(0), nil)
		for i := range 10 {
			if got := mustPick(t, b, clientAddr(i), nil); got != want {
				t.Fatalf("client %v: got %v, want %v", clientAddr(i), got, want)
			}
		}
	})
}

// Every scheduler, asked repeatedly with everything it returned so far as tried, must
// return every endpoint exactly once before it may repeat one. At 300 endpoints this
// also checks that sh and dh reach endpoints beyond a 256-bucket table.
func TestTriedAvoidance(t *testing.T) {
	t.Parallel()
	for _, sched := range Schedulers {
		for _, n := range []int{1, 2, 5, 300} {
			t.Run(fmt.Sprintf("%s/%d", sched, n), func(t *testing.T) {
				b, _ := mkBalancer(t, sched, endpoints(n), false, 0)
				// Load some endpoints so lc, sed and nq are not all ties.
				for i := range n / 2 {
					mustPick(t, b, clientAddr(i), nil)
				}
				client := clientAddr(99)
				var tried []netip.AddrPort
				for range n {
					ep := mustPick(t, b, client, tried)
					if slices.Contains(tried, ep) {
						t.Fatalf("after %d tries: got %v again, want an untried endpoint", len(tried), ep)
					}
					tried = append(tried, ep)
				}
				// Every endpoint tried: the scheduler chooses among all again, as it
				// would with nothing tried.
				want, _, err := b.Peek(client)
				if err != nil {
					t.Fatal(err)
				}
				if got := mustPick(t, b, client, tried); got != want {
					t.Errorf("all %d tried: got %v, want %v (the choice with nothing tried)", n, got, want)
				}
				// Stale tried entries (endpoints no longer in the set) change nothing.
				stale := append(slices.Clone(tried[:n-1]), netip.MustParseAddrPort("192.0.2.9:1"))
				if got := mustPick(t, b, client, stale); got != tried[n-1] {
					t.Errorf("all but %v tried (plus a stale endpoint): got %v, want %v", tried[n-1], got, tried[n-1])
				}
			})
		}
	}
}

// Peek must predict Pick exactly and change nothing.
func TestPeekPredictsPick(t *testing.T) {
	t.Parallel()
	for _, sched := range Schedulers {
		t.Run(sched, func(t *testing.T) {
			b, clock := mkBalancer(t, sched, endpoints(5), true, 10*time.Second)
			for i := range 50 {
				c := clientAddr(i % 7)
				before := b.State()
				want, _, err := b.Peek(c)
				if err != nil {
					t.Fatal(err)
				}
				if after := b.State(); !statesEqual(before, after) {
					t.Fatalf("Peek changed state: got %+v, want %+v", after, before)
				}
				if got := mustPick(t, b, c, nil); got != want {
					t.Fatalf("pick %d for %v: got %v, want %v as Peek said", i, c, got, want)
				}
				if i%3 == 0 {
					b.Release(want)
				}
				clock.advance(3 * time.Second)
			}
		})
	}
}

func statesEqual(a, b State) bool {
	return a.Scheduler == b.Scheduler && a.Next == b.Next && a.Counters == b.Counters &&
		slices.Equal(a.Endpoints, b.Endpoints) && slices.Equal(a.Affinity, b.Affinity)
}

func TestNoEndpoints(t *testing.T) {
	t.Parallel()
	for _, sched := range Schedulers {
		t.Run(sched, func(t *testing.T) {
			b, err := NewBalancer(sched)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := b.Pick(clientAddr(1), nil); !errors.Is(err, ErrNoEndpoints) {
				t.Errorf("new Balancer: got error %v, want %v", err, ErrNoEndpoints)
			}
			b.Update(endpoints(3), netip.MustParseAddr("10.96.0.1"), true, time.Minute)
			mustPick(t, b, clientAddr(1), nil)
			b.Update(nil, netip.MustParseAddr("10.96.0.1"), true, time.Minute)
			if ep, err := b.Pick(clientAddr(1), nil); !errors.Is(err, ErrNoEndpoints) {
				t.Errorf("after emptying: got %v, %v, want error %v", ep, err, ErrNoEndpoints)
			}
			if _, _, err := b.Peek(clientAddr(1)); !errors.Is(err, ErrNoEndpoints) {
				t.Errorf("Peek after emptying: got error %v, want %v", err, ErrNoEndpoints)
			}
			if s := b.State(); len(s.Endpoints) != 0 || len(s.Affinity) != 0 {
				t.Errorf("state after emptying: got %+v, want no endpoints and no entries", s)
			}
		})
	}
}
