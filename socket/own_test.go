package socket

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/record"
	"github.com/uproxy/uproxy/test/testbed"
)

// A TCP endpoint that is one of the proxy's own sockets is never dialed: the
// attempt fails at once with ErrOwnSocket, as the endpoint's failure, and the
// next attempt goes to another endpoint; with no other endpoint the client is
// reset after its attempts, and not a single connection is made to the proxy
// itself.
func TestTCPProxyNeverDialsItsOwnSocket(t *testing.T) {
	t.Parallel()
	backend := startTCPServer(t, "127.0.0.2", echo)
	picker := newCyclePicker()
	rec := &recorder{}
	var own netip.AddrPort // the proxy's address, set before any client connects
	p := &TCPProxy{Service: "ns/loop:tcp", Picker: picker, Observer: rec,
		DialTimeouts: []time.Duration{time.Second, time.Second, time.Second},
		OwnSocket:    func(ep netip.AddrPort) bool { return ep == own }}
	own = startTCPProxy(t, p)

	// The first pick is the proxy itself, the retry the backend. Fatal on
	// failure: a proxy that dialed itself would go on with the next case, where
	// it has nothing but itself to dial, until it ran out of descriptors.
	picker.mu.Lock()
	picker.eps = []netip.AddrPort{own, backend.addr}
	picker.mu.Unlock()
	c := dialProxy(t, own)
	if got, err := roundTrip(c, []byte("ping")); err != nil || string(got) != "ping" {
		t.Fatalf("round trip with the proxy's own socket first among the endpoints: got %q, %v", got, err)
	}
	c.Close()
	recs := rec.awaitClosed(t, 1)
	if n := len(recs); n != 1 {
		t.Fatalf("connections recorded: got %d, want the client's alone (none of the proxy's own)", n)
	}
	got := recs[0]
	if len(got.Attempts) != 2 || !errors.Is(got.Attempts[0].Err, record.ErrOwnSocket) || got.Attempts[0].Endpoint != own ||
		got.Attempts[1].Err != nil || got.Endpoint != backend.addr {
		t.Fatalf("attempts: got %+v, served by %v; want %v refused with ErrOwnSocket, then %v served", got.Attempts, got.Endpoint, own, backend.addr)
	}
	if r := picker.dialReports(); len(r) != 2 || !r[0].failed || r[0].ep != own || !errors.Is(r[0].err, record.ErrOwnSocket) || r[1].failed {
		t.Errorf("dial reports to the Picker: got %v, want %v failed with ErrOwnSocket, then %v succeeded", r, own, backend.addr)
	}

	// Nothing but the proxy itself: every attempt refused, the client reset.
	picker.mu.Lock()
	picker.eps = []netip.AddrPort{own}
	picker.mu.Unlock()
	if err := connectAndRead(own); !isReset(err) {
		t.Errorf("client of a Service whose one endpoint is the proxy itself: got %v, want a reset", err)
	}
	recs = rec.awaitClosed(t, 2)
	if n := len(recs); n != 2 {
		t.Fatalf("connections recorded: got %d, want the two clients' alone", n)
	}
	got = recs[1]
	if len(got.Attempts) != 3 || slices.ContainsFunc(got.Attempts, func(a record.Attempt) bool { return !errors.Is(a.Err, record.ErrOwnSocket) }) ||
		!errors.Is(got.Err, record.ErrOwnSocket) {
		t.Errorf("record: attempts %+v, err %v; want three attempts and the connection failed, all with ErrOwnSocket", got.Attempts, got.Err)
	}
	if n := p.Active(); n != 0 {
		t.Errorf("open connections: got %d, want 0", n)
	}
	if u := picker.unreleased(); len(u) != 0 {
		t.Errorf("Pick without Release: %v", u)
	}
}

