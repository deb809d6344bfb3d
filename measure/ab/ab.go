// Package ab compares the TCP latency of two live addresses, A and B: typically
// the same pods behind one Service through kube-proxy and behind a copy of it
// through uproxy. It runs short (or persistent) connections against both,
// interleaved in blocks so that whatever else the machine does hits both alike,
// and reports connect and exchange latency percentiles with a bootstrap
// confidence interval of the difference B−A, so a real difference can be told
// from noise. `uproxy ab` is its command.
//
//	rep, err := ab.Run(ctx, ab.Config{A: "10.96.0.10:80", B: "10.96.0.11:80", Mode: ab.ModeHTTP, Path: "/healthz"})
//	if err != nil { ... }
//	rep.WriteTable(os.Stdout)
//
// What an exchange is depends on the Mode: in ModeEcho it writes Payload bytes
// and reads the same bytes back (Echo is such a server); in ModeHTTP it sends a
// GET and reads the whole response, which must have a 2xx status; ModeConnect
// makes none (connect, then close), so any TCP server will do. Connections run
// one at a time, so a latency is never a queue behind the tool's own traffic.
package ab

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"slices"
	"strings"
	"syscall"
	"time"
)

// Modes, the values of Config.Mode: what a connection does once connected.
const (
	// ModeEcho writes Payload bytes and reads the same bytes back, per
	// exchange: the server must echo.
	ModeEcho = "echo"
	// ModeHTTP sends GET Path and reads the whole response, per exchange; a
	// status other than 2xx fails the connection.
	ModeHTTP = "http"
	// ModeConnect connects and closes, with no exchange: any TCP server.
	ModeConnect = "connect"
)

// Modes lists the modes, the first the default.
var Modes = []string{ModeEcho, ModeHTTP, ModeConnect}

// Config says what to measure. The zero value of every field but A and B
// selects its default.
type Config struct {
	// A and B are the addresses compared, host:port; a host name is resolved
	// once, before the first connection.
	A, B string
	// Mode is what a connection does: ModeEcho, ModeHTTP or ModeConnect;
	// zero: ModeEcho.
	Mode string
	// Path is the path ModeHTTP requests; zero: "/". Other modes take none.
	Path string
	// HTTPClose sends ModeHTTP's requests with "Connection: close": the server
	// closes the connection after its response, so a connection makes one
	// exchange. Otherwise the connection is kept alive for the next request
	// (RequestsPerConnection of them) and the client closes it after the last.
	HTTPClose bool
	// Connections is the number of connections to each address; zero: 5000
	// (enough for p99.9 to rest on 5 samples beyond it).
	Connections int
	// RequestsPerConnection is the number of exchanges on each connection;
	// zero: 1 (connect, one exchange, close). ModeConnect makes none, and
	// HTTPClose allows one.
	RequestsPerConnection int
	// Payload is the size in bytes of each ModeEcho exchange's request (and
	// reply); zero: 64. Other modes take none.
	Payload int
	// Interleave is the number of connections in a block: a block to A, a block
	// to B, and so on, the first of each pair alternating between A and B; zero: 10.
	Interleave int
	// DialTimeout bounds each connect; zero: 1s.
	DialTimeout time.Duration
	// Timeout bounds each exchange (write and read back); zero: 2s.
	Timeout time.Duration
	// MaxErrors stops the run once either address has failed that many
	// connections; zero: 100; negative: never.
	MaxErrors int
	// Resamples is the number of bootstrap rounds; zero: 2000. The intervals
	// take time in proportion to resamples × samples: on one core here, 0.15s
	// per metric at 5000 samples a side, 4s at 100000 (many exchanges per
	// connection).
	Resamples int
	// Confidence is the level of the intervals, in (0, 1); zero: 0.95.
	Confidence float64
	// Seed seeds the bootstrap, so the same measurements give the same intervals.
	Seed uint64
	// Progress, if set, receives a progress line now and then and a last one at
	// the end. With Live, the line is rewritten in place (a terminal) several
	// times a second; otherwise a new line comes every 5 seconds.
	Progress io.Writer
	Live     bool
	// Dial opens a connection; nil dials TCP with DialTimeout and no keepalive
	// (nothing the tool does not need on the connect path). Tests use it to
	// dial from another network namespace.
	Dial func(ctx context.Context, address string) (net.Conn, error)
}

