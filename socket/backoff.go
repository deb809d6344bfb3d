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

// errAction is what accepting (TCP) or reading a Service socket (UDP) does after
// an error.
type errAction uint8

const (
	// retryNow: the error belonged to one peer, not to the socket; go on at once.
	retryNow errAction = iota
	// backOff: the node is short of a resource; wait before trying again.
	backOff
	// giveUp: the socket itself is broken; stop serving it.
	giveUp
)

// peerErrors belong to one connection or datagram, not to the socket that
// reports them. accept(2) passes on a network error already pending on the
// connection it was about to return (and asks callers to retry those as they
// would EAGAIN); ECONNABORTED is a connection its client gave up before it was
// accepted; ECONNREFUSED is how a UDP socket reports the ICMP error an earlier
// datagram drew. Each is reported once and is gone with its peer.
var peerErrors = [...]syscall.Errno{
	syscall.ECONNABORTED, syscall.ECONNREFUSED,
	syscall.ENETDOWN, syscall.EPROTO, syscall.ENOPROTOOPT, syscall.EHOSTDOWN,
	syscall.ENONET, syscall.EHOSTUNREACH, syscall.EOPNOTSUPP, syscall.ENETUNREACH,
}

// actionAfter classifies an error of accept or of a Service socket's read
// (EAGAIN is not an error there: the caller waits for the next event).
func actionAfter(err error) errAction {
	switch {
	case errors.Is(err, syscall.EINTR):
		return retryNow
	case isShortage(err):
		return backOff
	}
	for _, e := range peerErrors {
		if errors.Is(err, e) {
			return retryNow
		}
	}
	return giveUp
}

// isLocalPortShortage reports whether a connect failed for want of a local port:
// EADDRNOTAVAIL from a TCP connect, EAGAIN from a UDP one. Every ephemeral port
// (net.ipv4.ip_local_port_range) already carries a connection to that endpoint,
// most often in TIME_WAIT: the proxy sends the first FIN toward the backend
// whenever the client closes first, so the TIME_WAIT of every client's
// connection gathers on the node. The node is short, not the endpoint, and only
// toward that endpoint: another has ports of its own.
func isLocalPortShortage(err error) bool {
	return errors.Is(err, syscall.EADDRNOTAVAIL) || errors.Is(err, syscall.EAGAIN)
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
