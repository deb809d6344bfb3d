package rules

import (
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/hashicorp/go-multierror"

	"github.com/uproxy/uproxy/netfilter/conntrack/conntracktest"
	"github.com/uproxy/uproxy/service"
)

type nopCloser struct{}

func (nopCloser) Close() error { return nil }

// TestNFTablesChangeWritesWhatAWholeWriteWould: after every sync of a random
// walk of small changes (Service ports added, removed, moved, refused,
// re-addressed onto another's key, given a NodePort or another protocol),
// the table and the errors are those of one whole write of the same
// portals, and the stale UDP flows deleted are those the whole way deletes.
func TestNFTablesChangeWritesWhatAWholeWriteWould(t *testing.T) {
	t.Parallel()
	listen := func(network, address string) (io.Closer, error) { return nopCloser{}, nil }
	rng := rand.New(rand.NewPCG(44, 1))
	const names = 40
	newPort := func(i int) *service.Port {
		proto := service.TCP
		if rng.IntN(4) == 0 {
			proto = service.UDP
		}
		sp := port("ns", fmt.Sprintf("svc-%02d", i), "", proto, 80+rng.IntN(2))
		sp.ClusterIPs = ips(fmt.Sprintf("10.96.0.%d", 1+i))
		if rng.IntN(10) == 0 {
			// Few addresses, so that two Service ports sometimes want one key.
			sp.ClusterIPs = ips(fmt.Sprintf("10.96.1.%d", 1+rng.IntN(3)))
		}
		if rng.IntN(5) == 0 {
			sp.ExternalIPs = ips(fmt.Sprintf("10.250.0.%d", 1+rng.IntN(20)))
		}
		if rng.IntN(8) == 0 {
			sp.NodePort = 30000 + rng.IntN(10)
		}
		return sp
	}
	newPortal := func(i int) Portal {
		pt := Portal{Port: newPort(i), ProxyPort: 40000 + rng.IntN(1000)}
		if rng.IntN(6) == 0 {
			pt.Refuse.Cluster[v4] = true
		}
		return pt
	}
	cur := map[int]Portal{}
	for i := range names / 2 {
		cur[i] = newPortal(i)
	}
	rec := &conntracktest.Recorder{}
	p, k := newTestNFTables(t, Config{Listen: listen, Conntrack: rec})
	for step := range 300 {
		for range 1 + rng.IntN(3) {
			i := rng.IntN(names)
			switch _, in := cur[i]; {
			case !in:
				cur[i] = newPortal(i)
			case rng.IntN(3) == 0:
				delete(cur, i)
			case rng.IntN(2) == 0:
				// The same Service port, in a new Port (an endpoint change).
				pt := cur[i]
				c := *pt.Port
				pt.Port = &c
				cur[i] = pt
			default:
				cur[i] = newPortal(i)
			}
		}
		var portals []Portal
		for i := range names {
			if pt, ok := cur[i]; ok {
				portals = append(portals, pt)
			}
		}
		err := p.Sync(portals)

		wrec := &conntracktest.Recorder{}
		whole, wk := newTestNFTables(t, Config{Listen: listen, Conntrack: wrec})
		p.mu.Lock()
		lastUDP := p.udp[v4].last
		p.mu.Unlock()
		wantErr := whole.Sync(portals)
		if got, want := errorLines(err), errorLines(wantErr); got != want {
			t.Fatalf("step %d: errors\n%s\nwant, as a whole write gives,\n%s", step, got, want)
		}
		sorted := func(dump string) string {
			lines := strings.Split(dump, "\n")
			slices.Sort(lines)
			return strings.Join(lines, "\n")
		}
		if got, want := sorted(k.Dump()), sorted(wk.Dump()); got != want {
			t.Fatalf("step %d: table\n%s\nwant, as written whole,\n%s", step, got, want)
		}
		whole.mu.Lock()
		wantUDP := whole.udp[v4].last
		whole.mu.Unlock()
		if lastUDP != nil && wantUDP != nil && (fmt.Sprint(*lastUDP) != fmt.Sprint(*wantUDP)) {
			t.Fatalf("step %d: UDP destinations %v, want %v", step, *lastUDP, *wantUDP)
		}
	}
}

// errorLines returns the messages inside err, sorted, one a line.
func errorLines(err error) string {
	if err == nil {
		return ""
	}
	var lines []string
	var m *multierror.Error
	errs := []error{err}
	if errors.As(err, &m) {
		errs = m.Errors
	}
	for _, e := range errs {
		lines = append(lines, e.Error())
	}
	slices.Sort(lines)
	return strings.Join(lines, "\n")
}
