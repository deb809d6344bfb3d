package poll

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// Config configures a Group. The zero value gives DefaultLoops loops on the real
// clock.
type Config struct {
	// Loops is how many loops the group runs; 0 (or less): DefaultLoops().
	Loops int
	// Clock is what the loops' timers follow; nil: the real monotonic clock.
	Clock Clock
}

// DefaultLoops is the number of loops of a Config that sets none: one per P
// (GOMAXPROCS) but one, and at least one. A loop idle in epoll_wait holds its P,
// which the runtime takes back only when no P is idle, so the program keeps
// GOMAXPROCS one above its loops; poll itself never changes GOMAXPROCS.
func DefaultLoops() int { return max(1, runtime.GOMAXPROCS(0)-1) }

// Group is a set of loops that its owner starts with New and stops with Close.
type Group struct {
	loops []*Loop
	next  atomic.Uint32

	closeOnce sync.Once
}

// New starts the loops of cfg: all of them, or none and an error.
func New(cfg Config) (*Group, error) {
	n := cfg.Loops
	if n <= 0 {
		n = DefaultLoops()
	}
	clock := cfg.Clock
	if clock == nil {
		clock = realClock{base: time.Now()}
	}
	g := &Group{loops: make([]*Loop, 0, n)}
	for range n {
		l, err := newLoop(clock)
		if err != nil {
			for _, l := range g.loops {
				l.release()
			}
			return nil, fmt.Errorf("start event loops: %w", err)
		}
		g.loops = append(g.loops, l)
	}
	for _, l := range g.loops {
		// A manual clock's move runs the timers it made due before it returns.
		l.manual = clock.OnAdvance(func() { l.PostWait(l.runTimers) })
		go l.run()
	}
	return g, nil
}

// Next returns one of the loops, each in turn: it spreads new work over them.
func (g *Group) Next() *Loop {
	return g.loops[g.next.Add(1)%uint32(len(g.loops))]
}

// Loops returns every loop of the group; the slice must not be modified.
func (g *Group) Loops() []*Loop { return g.loops }

// Close stops every loop, once it has run what was posted to it, and releases the
// loops' descriptors. Descriptors still watched stay open (they are their
// owners'), and timers still armed never expire: close what runs on the loops
// first. Close must not be called on a loop's goroutine; later calls return nil.
func (g *Group) Close() error {
	var errs []error
	g.closeOnce.Do(func() {
		for _, l := range g.loops {
			l.stop()
		}
		for _, l := range g.loops {
			<-l.stopped
			errs = append(errs, l.release())
		}
	})
	return errors.Join(errs...)
}
