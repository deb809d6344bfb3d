package syncloop

// Resync queues a sync of the latest Snapshot, as if it had just come: for a
// mode whose last syncs wrote nothing (a uproxy taking over holds its first
// writes back until its predecessor has stopped writing). Nothing is queued
// before the first Update.
func (r *Runner) Resync() {
	r.init()
	r.mu.Lock()
	if r.latest == nil {
		r.mu.Unlock()
		return
	}
	r.pending = true
	r.mu.Unlock()
	select {
	case r.kick <- struct{}{}:
	default:
	}
}
