// Package polltest has what tests of code on event loops need: a clock that
// moves only when the test says so.
//
// Usage:
//
//	clock := polltest.NewClock()
//	g, err := poll.New(poll.Config{Loops: 1, Clock: clock})
//	...
//	clock.Advance(time.Second) // returns once every timer due has expired
package polltest

import (
	"sync"
	"time"
)

// Clock is a poll.Clock that stands still until Advance moves it.
type Clock struct {
	mu    sync.Mutex
	now   int64
	wakes []func()
}

// NewClock returns a clock at time zero.
func NewClock() *Clock { return &Clock{} }

// Now returns the clock's time in nanoseconds.
func (c *Clock) Now() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// OnAdvance keeps wake, called after every Advance; the clock moves only when told.
func (c *Clock) OnAdvance(wake func()) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.wakes = append(c.wakes, wake)
	return true
}

// Advance moves the clock on by d and returns once every loop on it has run the
// timers that became due. It must not be called on a loop's goroutine, which
// would wait for itself.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now += int64(d)
	wakes := c.wakes
	c.mu.Unlock()
	for _, wake := range wakes {
		wake()
	}
}