// A UDP endpoint that is one of the proxy's own sockets is never connected:
// the datagram would come back in as another client's, without end. The
// client's entry fails with ErrOwnSocket and no entry stays.
func TestUDPProxyNeverSendsToItsOwnSocket(t *testing.T) {
	t.Parallel()
	picker := newCyclePicker()
	rec := &recorder{}
	var own netip.AddrPort
	p := &UDPProxy{Service: "ns/loop:udp", Picker: picker, Observer: rec, MaxClients: 16, Timeout: time.Hour,
		OwnSocket: func(ep netip.AddrPort) bool { return ep == own }}
	own = startUDPProxy(t, p)
	picker.mu.Lock()
	picker.eps = []netip.AddrPort{own}
	picker.mu.Unlock()

	client := listenUDP(t, "127.0.0.1")
	if _, err := client.WriteToUDPAddrPort([]byte("ping"), own); err != nil {
		t.Fatal(err)
	}
	c := rec.awaitClosed(t, 1)[0]
	if c.Client != udpAddr(client) || !errors.Is(c.Err, record.ErrOwnSocket) || len(c.Attempts) != 1 || !errors.Is(c.Attempts[0].Err, record.ErrOwnSocket) {
		t.Errorf("record: client %v, err %v, attempts %+v; want %v failed with ErrOwnSocket in its one attempt", c.Client, c.Err, c.Attempts, udpAddr(client))
	}
	// A proxy that sent the datagram to itself would have a client entry for
	// its own socket by now, and another record for each round.
	time.Sleep(50 * time.Millisecond)
	if n := p.Clients(); n != 0 {
		t.Errorf("client entries: got %d, want none", n)
	}
	if _, _, closed := rec.counts(); closed != 1 {
		t.Errorf("entries recorded: got %d, want the client's alone", closed)
	}
	if r := picker.dialReports(); len(r) != 1 || !r[0].failed || !errors.Is(r[0].err, record.ErrOwnSocket) {
		t.Errorf("dial reports to the Picker: got %v, want one failure with ErrOwnSocket", r)
	}
}

// The data path keeps the last descriptors of the open-file limit for the rest
// of the process: with its share used up, a connection is reset (its
// descriptor was numbered in the reserve) and accepting backs off, as when the
// limit itself is hit, while the reserve stays free for others to open. The
// proxy runs in a process of its own (the test binary), under a low limit.
func TestTCPProxyLeavesTheReserve(t *testing.T) {
	t.Parallel()
	backend := startTCPServer(t, "127.0.0.2", echo)
	const limit = 160 // a reserve of 40
	addr, cmd := startChildProcess(t, "SOCKET_TEST_PROXY_TO="+backend.addr.String(),
		"SOCKET_TEST_PROXY_NOFILE="+strconv.Itoa(limit))
	ceiling := limit - Reserve(limit)

	// Hold connections until the proxy refuses one.
	var held []*net.TCPConn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	refused := false
	for i := 0; i < limit && !refused; i++ {
		c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(addr))
		if err == nil {
			c.SetDeadline(time.Now().Add(awaitTimeout))
			if _, err = roundTrip(c, []byte("x")); err == nil {
				held = append(held, c)
				continue
			}
			c.Close()
		}
		// The reset may come before connect has even returned.
		if !isReset(err) {
			t.Fatalf("connection %d: got %v, want it served or reset", i, err)
		}
		refused = true
	}
	if !refused {
		t.Fatalf("%d connections all served under a limit of %d descriptors; want the proxy to refuse one", len(held), limit)
	}
	// Each connection holds two descriptors of the proxy's: it stopped at the
	// ceiling, not at the limit. (A descriptor numbered above the limit was
	// inherited by the process, as the go command may pass one down; it takes
	// none of the numbers the limit allows.)
	entries, err := os.ReadDir("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/fd")
	if err != nil {
		t.Fatal(err)
	}
	highest, used := 0, 0
	for _, e := range entries {
		var fd int
		if _, err := fmt.Sscan(e.Name(), &fd); err == nil && fd < limit {
			highest = max(highest, fd)
			used++
		}
	}
	if highest >= ceiling {
		t.Errorf("highest descriptor of the proxy with its share used up: got %d, want below the ceiling %d (limit %d less its reserve of %d)",
			highest, ceiling, limit, Reserve(limit))
	}
	// The reserve is free: the process can still open that many.
	if free := limit - used; free < Reserve(limit) {
		t.Errorf("descriptors left to the rest of the proxy's process: got %d, want at least its reserve of %d", free, Reserve(limit))
	}

	// The held connections still work, and once they close the proxy serves again.
	if got, err := roundTrip(held[0], []byte("y")); err != nil || string(got) != "y" {
		t.Errorf("a held connection: got %q, %v", got, err)
	}
	for _, c := range held {
		c.Close()
	}
	held = nil
	testbed.Await(t, awaitTimeout, "a connection served once the others closed", func() bool {
		c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(addr))
		if err != nil {
			return false
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(time.Second))
		got, err := roundTrip(c, []byte("z"))
		return err == nil && string(got) == "z"
	})
}

// setChildFileLimit sets the soft and hard RLIMIT_NOFILE of a child process
// from SOCKET_TEST_PROXY_NOFILE, when given, before it opens anything.
func setChildFileLimit() error {
	v := os.Getenv("SOCKET_TEST_PROXY_NOFILE")
	if v == "" {
		return nil
	}
	var n uint64
	if _, err := fmt.Sscan(v, &n); err != nil {
		return err
	}
	return unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: n, Max: n})
}
