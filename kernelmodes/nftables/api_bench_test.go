package nftables

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/source/kube"
	"github.com/uproxy/uproxy/test/testbed"
	"github.com/uproxy/uproxy/test/testbed/kubeapi"
)

// BenchmarkSyncFromAPI measures Sync of the mode fed by the Kubernetes source,
// as uproxy runs it: a real kube-apiserver, the source's informers and
// service.Builder, real nftables in a namespace. It holds 10k Services of one
// port and two endpoints (one EndpointSlice each); an iteration makes one
// change through the API, waits for the Snapshot that has it, and times the
// Sync of that Snapshot alone (what kubeproxy_sync_proxy_rules_duration_seconds
// measures). min-ms, median-ms and max-ms give the spread.
//
//	one-endpoint: one endpoint address of one Service moves (and back)
//	one-service:  one Service with its slice is created (and deleted again)
//
//	UPROXY_KUBE_BIN=... go test -run '^$' -bench SyncFromAPI -benchtime 20x ./kernelmodes/nftables/
func BenchmarkSyncFromAPI(b *testing.B) {
	testbed.Needs(b, testbed.NFTables)
	const n = 10000
	srv := kubeapi.Start(b)
	client := srv.Client(b)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "bench"}}, metav1.CreateOptions{}); err != nil {
		b.Fatal(err)
	}
	created := time.Now()
	if err := createAPIServices(ctx, client, 0, n); err != nil {
		b.Fatal(err)
	}
	b.Logf("%d Services and their slices created in %v", n, time.Since(created).Round(time.Second))

	// The source's Snapshots, newest last; wait returns the first that
	// satisfies ok.
	var mu sync.Mutex
	cond := sync.NewCond(&mu)
	var latest *service.Snapshot
	src := &kube.Source{Client: client}
	go src.Run(ctx, func(s *service.Snapshot) {
		mu.Lock()
		latest = s
		mu.Unlock()
		cond.Broadcast()
	})
	wait := func(what string, ok func(*service.Snapshot) bool) *service.Snapshot {
		deadline := time.AfterFunc(2*time.Minute, func() { cancel(); cond.Broadcast() })
		defer deadline.Stop()
		mu.Lock()
		defer mu.Unlock()
		for latest == nil || !ok(latest) {
			if ctx.Err() != nil {
				b.Fatalf("no Snapshot with %s", what)
			}
			cond.Wait()
		}
		return latest
	}
	first := wait("every Service", func(s *service.Snapshot) bool { return len(s.Ports) >= n })

	tp := testbed.New(b)
	var p *Proxier
	if err := tp.Run(testbed.Node, func() (err error) {
		if p, err = New(Config{}); err != nil {
			return err
		}
		return p.Sync(first)
	}); err != nil {
		b.Fatal(err)
	}
	defer tp.Run(testbed.Node, p.Cleanup)

	for _, mode := range []string{"one-endpoint", "one-service"} {
		b.Run(mode, func(b *testing.B) {
			var runs []time.Duration
			moving := apiServiceName(n / 2)
			port := service.PortName{Namespace: "bench", Name: moving, Port: "p"}
			extra := service.PortName{Namespace: "bench", Name: apiServiceName(n), Port: "p"}
			for i := 0; b.Loop(); i++ {
				var snap *service.Snapshot
				switch {
				case mode == "one-endpoint":
					want := apiEndpoint(n/2, 1, i%2 == 0)
					s, err := client.DiscoveryV1().EndpointSlices("bench").Get(ctx, moving, metav1.GetOptions{})
					if err != nil {
						b.Fatal(err)
					}
					s.Endpoints[1].Addresses = []string{want.Addr().String()}
					if _, err := client.DiscoveryV1().EndpointSlices("bench").Update(ctx, s, metav1.UpdateOptions{}); err != nil {
						b.Fatal(err)
					}
					snap = wait("the endpoint moved", func(s *service.Snapshot) bool {
						sp := s.Lookup(port)
						return sp != nil && slices.ContainsFunc(sp.Endpoints, func(e service.Endpoint) bool { return e.Addr == want })
					})
				case i%2 == 0:
					if err := createAPIServices(ctx, client, n, n+1); err != nil {
						b.Fatal(err)
					}
					snap = wait("the Service added", func(s *service.Snapshot) bool {
						sp := s.Lookup(extra)
						return sp != nil && len(sp.Endpoints) == 2
					})
				default:
					for _, err := range []error{
						client.CoreV1().Services("bench").Delete(ctx, extra.Name, metav1.DeleteOptions{}),
						client.DiscoveryV1().EndpointSlices("bench").Delete(ctx, extra.Name, metav1.DeleteOptions{}),
					} {
						if err != nil {
							b.Fatal(err)
						}
					}
					snap = wait("the Service removed", func(s *service.Snapshot) bool { return s.Lookup(extra) == nil })
				}
				var took time.Duration
				if err := tp.Run(testbed.Node, func() error {
					start := time.Now()
					err := p.Sync(snap)
					took = time.Since(start)
					return err
				}); err != nil {
					b.Fatal(err)
				}
				if p.lastWasFull {
					b.Fatalf("iteration %d: a whole write, want a partial one", i)
				}
				runs = append(runs, took)
			}
			slices.Sort(runs)
			b.ReportMetric(float64(runs[0].Microseconds())/1000, "min-ms")
			b.ReportMetric(float64(runs[len(runs)/2].Microseconds())/1000, "median-ms")
			b.ReportMetric(float64(runs[len(runs)-1].Microseconds())/1000, "max-ms")
		})
	}
}

