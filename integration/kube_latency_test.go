package integration

import (
	"context"
	"regexp"
	"slices"
	"strconv"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/uproxy/uproxy/test/testbed"
)

// BenchmarkKubeEndpointSliceToTraffic measures how long traffic takes to follow
// an EndpointSlice change: each iteration updates one slice in the API server
// to the other of two backends, then connects from a pod to the Service's
// ClusterIP (through the portal rules and the proxy) until the new backend
// answers. It reports the median and 99th percentile, and the mean of
// kubeproxy_network_programming_duration_seconds as uproxy observed it.
//
//	sudo go test ./integration -run '^$' -bench KubeEndpointSliceToTraffic -benchtime 200x
func BenchmarkKubeEndpointSliceToTraffic(b *testing.B) {
	for _, minSync := range []string{"0s", "1s"} {
		b.Run("min-sync-period="+minSync, func(b *testing.B) {
			w := newKubeWorld(b)
			c := newCluster(b, w.srv, "latency")
			backends := []*backend{w.backend(b, "b0"), w.backend(b, "b1")}
			web := clusterAddr(c.service("web", nil))
			slice := latencySlice(backends[0])
			api := c.client.DiscoveryV1().EndpointSlices(c.ns)
			slice, err := api.Create(context.Background(), slice, metav1.CreateOptions{})
			if err != nil {
				b.Fatal(err)
			}
			px := w.startKubeProxy(b, w.kubeconfig, 1, "--min-sync-period", minSync, "-v", "0")
			w.awaitServed(b, web, "b0")

			took := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for i := range b.N {
				next := backends[(i+1)%2]
				fresh := latencySlice(next)
				fresh.ResourceVersion = slice.ResourceVersion
				start := time.Now()
				fresh.Annotations[v1.EndpointsLastChangeTriggerTime] = start.UTC().Format(time.RFC3339Nano)
				if slice, err = api.Update(context.Background(), fresh, metav1.UpdateOptions{}); err != nil {
					b.Fatal(err)
				}
				deadline := start.Add(30 * time.Second)
				for {
					if name, err := whoTCP(w.tp, testbed.Pod, web); err == nil && name == next.name {
						break
					}
					if time.Now().After(deadline) {
						b.Fatalf("change %d: traffic did not follow within 30s", i)
					}
				}
				took = append(took, time.Since(start))
			}
			b.StopTimer()
			slices.Sort(took)
			b.ReportMetric(ms(took[len(took)/2]), "p50-ms")
			b.ReportMetric(ms(took[min(len(took)-1, len(took)*99/100)]), "p99-ms")
			b.ReportMetric(ms(took[len(took)-1]), "max-ms")
			if metrics, err := px.get("/metrics"); err == nil {
				sum := metricValue(metrics, "kubeproxy_network_programming_duration_seconds_sum")
				count := metricValue(metrics, "kubeproxy_network_programming_duration_seconds_count")
				if count > 0 {
					b.ReportMetric(sum/count*1000, "programming-mean-ms")
				}
			}
		})
	}
}

func latencySlice(be *backend) *discoveryv1.EndpointSlice {
	return &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: "web-1", Namespace: "latency",
			Labels:      map[string]string{discoveryv1.LabelServiceName: "web"},
			Annotations: map[string]string{v1.EndpointsLastChangeTriggerTime: time.Now().UTC().Format(time.RFC3339Nano)}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("p"), Protocol: ptr.To(v1.ProtocolTCP), Port: ptr.To(be.port)}},
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{be.ip}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)}}},
	}
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// metricValue returns the value of a sample in Prometheus text: a name, or a
// name with its labels as the exposition writes them; 0 when absent.
func metricValue(text, name string) float64 {
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + ` (\S+)$`).FindStringSubmatch(text)
	if m == nil {
		return 0
	}
	v, _ := strconv.ParseFloat(m[1], 64)
	return v
}
