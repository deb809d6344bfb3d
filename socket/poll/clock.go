package poll

import "time"

// Clock is the time a group's timers follow: real time, or a test's clock that
// moves only when told (see polltest.Clock).
type Clock interface {
	// Now returns the time in nanoseconds from an origin of the clock's own. It
	// never goes back.
	Now() int64
	// OnAdvance reports whether the clock moves only when told. If it does, it
	// keeps wake and calls it after every move; wake returns once its loop has
	// run the timers the move made due. A clock that follows real time keeps
	// nothing and returns false: loops then wait in epoll_wait until the next
	// timer is due.
	OnAdvance(wake func()) bool
}

// realClock is the monotonic clock, counted from base.
type realClock struct{ base time.Time }

func (c realClock) Now() int64          { return int64(time.Since(c.base)) }
func (realClock) OnAdvance(func()) bool { return false }
