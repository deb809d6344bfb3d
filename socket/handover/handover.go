// Package handover moves file descriptors, each with a few bytes of its owner's
// state, from one process to another over a unix stream socket between two root
// processes: the way a uproxy hands its sockets and connections to its successor.
//
// Usage:
//
//	// The process that hands over listens; its successor dials.
//	ln, err := handover.Listen("@uproxy-handover") // a leading '@' is an abstract name
//	c, err := ln.Accept() // refuses a peer that is not root, agrees on the version
//	err = c.Send([]handover.Item{{FD: fd, Meta: state}, ...}) // at most MaxFDs descriptors
//
//	c, err := handover.Dial("@uproxy-handover") // in the successor
//	items, err := c.Receive() // the same items, with descriptors of its own
//
// # Protocol
//
// Both sides first check that the peer's credentials (SO_PEERCRED) are root's,
// then exchange a hello naming their protocol version; a peer of another
// version is refused with a VersionError before anything is sent. Then each
// Send is one batch: a 12-byte header (version, items, descriptors, metadata
// length), then the items' metadata, each a flag (whether it carries the next
// descriptor) and a uvarint-length-prefixed byte string, all in one sendmsg
// whose SCM_RIGHTS carry the batch's descriptors (at most MaxFDs, the kernel's
// SCM_MAX_FD). What the metadata means is the caller's: this package frames it
// and never parses it, so a caller's state is versioned by this header and
// encoded by the caller (encoding/binary: fixed layouts of a few numbers, no
// reflection and no type descriptors per stream, as encoding/gob would have).
// Items without a descriptor (FD -1) carry state alone, such as an affinity
// table, or an acknowledgement going back.
//
// A sent descriptor stays open in the sender too: Send closes nothing, so a
// sender that waits for the successor's acknowledgement before closing its
// copies keeps serving whatever a successor that died halfway did not take.
//
// # Cost
//
// A batch costs one sendmsg and one recvmsg of its header, and one read of its
// metadata; per descriptor, the kernel takes a file reference on the way and
// installs it in the receiver's descriptor table (BenchmarkTransfer measures
// it, against pidfd_getfd). Receive allocates the batch's items and one buffer
// for all their metadata, nothing per descriptor.
package handover

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"

	"golang.org/x/sys/unix"
)

// Version is the protocol version this package speaks: a peer of another
// version is refused at the hello.
const Version = 1

// MaxFDs is the most descriptors one batch carries: the kernel's SCM_MAX_FD,
// the most one SCM_RIGHTS message may hold.
const MaxFDs = 253

// MaxMeta is the most bytes of metadata one batch carries; a peer announcing
// more is refused rather than trusted with an allocation.
const MaxMeta = 16 << 20

const (
	helloMagic = "uphv"
	helloSize  = 8  // magic, version (uint16), reserved (uint16)
	headerSize = 12 // version, items, descriptors (uint16 each), reserved (uint16), metadata length (uint32)
)

// ErrPeerNotRoot is the refusal of a peer whose credentials are not root's.
var ErrPeerNotRoot = errors.New("the peer is not root")

// A VersionError is the refusal of a peer that speaks another protocol version.
type VersionError struct {
	Own, Peer uint16
}

func (e *VersionError) Error() string {
	return fmt.Sprintf("handover: the peer speaks protocol version %d, this process %d", e.Peer, e.Own)
}

// An Item is a descriptor and its owner's metadata about it. FD is -1 for an
// item of metadata alone.
type Item struct {
	FD   int
	Meta []byte
}

// A Listener accepts handover connections from root peers.
type Listener struct {
	ln *net.UnixListener
}

// Listen listens on a unix stream socket: a path, or an abstract name that
// begins with '@' (reachable from every process of the network namespace, so
// two pods of the host's network find each other without a shared volume).
func Listen(name string) (*Listener, error) {
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: name, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("handover: listen on %s: %w", name, err)
	}
	return &Listener{ln: ln}, nil
}

// Accept waits for a peer and returns the connection once the peer is known
// to be root and to speak this version. A refused peer's connection is closed
// and its error returned (wrapping ErrPeerNotRoot or a *VersionError); the
// listener stays open.
func (l *Listener) Accept() (*Conn, error) {
	uc, err := l.ln.AcceptUnix()
	if err != nil {
		return nil, fmt.Errorf("handover: accept: %w", err)
	}
	return NewConn(uc)
}

// Close closes the listener.
func (l *Listener) Close() error { return l.ln.Close() }

// Addr is the listener's address.
func (l *Listener) Addr() net.Addr { return l.ln.Addr() }

// Dial connects to a Listener at name and returns the connection once the
// peer is known to be root and to speak this version.
func Dial(name string) (*Conn, error) {
	uc, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: name, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("handover: dial %s: %w", name, err)
	}
	return NewConn(uc)
}

