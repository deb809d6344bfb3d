// Package soak drives uproxy with mixed TCP and UDP traffic whose every byte is
// checked, while its Services' endpoints change, backends die and return and
// its rules are flushed, and classifies every failure as allowed by the retry
// contract or not. TestSoak (make soak) runs it against the binary in network
// namespaces and prints the Figures.
//
// Wire format. A TCP backend first writes "SERVICE BACKEND\n", then echoes. A
// TCP client reads that line, sends its payload while reading the echo, half-
// closes and reads to EOF: what it reads back must be a prefix of what it sent,
// all of it for a completed transfer. A UDP backend answers a datagram with
// "SERVICE BACKEND\n" followed by the datagram, and a datagram carries its own
// SHA-256, so a reply proves itself intact.
package soak

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Backend is one endpoint of one Service: a TCP or UDP server that can be killed
// (listener and every connection closed at once, as a dying process's are) and
// started again on the same address.
type Backend struct {
	Service string
	Name    string
	// Listen opens the TCP listener (TCP backends).
	Listen func() (net.Listener, error)
	// ListenPacket opens the UDP socket (UDP backends).
	ListenPacket func() (net.PacketConn, error)

	mu    sync.Mutex
	ln    net.Listener
	pc    net.PacketConn
	conns map[net.Conn]struct{}
	alive bool
	kills []time.Time
	wg    sync.WaitGroup
}

// Start opens the backend's socket and serves it; the first Start may pass an
// address ending in :0, later ones reuse the port of Addr.
func (b *Backend) Start() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.alive {
		return nil
	}
	b.conns = make(map[net.Conn]struct{})
	switch {
	case b.Listen != nil:
		ln, err := b.Listen()
		if err != nil {
			return fmt.Errorf("start %s: %w", b.Name, err)
		}
		b.ln = ln
		b.wg.Add(1)
		go b.serveTCP(ln)
	default:
		pc, err := b.ListenPacket()
		if err != nil {
			return fmt.Errorf("start %s: %w", b.Name, err)
		}
		b.pc = pc
		b.wg.Add(1)
		go b.serveUDP(pc)
	}
	b.alive = true
	return nil
}

// Port returns the backend's port (valid after the first Start).
func (b *Backend) Port() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.ln != nil {
		return b.ln.Addr().(*net.TCPAddr).Port
	}
	return b.pc.LocalAddr().(*net.UDPAddr).Port
}

// Kill closes the backend's socket and every connection it has, at once.
func (b *Backend) Kill() {
	b.mu.Lock()
	if !b.alive {
		b.mu.Unlock()
		return
	}
	b.alive = false
	b.kills = append(b.kills, time.Now())
	if b.ln != nil {
		b.ln.Close()
	}
	if b.pc != nil {
		b.pc.Close()
	}
	for c := range b.conns {
		// An abortive close: a killed process's peers see a reset when data was
		// in flight, which is the harder case for the proxy.
		if tc, ok := c.(*net.TCPConn); ok {
			tc.SetLinger(0)
		}
		c.Close()
	}
	b.mu.Unlock()
	b.wg.Wait()
}

// KilledBetween reports whether the backend was killed in [from, to].
func (b *Backend) KilledBetween(from, to time.Time) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, k := range b.kills {
		if !k.Before(from) && !k.After(to) {
			return true
		}
	}
	return false
}

// Kills returns how many times the backend was killed.
func (b *Backend) Kills() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.kills)
}

func (b *Backend) identity() string { return b.Service + " " + b.Name + "\n" }

func (b *Backend) serveTCP(ln net.Listener) {
	defer b.wg.Done()
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		b.mu.Lock()
		if !b.alive {
			b.mu.Unlock()
			c.Close()
			continue
		}
		b.conns[c] = struct{}{}
		b.wg.Add(1)
		b.mu.Unlock()
		go func() {
			defer b.wg.Done()
			if _, err := io.WriteString(c, b.identity()); err == nil {
				// Plain reads and writes: io.Copy from a socket to itself would
				// splice it into itself.
				io.Copy(struct{ io.Writer }{c}, struct{ io.Reader }{c})
				c.(*net.TCPConn).CloseWrite()
			}
			b.mu.Lock()
			delete(b.conns, c)
			b.mu.Unlock()
			c.Close()
		}()
	}
}

func (b *Backend) serveUDP(pc net.PacketConn) {
	defer b.wg.Done()
	buf := make([]byte, 65536)
	id := []byte(b.identity())
	for {
		n, from, err := pc.ReadFrom(buf)
		if err != nil {
			return
		}
		pc.WriteTo(append(append([]byte{}, id...), buf[:n]...), from)
	}
}

// Outcome classifies one transfer.
type Outcome int

