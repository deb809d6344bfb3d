package socket

import (
	"encoding/binary"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A UDP flow that carries bulk (a QUIC transfer, a media stream) sends runs of
// same-sized datagrams. Every socket of a UDPProxy asks for them coalesced
// (UDP_GRO): where the sender segmented them itself (UDP_SEGMENT, as QUIC stacks
// do) or the receiving NIC's GRO merged them, one read takes a whole run as one
// buffer, with the size of its datagrams in a control message. The proxy passes
// the run on with one send that asks the kernel to cut it at that size again
// (UDP_SEGMENT), so every datagram keeps its boundary and the run costs two system
// calls instead of two per datagram. A datagram that arrives alone (any
// request/response traffic) carries no such message and is sent as before.

// maxSegments is the most datagrams one segmented send carries: UDP_MAX_SEGMENTS
// of kernels before 6.6 (later ones take 128). A longer run goes out in pieces.
const maxSegments = 64

// segmentSpace is the control-message room of a segment size: a header and the
// uint16 UDP_SEGMENT takes (UDP_GRO reports an int; both fit).
var segmentSpace = unix.CmsgSpace(4)

// coalesce says whether the proxy's sockets ask for coalesced runs; always, but
// for BenchmarkUDPRun, which measures what that saves.
var coalesce = true

// enableGRO asks the kernel to coalesce runs of datagrams on socket fd. A kernel
// without UDP_GRO (before 5.0) refuses, and datagrams then come one by one.
func enableGRO(fd int) {
	if coalesce {
		unix.SetsockoptInt(fd, unix.SOL_UDP, unix.UDP_GRO, 1)
	}
}

// appendSegment appends the control message that makes the kernel cut a send into
// datagrams of size bytes.
func appendSegment(oob []byte, size int) []byte {
	n := len(oob)
	oob = append(oob, make([]byte, segmentSpace)...)
	h := (*unix.Cmsghdr)(unsafe.Pointer(&oob[n]))
	h.Level, h.Type = unix.SOL_UDP, unix.UDP_SEGMENT
	h.SetLen(unix.CmsgLen(2))
	binary.NativeEndian.PutUint16(oob[n+unix.CmsgLen(0):], uint16(size))
	return oob
}

// sendRun sends b, a run of datagrams of size bytes each (the last may be
// shorter), on fd to to (nil for a connected socket) with control messages
// prefix, and returns the first error. size 0, or a b no longer than size, is
// one datagram. scratch is room for the control messages. When the kernel
// refuses to segment (a route whose device cannot checksum the pieces answers
// EIO), the run goes out one datagram at a time and *noSegments is set, so later
// runs on the same socket do so at once.
func sendRun(fd int, b []byte, size int, to unix.Sockaddr, prefix, scratch []byte, noSegments *bool) error {
	if size <= 0 || len(b) <= size {
		return send(fd, b, to, prefix)
	}
	if !*noSegments {
		oob := appendSegment(append(scratch[:0], prefix...), size)
		for len(b) > 0 {
			n := min(len(b), maxSegments*size)
			err := send(fd, b[:n], to, oob)
			if err == unix.EIO || err == unix.EINVAL || err == unix.EOPNOTSUPP {
				*noSegments = true
				break
			}
			if err != nil {
				return err
			}
			b = b[n:]
		}
	}
	for len(b) > 0 {
		n := min(len(b), size)
		if err := send(fd, b[:n], to, prefix); err != nil {
			return err
		}
		b = b[n:]
	}
	return nil
}

// send makes one send of b: a plain write on a connected socket without control
// messages, sendmsg otherwise.
func send(fd int, b []byte, to unix.Sockaddr, oob []byte) error {
	for {
		var err error
		if to == nil && oob == nil {
			_, err = unix.Write(fd, b)
		} else {
			_, err = unix.SendmsgN(fd, b, oob, to, 0)
		}
		if err != unix.EINTR {
			return err
		}
	}
}
