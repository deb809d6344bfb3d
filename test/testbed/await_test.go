package testbed

import (
	"fmt"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// Await returns once the condition holds, polling until then; a condition that
// never holds fails the test, naming what it waited for and, from
// AwaitNoError, the condition's last word.
func TestAwait(t *testing.T) {
	t.Parallel()
	var polls atomic.Int64
	Await(t, 5*time.Second, "the third poll", func() bool { return polls.Add(1) == 3 })
	if got := polls.Load(); got != 3 {
		t.Errorf("polls: got %d, want 3", got)
	}

	tests := []struct {
		name  string
		await func(testing.TB)
		says  []string
	}{
		{"Await", func(tb testing.TB) {
			Await(tb, 20*time.Millisecond, "a condition that never holds", func() bool { return false })
		}, []string{"20ms", "a condition that never holds"}},
		{"AwaitNoError", func(tb testing.TB) {
			n := 0
			AwaitNoError(tb, 20*time.Millisecond, "a server", func() error {
				n++
				return fmt.Errorf("attempt %d refused", n)
			})
		}, []string{"a server", "refused"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rec := &fatalfTB{TB: t}
			done := make(chan struct{})
			go func() {
				defer close(done)
				tc.await(rec)
			}()
			<-done
			if rec.failure == "" {
				t.Fatal("a condition that never held did not fail the test")
			}
			for _, s := range tc.says {
				if !strings.Contains(rec.failure, s) {
					t.Errorf("failure %q does not say %q", rec.failure, s)
				}
			}
		})
	}
}

// fatalfTB records a Fatalf and ends the goroutine as the real one does.
type fatalfTB struct {
	testing.TB
	failure string
}

func (r *fatalfTB) Helper() {}
func (r *fatalfTB) Fatalf(format string, args ...any) {
	r.failure = fmt.Sprintf(format, args...)
	runtime.Goexit()
}