// Defaults of the Config fields.
const (
	DefaultConnections = 5000
	DefaultPayload     = 64
	DefaultInterleave  = 10
	DefaultDialTimeout = time.Second
	DefaultTimeout     = 2 * time.Second
	DefaultMaxErrors   = 100
	DefaultResamples   = 2000
	DefaultConfidence  = 0.95
	// MaxPayload bounds Payload: an exchange is a request and its reply, not a
	// bulk transfer.
	MaxPayload = 16 << 20
)

func (c *Config) setDefaults() {
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	if c.Mode == "" {
		c.Mode = ModeEcho
	}
	if c.Mode == ModeHTTP && c.Path == "" {
		c.Path = "/"
	}
	def(&c.Connections, DefaultConnections)
	def(&c.RequestsPerConnection, 1)
	if c.Mode == ModeEcho {
		def(&c.Payload, DefaultPayload)
	}
	def(&c.Interleave, DefaultInterleave)
	def(&c.MaxErrors, DefaultMaxErrors)
	def(&c.Resamples, DefaultResamples)
	if c.DialTimeout == 0 {
		c.DialTimeout = DefaultDialTimeout
	}
	if c.Timeout == 0 {
		c.Timeout = DefaultTimeout
	}
	if c.Confidence == 0 {
		c.Confidence = DefaultConfidence
	}
}

// validate returns an error naming the first bad field by its flag of
// `uproxy ab`, the name users know it by.
func (c *Config) validate() error {
	if !slices.Contains(Modes, c.Mode) {
		return fmt.Errorf("--mode %q: want %s", c.Mode, strings.Join(Modes, ", "))
	}
	if err := c.validateMode(); err != nil {
		return err
	}
	for _, f := range []struct {
		name string
		v    int
	}{
		{"connections", c.Connections},
		{"requests-per-connection", c.RequestsPerConnection},
		{"interleave", c.Interleave},
		{"resamples", c.Resamples},
	} {
		if f.v < 1 {
			return fmt.Errorf("--%s %d: want at least 1", f.name, f.v)
		}
	}
	if c.Mode == ModeEcho && c.Payload < 1 {
		return fmt.Errorf("--payload %d: want at least 1", c.Payload)
	}
	if c.Payload > MaxPayload {
		return fmt.Errorf("--payload %d: want at most %d bytes", c.Payload, MaxPayload)
	}
	if c.Resamples < 100 {
		return fmt.Errorf("--resamples %d: want at least 100 for an interval to mean anything", c.Resamples)
	}
	if c.DialTimeout < 0 {
		return fmt.Errorf("--dial-timeout %v: want a positive duration", c.DialTimeout)
	}
	if c.Timeout < 0 {
		return fmt.Errorf("--timeout %v: want a positive duration", c.Timeout)
	}
	if !(c.Confidence > 0 && c.Confidence < 1) {
		return fmt.Errorf("--confidence %g: want a level between 0 and 1, e.g. 0.95", c.Confidence)
	}
	return nil
}

// validateMode refuses the settings the mode has no use for, naming them by
// their flags.
func (c *Config) validateMode() error {
	if c.Mode != ModeEcho && c.Payload != 0 {
		return fmt.Errorf("--payload %d: --mode %s sends no payload (only echo does)", c.Payload, c.Mode)
	}
	if c.Mode != ModeHTTP && (c.Path != "" || c.HTTPClose) {
		return fmt.Errorf("--path and --http-close are --mode http's; --mode %s sends no request", c.Mode)
	}
	if c.Mode == ModeHTTP && (!strings.HasPrefix(c.Path, "/") || strings.ContainsAny(c.Path, " \t\r\n")) {
		return fmt.Errorf("--path %q: want an absolute path without spaces, e.g. /healthz", c.Path)
	}
	if c.Mode == ModeConnect && c.RequestsPerConnection > 1 {
		return fmt.Errorf("--requests-per-connection %d: --mode connect makes no exchange (it connects and closes)", c.RequestsPerConnection)
	}
	if c.HTTPClose && c.RequestsPerConnection > 1 {
		return fmt.Errorf("--requests-per-connection %d: with --http-close the server closes each connection after one response", c.RequestsPerConnection)
	}
	return nil
}

