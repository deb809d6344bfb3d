package integration

import (
	"context"
	"flag"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/uproxy/uproxy/test/testbed"
)

// BenchmarkSyncThroughAPI measures the userspace mode's syncs with a real
// kube-apiserver as the source, at 1,000 and 10,000 Service ports (one
// Service and one EndpointSlice of two endpoints each), for both portal
// backends: the first sync of a uproxy started beside them (from its start's
// informers to every Service port programmed; the sum of the syncs it took),
// one endpoint change (an EndpointSlice updated; three, the median and the
// longest reported), one new Service (without endpoints, as a Service
// arrives before its EndpointSlice), its endpoints arriving, and the
// live heap per Service port (against the same uproxy on an empty cluster).
// Sync times are kubeproxy_sync_proxy_rules_duration_seconds, as uproxy
// bench's control workload reads them for manifests. 20,000 Service ports
// cannot be had here: each takes a proxy socket, and the open-file limit is
// 20,000. Run with -benchtime 1x: each size populates its own API server.
// -bench.uproxy OLD,NEW,OLD,NEW alternates binaries beside the same objects.
//
//	go test -run '^$' -bench '^BenchmarkSyncThroughAPI$' -benchtime 1x ./integration
var benchUproxy = flag.String("bench.uproxy", "", "uproxy binaries, comma-separated, that BenchmarkSyncThroughAPI runs in turn beside the same API server, to compare them (default: the one built from this tree)")

func BenchmarkSyncThroughAPI(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		b.Run(fmt.Sprintf("ports=%d", n), func(b *testing.B) {
			w := newKubeWorld(b)
			c := newCluster(b, w.srv, "scale")
			pod := w.tp.NS(testbed.Pod).IPv4.String()
			// The heap of a uproxy with nothing to serve, the baseline of
			// the heap per Service port.
			empty := startSyncBench(b, w, "nftables", uproxyBin, 0)
			heap0 := liveHeap(b, empty)
			empty.stop()
			populate(b, c, n, pod)
			bins := []string{uproxyBin}
			if *benchUproxy != "" {
				bins = strings.Split(*benchUproxy, ",")
			}
			for _, rules := range []string{"nftables", "iptables"} {
				for i, bin := range bins {
					b.Run(fmt.Sprintf("rules=%s/uproxy=%d", rules, i), func(b *testing.B) {
						b.Logf("uproxy %d: %s", i, bin)
						for range b.N {
							benchSyncThroughAPI(b, w, c, n, rules, bin, pod, heap0)
						}
					})
				}
			}
		})
	}
}

func benchSyncThroughAPI(b *testing.B, w *kubeWorld, c *cluster, n int, rules, bin, pod string, heap0 float64) {
	b.StopTimer()
	p := startSyncBench(b, w, rules, bin, n)
	sum, count := syncMetric(b, p)
	b.ReportMetric(sum*1000, "first-sync-ms")
	b.ReportMetric(count, "first-syncs")
	heap := liveHeap(b, p)
	b.ReportMetric((heap-heap0)/float64(n), "heap-B/port")

	// One endpoint change, three times (the slice's port moves and back).
	var changes []float64
	for i := range 3 {
		name := fmt.Sprintf("s%05d", n/2)
		s, err := c.client.DiscoveryV1().EndpointSlices(c.ns).Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			b.Fatal(err)
		}
		s.Ports[0].Port = ptr.To(int32(9000 + i))
		d, syncs := afterSync(b, p, func() {
			if _, err := c.client.DiscoveryV1().EndpointSlices(c.ns).Update(context.Background(), s, metav1.UpdateOptions{}); err != nil {
				b.Fatal(err)
			}
		})
		changes = append(changes, d/syncs)
	}
	b.ReportMetric(slices.Max(changes)*1000, "endpoint-change-max-ms")
	b.ReportMetric(median(changes)*1000, "endpoint-change-median-ms")

	// One new Service, then its endpoints; both removed again at the end.
	extra := fmt.Sprintf("extra-%s", rules)
	d, syncs := afterSync(b, p, func() { createScaleService(b, c.client, c.ns, extra, pod, false) })
	b.ReportMetric(d*1000/syncs, "new-service-ms")
	d, syncs = afterSync(b, p, func() { createScaleService(b, c.client, c.ns, extra, pod, true) })
	b.ReportMetric(d*1000/syncs, "its-endpoints-ms")
	p.stop()
	if err := c.client.CoreV1().Services(c.ns).Delete(context.Background(), extra, metav1.DeleteOptions{}); err != nil {
		b.Fatal(err)
	}
	if err := c.client.DiscoveryV1().EndpointSlices(c.ns).Delete(context.Background(), extra, metav1.DeleteOptions{}); err != nil {
		b.Fatal(err)
	}
}

