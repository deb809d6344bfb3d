package rules

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os/exec"
	"strings"

	"github.com/coreos/go-iptables/iptables"
	"github.com/vishvananda/netlink"
)

// Tables is the part of go-iptables (*iptables.IPTables) the portals use: checking
// and inserting the jump rules in built-in chains, and reading the canary chain.
type Tables interface {
	Exists(table, chain string, rulespec ...string) (bool, error)
	Insert(table, chain string, pos int, rulespec ...string) error
	Append(table, chain string, rulespec ...string) error
	List(table, chain string) ([]string, error)
}

// ConntrackDeleter deletes conntrack flows; *netlink.Handle implements it.
type ConntrackDeleter interface {
	ConntrackDeleteFilters(table netlink.ConntrackTableType, family netlink.InetFamily, filters ...netlink.CustomConntrackFilter) (uint, error)
}

// Kernel is everything outside the process the portals touch. A nil *Kernel in
// Config, or a nil field, means the real thing: iptables commands, netlink and
// sockets. Every call happens on the goroutine that called Sync or Cleanup, so a
// caller that locked its thread into a network namespace programs that namespace.
type Kernel struct {
	// Tables returns the rule API of one family (go-iptables by default).
	Tables func(v6 bool) (Tables, error)
	// Restore feeds input to `iptables-restore --noflush` (ip6tables-restore when v6).
	Restore func(v6 bool, input []byte) error
	// Save returns the output of `iptables-save` (ip6tables-save when v6) for every
	// table that exists.
	Save func(v6 bool) ([]byte, error)
	// Conntrack deletes stale UDP flows (netlink in the caller's namespace by default).
	Conntrack ConntrackDeleter
	// Listen holds a NodePort open: network is tcp4, tcp6, udp4 or udp6 (net.Listen /
	// net.ListenPacket by default).
	Listen func(network, address string) (io.Closer, error)
}

func (k *Kernel) tables(v6 bool) (Tables, error) {
	if k != nil && k.Tables != nil {
		return k.Tables(v6)
	}
	proto := iptables.ProtocolIPv4
	if v6 {
		proto = iptables.ProtocolIPv6
	}
	t, err := iptables.New(iptables.IPFamily(proto), iptables.Timeout(5))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", command(v6, ""), err)
	}
	return t, nil
}

func (k *Kernel) restore(v6 bool, input []byte) error {
	if k != nil && k.Restore != nil {
		return k.Restore(v6, input)
	}
	// -w waits for the xtables lock when the legacy backend holds it; nf_tables
	// ignores it. The argument list goes to exec directly: no shell sees it.
	cmd := exec.Command(command(v6, "-restore"), "-w", "5", "--noflush")
	cmd.Stdin = bytes.NewReader(input)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s --noflush: %w: %s", command(v6, "-restore"), err, strings.TrimSpace(stderr.String()))
	}
	return nil
}

func (k *Kernel) save(v6 bool) ([]byte, error) {
	if k != nil && k.Save != nil {
		return k.Save(v6)
	}
	cmd := exec.Command(command(v6, "-save"))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("%s: %w: %s", command(v6, "-save"), err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}

func (k *Kernel) conntrack() ConntrackDeleter {
	if k != nil && k.Conntrack != nil {
		return k.Conntrack
	}
	// A zero Handle opens a netlink socket per request, in the namespace of the
	// calling thread at that moment (NewHandle would pin the namespace of creation).
	return &netlink.Handle{}
}

func (k *Kernel) listen(network, address string) (io.Closer, error) {
	if k != nil && k.Listen != nil {
		return k.Listen(network, address)
	}
	if strings.HasPrefix(network, "udp") {
		return net.ListenPacket(network, address)
	}
	// A listening socket, never accepted from: a bound but idle TCP socket would
	// not stop another SO_REUSEADDR socket from binding the port.
	return net.Listen(network, address)
}

func command(v6 bool, suffix string) string {
	if v6 {
		return "ip6tables" + suffix
	}
	return "iptables" + suffix
}

// missingCommand reports whether err says the iptables binary itself is absent,
// which Cleanup treats as nothing to clean.
func missingCommand(err error) bool {
	return errors.Is(err, exec.ErrNotFound)
}
