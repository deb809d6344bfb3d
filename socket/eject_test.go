package socket

import (
	"bytes"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/uproxy/uproxy/affinity"
	"github.com/uproxy/uproxy/test/testbed"
)

// ejectingBalancer returns a real Balancer over eps, in that order (rr), that
// ejects an endpoint after `after` consecutive failed dials for an hour: long
// enough that no ejection ends during a test. Nobody observes its ejections.
func ejectingBalancer(t *testing.T, after int, eps ...netip.AddrPort) *affinity.Balancer {
	t.Helper()
	b, err := affinity.NewBalancer("rr")
	if err != nil {
		t.Fatal(err)
	}
	b.Update(eps, netip.Addr{}, false, 0)
	b.SetEjection(affinity.Ejection{After: after, Base: time.Hour, Max: time.Hour})
	return b
}

// endpointState returns ep's state in b.
func endpointState(t *testing.T, b *affinity.Balancer, ep netip.AddrPort) affinity.EndpointState {
	t.Helper()
	for _, e := range b.State().Endpoints {
		if e.Addr == ep {
			return e
		}
	}
	t.Fatalf("endpoint %v not in the balancer", ep)
	return affinity.EndpointState{}
}

// Ejection is the balancer's decision, fed by the proxy's dial reports: it must
// happen with no Observer at all.
func TestEjectionWithoutObserver(t *testing.T) {
	t.Parallel()
	t.Run("TCP: refused dials eject the endpoint", func(t *testing.T) {
		const after = 3
		dead := refusedAddr(t, "127.0.0.3")
		live := startTCPServer(t, "127.0.0.2", echo).addr
		bal := ejectingBalancer(t, after, dead, live)
		p := &TCPProxy{Service: "ns/eject:tcp", Picker: bal} // Observer unset
		addr := startTCPProxy(t, p)

		// rr offers dead first to every connection until it is ejected; each
		// retries on live. The report of a failed dial precedes the retry, so
		// it has been made once the round trip is done.
		for i := range after {
			msg := fmt.Appendf(nil, "connection %d", i)
			if got, err := roundTrip(dialProxy(t, addr), msg); err != nil || !bytes.Equal(got, msg) {
				t.Fatalf("connection %d: got %q, %v, want %q", i, got, err, msg)
			}
		}
		st := endpointState(t, bal, dead)
		if st.EjectedUntil.IsZero() || st.Failures != after {
			t.Fatalf("after %d refused dials: got %+v, want %v ejected with %d failures", after, st, dead, after)
		}
		// While ejected, dead is never dialed: its failures stay as they were.
		for i := range 4 {
			msg := fmt.Appendf(nil, "while ejected %d", i)
			if got, err := roundTrip(dialProxy(t, addr), msg); err != nil || !bytes.Equal(got, msg) {
				t.Fatalf("connection %d while ejected: got %q, %v, want %q", i, got, err, msg)
			}
		}
		if st := endpointState(t, bal, dead); st.Failures != after {
			t.Errorf("failures of the ejected endpoint: got %d, want still %d (never dialed)", st.Failures, after)
		}
		if c := bal.State().Counters; c.Ejections != 1 {
			t.Errorf("ejections: got %d, want 1", c.Ejections)
		}
	})

	t.Run("UDP: ICMP refusals eject the endpoint", func(t *testing.T) {
		const after = 3
		dead := deadUDPAddr(t, "127.0.0.3")
		live := startUDPEcho(t, "127.0.0.2")
		bal := ejectingBalancer(t, after, dead, live)
		p := &UDPProxy{Service: "ns/eject:udp", Picker: bal, Timeout: time.Hour} // Observer unset
		svc := startUDPProxy(t, p)

		// rr offers dead to every new client until it is ejected: the client's
		// datagrams draw ICMP port unreachable until its entry ends and the
		// next one picks live. A UDP connect succeeds even to dead, so were it
		// counted a success, each new client's would clear the failure the
		// previous one's refusal had added, and dead would never be ejected.
		msg := []byte("anyone there?")
		for i := range after {
			c := listenUDP(t, "127.0.0.1")
			testbed.Await(t, awaitTimeout, fmt.Sprintf("a reply to client %d", i), func() bool {
				_, _, err := exchange(c, svc, msg, 50*time.Millisecond)
				return err == nil
			})
			if st := endpointState(t, bal, dead); st.Failures != i+1 {
				t.Fatalf("after client %d: got %d failures of %v, want %d", i, st.Failures, dead, i+1)
			}
		}
		if st := endpointState(t, bal, dead); st.EjectedUntil.IsZero() {
			t.Fatalf("after %d ICMP refusals: got %+v, want %v ejected", after, st, dead)
		}
		// New clients go straight to live: their first datagram is answered.
		for i := range 4 {
			c := listenUDP(t, "127.0.0.1")
			if got, _, err := exchange(c, svc, msg, 5*time.Second); err != nil || !bytes.Equal(got, msg) {
				t.Errorf("client %d while %v is ejected: got %q, %v, want %q at once", i, dead, got, err, msg)
			}
		}
		if c := bal.State().Counters; c.Ejections != 1 {
			t.Errorf("ejections: got %d, want 1", c.Ejections)
		}
	})
}