// Error kinds, the keys of Side.Errors.
const (
	ErrRefused        = "refused"         // the connect was refused (RST to the SYN)
	ErrConnectTimeout = "connect timeout" // no answer to the connect within DialTimeout
	ErrUnreachable    = "unreachable"     // no route, or an ICMP unreachable
	ErrTimeout        = "timeout"         // no full reply within Timeout
	ErrReset          = "reset"           // the connection was reset during an exchange
	ErrShortRead      = "short read"      // the server closed before the full reply (or, in ModeHTTP, a connection with requests left)
	ErrStatus         = "status"          // ModeHTTP: the response's status was not 2xx
	ErrMismatch       = "mismatch"        // the reply was not what the mode expects: not the request (echo), not an HTTP response (http)
	ErrOther          = "other"
)

// errorKinds lists the kinds in the order the table shows them.
var errorKinds = []string{ErrRefused, ErrConnectTimeout, ErrUnreachable, ErrTimeout, ErrReset, ErrShortRead, ErrStatus, ErrMismatch, ErrOther}

var (
	errMismatch = errors.New("reply differs from the request")
	errNotHTTP  = errors.New("the reply is not an HTTP response")
)

// statusError is a ModeHTTP response whose status is not 2xx.
type statusError struct {
	path, status string
}

func (e *statusError) Error() string {
	return fmt.Sprintf("GET %s answered %s, want a 2xx status", e.path, e.status)
}

// closedError is a ModeHTTP response that closes a connection with requests
// left to make on it.
type closedError struct {
	done, want int
}

func (e *closedError) Error() string {
	return fmt.Sprintf("the server closed the connection after request %d of %d (its response said Connection: close); "+
		"ask for one request per connection (--requests-per-connection 1, or --http-close)", e.done, e.want)
}

// Check returns the error Run would return for cfg's settings, naming the
// flag, without running anything.
func (c Config) Check() error {
	c.setDefaults()
	return c.validate()
}

// Run measures both addresses and returns the report. It stops early, with a
// report of what it measured and Report.Stopped saying why, when ctx ends or
// an address reaches MaxErrors; the error is for bad configuration only.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	sides := [2]*side{{name: "A", address: cfg.A}, {name: "B", address: cfg.B}}
	for _, s := range sides {
		ap, err := resolve(ctx, s.address)
		if err != nil {
			return nil, fmt.Errorf("ADDR_%s %q: %w", s.name, s.address, err)
		}
		s.dialed = ap.String()
		s.errors = map[string]int{}
		s.examples = map[string]string{}
		switch cfg.Mode {
		case ModeEcho:
			s.request = make([]byte, cfg.Payload)
			s.reply = make([]byte, cfg.Payload)
			for i := range s.request {
				s.request[i] = byte('a' + i%26)
			}
		case ModeHTTP:
			s.request = httpRequest(cfg.Path, s.address, cfg.HTTPClose)
			s.responses = bufio.NewReader(nil)
		}
	}
	dial := cfg.Dial
	if dial == nil {
		d := &net.Dialer{Timeout: cfg.DialTimeout, KeepAlive: -1}
		dial = func(ctx context.Context, address string) (net.Conn, error) {
			return d.DialContext(ctx, "tcp", address)
		}
	}
	r := &runner{cfg: cfg, dial: dial, sides: sides, start: time.Now()}
	stopped := r.loop(ctx)
	elapsed := time.Since(r.start)
	r.progress(true)
	return newReport(cfg, sides, stopped, elapsed), nil
}

