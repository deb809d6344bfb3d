package nftables

import (
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/test/testbed"
)

// benchSnapshot returns n Service ports: alternating TCP and UDP, each with a
// ClusterIP and two endpoints, every tenth with an ExternalIP and a NodePort.
func benchSnapshot(n int) *service.Snapshot {
	ports := make([]*service.Port, n)
	for i := range n {
		ports[i] = benchServicePort(i, 0)
	}
	return &service.Snapshot{Ports: ports}
}

// benchServicePort is Service port i; gen moves its endpoints, as a rollout would.
func benchServicePort(i, gen int) *service.Port {
	proto := service.TCP
	if i%2 == 1 {
		proto = service.UDP
	}
	sp := svcPort("bench", fmt.Sprintf("svc-%05d", i), "p", proto, 80)
	sp.ClusterIPs = []netip.Addr{netip.AddrFrom4([4]byte{10, 96 + byte(i>>16), byte(i >> 8), byte(i)})}
	port := uint16(8080 + gen)
	sp.Endpoints = []service.Endpoint{
		{Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 244 + byte(i>>16), byte(i >> 8), byte(i)}), 8080), Ready: true},
		{Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 248 + byte(i>>16), byte(i >> 8), byte(i)}), port), Ready: true},
	}
	if i%10 == 0 {
		sp.ExternalIPs = []netip.Addr{netip.AddrFrom4([4]byte{10, 252 + byte(i>>16), byte(i >> 8), byte(i)})}
		sp.NodePort = 30000 + i/10
	}
	return sp
}

// with returns s with port i replaced by p (nil: removed); the other ports
// are the same pointers, as a source hands them on.
func with(s *service.Snapshot, i int, p *service.Port) *service.Snapshot {
	ports := append([]*service.Port{}, s.Ports[:i]...)
	if p != nil {
		ports = append(ports, p)
	}
	return &service.Snapshot{Ports: append(ports, s.Ports[i+1:]...)}
}

// BenchmarkSync measures Sync with real nftables in a namespace, nft's start
// and the kernel's commit included. min-ms and max-ms give the range.
//
//	full:         every iteration forgets what was written, as after a restart
//	              or a flush: the whole table in one transaction
//	one-service:  a Service port appears or goes (alternately): its elements
//	one-endpoint: one endpoint of one Service port moves (and back): one
//	              element deleted and added, and the hairpin pair
//
//	go test -run '^$' -bench Sync -benchtime 3x ./kernelmodes/nftables/
func BenchmarkSync(b *testing.B) {
	for _, c := range []struct {
		n    int
		mode string
	}{
		{10000, "full"}, {10000, "one-service"}, {10000, "one-endpoint"}, {50000, "full"},
	} {
		b.Run(fmt.Sprintf("ports=%d/%s", c.n, c.mode), func(b *testing.B) {
			testbed.Needs(b, testbed.NFTables)
			tp := testbed.New(b)
			s := benchSnapshot(c.n)
			var other *service.Snapshot
			switch c.mode {
			case "one-service":
				other = with(s, c.n/2, nil)
			case "one-endpoint":
				other = with(s, c.n/2, benchServicePort(c.n/2, 1))
			}
			err := tp.Run(testbed.Node, func() error {
				p, err := New(Config{})
				if err != nil {
					return err
				}
				if err := p.Sync(s); err != nil {
					return err
				}
				var runs []time.Duration
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					next := s
					switch {
					case c.mode == "full":
						p.mu.Lock()
						p.written = nil
						p.mu.Unlock()
					case i%2 == 0:
						next = other
					}
					start := time.Now()
					if err := p.Sync(next); err != nil {
						return err
					}
					runs = append(runs, time.Since(start))
					if p.lastWasFull != (c.mode == "full") {
						return fmt.Errorf("sync %d: whole write %v, want %v", i, p.lastWasFull, c.mode == "full")
					}
				}
				b.StopTimer()
				b.ReportMetric(float64(minOf(runs).Microseconds())/1000, "min-ms")
				b.ReportMetric(float64(maxOf(runs).Microseconds())/1000, "max-ms")
				return p.Cleanup()
			})
			if err != nil {
				b.Fatal(err)
			}
		})
	}
}

func minOf(ds []time.Duration) time.Duration {
	m := ds[0]
	for _, d := range ds {
		m = min(m, d)
	}
	return m
}

func maxOf(ds []time.Duration) time.Duration {
	m := ds[0]
	for _, d := range ds {
		m = max(m, d)
	}
	return m
}

// BenchmarkRender measures rendering every Service port alone.
func BenchmarkRender(b *testing.B) {
	for _, n := range []int{10000} {
		b.Run(fmt.Sprintf("ports=%d", n), func(b *testing.B) {
			s := benchSnapshot(n)
			p, _, _ := newFake(b, Config{})
			for b.Loop() {
				for _, sp := range s.Ports {
					p.r.port(sp)
				}
			}
		})
	}
}

// BenchmarkConnThroughKernelMode measures the CPU (user + system of the
// process, in which the kernel runs the nat chains for the connections it
// opens, from either namespace) per new connection from a pod and from the
// node to a ClusterIP DNATed to a listener on the node, with 10 and 10k other
// Service ports in the table: the cost must not grow with the number of
// Services.
//
//	go test -run '^$' -bench ConnThroughKernelMode ./kernelmodes/nftables/
func BenchmarkConnThroughKernelMode(b *testing.B) {
	testbed.Needs(b, testbed.NFTables)
	tp := testbed.New(b)
	node := tp.NS(testbed.Node)
	ln := tp.Listen(testbed.Node, "tcp", node.IPv4.String()+":0")
	to := ln.Addr().(*net.TCPAddr).AddrPort()
	lfd, err := ln.(*net.TCPListener).File()
	if err != nil {
		b.Fatal(err)
	}
	defer lfd.Close()
	unix.SetNonblock(int(lfd.Fd()), false)
	target := svcPort("bench", "target", "", service.TCP, 80)
	target.ClusterIPs = []netip.Addr{netip.MustParseAddr("10.95.0.10")}
	target.Endpoints = []service.Endpoint{{Addr: to, Ready: true}}
	sa := &unix.SockaddrInet4{Addr: [4]byte{10, 95, 0, 10}, Port: 80}
	dial := func() error { return testbed.ConnectAccept(sa, int(lfd.Fd()), 0) }
	var p *Proxier
	if err := tp.Run(testbed.Node, func() (err error) { p, err = New(Config{}); return err }); err != nil {
		b.Fatal(err)
	}
	for _, n := range []int{10, 10000} {
		s := benchSnapshot(n)
		s.Ports = append(s.Ports, target)
		if err := tp.Run(testbed.Node, func() error { return p.Sync(s) }); err != nil {
			b.Fatal(err)
		}
		for _, from := range []string{testbed.Pod, testbed.Node} {
			b.Run(fmt.Sprintf("from=%s/ports=%d", from, n), func(b *testing.B) { tp.BenchConns(b, from, dial) })
		}
	}
	tp.Run(testbed.Node, p.Cleanup)
}