// A Conn is one end of a handover connection. Send and Receive may be used by
// one goroutine each at a time.
type Conn struct {
	uc   *net.UnixConn
	peer unix.Ucred

	// Receive's buffers, reused across batches.
	hdr [headerSize]byte
	oob []byte
}

// NewConn checks the peer of uc and exchanges hellos with it, closing uc if
// the peer is refused. It is for a connection made some other way than Listen
// and Dial (a socketpair, an inherited descriptor).
func NewConn(uc *net.UnixConn) (*Conn, error) {
	c := &Conn{uc: uc, oob: make([]byte, unix.CmsgSpace(MaxFDs*4))}
	if err := c.checkPeer(); err != nil {
		uc.Close()
		return nil, err
	}
	if err := c.hello(); err != nil {
		uc.Close()
		return nil, err
	}
	return c, nil
}

func (c *Conn) checkPeer() error {
	rc, err := c.uc.SyscallConn()
	if err != nil {
		return fmt.Errorf("handover: peer credentials: %w", err)
	}
	var cred *unix.Ucred
	var gerr error
	if err := rc.Control(func(fd uintptr) {
		cred, gerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return fmt.Errorf("handover: peer credentials: %w", err)
	}
	if gerr != nil {
		return fmt.Errorf("handover: peer credentials (SO_PEERCRED): %w", gerr)
	}
	c.peer = *cred
	if cred.Uid != 0 {
		return fmt.Errorf("handover: refused peer process %d running as uid %d: %w; only root hands over or takes over sockets",
			cred.Pid, cred.Uid, ErrPeerNotRoot)
	}
	return nil
}

func (c *Conn) hello() error {
	var out [helloSize]byte
	copy(out[:], helloMagic)
	binary.BigEndian.PutUint16(out[4:], Version)
	// Both sides write first: 8 bytes fit any socket buffer, so neither blocks.
	if _, err := c.uc.Write(out[:]); err != nil {
		return fmt.Errorf("handover: hello: %w", err)
	}
	var in [helloSize]byte
	if _, err := io.ReadFull(c.uc, in[:]); err != nil {
		return fmt.Errorf("handover: hello: %w", err)
	}
	if string(in[:4]) != helloMagic {
		return fmt.Errorf("handover: hello: the peer does not speak the handover protocol (got %q)", in[:4])
	}
	if v := binary.BigEndian.Uint16(in[4:]); v != Version {
		return &VersionError{Own: Version, Peer: v}
	}
	return nil
}

// Peer is the peer's credentials (its pid is what Pull takes).
func (c *Conn) Peer() unix.Ucred { return c.peer }

// UnixConn is the connection underneath, for deadlines.
func (c *Conn) UnixConn() *net.UnixConn { return c.uc }

// Close closes the connection.
func (c *Conn) Close() error { return c.uc.Close() }

// Send sends items as one batch. Their descriptors (at most MaxFDs of them)
// stay open in this process: closing them is the caller's decision, once the
// peer has confirmed it took them.
func (c *Conn) Send(items []Item) error {
	msg, fds, err := encode(items)
	if err != nil {
		return err
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	n, _, err := c.uc.WriteMsgUnix(msg, oob, nil)
	if err != nil {
		return fmt.Errorf("handover: send a batch of %d items, %d descriptors: %w", len(items), len(fds), err)
	}
	// The descriptors went with the first bytes; a stream socket may take the
	// rest in further writes.
	if n < len(msg) {
		if _, err := c.uc.Write(msg[n:]); err != nil {
			return fmt.Errorf("handover: send a batch's metadata: %w", err)
		}
	}
	return nil
}

func encode(items []Item) (msg []byte, fds []int, err error) {
	if len(items) > 0xffff {
		return nil, nil, fmt.Errorf("handover: a batch of %d items; at most %d", len(items), 0xffff)
	}
	size := headerSize
	for _, it := range items {
		size += 1 + binary.MaxVarintLen32 + len(it.Meta)
		if it.FD >= 0 {
			fds = append(fds, it.FD)
		}
	}
	if len(fds) > MaxFDs {
		return nil, nil, fmt.Errorf("handover: a batch of %d descriptors; at most %d", len(fds), MaxFDs)
	}
	msg = make([]byte, headerSize, size)
	for _, it := range items {
		var flag byte
		if it.FD >= 0 {
			flag = 1
		}
		msg = append(msg, flag)
		msg = binary.AppendUvarint(msg, uint64(len(it.Meta)))
		msg = append(msg, it.Meta...)
	}
	if len(msg)-headerSize > MaxMeta {
		return nil, nil, fmt.Errorf("handover: a batch of %d bytes of metadata; at most %d", len(msg)-headerSize, MaxMeta)
	}
	binary.BigEndian.PutUint16(msg[0:], Version)
	binary.BigEndian.PutUint16(msg[2:], uint16(len(items)))
	binary.BigEndian.PutUint16(msg[4:], uint16(len(fds)))
	binary.BigEndian.PutUint32(msg[8:], uint32(len(msg)-headerSize))
	return msg, fds, nil
}

// Receive returns the next batch, its descriptors this process's own (close
// on exec). At the end of the stream it returns io.EOF. On any other error the
// descriptors that came are closed.
func (c *Conn) Receive() ([]Item, error) {
	n, oobn, flags, _, err := c.uc.ReadMsgUnix(c.hdr[:], c.oob)
	var fds []int
	if oobn > 0 {
		fds, err = parseRights(c.oob[:oobn], err)
	}
	if err != nil {
		closeAll(fds)
		if n == 0 && errors.Is(err, io.EOF) {
			return nil, io.EOF
		}
		return nil, fmt.Errorf("handover: receive a batch: %w", err)
	}
	if flags&unix.MSG_CTRUNC != 0 {
		closeAll(fds)
		return nil, errors.New("handover: receive a batch: descriptors were dropped (MSG_CTRUNC: is RLIMIT_NOFILE too low?)")
	}
	if n == 0 {
		closeAll(fds)
		return nil, io.EOF
	}
	if n < headerSize {
		if _, err := io.ReadFull(c.uc, c.hdr[n:]); err != nil {
			closeAll(fds)
			return nil, fmt.Errorf("handover: receive a batch's header: %w", err)
		}
	}
	items, err := c.decode(fds)
	if err != nil {
		closeAll(fds)
		return nil, err
	}
	return items, nil
}

func (c *Conn) decode(fds []int) ([]Item, error) {
	h := c.hdr[:]
	if v := binary.BigEndian.Uint16(h[0:]); v != Version {
		return nil, &VersionError{Own: Version, Peer: v}
	}
	nitems := int(binary.BigEndian.Uint16(h[2:]))
	nfds := int(binary.BigEndian.Uint16(h[4:]))
	size := binary.BigEndian.Uint32(h[8:])
	if nfds != len(fds) {
		return nil, fmt.Errorf("handover: a batch announces %d descriptors and carried %d", nfds, len(fds))
	}
	if size > MaxMeta {
		return nil, fmt.Errorf("handover: a batch announces %d bytes of metadata; at most %d", size, MaxMeta)
	}
	meta := make([]byte, size)
	if _, err := io.ReadFull(c.uc, meta); err != nil {
		return nil, fmt.Errorf("handover: receive a batch's metadata: %w", err)
	}
	items := make([]Item, nitems)
	next := 0
	for i := range items {
		if len(meta) < 1 {
			return nil, errors.New("handover: a batch's metadata ends early")
		}
		flag := meta[0]
		l, k := binary.Uvarint(meta[1:])
		if k <= 0 || uint64(len(meta)-1-k) < l {
			return nil, errors.New("handover: a batch's metadata ends early")
		}
		items[i].FD = -1
		if flag == 1 {
			if next == len(fds) {
				return nil, errors.New("handover: a batch's items name more descriptors than it carried")
			}
			items[i].FD = fds[next]
			next++
		}
		// The items share meta: one allocation per batch.
		items[i].Meta = meta[1+k : 1+k+int(l) : 1+k+int(l)]
		meta = meta[1+k+int(l):]
	}
	if next != len(fds) || len(meta) != 0 {
		return nil, errors.New("handover: a batch's items and descriptors disagree")
	}
	return items, nil
}

func parseRights(oob []byte, err error) ([]int, error) {
	msgs, perr := unix.ParseSocketControlMessage(oob)
	if perr != nil {
		return nil, errors.Join(err, fmt.Errorf("control message: %w", perr))
	}
	var fds []int
	for i := range msgs {
		got, perr := unix.ParseUnixRights(&msgs[i])
		if perr != nil {
			closeAll(fds)
			return nil, errors.Join(err, fmt.Errorf("control message: %w", perr))
		}
		fds = append(fds, got...)
	}
	return fds, err
}

func closeAll(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// Pull copies descriptors fds of process pid into this one (pidfd_open and
// pidfd_getfd, close on exec), in order. It needs the right to ptrace pid
// (root does), and it is the other way to take descriptors over: the numbers
// and their state still come over a Conn. On error the descriptors pulled so
// far are closed.
func Pull(pid int, fds []int) ([]int, error) {
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return nil, fmt.Errorf("handover: pidfd_open %d: %w", pid, err)
	}
	defer unix.Close(pidfd)
	out := make([]int, 0, len(fds))
	for _, fd := range fds {
		nfd, err := unix.PidfdGetfd(pidfd, fd, 0)
		if err != nil {
			closeAll(out)
			return nil, fmt.Errorf("handover: pidfd_getfd %d of process %d: %w", fd, pid, os.NewSyscallError("pidfd_getfd", err))
		}
		out = append(out, nfd)
	}
	return out, nil
}