const (
	// OK: every byte came back and the checksums match.
	OK Outcome = iota
	// NoBackend: the connection failed before any backend answered (every dial
	// attempt failed, or the Service had no usable endpoint): the contract's reset.
	NoBackend
	// BackendDied: the transfer broke after its backend was killed.
	BackendDied
	// RulesFlushed: the connection failed while the rules were flushed and not yet restored.
	RulesFlushed
	// Lost: a UDP datagram without an answer (UDP does not promise delivery).
	Lost
	// Violation: corrupted or misrouted bytes, or a failure nothing explains.
	Violation
	numOutcomes
)

var outcomeNames = [...]string{"ok", "no backend (reset)", "backend killed mid-transfer", "across the rules flush", "UDP datagram lost", "VIOLATION"}

func (o Outcome) String() string { return outcomeNames[o] }

// Result is one transfer's record.
type Result struct {
	Service    string
	Protocol   string
	Start, End time.Time
	Sent, Got  int
	Backend    string // as the backend named itself ("SERVICE NAME"); "" if none answered
	Err        error
	// Corrupt is set when a received byte differs from the byte sent at its offset,
	// Misrouted when the answering backend belongs to another Service.
	Corrupt, Misrouted bool
}

// TCPTransfer sends size random bytes through a connection dial opens and checks
// the echo. It never returns an error: the Result says what happened.
func TCPTransfer(service string, size int, dial func() (net.Conn, error), deadline time.Duration) (r Result) {
	r = Result{Service: service, Protocol: "TCP", Start: time.Now(), Sent: size}
	defer func() { r.End = time.Now() }()
	c, err := dial()
	if err != nil {
		r.Err = err
		return r
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(deadline))
	br := bufio.NewReader(c)
	line, err := br.ReadString('\n')
	if err != nil {
		r.Err = fmt.Errorf("identity: %w", err)
		return r
	}
	r.Backend = strings.TrimSpace(line)
	svc, _, _ := strings.Cut(r.Backend, " ")
	r.Misrouted = svc != service
	payload := make([]byte, size)
	fill(payload)
	werr := make(chan error, 1)
	go func() {
		_, err := c.Write(payload)
		if err == nil {
			err = c.(*net.TCPConn).CloseWrite()
		}
		werr <- err
	}()
	got := make([]byte, 0, size)
	buf := make([]byte, 32<<10)
	for {
		n, err := br.Read(buf)
		got = append(got, buf[:n]...)
		if err == io.EOF {
			break
		}
		if err != nil {
			r.Err = err
			break
		}
	}
	if e := <-werr; e != nil && r.Err == nil {
		r.Err = fmt.Errorf("write: %w", e)
	}
	r.Got = len(got)
	r.Corrupt = len(got) > size || !bytes.Equal(got, payload[:len(got)])
	if r.Err == nil && len(got) != size {
		r.Err = fmt.Errorf("got %d bytes back, sent %d", len(got), size)
	}
	if r.Err == nil && sha256.Sum256(got) != sha256.Sum256(payload) {
		r.Corrupt = true
	}
	return r
}

// UDPExchange sends one self-checking datagram of size bytes (at least 40) on c and
// waits for the answer.
func UDPExchange(service string, c net.Conn, size int, wait time.Duration) (r Result) {
	r = Result{Service: service, Protocol: "UDP", Start: time.Now(), Sent: size}
	defer func() { r.End = time.Now() }()
	size = max(size, 40)
	msg := make([]byte, size)
	fill(msg[:size-32])
	sum := sha256.Sum256(msg[:size-32])
	copy(msg[size-32:], sum[:])
	if _, err := c.Write(msg); err != nil {
		r.Err = err
		return r
	}
	c.SetReadDeadline(time.Now().Add(wait))
	buf := make([]byte, 65536+256)
	for {
		n, err := c.Read(buf)
		if err != nil {
			r.Err = err
			return r
		}
		id, body, ok := bytes.Cut(buf[:n], []byte("\n"))
		if !ok {
			r.Corrupt = true
			return r
		}
		if len(body) >= 32 && !bytes.Equal(body[len(body)-32:], sum[:]) {
			// A late answer to an earlier datagram of this client: it must be
			// intact in itself, and the wait goes on for ours.
			s := sha256.Sum256(body[:len(body)-32])
			if !bytes.Equal(s[:], body[len(body)-32:]) {
				r.Corrupt = true
				return r
			}
			continue
		}
		r.Backend = string(id)
		svc, _, _ := strings.Cut(r.Backend, " ")
		r.Misrouted = svc != service
		r.Got = len(body)
		r.Corrupt = !bytes.Equal(body, msg)
		return r
	}
}

