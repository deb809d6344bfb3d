// Package logs lets a test read what klog writes while it runs, line by line,
// so that log lines meant for people can be specified like any other output.
//
//	log := logs.Capture(t)
//	doSomething()
//	lines := log.Since() // "I1123 20:45:14.427863 ... \"Opened proxy port\" service=..."
//
// klog is a process global: a test that captures it must not run in parallel
// with another that does.
package logs

import (
	"bytes"
	"strings"
	"sync"
	"testing"

	"k8s.io/klog/v2"
	"k8s.io/klog/v2/textlogger"
)

// Lines is what klog wrote since Capture, in klog's text format with its
// header (severity letter first). Lines logged at a -v level above klog's
// verbosity (0 in tests) are not written, as for a user at the default.
type Lines struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	read int // bytes returned by Since
}

// Capture sends klog's output to the returned Lines until the test ends.
func Capture(t testing.TB) *Lines {
	l := &Lines{}
	klog.SetLogger(textlogger.NewLogger(textlogger.NewConfig(textlogger.Output(l))))
	t.Cleanup(klog.ClearLogger)
	return l
}

// Write is called by the logger, from any goroutine.
func (l *Lines) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

// Since returns the lines written since its previous call (nil when none).
func (l *Lines) Since() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := strings.TrimSpace(l.buf.String()[l.read:])
	l.read = l.buf.Len()
	if out == "" {
		return nil
	}
	return strings.Split(out, "\n")
}

// Check compares lines with want: for each line, its severity letter (I, E)
// and substrings it must contain. what names the step in failures.
func Check(t testing.TB, what string, lines []string, want [][]string) {
	t.Helper()
	if len(lines) != len(want) {
		t.Errorf("%s: got %d log lines, want %d:\n%s", what, len(lines), len(want), strings.Join(lines, "\n"))
		return
	}
	for i, parts := range want {
		if !strings.HasPrefix(lines[i], parts[0]) {
			t.Errorf("%s: got log line %q, want severity %s", what, lines[i], parts[0])
		}
		for _, p := range parts[1:] {
			if !strings.Contains(lines[i], p) {
				t.Errorf("%s: got log line %q, want it to contain %q", what, lines[i], p)
			}
		}
	}
}
