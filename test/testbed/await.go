package testbed

import (
	"errors"
	"testing"
	"time"
)

// Await polls cond until it holds and fails the test when it still does not
// after within, naming what it waited for. It is the tests' one wait for a
// condition that comes true later: no test sleeps for a fixed time instead.
// A generous within costs nothing where the condition holds; it only bounds
// how long a failing test takes to say so.
func Await(t testing.TB, within time.Duration, what string, cond func() bool) {
	t.Helper()
	errNotYet := errors.New("not yet")
	AwaitNoError(t, within, what, func() error {
		if cond() {
			return nil
		}
		return errNotYet
	})
}

// AwaitNoError is Await for a condition that says why it does not hold yet:
// it polls f until f returns nil, and the failure reports f's last error.
func AwaitNoError(t testing.TB, within time.Duration, what string, f func() error) {
	t.Helper()
	if err := poll(within, f); err != nil {
		t.Fatalf("waited %s for %s: %v", within, what, err)
	}
}

// maxPollInterval bounds the wait between two polls. The first polls follow
// each other within a millisecond, then the interval doubles: a condition that
// holds soon is seen at once, one that takes seconds costs a poll every 10ms.
const maxPollInterval = 10 * time.Millisecond

func poll(within time.Duration, f func() error) error {
	deadline := time.Now().Add(within)
	interval := 100 * time.Microsecond
	for {
		err := f()
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(interval)
		interval = min(2*interval, maxPollInterval)
	}
}