func fill(b []byte) {
	for i := 0; i+8 <= len(b); i += 8 {
		v := rand.Uint64()
		for j := range 8 {
			b[i+j] = byte(v >> (8 * j))
		}
	}
	for i := len(b) &^ 7; i < len(b); i++ {
		b[i] = byte(rand.Uint32())
	}
}

// Classify decides a Result's Outcome. backendOf finds a backend by its name
// (nil if unknown); flushed reports whether [from, to] overlaps the time between
// a rules flush and the rules' restoration.
func Classify(r Result, backendOf func(name string) *Backend, flushed func(from, to time.Time) bool) Outcome {
	switch {
	case r.Corrupt || r.Misrouted:
		return Violation
	case r.Err == nil:
		return OK
	case r.Backend == "":
		if r.Protocol == "UDP" && isTimeout(r.Err) {
			return Lost
		}
		if flushed(r.Start, r.End) {
			return RulesFlushed
		}
		if isTimeout(r.Err) {
			// A hang with no backend answering: dials are bounded, so this is
			// only allowed while the rules are gone.
			return Violation
		}
		return NoBackend
	default:
		_, name, _ := strings.Cut(r.Backend, " ")
		if b := backendOf(name); b != nil && b.KilledBetween(r.Start, r.End) {
			return BackendDied
		}
		// Connections in flight when the nat table is flushed depend on the
		// kernel keeping their conntrack NAT binding; counted apart, not hidden.
		if flushed(r.Start, r.End) {
			return RulesFlushed
		}
		return Violation
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// IsRefusedOrReset reports a connection refused or reset.
func IsRefusedOrReset(err error) bool {
	return errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET)
}

// Figures are the soak's totals.
type Figures struct {
	Duration             time.Duration
	Services             int
	Transfers            [2][numOutcomes]int // [0] TCP, [1] UDP
	Bytes                [2]int64            // bytes sent and verified back, TCP and UDP
	EndpointUpdates      int
	Syncs                int
	BackendKills         int
	FlushAt              time.Time
	FlushRecovery        time.Duration
	FDs, Sockets         [2]int // baseline, end
	Goroutines           [2]int
	CloseWait            int
	Violations           []string
	ViolationsSuppressed int
}

// Add counts r.
func (f *Figures) Add(r Result, o Outcome) {
	i := 0
	if r.Protocol == "UDP" {
		i = 1
	}
	f.Transfers[i][o]++
	if o == OK {
		f.Bytes[i] += int64(r.Sent)
	}
	if o == Violation {
		if len(f.Violations) < 20 {
			f.Violations = append(f.Violations, fmt.Sprintf("%s %s via %q at %s: sent %d got %d corrupt=%v misrouted=%v err=%v",
				r.Protocol, r.Service, r.Backend, r.Start.Format("15:04:05.000"), r.Sent, r.Got, r.Corrupt, r.Misrouted, r.Err))
		} else {
			f.ViolationsSuppressed++
		}
	}
}

// ViolationCount is the number of transfers the contract does not allow.
func (f *Figures) ViolationCount() int { return f.Transfers[0][Violation] + f.Transfers[1][Violation] }

func (f *Figures) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "soak: %v, %d Services, %d endpoint updates, %d syncs, %d backend kills, rules flushed once at %s (restored after %v)\n",
		f.Duration.Round(time.Millisecond), f.Services, f.EndpointUpdates, f.Syncs, f.BackendKills, f.FlushAt.Format("15:04:05.000"), f.FlushRecovery.Round(time.Millisecond))
	for i, proto := range []string{"TCP", "UDP"} {
		total := 0
		for _, n := range f.Transfers[i] {
			total += n
		}
		fmt.Fprintf(&b, "  %s transfers: %d, bytes verified: %d (%.1f MiB)\n", proto, total, f.Bytes[i], float64(f.Bytes[i])/(1<<20))
		for o := Outcome(0); o < numOutcomes; o++ {
			if n := f.Transfers[i][o]; n > 0 {
				fmt.Fprintf(&b, "    %-28s %d\n", o.String()+":", n)
			}
		}
	}
	fmt.Fprintf(&b, "  uproxy descriptors: %d -> %d (sockets %d -> %d), goroutines: %d -> %d, CLOSE_WAIT sockets: %d\n",
		f.FDs[0], f.FDs[1], f.Sockets[0], f.Sockets[1], f.Goroutines[0], f.Goroutines[1], f.CloseWait)
	fmt.Fprintf(&b, "  violations: %d\n", f.ViolationCount())
	for _, v := range f.Violations {
		fmt.Fprintf(&b, "    %s\n", v)
	}
	if f.ViolationsSuppressed > 0 {
		fmt.Fprintf(&b, "    ... and %d more\n", f.ViolationsSuppressed)
	}
	return b.String()
}
