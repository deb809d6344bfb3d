// Package nfacct reads and keeps the kernel's extended accounting objects
// (nfnetlink_acct): named packet and byte counters that an iptables rule adds
// to with `-m nfacct --nfacct-name NAME`, as the iptables mode counts the
// packets it accepts on localhost NodePorts.
//
//	c, err := nfacct.Open()        // the calling thread's network namespace
//	err = c.Ensure("uproxy_localhost_nps_pkts")
//	n, err := c.Get("uproxy_localhost_nps_pkts")
//
// An object belongs to the network namespace it was created in, and so does a
// Client: it keeps one netlink socket opened by Open, whatever thread later
// uses it. A rule naming an object that does not exist is refused by the
// kernel, so a rule's object must be ensured before the rule is written.
package nfacct

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// MaxNameLen is the longest name the kernel takes (NFACCT_NAME_MAX less its NUL).
const MaxNameLen = 31

// Message types and attributes of nfnetlink_acct (linux/netfilter/nfnetlink_acct.h).
const (
	msgNew = 0 // NFNL_MSG_ACCT_NEW
	msgGet = 1 // NFNL_MSG_ACCT_GET
	msgDel = 3 // NFNL_MSG_ACCT_DEL

	attrName    = 1 // NFACCT_NAME, NUL-terminated
	attrPackets = 2 // NFACCT_PKTS, big-endian u64
	attrBytes   = 3 // NFACCT_BYTES, big-endian u64
)

// requestTimeout bounds the wait for the kernel's answer to one request.
const requestTimeout = 5 * time.Second

// ErrNotFound is the error of Get and Delete for a name no object has.
var ErrNotFound = errors.New("no such nfacct object")

// Counter is one object's value.
type Counter struct {
	Name    string
	Packets uint64
	Bytes   uint64
}

// Client talks to nfnetlink_acct in the network namespace it was opened in.
// Its methods may be called from any goroutine.
type Client struct {
	// mu guards sock, which is nil once closed; nl serialises each request's
	// send and receive on the socket, mu keeps Close from racing them.
	mu   sync.Mutex
	sock *nl.NetlinkSocket
}

// Open opens a netfilter netlink socket in the calling thread's network
// namespace and checks that the kernel has nfnetlink_acct
// (CONFIG_NETFILTER_NETLINK_ACCT): a kernel without it answers every request
// with EOPNOTSUPP or EPROTONOSUPPORT, and Open says so.
func Open() (*Client, error) {
	sock, err := nl.GetNetlinkSocketAt(netns.None(), netns.None(), unix.NETLINK_NETFILTER)
	if err != nil {
		return nil, fmt.Errorf("open netfilter netlink socket for nfacct: %w", err)
	}
	// A kernel that never answers must not hang a sync or a scrape.
	tv := unix.NsecToTimeval(int64(requestTimeout))
	if err := sock.SetReceiveTimeout(&tv); err != nil {
		sock.Close()
		return nil, fmt.Errorf("nfacct socket receive timeout: %w", err)
	}
	c := &Client{sock: sock}
	// A name no one uses: the kernel answers ENOENT when it has the subsystem.
	if _, err := c.Get("uproxy probe"); err != nil && !errors.Is(err, ErrNotFound) {
		c.Close()
		return nil, fmt.Errorf("nfacct unavailable (CONFIG_NETFILTER_NETLINK_ACCT): %w", err)
	}
	return c, nil
}

// Close closes the socket; later calls return an error.
func (c *Client) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.sock != nil {
		c.sock.Close()
		c.sock = nil
	}
	return nil
}

// Ensure creates the object name unless it exists; an existing object keeps
// its counts.
func (c *Client) Ensure(name string) error {
	if _, err := c.Get(name); !errors.Is(err, ErrNotFound) {
		return err
	}
	// Without NLM_F_REPLACE the kernel refuses a name that exists (EBUSY)
	// rather than zeroing it: another process that created it meanwhile wins.
	if _, err := c.execute(msgNew, unix.NLM_F_CREATE|unix.NLM_F_ACK, name); err != nil && !errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("create nfacct object %q: %w", name, err)
	}
	return nil
}

