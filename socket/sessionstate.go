package socket

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/uproxy/uproxy/record"
	"github.com/uproxy/uproxy/socket/handover"
)

// A SessionState travels as handover items, one per descriptor, in a fixed
// order: the client socket (whose item carries the state's encoding), the
// backend socket, then the read end of the up direction's pipe and of the down
// direction's, each only when that pipe holds bytes. So a connection is 2
// descriptors, and 4 at most.
//
// The encoding (version 1, big-endian) is:
//
//	version          1 byte
//	flags            2 bytes (sessionFlag*)
//	backend nagle    1 byte
//	client, endpoint address each: family (0, 4 or 6), its 0, 4 or 16 bytes, port (2)
//	start            8 bytes, Unix nanoseconds
//	bytes up, down   8 bytes each
//	idle for, keepalive in  8 bytes each, nanoseconds
//	pipe bytes up, down     4 bytes each, for each pipe that travels
//	pending up, down        uvarint length and the bytes, each
//	attempts         uvarint count, each: endpoint (as above), start (8),
//	                 duration (8), source (1), error kind (1: none, hedge
//	                 lost, another) and, for another, its text (uvarint length)
//
// A failed attempt's error travels as its text (record.ErrHedgeLost as
// itself): the record a resumed connection ends with names its attempts'
// errors as they read, not as the values they were.
const sessionStateVersion = 1

const (
	sessionFlagUpEOF = 1 << iota
	sessionFlagUpDone
	sessionFlagUpSplice
	sessionFlagUpPipe
	sessionFlagDownEOF
	sessionFlagDownDone
	sessionFlagDownSplice
	sessionFlagDownPipe
	sessionFlagClientFinSent
	sessionFlagBackendFinSent
	sessionFlagFromClient
	sessionFlagRetryRefused
	sessionFlagsKnown = 1<<iota - 1
)

const (
	attemptOK = iota
	attemptHedgeLost
	attemptFailed
)

// NumFDs returns how many descriptors the state travels with (2 to 4).
func (st *SessionState) NumFDs() int {
	n := 2
	if st.up.pipeR >= 0 {
		n++
	}
	if st.down.pipeR >= 0 {
		n++
	}
	return n
}

// AppendBinary appends the state's encoding to b (encoding.BinaryAppender);
// its descriptors travel apart, in the order SessionItems gives them.
func (st *SessionState) AppendBinary(b []byte) ([]byte, error) {
	var flags uint16
	set := func(bit uint16, on bool) {
		if on {
			flags |= bit
		}
	}
	set(sessionFlagUpEOF, st.up.eof)
	set(sessionFlagUpDone, st.up.done)
	set(sessionFlagUpSplice, st.up.splice)
	set(sessionFlagUpPipe, st.up.pipeR >= 0)
	set(sessionFlagDownEOF, st.down.eof)
	set(sessionFlagDownDone, st.down.done)
	set(sessionFlagDownSplice, st.down.splice)
	set(sessionFlagDownPipe, st.down.pipeR >= 0)
	set(sessionFlagClientFinSent, st.clientFinSent)
	set(sessionFlagBackendFinSent, st.backendFinSent)
	set(sessionFlagFromClient, st.fromClient)
	set(sessionFlagRetryRefused, st.retryRefused)
	b = append(b, sessionStateVersion)
	b = binary.BigEndian.AppendUint16(b, flags)
	b = append(b, byte(st.backendNagle))
	b = appendAddrPort(b, st.clientAddr)
	b = appendAddrPort(b, st.endpoint)
	b = binary.BigEndian.AppendUint64(b, uint64(st.start.UnixNano()))
	b = binary.BigEndian.AppendUint64(b, uint64(st.up.bytes))
	b = binary.BigEndian.AppendUint64(b, uint64(st.down.bytes))
	b = binary.BigEndian.AppendUint64(b, uint64(st.idleFor))
	b = binary.BigEndian.AppendUint64(b, uint64(st.keepAliveIn))
	for _, ds := range []*directionState{&st.up, &st.down} {
		if ds.pipeR >= 0 {
			b = binary.BigEndian.AppendUint32(b, uint32(ds.pipeN))
		}
	}
	for _, ds := range []*directionState{&st.up, &st.down} {
		b = binary.AppendUvarint(b, uint64(len(ds.pending)))
		b = append(b, ds.pending...)
	}
	b = binary.AppendUvarint(b, uint64(len(st.attempts)))
	for _, a := range st.attempts {
		b = appendAttempt(b, a)
	}
	return b, nil
}

