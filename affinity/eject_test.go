package affinity

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// ejectionLog is an EjectionObserver that keeps what it is told, one line per
// call.
type ejectionLog struct {
	mu    sync.Mutex
	lines []string
}

func (l *ejectionLog) Ejected(ep netip.AddrPort, period time.Duration, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fmt.Sprintf("ejected %s for %s: %v", ep, period, err))
}

func (l *ejectionLog) Readmitted(ep netip.AddrPort) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fmt.Sprintf("readmitted %s", ep))
}

// take returns the lines logged since the previous take.
func (l *ejectionLog) take() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	lines := l.lines
	l.lines = nil
	return lines
}

// errDial stands for a dial's error: the Balancer passes it on to its observer.
var errDial = errors.New("dial tcp: connect: connection refused")

// ejectStep is one action of a scripted ejection test: advance the clock, then
// either fail or succeed a dial of an endpoint, or pick.
type ejectStep struct {
	advance time.Duration
	fail    string
	succeed string
	// wantEject is the ejection period the observer must hear of after a
	// DialFailed (0: not ejected, nothing heard).
	wantEject time.Duration
	// wantReadmit says whether the observer must hear of a re-admission after a
	// DialSucceeded.
	wantReadmit bool
	// pick: Pick(clientA, tried) must return want (a pick is released at once).
	pick  bool
	tried []string
	want  string
}

