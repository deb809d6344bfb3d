package poll

import (
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/uproxy/uproxy/socket/poll/polltest"
)

// expireFunc adapts a function to TimerTarget.
type expireFunc func()

func (f expireFunc) Expire() { f() }

// Timers on a manual clock expire in the order of their deadlines, each once the
// clock has reached it and not before; a timer scheduled again keeps only its new
// deadline, a cancelled one never expires, and one may re-arm itself as it expires.
func TestTimersOnAManualClock(t *testing.T) {
	const ms = time.Millisecond
	clock := polltest.NewClock()
	l := newGroup(t, Config{Loops: 1, Clock: clock}).Next()

	var expired []string // appended on the loop; read after Advance, which waits for it
	timers := make(map[string]*Timer)
	add := func(name string, f func()) {
		tm := NewTimer(expireFunc(func() {
			expired = append(expired, name)
			if f != nil {
				f()
			}
		}))
		timers[name] = &tm
	}
	add("a", nil)
	add("b", nil)
	add("c", nil)
	add("cancelled", nil)
	ticks := 0
	add("ticker", func() {
		if ticks++; ticks < 3 {
			l.Schedule(timers["ticker"], 25*ms)
		}
	})
	l.PostWait(func() {
		l.Schedule(timers["a"], 30*ms)
		l.Schedule(timers["b"], 10*ms)
		l.Schedule(timers["c"], 20*ms)
		l.Schedule(timers["cancelled"], 5*ms)
		l.Schedule(timers["ticker"], 25*ms)             // and at 50ms, 75ms
		l.ScheduleAt(timers["a"], l.Now()+int64(15*ms)) // replaces 30ms
		l.Cancel(timers["cancelled"])
	})

	steps := []struct {
		advance time.Duration
		want    []string // expired by this step
	}{
		{9 * ms, nil},                      // 9ms
		{1 * ms, []string{"b"}},            // 10ms: exactly at the deadline
		{4 * ms, nil},                      // 14ms
		{1 * ms, []string{"a"}},            // 15ms, not 30ms
		{10 * ms, []string{"c", "ticker"}}, // 25ms: both passed, earliest first
		{24 * ms, nil},                     // 49ms
		{1 * ms, []string{"ticker"}},       // 50ms
		{time.Hour, []string{"ticker"}},    // and no more: it stopped re-arming
	}
	var now time.Duration
	for _, st := range steps {
		expired = expired[:0]
		clock.Advance(st.advance)
		now += st.advance
		if !slices.Equal(expired, st.want) {
			t.Errorf("advancing to %v: got %q expired, want %q", now, expired, st.want)
		}
	}
	var armed int
	l.PostWait(func() { armed = len(l.timers) })
	if armed != 0 {
		t.Errorf("armed timers at the end: got %d, want 0", armed)
	}
}

// On the real clock a timer expires once its delay has passed in real time.
func TestTimerOnTheRealClock(t *testing.T) {
	l := newGroup(t, Config{Loops: 1}).Next()
	const delay = 20 * time.Millisecond
	fired := make(chan time.Time, 1)
	tm := NewTimer(expireFunc(func() { fired <- time.Now() }))
	var start time.Time
	l.PostWait(func() {
		start = time.Now()
		l.Schedule(&tm, delay)
	})
	select {
	case at := <-fired:
		if got := at.Sub(start); got < delay {
			t.Errorf("timer of %v expired after %v", delay, got)
		}
	case <-time.After(awaitTimeout):
		t.Fatalf("timer of %v: not expired after %v", delay, awaitTimeout)
	}
}

// Concurrent first calls of Local agree on one value.
func TestLocalIsOneValuePerLoop(t *testing.T) {
	g := newGroup(t, Config{Loops: 2})
	// Not zero-sized: two zero-sized values may share an address.
	type state struct{ _ int }
	for _, l := range g.Loops() {
		got := make([]any, 8)
		var wg sync.WaitGroup
		for i := range got {
			wg.Go(func() { got[i] = l.Local(func() any { return &state{} }) })
		}
		wg.Wait()
		for i, v := range got {
			if v != got[0] {
				t.Errorf("Local call %d: got %p, want %p like the first", i, v, got[0])
			}
		}
	}
	if a, b := g.Loops()[0].Local(nil), g.Loops()[1].Local(nil); a == b {
		t.Errorf("two loops share the value %p, want one each", a)
	}
}

// Next hands out every loop in turn.
func TestNextTakesEachLoopInTurn(t *testing.T) {
	g := newGroup(t, Config{Loops: 3})
	count := make(map[*Loop]int)
	for range 9 {
		count[g.Next()]++
	}
	for i, l := range g.Loops() {
		if count[l] != 3 {
			t.Errorf("loop %d: got %d of 9 picks, want 3", i, count[l])
		}
	}
}
