package socket

import (
	"errors"
	"syscall"
	"time"
)

// Accept (TCP) and read (UDP) loops back off on errors that say the process or the
// kernel is short of a resource: retrying at once would only spin on the same error.
const (
	minBackoff = 5 * time.Millisecond
	maxBackoff = 1 * time.Second
)

// nextBackoff returns the wait after one more consecutive temporary error, given the
// previous wait (zero after a success).
func nextBackoff(prev time.Duration) time.Duration {
	if prev == 0 {
		return minBackoff
	}
	return min(2*prev, maxBackoff)
}

// isTemporary reports whether an accept or read error may go away by itself: a
// shortage (see isShortage), or a connection the client aborted before it was
// accepted.
func isTemporary(err error) bool {
	return isShortage(err) || errors.Is(err, syscall.ECONNABORTED)
}

// isShortage reports whether err says the process or the kernel ran short of file
// descriptors (process or system), buffers or memory. Nobody else is at fault: a
// dial that fails so says nothing about the endpoint.
func isShortage(err error) bool {
	for _, e := range [...]syscall.Errno{syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}