func apiServiceName(i int) string { return fmt.Sprintf("svc-%05d", i) }

// apiEndpoint is endpoint j (0 or 1) of Service i; moved gives the second
// one's other address.
func apiEndpoint(i, j int, moved bool) netip.AddrPort {
	b := byte(244 + j)
	if moved {
		b = 250
	}
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, b, byte(i >> 8), byte(i)}), 8080)
}

// createAPIServices creates Services from to to-1, each with a ClusterIP of its
// own and one EndpointSlice of two ready endpoints, a few requests at a time.
func createAPIServices(ctx context.Context, client kubernetes.Interface, from, to int) error {
	next := make(chan int)
	errs := make(chan error, 16)
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			for i := range next {
				name := apiServiceName(i)
				ip := netip.AddrFrom4([4]byte{10, 96, byte(10 + i>>8), byte(i)}).String()
				svc := &v1.Service{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "bench"},
					Spec: v1.ServiceSpec{ClusterIP: ip, ClusterIPs: []string{ip},
						Ports: []v1.ServicePort{{Name: "p", Protocol: v1.ProtocolTCP, Port: 80}}}}
				ready, portName, proto, port := true, "p", v1.ProtocolTCP, int32(8080)
				slice := &discoveryv1.EndpointSlice{
					ObjectMeta:  metav1.ObjectMeta{Name: name, Namespace: "bench", Labels: map[string]string{discoveryv1.LabelServiceName: name}},
					AddressType: discoveryv1.AddressTypeIPv4,
					Ports:       []discoveryv1.EndpointPort{{Name: &portName, Protocol: &proto, Port: &port}},
				}
				for j := range 2 {
					slice.Endpoints = append(slice.Endpoints, discoveryv1.Endpoint{
						Addresses: []string{apiEndpoint(i, j, false).Addr().String()}, Conditions: discoveryv1.EndpointConditions{Ready: &ready}})
				}
				if _, err := client.CoreV1().Services("bench").Create(ctx, svc, metav1.CreateOptions{}); err != nil {
					errs <- fmt.Errorf("create Service %s: %w", name, err)
					return
				}
				if _, err := client.DiscoveryV1().EndpointSlices("bench").Create(ctx, slice, metav1.CreateOptions{}); err != nil {
					errs <- fmt.Errorf("create EndpointSlice %s: %w", name, err)
					return
				}
			}
		})
	}
	for i := from; i < to; i++ {
		select {
		case next <- i:
		case err := <-errs:
			close(next)
			wg.Wait()
			return err
		}
	}
	close(next)
	wg.Wait()
	select {
	case err := <-errs:
		return err
	default:
		return nil
	}
}