func TestEjection(t *testing.T) {
	t.Parallel()
	policy := Ejection{After: 3, Base: time.Second, Max: 4 * time.Second}
	fail3 := func(ep string, wantEject time.Duration) []ejectStep {
		return []ejectStep{{fail: ep}, {fail: ep}, {fail: ep, wantEject: wantEject}}
	}
	var cases = []struct {
		name  string
		eps   []string
		steps []ejectStep
		want  Counters
	}{
		{
			name: "fewer failures than After do not eject",
			eps:  []string{epA, epB},
			steps: []ejectStep{
				{fail: epA}, {fail: epA}, {succeed: epA}, {fail: epA}, {fail: epA},
				{pick: true, want: epA}, {pick: true, want: epB}, {pick: true, want: epA},
			},
		},
		{
			name: "ejected endpoint is skipped until the period ends",
			eps:  []string{epA, epB, epC},
			steps: append(fail3(epA, time.Second),
				ejectStep{pick: true, want: epB},
				ejectStep{pick: true, want: epC},
				ejectStep{pick: true, want: epB},
				ejectStep{advance: time.Second, pick: true, want: epC},
				ejectStep{pick: true, want: epA},
			),
			want: Counters{Ejections: 1},
		},
		{
			name: "failure on probation re-ejects at once with a doubled period, capped",
			eps:  []string{epA, epB},
			steps: append(fail3(epA, time.Second),
				ejectStep{advance: time.Second, fail: epA, wantEject: 2 * time.Second},
				ejectStep{advance: 2 * time.Second, fail: epA, wantEject: 4 * time.Second},
				ejectStep{advance: 4 * time.Second, fail: epA, wantEject: 4 * time.Second},
				ejectStep{pick: true, want: epB},
				ejectStep{pick: true, want: epB},
			),
			want: Counters{Ejections: 4},
		},
		{
			name: "success on probation re-admits and resets the backoff",
			eps:  []string{epA, epB},
			steps: append(append(fail3(epA, time.Second),
				ejectStep{advance: time.Second, succeed: epA, wantReadmit: true},
				// A single failure no longer ejects: the history is gone.
				ejectStep{fail: epA},
				ejectStep{succeed: epA},
			), fail3(epA, time.Second)...),
			want: Counters{Ejections: 2, Readmissions: 1},
		},
		{
			name: "last usable endpoint is never ejected",
			eps:  []string{epA, epB},
			steps: append(append(fail3(epA, time.Second), fail3(epB, 0)...),
				ejectStep{fail: epB},
				ejectStep{pick: true, want: epB},
				ejectStep{pick: true, want: epB},
			),
			want: Counters{Ejections: 1},
		},
		{
			name: "single endpoint is never ejected",
			eps:  []string{epA},
			steps: append(fail3(epA, 0),
				ejectStep{pick: true, want: epA},
			),
		},
		{
			name: "ejection gives way to tried avoidance when nothing else remains",
			eps:  []string{epA, epB, epC},
			steps: append(fail3(epA, time.Second),
				// C is ejected too and B failed for this connection: only
				// ejected endpoints are left untried, so ejection gives way.
				ejectStep{fail: epC}, ejectStep{fail: epC}, ejectStep{fail: epC, wantEject: time.Second},
				// B is the last one not ejected: it stays.
				ejectStep{fail: epB}, ejectStep{fail: epB}, ejectStep{fail: epB, wantEject: 0},
				ejectStep{pick: true, tried: []string{epB}, want: epA},
				ejectStep{pick: true, want: epB},
			),
			want: Counters{Ejections: 2},
		},
		{
			name: "ejected and tried: the untried ejected endpoint is still used",
			eps:  []string{epA, epB},
			steps: append(fail3(epA, time.Second),
				ejectStep{pick: true, tried: []string{epB}, want: epA},
			),
			want: Counters{Ejections: 1},
		},
		{
			name: "success of a dial begun before the ejection re-admits at once",
			eps:  []string{epA, epB},
			steps: append(fail3(epA, time.Second),
				ejectStep{succeed: epA, wantReadmit: true},
				ejectStep{pick: true, want: epA},
			),
			want: Counters{Ejections: 1, Readmissions: 1},
		},
	}
	// rr's fixed rotation makes every pick predictable; TestEjectionEveryScheduler
	// checks the other schedulers against the rule itself.
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b, clock := mkBalancer(t, "rr", addrs(tc.eps...), false, 0)
			b.SetEjection(policy)
			log := &ejectionLog{}
			b.SetEjectionObserver(log)
			for n, s := range tc.steps {
				clock.advance(s.advance)
				switch {
				case s.fail != "":
					b.DialFailed(netip.MustParseAddrPort(s.fail), errDial)
					var want []string
					if s.wantEject > 0 {
						want = []string{fmt.Sprintf("ejected %s for %s: %v", s.fail, s.wantEject, errDial)}
					}
					if got := log.take(); !slices.Equal(got, want) {
						t.Fatalf("step %d: DialFailed(%s): observer heard %q, want %q", n, s.fail, got, want)
					}
				case s.succeed != "":
					b.DialSucceeded(netip.MustParseAddrPort(s.succeed))
					var want []string
					if s.wantReadmit {
						want = []string{"readmitted " + s.succeed}
					}
					if got := log.take(); !slices.Equal(got, want) {
						t.Fatalf("step %d: DialSucceeded(%s): observer heard %q, want %q", n, s.succeed, got, want)
					}
				case s.pick:
					got := mustPick(t, b, clientA, addrs(s.tried...))
					b.Release(got)
					if got.String() != s.want {
						t.Fatalf("step %d: Pick(tried %v): got %v, want %s", n, s.tried, got, s.want)
					}
				}
			}
			if got := b.State().Counters; got != tc.want {
				t.Errorf("counters: got %+v, want %+v", got, tc.want)
			}
		})
	}
}

