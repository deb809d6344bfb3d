package rules

import (
	"fmt"
	"net"
	"net/netip"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/test/testbed"
)

// BenchmarkConnThroughPortals measures, for each backend, the CPU of one new
// TCP connection to a ClusterIP that the portals steer to a proxy port
// (connect, accept, close; the test process does both ends, so its CPU holds
// the netfilter work of the SYN in either namespace), from a pod and from a
// node process, with 10 and with 10000 Service ports programmed. The
// connections go round robin to five Service ports spread evenly over the
// set, the last of them at its end, so a layout whose cost grows with the
// Service ports shows it at 10000 and a flat one does not.
//
// Run as root: go test -run '^$' -bench ConnThroughPortals -benchtime 20000x ./rules
func BenchmarkConnThroughPortals(b *testing.B) {
	for _, be := range realBackends {
		b.Run(be.name, func(b *testing.B) { benchmarkConnThroughPortals(b, be) })
	}
}

func benchmarkConnThroughPortals(b *testing.B, be realBackend) {
	testbed.Needs(b, be.need)
	tp := testbed.New(b)
	node := tp.NS(testbed.Node)
	p, _ := be.build(b, Config{NodeIPs: []netip.Addr{node.IPv4}, DialMark: testDialMark})
	defer func() {
		if err := tp.Run(testbed.Node, p.Cleanup); err != nil {
			b.Error(err)
		}
	}()
	for _, n := range []int{10, 10000} {
		portals := benchPortals(n, 20000)
		// Five TCP Service ports (even indexes), the last at the end.
		type target struct {
			sa *unix.SockaddrInet4
			ln *net.TCPListener
		}
		var targets []target
		for k := range 5 {
			pt := portals[(k+1)*n/5-2]
			vip := pt.Port.ClusterIPs[0]
			ln := tp.Listen(testbed.Node, "tcp", fmt.Sprintf("0.0.0.0:%d", pt.ProxyPort)).(*net.TCPListener)
			targets = append(targets, target{sa: &unix.SockaddrInet4{Addr: vip.As4(), Port: pt.Port.Port}, ln: ln})
		}
		if err := tp.Run(testbed.Node, func() error { return p.Sync(portals) }); err != nil {
			b.Fatal(err)
		}
		var lfds []int
		for _, t := range targets {
			f, err := t.ln.File()
			if err != nil {
				b.Fatal(err)
			}
			defer f.Close()
			unix.SetNonblock(int(f.Fd()), false)
			lfds = append(lfds, int(f.Fd()))
		}
		i := 0
		dial := func() error {
			t := i % len(targets)
			i++
			return testbed.ConnectAccept(targets[t].sa, lfds[t], 0)
		}
		for _, from := range []string{testbed.Pod, testbed.Node} {
			b.Run(fmt.Sprintf("from=%s/portals=%d", from, n), func(b *testing.B) { tp.BenchConns(b, from, dial) })
		}
	}
}