// resolve turns host:port into one IP address and port, so that every
// connection dials the same address and no lookup lands in a latency.
func resolve(ctx context.Context, address string) (netip.AddrPort, error) {
	host, port, err := net.SplitHostPort(address)
	if err != nil {
		return netip.AddrPort{}, err
	}
	pn, err := net.LookupPort("tcp", port)
	if err != nil || pn == 0 {
		return netip.AddrPort{}, fmt.Errorf("port %q: want a port number from 1 to 65535", port)
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		return netip.AddrPortFrom(ip, uint16(pn)), nil
	}
	if host == "" {
		return netip.AddrPort{}, errors.New("no host")
	}
	ips, err := net.DefaultResolver.LookupNetIP(ctx, "ip", host)
	if err != nil {
		return netip.AddrPort{}, err
	}
	return netip.AddrPortFrom(ips[0].Unmap(), uint16(pn)), nil
}

// side is one address's measurements.
type side struct {
	name, address, dialed string
	attempted             int
	connect, exchange     []time.Duration
	// connection is connect plus every exchange: what a client of the Service
	// waits for, the fair row when one path accepts before it reaches a
	// backend (a userspace proxy) and the other does not (DNAT).
	connection []time.Duration
	errors     map[string]int
	failed     int
	examples   map[string]string
	seq        uint64
	// request is what an exchange writes: the payload (ModeEcho) or the GET
	// (ModeHTTP); reply is where ModeEcho reads the echo, responses the
	// buffer ModeHTTP reads responses through (reset on each connection).
	request   []byte
	reply     []byte
	responses *bufio.Reader
}

type runner struct {
	cfg          Config
	dial         func(context.Context, string) (net.Conn, error)
	sides        [2]*side
	start        time.Time
	lastProgress time.Time
}

// loop runs the blocks until both sides have made every connection, and
// returns why it stopped early ("" when it did not).
func (r *runner) loop(ctx context.Context) string {
	for round := 0; ; round++ {
		// ABBA: the side that goes first alternates, so neither always follows
		// the other's block (or the idle moment before the run).
		order := []*side{r.sides[0], r.sides[1]}
		if round%2 == 1 {
			order[0], order[1] = order[1], order[0]
		}
		for _, s := range order {
			for i := 0; i < r.cfg.Interleave && s.attempted < r.cfg.Connections; i++ {
				if ctx.Err() != nil {
					return "interrupted"
				}
				s.attempted++
				if !s.connectAndExchange(ctx, r.cfg, r.dial) && ctx.Err() != nil {
					s.attempted-- // cut short by the end of ctx, not a failure
					return "interrupted"
				}
				if r.cfg.MaxErrors > 0 && s.failed >= r.cfg.MaxErrors {
					return fmt.Sprintf("%s (%s) failed %d connections (%s), the limit set by --max-errors", s.name, s.address, s.failed, s.errorSummary())
				}
				r.progress(false)
			}
		}
		if r.sides[0].attempted >= r.cfg.Connections && r.sides[1].attempted >= r.cfg.Connections {
			return ""
		}
	}
}

// connectAndExchange makes one connection and its exchanges, recording the
// latencies or the failure; it reports whether every step succeeded.
func (s *side) connectAndExchange(ctx context.Context, cfg Config, dial func(context.Context, string) (net.Conn, error)) bool {
	dctx, cancel := context.WithTimeout(ctx, cfg.DialTimeout)
	start := time.Now()
	c, err := dial(dctx, s.dialed)
	connected := time.Now()
	cancel()
	if err != nil {
		if ctx.Err() == nil {
			s.fail(classify(err, true), err)
		}
		return false
	}
	defer c.Close()
	s.connect = append(s.connect, connected.Sub(start))
	if cfg.Mode == ModeConnect {
		return true
	}
	if s.responses != nil {
		s.responses.Reset(c)
	}
	end := connected
	for i := range cfg.RequestsPerConnection {
		t0 := time.Now()
		c.SetDeadline(t0.Add(cfg.Timeout))
		var err error
		if cfg.Mode == ModeHTTP {
			err = s.get(c, cfg.Path, i+1, cfg.RequestsPerConnection)
		} else {
			s.seq++
			stamp(s.request, s.seq)
			err = exchange(c, s.request, s.reply)
		}
		end = time.Now()
		if err != nil {
			if ctx.Err() == nil {
				s.fail(classify(err, false), err)
			}
			return false
		}
		s.exchange = append(s.exchange, end.Sub(t0))
	}
	s.connection = append(s.connection, end.Sub(start))
	return true
}

