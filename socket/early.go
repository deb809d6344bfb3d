package socket

import (
	"fmt"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Fewer segments per short connection. Most short connections are a request
// and a reply: the client writes at once after its connect, and the server
// often closes right after its reply. Two things let such a connection cross
// the proxy in fewer segments than a plain copy sends, and so wake each peer
// less often (on one node a segment costs its sender the receiver's work too,
// and a wake-up of the receiver):
//
//   - Request first. A client's request usually waits in its socket by the
//     time the proxy accepts it. The proxy reads it then, before it dials
//     (readEarly), and the dial holds back the last ACK of its handshake
//     (TCP_DEFER_ACCEPT on a connecting socket) so that it goes out with the
//     request: the backend sees its connection and the request in one segment
//     and one wake-up, not two. The dial is then exactly as fast; a request
//     that only arrives later is copied as before, with the ACK sent at once.
//     A protocol in which the server speaks first costs the read that found
//     nothing, until a listener has found nothing earlyGiveUp times in a row:
//     it then reads early only every earlyRetry connections, to notice the
//     traffic change.
//   - Last bytes with the FIN. When a read reaches the source's FIN, the bytes
//     it got are the last: they are sent with MSG_MORE, and the half-close
//     (or close) that follows at once sends them with the FIN in one segment,
//     which the peer acknowledges once.

const (
	// earlyReadSize bounds what readEarly reads: the size of most requests.
	// The rest, if any, waits in the socket until the backend is connected.
	earlyReadSize = 4 << 10
	// earlyGiveUp is how many accepted connections in a row may have had
	// nothing to read before a listener stops looking on every connection,
	// and earlyRetry how often it looks after that.
	earlyGiveUp = 8
	earlyRetry  = 64
)

// earlyReads is a listener's record, on one loop, of whether its clients
// write first.
type earlyReads struct {
	// misses counts the early reads in a row that found nothing; skipped the
	// connections since the last look, once misses reached earlyGiveUp.
	misses, skipped uint8
}

// due says whether the next accepted connection is read early.
func (e *earlyReads) due() bool {
	if e.misses < earlyGiveUp {
		return true
	}
	e.skipped++
	if e.skipped < earlyRetry {
		return false
	}
	e.skipped = 0
	return true
}

// found notes what an early read found.
func (e *earlyReads) found(anything bool) {
	if anything {
		e.misses = 0
	} else if e.misses < earlyGiveUp {
		e.misses++
	}
}

// readEarly reads what the client sent with its connection into the up
// direction's pending bytes, before the client socket is watched (so that
// watching it reports no input that was already read). It reports false when
// the read found the client reset, and the session was ended.
func (s *tcpSession) readEarly() bool {
	early := &s.ln.early
	if !early.due() {
		return true
	}
	buf := s.l.buf[:earlyReadSize]
	n, err := unix.Read(s.client.fd, buf)
	for err == unix.EINTR {
		n, err = unix.Read(s.client.fd, buf)
	}
	early.found(err == nil)
	switch {
	case err == unix.EAGAIN:
	case err != nil:
		s.client.peerFailed(err)
		s.abort(fmt.Errorf("copy client to backend: %w", os.NewSyscallError("read", err)))
		return false
	case n == 0:
		// Closed before a byte: the FIN is passed on once the backend is
		// connected, as it would have been.
		s.up.eof = true
	default:
		s.up.pending = append(s.up.pending[:0], buf[:n]...)
		s.up.off = 0
		// Whatever is left shows when the socket is watched.
	}
	return true
}

// sendMore sends b on fd with MSG_MORE: the kernel holds the bytes until a
// call without the flag, a shutdown or a close pushes them out.
func sendMore(fd int, b []byte) (int, error) {
	n, _, errno := unix.Syscall6(unix.SYS_SENDTO, uintptr(fd), uintptr(unsafe.Pointer(unsafe.SliceData(b))),
		uintptr(len(b)), unix.MSG_MORE|unix.MSG_NOSIGNAL, 0, 0)
	if errno != 0 {
		return 0, errno
	}
	return int(n), nil
}