// Get returns the object name's counts; ErrNotFound when there is none.
func (c *Client) Get(name string) (Counter, error) {
	// The kernel marks its answer NLM_F_MULTI though it is one message and
	// sends no NLMSG_DONE after it: the ACK asked for is what ends it.
	msgs, err := c.execute(msgGet, unix.NLM_F_ACK, name)
	if errors.Is(err, unix.ENOENT) {
		return Counter{}, fmt.Errorf("nfacct object %q: %w", name, ErrNotFound)
	}
	if err != nil {
		return Counter{}, fmt.Errorf("read nfacct object %q: %w", name, err)
	}
	for _, m := range msgs {
		if ctr, err := decode(m); err != nil {
			return Counter{}, fmt.Errorf("read nfacct object %q: %w", name, err)
		} else if ctr.Name == name {
			return ctr, nil
		}
	}
	return Counter{}, fmt.Errorf("read nfacct object %q: the kernel's answer does not hold it", name)
}

// Delete removes the object name. The kernel refuses (EBUSY) while a rule
// names it; an object already gone is ErrNotFound.
func (c *Client) Delete(name string) error {
	_, err := c.execute(msgDel, unix.NLM_F_ACK, name)
	switch {
	case errors.Is(err, unix.ENOENT):
		return fmt.Errorf("nfacct object %q: %w", name, ErrNotFound)
	case err != nil:
		return fmt.Errorf("delete nfacct object %q: %w", name, err)
	}
	return nil
}

// execute sends one request about name and returns the answer's messages.
func (c *Client) execute(msg int, flags int, name string) ([][]byte, error) {
	if name == "" || len(name) > MaxNameLen {
		return nil, fmt.Errorf("nfacct name %q: want 1 to %d bytes", name, MaxNameLen)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.sock == nil {
		return nil, errors.New("nfacct client closed")
	}
	req := nl.NewNetlinkRequest(unix.NFNL_SUBSYS_ACCT<<8|msg, flags)
	req.Sockets = map[int]*nl.SocketHandle{unix.NETLINK_NETFILTER: {Socket: c.sock}}
	req.AddData(&nl.Nfgenmsg{NfgenFamily: unix.AF_UNSPEC, Version: nl.NFNETLINK_V0})
	req.AddData(nl.NewRtAttr(attrName, nl.ZeroTerminated(name)))
	return req.Execute(unix.NETLINK_NETFILTER, 0)
}

// decode reads one NFNL_MSG_ACCT_NEW message (the answer to a GET): a
// nfgenmsg, then attributes.
func decode(m []byte) (Counter, error) {
	if len(m) < nl.SizeofNfgenmsg {
		return Counter{}, fmt.Errorf("nfacct message of %d bytes: shorter than its header", len(m))
	}
	attrs, err := nl.ParseRouteAttr(m[nl.SizeofNfgenmsg:])
	if err != nil {
		return Counter{}, fmt.Errorf("nfacct message attributes: %w", err)
	}
	var ctr Counter
	var seen int
	for _, a := range attrs {
		switch a.Attr.Type {
		case attrName:
			ctr.Name = string(trimNUL(a.Value))
			seen |= 1
		case attrPackets, attrBytes:
			if len(a.Value) != 8 {
				return Counter{}, fmt.Errorf("nfacct attribute %d of %d bytes, want 8", a.Attr.Type, len(a.Value))
			}
			if a.Attr.Type == attrPackets {
				ctr.Packets, seen = binary.BigEndian.Uint64(a.Value), seen|2
			} else {
				ctr.Bytes, seen = binary.BigEndian.Uint64(a.Value), seen|4
			}
		}
	}
	if seen != 7 {
		return Counter{}, fmt.Errorf("nfacct message lacks its name, packets or bytes")
	}
	return ctr, nil
}

func trimNUL(b []byte) []byte {
	for i, c := range b {
		if c == 0 {
			return b[:i]
		}
	}
	return b
}
