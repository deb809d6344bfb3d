package socket

import (
	"errors"
	"fmt"
	"strings"
	"time"
)

// DefaultDialTimeouts are the per-attempt dial timeouts when a TCPProxy sets none:
// four attempts, each allowed twice as long as the one before.
var DefaultDialTimeouts = []time.Duration{
	250 * time.Millisecond,
	500 * time.Millisecond,
	1 * time.Second,
	2 * time.Second,
}

// MaxDialAttempts bounds the length of a dial timeout list: beyond it a client would
// wait for minutes before learning that no backend answers.
const MaxDialAttempts = 16

// ParseDialTimeouts parses a comma-separated list of durations such as
// "250ms,500ms,1s,2s" (the --dial-timeouts flag): one entry per attempt, each positive,
// at most MaxDialAttempts of them.
func ParseDialTimeouts(s string) ([]time.Duration, error) {
	if strings.TrimSpace(s) == "" {
		return nil, errors.New("dial timeouts: empty list, want at least one duration such as 250ms")
	}
	fields := strings.Split(s, ",")
	if len(fields) > MaxDialAttempts {
		return nil, fmt.Errorf("dial timeouts %q: %d entries, want at most %d", s, len(fields), MaxDialAttempts)
	}
	out := make([]time.Duration, 0, len(fields))
	for i, f := range fields {
		f = strings.TrimSpace(f)
		if f == "" {
			return nil, fmt.Errorf("dial timeouts %q: entry %d is empty", s, i+1)
		}
		d, err := time.ParseDuration(f)
		if err != nil {
			return nil, fmt.Errorf("dial timeouts %q: entry %d: %w", s, i+1, err)
		}
		if d <= 0 {
			return nil, fmt.Errorf("dial timeouts %q: entry %d is %s, want a positive duration", s, i+1, f)
		}
		out = append(out, d)
	}
	return out, nil
}