// stamp writes the exchange's sequence number into the request, so that a
// reply from an earlier exchange (or another connection) is a mismatch.
func stamp(req []byte, seq uint64) {
	for i := 0; i < 8 && i < len(req); i++ {
		req[i] = byte(seq >> (8 * i))
	}
}

// httpRequest is the GET of path that ModeHTTP writes to address (its Host),
// with "Connection: close" when closing.
func httpRequest(path, address string, closing bool) []byte {
	req := "GET " + path + " HTTP/1.1\r\nHost: " + address + "\r\nUser-Agent: uproxy-ab\r\nAccept: */*\r\n"
	if closing {
		req += "Connection: close\r\n"
	}
	return []byte(req + "\r\n")
}

// get is ModeHTTP's exchange n of want on c: it writes the GET and reads the
// whole response, which must have a 2xx status and, with requests left to
// make, leave the connection open.
func (s *side) get(c net.Conn, path string, n, want int) error {
	if _, err := c.Write(s.request); err != nil {
		return err
	}
	resp, err := http.ReadResponse(s.responses, nil)
	if err != nil {
		var ne net.Error
		if !errors.As(err, &ne) && !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, syscall.ECONNRESET) {
			err = fmt.Errorf("%w: %v", errNotHTTP, err)
		}
		return err
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	switch {
	case err != nil:
		return err
	case resp.StatusCode < 200 || resp.StatusCode > 299:
		return &statusError{path: path, status: resp.Status}
	case resp.Close && n < want:
		return &closedError{done: n, want: want}
	}
	return nil
}

func exchange(c net.Conn, req, reply []byte) error {
	if _, err := c.Write(req); err != nil {
		return err
	}
	if _, err := io.ReadFull(c, reply); err != nil {
		return err
	}
	if !slices.Equal(req, reply) {
		return errMismatch
	}
	return nil
}

func (s *side) fail(kind string, err error) {
	s.failed++
	s.errors[kind]++
	if _, ok := s.examples[kind]; !ok {
		s.examples[kind] = err.Error()
	}
}

func (s *side) errorSummary() string {
	return summarizeErrors(s.errors)
}

// classify names the kind of a failed connect (dialing) or exchange.
func classify(err error, dialing bool) string {
	var ne net.Error
	switch {
	case errors.Is(err, errMismatch), errors.Is(err, errNotHTTP):
		return ErrMismatch
	case errors.As(err, new(*statusError)):
		return ErrStatus
	case errors.As(err, new(*closedError)):
		return ErrShortRead
	case errors.Is(err, syscall.ECONNREFUSED):
		return ErrRefused
	case errors.Is(err, syscall.EHOSTUNREACH), errors.Is(err, syscall.ENETUNREACH):
		return ErrUnreachable
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, os.ErrDeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
		if dialing {
			return ErrConnectTimeout
		}
		return ErrTimeout
	case errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
		return ErrReset
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return ErrShortRead
	}
	return ErrOther
}

// progress writes the progress line when it is due (or at last).
func (r *runner) progress(last bool) {
	if r.cfg.Progress == nil {
		return
	}
	now := time.Now()
	every := 5 * time.Second
	if r.cfg.Live {
		every = 200 * time.Millisecond
	}
	if !last && now.Sub(r.lastProgress) < every {
		return
	}
	if r.lastProgress.IsZero() && !last {
		// The first line waits one interval: a short run shows only the last.
		r.lastProgress = now
		return
	}
	r.lastProgress = now
	line := fmt.Sprintf("ab: %s", now.Sub(r.start).Round(100*time.Millisecond))
	for _, s := range r.sides {
		line += fmt.Sprintf("  %s %d/%d", s.name, s.attempted, r.cfg.Connections)
		if s.failed > 0 {
			line += fmt.Sprintf(" (%d failed)", s.failed)
		}
	}
	switch {
	case r.cfg.Live && last:
		fmt.Fprintf(r.cfg.Progress, "\r%s\x1b[K\n", line)
	case r.cfg.Live:
		fmt.Fprintf(r.cfg.Progress, "\r%s\x1b[K", line)
	default:
		fmt.Fprintln(r.cfg.Progress, line)
	}
}
