package proxier

import (
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"

	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/service"
)

// PortRange is an inclusive range of proxy ports. The zero value means "let the
// kernel choose" (bind port 0).
type PortRange struct {
	First, Last int
}

// ParsePortRange parses --proxy-port-range: "" (random), "FIRST-LAST", or
// "FIRST+OFFSET" (FIRST through FIRST+OFFSET), as kube-proxy spells it.
func ParsePortRange(s string) (PortRange, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return PortRange{}, nil
	}
	sep := strings.IndexAny(s, "-+")
	if sep <= 0 {
		return PortRange{}, fmt.Errorf("port range %q: want FIRST-LAST or FIRST+OFFSET", s)
	}
	first, err := strconv.Atoi(s[:sep])
	if err != nil {
		return PortRange{}, fmt.Errorf("port range %q: first port %q is not a number", s, s[:sep])
	}
	second, err := strconv.Atoi(s[sep+1:])
	if err != nil {
		return PortRange{}, fmt.Errorf("port range %q: %q is not a number", s, s[sep+1:])
	}
	last := second
	if s[sep] == '+' {
		if second < 0 {
			return PortRange{}, fmt.Errorf("port range %q: offset must not be negative", s)
		}
		last = first + second
	}
	r := PortRange{First: first, Last: last}
	if first < 1 || first > 65535 || last < 1 || last > 65535 {
		return PortRange{}, fmt.Errorf("port range %q: ports must be within 1-65535", s)
	}
	if last < first {
		return PortRange{}, fmt.Errorf("port range %q: last port %d is below first port %d", s, last, first)
	}
	return r, nil
}

func (r PortRange) String() string {
	if r.First == 0 {
		return ""
	}
	return fmt.Sprintf("%d-%d", r.First, r.Last)
}

// allocator hands out ports of a PortRange not already held. Ports are tried
// from a random start so restarts do not all race for the same first port. TCP
// and UDP ports are apart (a TCP and a UDP socket may hold one number), so each
// protocol has the whole range.
type allocator struct {
	r    PortRange
	used map[service.Protocol]map[int]bool
	// reserved are the node's ports that the kernel never assigns by itself
	// (net.ipv4.ip_local_reserved_ports), kept for programs that bind them by
	// number. Without --proxy-port-range the allocator stands in for the
	// kernel's choice of a port, so it skips them as the kernel would; a
	// range given by the operator is an explicit choice and is used whole.
	// nil when there are none.
	reserved *portSet
	// nodePorts are the NodePorts of the Services being synced, by protocol
	// (setNodePorts): no proxy port may take one, since a NodePort is held by
	// binding it, and while it could not be held its clients would reach the
	// proxy socket on that port, another Service's.
	nodePorts map[service.Protocol]*portSet
}

// setNodePorts records the NodePorts of ports, which the allocator skips
// from now on.
func (a *allocator) setNodePorts(ports []*service.Port) {
	a.nodePorts = map[service.Protocol]*portSet{}
	for _, p := range ports {
		if p.NodePort == 0 {
			continue
		}
		set := a.nodePorts[p.Protocol]
		if set == nil {
			set = &portSet{}
			a.nodePorts[p.Protocol] = set
		}
		set.add(p.NodePort)
	}
}

// isNodePort reports whether port is a NodePort of protocol proto as of the
// last setNodePorts.
func (a *allocator) isNodePort(proto service.Protocol, port int) bool {
	return a.nodePorts[proto].contains(port)
}

// newAllocator returns an allocator over r; the zero PortRange means the kernel's
// ephemeral range. Ports are chosen here rather than by binding port 0: the
// kernel's search for a free port gets slower with every port held, so that
// opening many proxy ports by port 0 takes many times as long (BenchmarkSync
// opens them at 10k Service ports).
func newAllocator(r PortRange) *allocator {
	a := &allocator{r: r, used: make(map[service.Protocol]map[int]bool)}
	if r.First == 0 {
		a.r = ephemeralRange()
		a.reserved = reservedPorts()
	}
	return a
}

// portSet is a set of port numbers, a bit each.
type portSet [65536 / 64]uint64

func (s *portSet) add(p int)           { s[p/64] |= 1 << (p % 64) }
func (s *portSet) contains(p int) bool { return s != nil && s[p/64]&(1<<(p%64)) != 0 }

// parsePortSet parses the kernel's list of ports, as ip_local_reserved_ports
// gives it: ports and inclusive ranges separated by commas ("8080,9000-9010"),
// or nothing. It returns nil for an empty list.
func parsePortSet(list string) (*portSet, error) {
	list = strings.TrimSpace(list)
	if list == "" {
		return nil, nil
	}
	var s portSet
	for _, item := range strings.Split(list, ",") {
		first, last, isRange := strings.Cut(strings.TrimSpace(item), "-")
		lo, err := strconv.Atoi(first)
		if err != nil {
			return nil, fmt.Errorf("port list %q: %q is not a port", list, item)
		}
		hi := lo
		if isRange {
			if hi, err = strconv.Atoi(last); err != nil {
				return nil, fmt.Errorf("port list %q: %q is not a port range", list, item)
			}
		}
		if lo < 0 || hi > 65535 || hi < lo {
			return nil, fmt.Errorf("port list %q: %q is not a port range", list, item)
		}
		for p := lo; p <= hi; p++ {
			s.add(p)
		}
	}
	return &s, nil
}

// reservedPorts reads net.ipv4.ip_local_reserved_ports (which the kernel
// applies to IPv6 as well); nil when there are none or they cannot be read.
func reservedPorts() *portSet {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_reserved_ports")
	if err != nil {
		return nil
	}
	s, err := parsePortSet(string(b))
	if err != nil {
		// The kernel writes the list itself; a list it wrote that does not
		// parse means the format changed. Nothing is skipped then, as before
		// this was read.
		klog.ErrorS(err, "Proxy ports: cannot read the node's reserved ports; none are skipped")
		return nil
	}
	return s
}

// ephemeralRange reads net.ipv4.ip_local_port_range (Linux's default when unreadable).
func ephemeralRange() PortRange {
	r := PortRange{First: 32768, Last: 60999}
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return r
	}
	var first, last int
	if _, err := fmt.Sscan(string(b), &first, &last); err == nil && first >= 1 && last <= 65535 && first <= last {
		r = PortRange{First: first, Last: last}
	}
	return r
}

// each calls try with ports free for proto until try takes one (the port is
// then held), asks to stop, or the range is exhausted.
func (a *allocator) each(proto service.Protocol, try func(port int) (taken, stop bool)) bool {
	used := a.used[proto]
	if used == nil {
		used = make(map[int]bool)
		a.used[proto] = used
	}
	n := a.r.Last - a.r.First + 1
	start := rand.IntN(n)
	for i := 0; i < n; i++ {
		p := a.r.First + (start+i)%n
		if used[p] || a.reserved.contains(p) || a.isNodePort(proto, p) {
			continue
		}
		taken, stop := try(p)
		if taken {
			a.hold(proto, p)
			return true
		}
		if stop {
			return false
		}
	}
	return false
}

// hold marks port as in use for proto: a port each took, or a proxy socket
// handed by a predecessor (adopt.go).
func (a *allocator) hold(proto service.Protocol, port int) {
	if a.used[proto] == nil {
		a.used[proto] = make(map[int]bool)
	}
	a.used[proto][port] = true
}

func (a *allocator) release(proto service.Protocol, port int) { delete(a.used[proto], port) }