// Every scheduler must leave ejected endpoints out while an endpoint that is
// neither ejected nor tried remains, and never eject the last one. No
// EjectionObserver is set: ejection must not depend on one.
func TestEjectionEveryScheduler(t *testing.T) {
	t.Parallel()
	eps := endpoints(5)
	for _, sched := range Schedulers {
		t.Run(sched, func(t *testing.T) {
			b, clock := mkBalancer(t, sched, eps, sched == "sh", time.Minute)
			b.SetEjection(Ejection{After: 2, Base: 3 * time.Second})
			rng := rand.New(rand.NewPCG(1, 2))
			for n := range 2000 {
				ep := eps[rng.IntN(len(eps))]
				switch rng.IntN(4) {
				case 0, 1:
					b.DialFailed(ep, errDial)
				case 2:
					if rng.IntN(4) == 0 {
						b.DialSucceeded(ep)
					}
				}
				clock.advance(time.Duration(rng.IntN(500)) * time.Millisecond)
				var tried []netip.AddrPort
				if rng.IntN(3) == 0 {
					tried = []netip.AddrPort{eps[rng.IntN(len(eps))]}
				}
				got := mustPick(t, b, clientAddr(rng.IntN(50)), tried)
				b.Release(got)
				st := b.State()
				ejected := map[netip.AddrPort]bool{}
				open := 0
				for _, e := range st.Endpoints {
					if !e.EjectedUntil.IsZero() {
						ejected[e.Addr] = true
					} else if !slices.Contains(tried, e.Addr) {
						open++
					}
				}
				if len(ejected) == len(eps) {
					t.Fatalf("step %d: every endpoint is ejected: %+v", n, st.Endpoints)
				}
				if ejected[got] && open > 0 {
					t.Fatalf("step %d: Pick(tried %v) returned ejected %v while %d others were open: %+v", n, tried, got, open, st.Endpoints)
				}
			}
			if st := b.State(); st.Counters.Ejections == 0 {
				t.Errorf("the script ejected nothing: got %+v, want some ejections", st.Counters)
			}
		})
	}
}

func TestEjectionState(t *testing.T) {
	b, clock := mkBalancer(t, "rr", addrs(epA, epB), true, time.Minute)
	b.SetEjection(Ejection{After: 2})
	log := &ejectionLog{}
	b.SetEjectionObserver(log)
	mustPick(t, b, clientA, nil) // clientA -> A
	b.DialFailed(netip.MustParseAddrPort(epA), errDial)
	b.DialFailed(netip.MustParseAddrPort(epA), errDial)
	if got, want := log.take(), []string{fmt.Sprintf("ejected %s for %s: %v", epA, DefaultEjectionBase, errDial)}; !slices.Equal(got, want) {
		t.Fatalf("after two failures: observer heard %q, want %q", got, want)
	}
	st := b.State()
	wantUntil := clock.now().Add(DefaultEjectionBase)
	if got := st.Endpoints[0]; got.EjectedUntil != wantUntil || got.Failures != 2 || got.Ejections != 1 {
		t.Errorf("endpoint A state: got %+v, want ejected until %v, 2 failures, 1 ejection", got, wantUntil)
	}
	if got := st.Endpoints[1]; !got.EjectedUntil.IsZero() {
		t.Errorf("endpoint B state: got %+v, want not ejected", got)
	}

	// Explain names the sticky endpoint's ejection and the scheduler's choice.
	c, err := b.Explain(clientA)
	if err != nil {
		t.Fatal(err)
	}
	if c.Endpoint.String() != epB || c.Sticky {
		t.Errorf("Explain(clientA): got %v sticky=%v, want %s not sticky", c.Endpoint, c.Sticky, epB)
	}
	for _, s := range []string{"names " + epA + ", which is ejected", "scheduler rr", "skipping ejected " + epA} {
		if !strings.Contains(c.Reason, s) {
			t.Errorf("Explain reason %q: missing %q", c.Reason, s)
		}
	}
	if got := mustPick(t, b, clientA, nil); got.String() != epB {
		t.Errorf("Pick for clientA with its endpoint ejected: got %v, want %s", got, epB)
	}

	// Update keeps the ejection of an endpoint that stays.
	b.Update(addrs(epC, epA, epB), netip.Addr{}, true, time.Minute)
	if got := b.State().Endpoints[1]; got.Addr.String() != epA || got.EjectedUntil != wantUntil {
		t.Errorf("after Update: got %+v, want %s ejected until %v", got, epA, wantUntil)
	}
	// Turning ejection off re-admits it.
	b.SetEjection(Ejection{})
	if got := b.State().Endpoints[1]; !got.EjectedUntil.IsZero() {
		t.Errorf("after SetEjection(off): got %+v, want not ejected", got)
	}
}