// startSyncBench runs uproxy (binary bin) in the node namespace on w's API server with
// the given portals, and returns once its syncs have programmed n Service
// ports (besides default/kubernetes).
func startSyncBench(b *testing.B, w *kubeWorld, rules, bin string, n int) *proxy {
	b.Helper()
	p := runUproxy(b, w.tp, "", launch{
		bin:    bin,
		source: []string{"--kubeconfig", w.kubeconfig, "--hostname-override", kubeNode},
		flags:  []string{"--rules", rules, "--sync-period", "1h", "--profiling", "-v", "0", "--shutdown-grace", "1s"},
		noWait: true,
	})
	deadline := time.Now().Add(5 * time.Minute)
	for {
		// (/healthz says 503 here: there is no Node object.)
		if text, err := p.get("/metrics"); err == nil && metricValue(text, "kubeproxy_sync_proxy_rules_duration_seconds_count") > 0 {
			if s, err := p.services(); err == nil && len(withProxyPorts(s)) == n {
				return p
			}
		}
		if !p.running() {
			b.Fatalf("uproxy exited before serving:\n%s", p.logText())
		}
		if time.Now().After(deadline) {
			b.Fatalf("uproxy did not program %d Service ports within 5m", n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// populate creates n Services of one TCP port, each with an EndpointSlice of
// two endpoints, 16 requests at a time.
func populate(b *testing.B, c *cluster, n int, pod string) {
	b.Helper()
	began := time.Now()
	var wg sync.WaitGroup
	next := make(chan int)
	for range 16 {
		wg.Go(func() {
			for i := range next {
				name := fmt.Sprintf("s%05d", i)
				createScaleService(b, c.client, c.ns, name, pod, false)
				createScaleService(b, c.client, c.ns, name, pod, true)
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	b.Logf("%d Services and EndpointSlices created in %v", n, time.Since(began).Round(time.Millisecond))
}

// createScaleService creates Service name (slice false) or its EndpointSlice
// of two endpoints at pod (slice true).
func createScaleService(b *testing.B, client kubernetes.Interface, ns, name, pod string, slice bool) {
	ctx := context.Background()
	if !slice {
		svc := &v1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
			Spec:       v1.ServiceSpec{Ports: []v1.ServicePort{{Name: "p", Protocol: v1.ProtocolTCP, Port: 80}}},
		}
		if _, err := client.CoreV1().Services(ns).Create(ctx, svc, metav1.CreateOptions{}); err != nil {
			b.Errorf("create Service %s: %v", name, err)
		}
		return
	}
	s := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{discoveryv1.LabelServiceName: name}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("p"), Protocol: ptr.To(v1.ProtocolTCP), Port: ptr.To(int32(8080))}},
		Endpoints: []discoveryv1.Endpoint{
			{Addresses: []string{pod}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)}},
			{Addresses: []string{"10.250.0.2"}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)}},
		},
	}
	if _, err := client.DiscoveryV1().EndpointSlices(ns).Create(ctx, s, metav1.CreateOptions{}); err != nil {
		b.Errorf("create EndpointSlice %s: %v", name, err)
	}
}

// syncMetric returns uproxy's sync time so far (seconds) and its count.
func syncMetric(b *testing.B, p *proxy) (sum, count float64) {
	b.Helper()
	text, err := p.get("/metrics")
	if err != nil {
		b.Fatal(err)
	}
	return metricValue(text, "kubeproxy_sync_proxy_rules_duration_seconds_sum"),
		metricValue(text, "kubeproxy_sync_proxy_rules_duration_seconds_count")
}

// afterSync makes change and returns the time of the sync that carried it:
// the first sync after it, as uproxy bench's control workload reads it (more
// than one when the next came within the 10 ms between two readings: the
// callers report the time per sync), and how many syncs that was.
func afterSync(b *testing.B, p *proxy, change func()) (seconds, syncs float64) {
	b.Helper()
	sum0, count0 := syncMetric(b, p)
	change()
	deadline := time.Now().Add(time.Minute)
	for {
		if sum, count := syncMetric(b, p); count > count0 {
			return sum - sum0, count - count0
		}
		if time.Now().After(deadline) {
			b.Fatalf("no sync within a minute of a change")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// liveHeap forces two GCs in uproxy (with --profiling) and returns the heap
// left live: the second frees what sync.Pools kept through the first.
func liveHeap(b *testing.B, p *proxy) float64 {
	b.Helper()
	for range 2 {
		if _, err := p.get("/debug/pprof/heap?gc=1"); err != nil {
			b.Fatal(err)
		}
	}
	text, err := p.get("/metrics")
	if err != nil {
		b.Fatal(err)
	}
	return metricValue(text, "go_gc_heap_live_bytes")
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}
