package socket

import "time"

// DefaultDialTimeouts are the per-attempt dial timeouts when a TCPProxy sets none:
// four attempts, each allowed twice as long as the one before. (Lists of them are
// parsed by service.ParseDialTimeouts.)
var DefaultDialTimeouts = []time.Duration{
	250 * time.Millisecond,
	500 * time.Millisecond,
	1 * time.Second,
	2 * time.Second,
}
