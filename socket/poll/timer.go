package poll

import (
	"container/heap"
	"time"
)

// TimerTarget is told when its Timer expires, on the loop's goroutine.
type TimerTarget interface {
	Expire()
}

// Timer is one pending expiry on a loop. It is embedded in what it times, so
// arming it allocates nothing; an armed Timer must not be copied.
type Timer struct {
	when int64 // on the loop's clock, see Loop.Now
	// pos is the timer's place in its loop's heap plus one; 0 when not armed.
	pos    int
	target TimerTarget
}

// NewTimer returns a disarmed timer that tells target when it expires.
func NewTimer(target TimerTarget) Timer { return Timer{target: target} }

type timerHeap []*Timer

func (h timerHeap) Len() int           { return len(h) }
func (h timerHeap) Less(i, j int) bool { return h[i].when < h[j].when }
func (h timerHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].pos, h[j].pos = i+1, j+1
}
func (h *timerHeap) Push(x any) {
	t := x.(*Timer)
	*h = append(*h, t)
	t.pos = len(*h)
}
func (h *timerHeap) Pop() any {
	old := *h
	t := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	t.pos = 0
	return t
}

// armed reports whether t is in the loop's heap.
func (l *Loop) armed(t *Timer) bool {
	i := t.pos - 1
	return i >= 0 && i < len(l.timers) && l.timers[i] == t
}

// Schedule arms t to expire once the loop's clock has moved on by d, replacing any
// earlier schedule on this loop.
func (l *Loop) Schedule(t *Timer, d time.Duration) {
	l.ScheduleAt(t, l.clock.Now()+int64(d))
}

// ScheduleAt arms t to expire once the loop's clock reads when (see Now),
// replacing any earlier schedule on this loop.
func (l *Loop) ScheduleAt(t *Timer, when int64) {
	t.when = when
	if l.armed(t) {
		heap.Fix(&l.timers, t.pos-1)
		return
	}
	heap.Push(&l.timers, t)
}

// Cancel disarms t if it is armed.
func (l *Loop) Cancel(t *Timer) {
	if l.armed(t) {
		heap.Remove(&l.timers, t.pos-1) // which clears pos
	}
}

// waitMillis is epoll_wait's timeout: until the next timer, rounded up, or
// forever. A manual clock's timers are looked at again when it moves.
func (l *Loop) waitMillis() int {
	if len(l.timers) == 0 {
		return -1
	}
	d := l.timers[0].when - l.clock.Now()
	switch {
	case d <= 0:
		return 0
	case l.manual:
		return -1
	}
	return int((d + int64(time.Millisecond) - 1) / int64(time.Millisecond))
}

// runTimers expires every timer whose time has come, earliest first.
func (l *Loop) runTimers() {
	if len(l.timers) == 0 {
		return
	}
	now := l.clock.Now()
	for len(l.timers) > 0 && l.timers[0].when <= now {
		t := heap.Pop(&l.timers).(*Timer)
		t.target.Expire()
	}
}