// appendAttempt encodes one attempt: endpoint, start, duration, source,
// error kind and, for another error, its text.
func appendAttempt(b []byte, a record.Attempt) []byte {
	b = appendAddrPort(b, a.Endpoint)
	b = binary.BigEndian.AppendUint64(b, uint64(a.Start.UnixNano()))
	b = binary.BigEndian.AppendUint64(b, uint64(a.Duration))
	b = append(b, byte(a.Source))
	switch {
	case a.Err == nil:
		return append(b, attemptOK)
	case a.Err == record.ErrHedgeLost:
		return append(b, attemptHedgeLost)
	}
	msg := a.Err.Error()
	b = append(b, attemptFailed)
	b = binary.AppendUvarint(b, uint64(len(msg)))
	return append(b, msg...)
}

// attempt reads what appendAttempt wrote.
func (r *stateReader) attempt() record.Attempt {
	a := record.Attempt{Endpoint: r.addrPort(), Start: time.Unix(0, int64(r.uint64())),
		Duration: time.Duration(r.uint64()), Source: record.Source(r.byte())}
	switch r.byte() {
	case attemptOK:
	case attemptHedgeLost:
		a.Err = record.ErrHedgeLost
	case attemptFailed:
		a.Err = errors.New(string(r.bytes()))
	default:
		r.fail()
	}
	return a
}

func appendAddrPort(b []byte, ap netip.AddrPort) []byte {
	switch a := ap.Addr(); {
	case a.Is4():
		b = append(b, 4)
		b = append(b, a.AsSlice()...)
	case a.Is6():
		b = append(b, 6)
		b = append(b, a.AsSlice()...)
	default:
		return append(b, 0, 0, 0)
	}
	return binary.BigEndian.AppendUint16(b, ap.Port())
}

// SessionItems returns the handover items of states, in batches of at most
// handover.MaxFDs descriptors (one Send each); a state's items are never
// split. The descriptors stay the states' (Send closes nothing).
func SessionItems(states []SessionState) ([][]handover.Item, error) {
	var batches [][]handover.Item
	var cur []handover.Item
	fds := 0
	for i := range states {
		st := &states[i]
		if st.client < 0 || st.backend < 0 {
			return nil, errors.New("encode a connection's state: it has no sockets (resumed or closed already)")
		}
		n := st.NumFDs()
		if fds+n > handover.MaxFDs {
			batches = append(batches, cur)
			cur, fds = nil, 0
		}
		meta, err := st.AppendBinary(nil)
		if err != nil {
			return nil, err
		}
		cur = append(cur, handover.Item{FD: st.client, Meta: meta}, handover.Item{FD: st.backend})
		for _, ds := range []*directionState{&st.up, &st.down} {
			if ds.pipeR >= 0 {
				cur = append(cur, handover.Item{FD: ds.pipeR})
			}
		}
		fds += n
	}
	if len(cur) > 0 {
		batches = append(batches, cur)
	}
	return batches, nil
}

// SessionStates decodes a batch of items that SessionItems made (and
// handover carried) into the states, which own the items' descriptors. On
// error it closes every descriptor of items: the connections are still the
// sender's, which holds its copies until it hears they were resumed.
func SessionStates(items []handover.Item) ([]SessionState, error) {
	var states []SessionState
	rest := items
	for len(rest) > 0 {
		st, n, err := decodeSessionState(rest)
		if err != nil {
			for _, it := range items {
				if it.FD >= 0 {
					closeFDs([]int{it.FD})
				}
			}
			return nil, fmt.Errorf("decode connection %d of a batch: %w", len(states)+1, err)
		}
		states = append(states, st)
		rest = rest[n:]
	}
	return states, nil
}

