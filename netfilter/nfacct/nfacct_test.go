package nfacct

import (
	"encoding/binary"
	"errors"
	"net"
	"strings"
	"testing"

	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/test/testbed"
)

// message builds an answer to a GET as the kernel writes it.
func message(name string, packets, bytes uint64, withBytes bool) []byte {
	b := make([]byte, nl.SizeofNfgenmsg)
	b = append(b, nl.NewRtAttr(attrName, nl.ZeroTerminated(name)).Serialize()...)
	var v [8]byte
	binary.BigEndian.PutUint64(v[:], packets)
	b = append(b, nl.NewRtAttr(attrPackets, v[:]).Serialize()...)
	if withBytes {
		binary.BigEndian.PutUint64(v[:], bytes)
		b = append(b, nl.NewRtAttr(attrBytes, v[:]).Serialize()...)
	}
	return b
}

func TestDecode(t *testing.T) {
	got, err := decode(message("localhost_nps", 1<<40+3, 77, true))
	if want := (Counter{Name: "localhost_nps", Packets: 1<<40 + 3, Bytes: 77}); err != nil || got != want {
		t.Errorf("decode: got %+v (%v), want %+v", got, err, want)
	}
	for name, m := range map[string][]byte{
		"no bytes attribute":      message("x", 1, 0, false),
		"shorter than its header": {0, 0},
	} {
		if c, err := decode(m); err == nil {
			t.Errorf("decode of a message with %s: got %+v, want an error", name, c)
		}
	}
}

func TestNameBounds(t *testing.T) {
	c := &Client{} // closed: a bad name must be refused before any use of it
	for _, name := range []string{"", strings.Repeat("n", MaxNameLen+1)} {
		if err := c.Ensure(name); err == nil || !strings.Contains(err.Error(), "want 1 to 31 bytes") {
			t.Errorf("Ensure(%q): got %v, want the name refused", name, err)
		}
	}
}

// TestRealNFAcct creates an object in a namespace of its own, counts packets
// with an iptables rule naming it, reads them back, and deletes it once no rule
// names it.
func TestRealNFAcct(t *testing.T) {
	testbed.Needs(t, testbed.IPTables)
	tp := testbed.New(t)
	const name = "test_nps_pkts"
	var c *Client
	if err := tp.Run(testbed.Node, func() (err error) { c, err = Open(); return err }); err != nil {
		t.Fatalf("Open: %v", err)
	}
	defer c.Close()

	if _, err := c.Get(name); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get before Ensure: got %v, want ErrNotFound", err)
	}
	// A rule cannot name an object that does not exist yet.
	rule := []string{"iptables", "-t", "filter", "-A", "OUTPUT", "-p", "udp", "--dport", "9", "-m", "nfacct", "--nfacct-name", name}
	if _, err := tp.Exec(testbed.Node, rule...); err == nil {
		t.Fatalf("iptables rule naming a missing nfacct object: accepted, want refused")
	}
	for range 2 { // the second finds it and keeps it
		if err := c.Ensure(name); err != nil {
			t.Fatalf("Ensure: %v", err)
		}
	}
	tp.MustExec(t, testbed.Node, rule...)

	// A sink, so that no port unreachable fails the sender's next write.
	tp.ListenPacket(testbed.External, "udp", tp.NS(testbed.External).IPv4.String()+":9")

	// The client was opened in the node's namespace: it reads that namespace's
	// object from this goroutine, which is not in it.
	send := func(n int) {
		t.Helper()
		err := tp.Run(testbed.Node, func() error {
			conn, err := net.Dial("udp", tp.NS(testbed.External).IPv4.String()+":9")
			if err != nil {
				return err
			}
			defer conn.Close()
			for range n {
				if _, err := conn.Write([]byte("x")); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	send(5)
	got, err := c.Get(name)
	if err != nil || got.Packets != 5 || got.Bytes != 5*29 {
		t.Fatalf("after 5 datagrams of 1 byte: got %+v (%v), want 5 packets, %d bytes", got, err, 5*29)
	}
	if err := c.Ensure(name); err != nil {
		t.Fatal(err)
	}
	send(2)
	if got, err := c.Get(name); err != nil || got.Packets != 7 {
		t.Errorf("Ensure of an existing object, then 2 datagrams: got %+v (%v), want 7 packets kept", got, err)
	}

	if err := c.Delete(name); !errors.Is(err, unix.EBUSY) {
		t.Errorf("Delete while a rule names it: got %v, want EBUSY", err)
	}
	tp.MustExec(t, testbed.Node, "iptables", "-t", "filter", "-F", "OUTPUT")
	if err := c.Delete(name); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	if err := c.Delete(name); !errors.Is(err, ErrNotFound) {
		t.Errorf("second Delete: got %v, want ErrNotFound", err)
	}
	if _, err := c.Get(name); !errors.Is(err, ErrNotFound) {
		t.Errorf("Get after Delete: got %v, want ErrNotFound", err)
	}
}
