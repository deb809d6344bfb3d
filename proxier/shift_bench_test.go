package proxier

import (
	"bufio"
	"fmt"
	"net"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/uproxy/uproxy/rules"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/test/testbed"
)

// shiftObjects returns n single-port Services, alternately TCP and UDP, every
// tenth a NodePort, each with one EndpointSlice of one endpoint at backend.
func shiftObjects(n int, backend netip.AddrPort) ([]*v1.Service, []*discoveryv1.EndpointSlice) {
	svcs := make([]*v1.Service, n)
	eps := make([]*discoveryv1.EndpointSlice, n)
	for i := range n {
		proto := v1.ProtocolTCP
		if i%2 == 1 {
			proto = v1.ProtocolUDP
		}
		svc := &v1.Service{
			ObjectMeta: metav1.ObjectMeta{Namespace: "bench", Name: fmt.Sprintf("svc-%05d", i)},
			Spec: v1.ServiceSpec{
				Type:      v1.ServiceTypeClusterIP,
				ClusterIP: netip.AddrFrom4([4]byte{10, 96, byte(i >> 8), byte(i)}).String(),
				Ports:     []v1.ServicePort{{Name: "p", Protocol: proto, Port: 80}},
			},
		}
		if i%10 == 0 {
			svc.Spec.Type = v1.ServiceTypeNodePort
			svc.Spec.Ports[0].NodePort = int32(30000 + i/10)
		}
		svcs[i] = svc
		eps[i] = shiftSlice(svc, backend)
	}
	return svcs, eps
}

func shiftSlice(svc *v1.Service, backend netip.AddrPort) *discoveryv1.EndpointSlice {
	name, proto, port := "p", svc.Spec.Ports[0].Protocol, int32(backend.Port())
	return &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: svc.Namespace,
			Name:      svc.Name + "-1",
			Labels:    map[string]string{discoveryv1.LabelServiceName: svc.Name},
		},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: &name, Protocol: &proto, Port: &port}},
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{backend.Addr().String()}}},
	}
}

// BenchmarkEndpointShift measures the userspace mode's path from an EndpointSlice
// change to traffic shifting, with n Service ports, real listeners and real
// iptables portals in a network namespace: building the Snapshot from the
// objects, the sources' comparison with the previous one, and the proxier's Sync
// (listeners, balancers and portals). Each iteration moves one TCP Service
// between two backends; after it, untimed, a connection to the Service's
// ClusterIP through the portal must reach the new backend.
//
// "incremental" builds with a service.Builder, as the sources do; "rebuild"
// builds every Snapshot from scratch with service.Build. The first full sync
// (every listener and rule) is reported as full-sync-ms.
func BenchmarkEndpointShift(b *testing.B) {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err == nil && lim.Cur < lim.Max {
		lim.Cur = lim.Max
		syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim)
	}
	builds := []struct {
		name string
		new  func() func([]*v1.Service, []*discoveryv1.EndpointSlice) *service.Snapshot
	}{
		{"incremental", func() func([]*v1.Service, []*discoveryv1.EndpointSlice) *service.Snapshot {
			return service.NewBuilder(service.BuildOptions{}).Build
		}},
		{"rebuild", func() func([]*v1.Service, []*discoveryv1.EndpointSlice) *service.Snapshot {
			return func(svcs []*v1.Service, eps []*discoveryv1.EndpointSlice) *service.Snapshot {
				return service.Build(svcs, eps, service.BuildOptions{})
			}
		}},
	}
	for _, n := range []int{1000, 10000} {
		for _, bl := range builds {
			b.Run(fmt.Sprintf("ports=%d/%s", n, bl.name), func(b *testing.B) {
				if uint64(n)+uint64(n)/10+1000 > lim.Cur { // listeners, held NodePorts, the rest
					b.Skipf("open-file limit %d is too low for %d ports", lim.Cur, n)
				}
				testbed.Needs(b, testbed.Netns)
				w := newWorld(b)
				// The backends live in this namespace: the proxy dials them from
				// goroutines that do not run in the node namespace.
				backends := [2]netip.AddrPort{w.tcpBackend("a", "127.0.0.2"), w.tcpBackend("b", "127.0.0.3")}
				svcs, eps := shiftObjects(n, backends[0])
				moving := n / 2 // even: TCP
				states := [2][]*discoveryv1.EndpointSlice{eps, slices.Clone(eps)}
				vip := net.JoinHostPort(svcs[moving].Spec.ClusterIP, "80")
				build := bl.new()
				tp := testbed.New(b)
				err := tp.Run(testbed.Node, func() error {
					portals, err := rules.NewIPTables(rules.Config{NodeIPs: []netip.Addr{tp.NS(testbed.Node).IPv4}})
					if err != nil {
						return err
					}
					defer portals.Cleanup()
					p, err := New(Config{Portals: portals})
					if err != nil {
						return err
					}
					defer p.Shutdown(b.Context())

					start := time.Now()
					last := build(svcs, states[0])
					if err := p.Sync(last); err != nil {
						return fmt.Errorf("full sync: %w", err)
					}
					fullSync := time.Since(start)
					if got, err := shiftGet(vip); err != nil || got != "a" {
						return fmt.Errorf("before any change: got %q, %v; want a", got, err)
					}

					b.ResetTimer()
					for i := range b.N {
						to := (i + 1) % 2
						b.StopTimer()
						// A new object per change, as informer caches and decoders give.
						states[to][moving] = shiftSlice(svcs[moving], backends[to])
						b.StartTimer()
						snap := build(svcs, states[to])
						if reflect.DeepEqual(last.Ports, snap.Ports) {
							return fmt.Errorf("iteration %d: the change left the Snapshot as it was", i)
						}
						if err := p.Sync(snap); err != nil {
							return fmt.Errorf("iteration %d: %w", i, err)
						}
						last = snap
						b.StopTimer()
						want := []string{"a", "b"}[to]
						if got, err := shiftGet(vip); err != nil || got != want {
							return fmt.Errorf("iteration %d: through the portal got %q, %v; want %s", i, got, err, want)
						}
						b.StartTimer()
					}
					b.StopTimer()
					// After the loop: ResetTimer clears reported metrics.
					b.ReportMetric(float64(fullSync)/float64(time.Millisecond), "full-sync-ms")
					return nil
				})
				if err != nil {
					b.Fatal(err)
				}
			})
		}
	}
}

// shiftGet connects to addr from the calling thread's namespace and returns the
// backend's name.
func shiftGet(addr string) (string, error) {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line), err
}