// decodeSessionState decodes the state that begins items, and returns how
// many items it took.
func decodeSessionState(items []handover.Item) (SessionState, int, error) {
	st := SessionState{client: -1, backend: -1}
	st.up.pipeR, st.up.pipeW, st.down.pipeR, st.down.pipeW = -1, -1, -1, -1
	r := stateReader{b: items[0].Meta}
	if v := r.byte(); r.err == nil && v != sessionStateVersion {
		return st, 0, fmt.Errorf("a connection's state of version %d; this proxy reads version %d", v, sessionStateVersion)
	}
	flags := r.uint16()
	if flags&^sessionFlagsKnown != 0 {
		return st, 0, fmt.Errorf("a connection's state with unknown flags %#x", flags&^sessionFlagsKnown)
	}
	has := func(bit uint16) bool { return flags&bit != 0 }
	st.up.eof, st.up.done, st.up.splice = has(sessionFlagUpEOF), has(sessionFlagUpDone), has(sessionFlagUpSplice)
	st.down.eof, st.down.done, st.down.splice = has(sessionFlagDownEOF), has(sessionFlagDownDone), has(sessionFlagDownSplice)
	st.clientFinSent, st.backendFinSent = has(sessionFlagClientFinSent), has(sessionFlagBackendFinSent)
	st.fromClient, st.retryRefused = has(sessionFlagFromClient), has(sessionFlagRetryRefused)
	st.backendNagle = nagleState(r.byte())
	if st.backendNagle > noDelayDue {
		return st, 0, fmt.Errorf("a connection's state with an unknown nagle state %d", st.backendNagle)
	}
	st.clientAddr = r.addrPort()
	st.endpoint = r.addrPort()
	st.start = time.Unix(0, int64(r.uint64()))
	st.up.bytes, st.down.bytes = int64(r.uint64()), int64(r.uint64())
	st.idleFor, st.keepAliveIn = time.Duration(r.uint64()), time.Duration(r.uint64())
	n := 2
	if has(sessionFlagUpPipe) {
		st.up.pipeN = int(r.uint32())
		n++
	}
	if has(sessionFlagDownPipe) {
		st.down.pipeN = int(r.uint32())
		n++
	}
	st.up.pending = r.bytes()
	st.down.pending = r.bytes()
	count := r.uvarint()
	if count > uint64(len(r.b)) {
		r.fail()
	}
	for i := uint64(0); i < count && r.err == nil; i++ {
		st.attempts = append(st.attempts, r.attempt())
	}
	if r.err != nil {
		return st, 0, r.err
	}
	if len(r.b) != 0 {
		return st, 0, fmt.Errorf("a connection's state has %d bytes past its end", len(r.b))
	}
	if !st.clientAddr.IsValid() || !st.endpoint.IsValid() {
		return st, 0, errors.New("a connection's state without its client's or its endpoint's address")
	}
	if len(items) < n {
		return st, 0, fmt.Errorf("a connection's state names %d descriptors and the batch has %d left", n, len(items))
	}
	for i, it := range items[:n] {
		if it.FD < 0 || (i > 0 && len(it.Meta) != 0) {
			return st, 0, errors.New("a connection's items and descriptors disagree")
		}
	}
	st.client, st.backend = items[0].FD, items[1].FD
	next := 2
	if has(sessionFlagUpPipe) {
		st.up.pipeR = items[next].FD
		next++
	}
	if has(sessionFlagDownPipe) {
		st.down.pipeR = items[next].FD
	}
	return st, n, nil
}

// stateReader reads an encoding, remembering that it ended early.
type stateReader struct {
	b   []byte
	err error
}

func (r *stateReader) fail() {
	if r.err == nil {
		r.err = errors.New("a connection's state ends early, or is malformed")
	}
	r.b = nil
}

func (r *stateReader) take(n int) []byte {
	if r.err != nil || n < 0 || len(r.b) < n {
		r.fail()
		return make([]byte, max(n, 0))
	}
	out := r.b[:n:n]
	r.b = r.b[n:]
	return out
}

func (r *stateReader) byte() byte     { return r.take(1)[0] }
func (r *stateReader) uint16() uint16 { return binary.BigEndian.Uint16(r.take(2)) }
func (r *stateReader) uint32() uint32 { return binary.BigEndian.Uint32(r.take(4)) }
func (r *stateReader) uint64() uint64 { return binary.BigEndian.Uint64(r.take(8)) }
func (r *stateReader) uvarint() uint64 {
	if r.err != nil {
		return 0
	}
	v, k := binary.Uvarint(r.b)
	if k <= 0 {
		r.fail()
		return 0
	}
	r.b = r.b[k:]
	return v
}

// bytes reads a uvarint length and that many bytes (nil for none).
func (r *stateReader) bytes() []byte {
	n := r.uvarint()
	if n == 0 || r.err != nil {
		return nil
	}
	if n > uint64(len(r.b)) {
		r.fail()
		return nil
	}
	return r.take(int(n))
}

func (r *stateReader) addrPort() netip.AddrPort {
	var a netip.Addr
	switch r.byte() {
	case 0:
		r.take(2)
		return netip.AddrPort{}
	case 4:
		a = netip.AddrFrom4([4]byte(r.take(4)))
	case 6:
		a = netip.AddrFrom16([16]byte(r.take(16)))
	default:
		r.fail()
		return netip.AddrPort{}
	}
	return netip.AddrPortFrom(a, r.uint16())
}
