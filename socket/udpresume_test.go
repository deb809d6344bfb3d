package socket

import (
	"bytes"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/socket/handover"
)

// startTaggedUDPEcho runs a UDP backend that answers each datagram with tag
// and the datagram; one that begins with "slow" is answered after delay.
func startTaggedUDPEcho(t *testing.T, tag string, delay time.Duration) netip.AddrPort {
	t.Helper()
	c := listenUDP(t, "127.0.0.1")
	go func() {
		buf := make([]byte, maxDatagram)
		for {
			n, from, err := c.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			reply := append([]byte(tag+":"), buf[:n]...)
			if bytes.HasPrefix(buf[:n], []byte("slow")) {
				time.AfterFunc(delay, func() { c.WriteToUDPAddrPort(reply, from) })
				continue
			}
			c.WriteToUDPAddrPort(reply, from)
		}
	}()
	return udpAddr(c)
}

// TestUDPClientsResume: twenty clients' entries, spread over two endpoints,
// move from one proxy to another through a handover connection, while each
// client's next datagram waits and one reply is still on its way from its
// endpoint. Every client keeps its endpoint (the new proxy's Picker would
// pick otherwise), the reply on its way reaches its client through the new
// proxy, the old proxy relays nothing after DetachClients, and both
// pickers' counts balance.
func TestUDPClientsResume(t *testing.T) {
	a := startTaggedUDPEcho(t, "a", 300*time.Millisecond)
	b := startTaggedUDPEcho(t, "b", 300*time.Millisecond)
	oldPicker, newPicker := newCyclePicker(a, b), newCyclePicker(b, a)
	old := &UDPProxy{Service: "ns/svc:udp", Picker: oldPicker, Loops: newLoops(t, 1, nil), Timeout: time.Minute}
	newP := &UDPProxy{Service: "ns/svc:udp", Picker: newPicker, Loops: newLoops(t, 1, nil), Timeout: time.Minute}

	conn, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	svc := udpAddr(conn)
	// The successor's copy of the Service socket, as HandOver gives it.
	f, err := conn.File()
	if err != nil {
		t.Fatal(err)
	}
	pc, err := net.FilePacketConn(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	oldDone, newDone := make(chan error, 1), make(chan error, 1)
	if err := old.Start(conn, func(err error) { oldDone <- err }); err != nil {
		t.Fatal(err)
	}

	const clients = 20
	var cs []*net.UDPConn
	first := map[int]string{}
	for i := range clients {
		c := listenUDP(t, "127.0.0.1")
		cs = append(cs, c)
		got, _, err := exchange(c, svc, []byte("hello"), 2*time.Second)
		if err != nil {
			t.Fatalf("client %d before: %v", i, err)
		}
		first[i], _, _ = strings.Cut(string(got), ":")
	}
	// One reply on its way when the entries move.
	if _, err := cs[0].WriteToUDPAddrPort([]byte("slow"), svc); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)

	states, err := old.DetachClients()
	if err != nil || len(states) != clients {
		t.Fatalf("DetachClients: %d states, %v; want %d", len(states), err, clients)
	}
	if n := old.Clients(); n != 0 {
		t.Errorf("the old proxy has %d entries after DetachClients, want none", n)
	}
	select {
	case err := <-oldDone:
		if err != nil {
			t.Errorf("the old proxy's Service socket ended with %v, want nil", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the old proxy still reads its Service socket after DetachClients")
	}
	if err := newP.Start(pc.(*net.UDPConn), func(err error) { newDone <- err }); err != nil {
		t.Fatal(err)
	}

	// Through a handover connection, as between processes.
	link := newHandoverLink(t)
	var moved []UDPClientState
	for _, batch := range UDPClientItems(states) {
		if err := link.sender.Send(batch); err != nil {
			t.Fatal(err)
		}
		items, err := link.receiver.Receive()
		if err != nil {
			t.Fatal(err)
		}
		got, err := UDPClientStates(items)
		if err != nil {
			t.Fatal(err)
		}
		moved = append(moved, got...)
	}
	for i := range states {
		states[i].Close() // the old process's copies, once the new one has them
	}
	if dropped, err := newP.ResumeClients(moved); dropped != 0 || err != nil {
		t.Fatalf("ResumeClients: %d dropped, %v", dropped, err)
	}

	cs[0].SetReadDeadline(time.Now().Add(3 * time.Second))
	buf := make([]byte, 100)
	n, err := cs[0].Read(buf)
	if err != nil || !strings.HasSuffix(string(buf[:n]), ":slow") {
		t.Errorf("the reply on its way during the move: %q, %v", buf[:n], err)
	}
	for i, c := range cs {
		got, _, err := exchange(c, svc, []byte("again"), 2*time.Second)
		if err != nil {
			t.Fatalf("client %d after: %v", i, err)
		}
		if tag, _, _ := strings.Cut(string(got), ":"); tag != first[i] {
			t.Errorf("client %d: endpoint %s before the move, %s after, want the same", i, first[i], tag)
		}
	}
	if n := newP.Clients(); n != clients {
		t.Errorf("the new proxy has %d entries, want %d", n, clients)
	}
	if err := old.Close(); err != nil {
		t.Error(err)
	}
	if err := newP.Close(); err != nil {
		t.Error(err)
	}
	if err := <-newDone; err != nil {
		t.Errorf("the new proxy's Service socket: %v", err)
	}
	if u := oldPicker.unreleased(); len(u) != 0 {
		t.Errorf("old picker: active counts %v, want none", u)
	}
	if u := newPicker.unreleased(); len(u) != 0 {
		t.Errorf("new picker: active counts %v, want none", u)
	}
}

// A state that ends early, or names no client, is refused whole, and its
// descriptors are closed.
func TestUDPClientStateEncoding(t *testing.T) {
	st := UDPClientState{fd: -1, client: netip.MustParseAddrPort("10.0.0.1:5353"), endpoint: netip.MustParseAddrPort("10.1.0.1:53"),
		local: netip.MustParseAddr("10.96.0.10"), service: "[::]:41000", start: time.Unix(1700000000, 5), idleFor: time.Second,
		bytesIn: 10, bytesOut: 20, judged: true}
	st.attempt.Endpoint = st.endpoint
	enc := st.appendBinary(nil)
	c := listenUDP(t, "127.0.0.1")
	fd, err := takeFD(c)
	if err != nil {
		t.Fatal(err)
	}
	got, err := decodeUDPClientState(handover.Item{FD: fd, Meta: enc})
	if err != nil {
		t.Fatal(err)
	}
	got.fd = -1
	if got.client != st.client || got.endpoint != st.endpoint || got.local != st.local || got.service != st.service ||
		!got.start.Equal(st.start) || got.idleFor != st.idleFor || got.bytesIn != 10 || got.bytesOut != 20 || !got.judged || got.attempt.Endpoint != st.endpoint {
		t.Errorf("decoded %+v, want %+v", got, st)
	}
	for cut := range len(enc) {
		if _, err := decodeUDPClientState(handover.Item{FD: fd, Meta: enc[:cut]}); err == nil {
			t.Errorf("a state cut at %d of %d bytes decoded", cut, len(enc))
		}
	}
	if _, err := UDPClientStates([]handover.Item{{FD: fd, Meta: enc[:3]}}); err == nil {
		t.Error("UDPClientStates took a cut state")
	}
}