// Peek and Explain must still predict Pick while endpoints are ejected.
func TestPeekPredictsPickWithEjection(t *testing.T) {
	t.Parallel()
	for _, sched := range Schedulers {
		t.Run(sched, func(t *testing.T) {
			b, clock := mkBalancer(t, sched, endpoints(5), true, 10*time.Second)
			b.SetEjection(Ejection{After: 1, Base: 5 * time.Second})
			for i := range 40 {
				c := clientAddr(i % 7)
				if i%4 == 0 {
					b.DialFailed(endpoints(5)[i%5], errDial)
				}
				want, _, err := b.Peek(c)
				if err != nil {
					t.Fatal(err)
				}
				if got := mustPick(t, b, c, nil); got != want {
					t.Fatalf("pick %d for %v: got %v, want %v as Peek said", i, c, got, want)
				}
				clock.advance(time.Second)
			}
		})
	}
}

// reentrantLog reads its Balancer from inside each call, as an observer that
// shows the Balancer's state beside an ejection may.
type reentrantLog struct {
	b    *Balancer
	seen []EndpointState
}

func (l *reentrantLog) Ejected(netip.AddrPort, time.Duration, error) { _, l.seen = l.b.Stats() }
func (l *reentrantLog) Readmitted(netip.AddrPort)                    { _, l.seen = l.b.Stats() }

// The observer is called after the Balancer's lock is released: one that reads
// the Balancer back must neither deadlock nor see the state before the decision.
func TestEjectionObserverCalledUnlocked(t *testing.T) {
	t.Parallel()
	b, _ := mkBalancer(t, "rr", addrs(epA, epB), false, 0)
	b.SetEjection(Ejection{After: 1})
	log := &reentrantLog{b: b}
	b.SetEjectionObserver(log)
	done := make(chan struct{})
	go func() {
		defer close(done)
		b.DialFailed(netip.MustParseAddrPort(epA), errDial)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("DialFailed did not return: the observer was called with the lock held")
	}
	if len(log.seen) != 2 || log.seen[0].EjectedUntil.IsZero() {
		t.Errorf("state seen by the observer: got %+v, want %s ejected", log.seen, epA)
	}
}

// State's Next is what the next new client gets: the decision Pick makes, with
// ejected endpoints skipped and affinity entries of other clients not in the
// way, in every scheduler where a new client's choice does not hang on its
// address (sh has no Next).
func TestStateNextIsPick(t *testing.T) {
	t.Parallel()
	for _, sched := range Schedulers {
		t.Run(sched, func(t *testing.T) {
			eps := endpoints(3)
			b, clock := mkBalancer(t, sched, eps, true, time.Minute)
			b.SetEjection(Ejection{After: 1, Base: time.Hour})
			b.DialFailed(eps[1], errDial) // ejected for the whole test
			for i := range 30 {
				st := b.State()
				c := clientAddr(100 + i) // a new client every time
				got := mustPick(t, b, c, nil)
				if got == eps[1] {
					t.Fatalf("pick %d: got the ejected %v", i, got)
				}
				if sched == "sh" {
					if st.Next.IsValid() || st.NextReason != "" {
						t.Fatalf("sample %d: got Next %v (%q), want none: sh's choice hangs on the client's address", i, st.Next, st.NextReason)
					}
					continue
				}
				if st.Next != got {
					t.Fatalf("sample %d: State said the next new client gets %v (%s), Pick gave %v", i, st.Next, st.NextReason, got)
				}
				if !strings.Contains(st.NextReason, "scheduler "+sched) || !strings.Contains(st.NextReason, "skipping ejected "+eps[1].String()) {
					t.Errorf("sample %d: NextReason %q, want the scheduler %s and the ejected %v named", i, st.NextReason, sched, eps[1])
				}
				if i%2 == 0 {
					b.Release(got)
				}
				clock.advance(time.Second)
			}
		})
	}
}
