package proxier

import (
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"

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
}

// newAllocator returns an allocator over r; the zero PortRange means the kernel's
// ephemeral range. Ports are chosen here rather than by binding port 0: the
// kernel's search for a free port gets slower with every port held, so that
// opening many proxy ports by port 0 takes many times as long (BenchmarkSync
// opens them at 10k Service ports).
func newAllocator(r PortRange) *allocator {
	if r.First == 0 {
		r = ephemeralRange()
	}
	return &allocator{r: r, used: make(map[service.Protocol]map[int]bool)}
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
		if used[p] {
			continue
		}
		taken, stop := try(p)
		if taken {
			used[p] = true
			return true
		}
		if stop {
			return false
		}
	}
	return false
}

func (a *allocator) release(proto service.Protocol, port int) { delete(a.used[proto], port) }
