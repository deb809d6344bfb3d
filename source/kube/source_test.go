package kube

import (
	"context"
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

	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/test/testbed"
	"github.com/uproxy/uproxy/test/testbed/kubeapi"
)

// watcher runs a Source and keeps what it reported.
type watcher struct {
	t       *testing.T
	mu      sync.Mutex
	latest  *service.Snapshot
	updates int
	nodes   []*v1.Node
	errc    chan error
}

func runSource(t *testing.T, src *Source) *watcher {
	t.Helper()
	w := &watcher{t: t, errc: make(chan error, 1)}
	src.NodeChanged = func(n *v1.Node) {
		w.mu.Lock()
		w.nodes = append(w.nodes, n)
		w.mu.Unlock()
	}
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		w.errc <- src.Run(ctx, func(s *service.Snapshot) {
			w.mu.Lock()
			w.latest = s
			w.updates++
			w.mu.Unlock()
		})
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-w.errc:
			if err != nil {
				t.Errorf("Run: got %v, want nil", err)
			}
		case <-time.After(30 * time.Second):
			t.Errorf("Run did not return within 30s of its context ending")
		}
	})
	return w
}

// await polls until ok holds for the latest Snapshot, or fails the test.
func (w *watcher) await(what string, ok func(*service.Snapshot) bool) *service.Snapshot {
	w.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		w.mu.Lock()
		s := w.latest
		w.mu.Unlock()
		if s != nil && ok(s) {
			return s
		}
		if time.Now().After(deadline) {
			var got []string
			if s != nil {
				got = portsOf(s)
			}
			w.t.Fatalf("waiting for %s: last snapshot %q", what, got)
		}
		select {
		case err := <-w.errc:
			w.t.Fatalf("Run returned %v while waiting for %s", err, what)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

func hasPorts(want ...string) func(*service.Snapshot) bool {
	return func(s *service.Snapshot) bool { return slices.Equal(portsOf(s), want) }
}

// apiObjects creates and changes objects in one namespace of a test API server.
type apiObjects struct {
	t      *testing.T
	client kubernetes.Interface
	ns     string
}

func (a *apiObjects) service(name string, lbls map[string]string) *v1.Service {
	a.t.Helper()
	svc := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: lbls},
		Spec:       v1.ServiceSpec{Ports: []v1.ServicePort{{Name: "p", Protocol: v1.ProtocolTCP, Port: 80}}},
	}
	out, err := a.client.CoreV1().Services(a.ns).Create(context.Background(), svc, metav1.CreateOptions{})
	if err != nil {
		a.t.Fatalf("create Service %s: %v", name, err)
	}
	return out
}

func (a *apiObjects) slice(name, svc string, lbls map[string]string, addrs ...string) *discoveryv1.EndpointSlice {
	a.t.Helper()
	s := testSlice(name, svc, addrs...)
	s.Namespace = a.ns
	for k, v := range lbls {
		s.Labels[k] = v
	}
	out, err := a.client.DiscoveryV1().EndpointSlices(a.ns).Create(context.Background(), s, metav1.CreateOptions{})
	if err != nil {
		a.t.Fatalf("create EndpointSlice %s: %v", name, err)
	}
	return out
}

func (a *apiObjects) updateSlice(s *discoveryv1.EndpointSlice) *discoveryv1.EndpointSlice {
	a.t.Helper()
	out, err := a.client.DiscoveryV1().EndpointSlices(a.ns).Update(context.Background(), s, metav1.UpdateOptions{})
	if err != nil {
		a.t.Fatalf("update EndpointSlice %s: %v", s.Name, err)
	}
	return out
}

func newNamespace(t *testing.T, client kubernetes.Interface, name string) *apiObjects {
	t.Helper()
	ns := &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if _, err := client.CoreV1().Namespaces().Create(context.Background(), ns, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create namespace %s: %v", name, err)
	}
	return &apiObjects{t: t, client: client, ns: name}
}

// TestSource runs Sources against a real API server: selection by proxy name,
// headless and stray slices, changes, the Node, and a server restart.
func TestSource(t *testing.T) {
	testbed.Needs(t, testbed.APIServer)
	srv := kubeapi.Start(t)
	client := srv.Client(t)

	t.Run("selection by proxy name", func(t *testing.T) {
		api := newNamespace(t, client, "selection")
		api.service("plain", nil)
		api.service("mine", map[string]string{LabelServiceProxyName: "uproxy"})
		api.service("theirs", map[string]string{LabelServiceProxyName: "other"})
		api.slice("plain-1", "plain", nil, "10.0.0.1")
		api.slice("mine-1", "mine", nil, "10.0.0.2")
		api.slice("theirs-1", "theirs", nil, "10.0.0.3")
		// A headless slice of a selected Service must never be read.
		api.slice("plain-headless", "plain", map[string]string{LabelHeadless: ""}, "10.0.0.4")
		api.slice("stray", "", nil, "10.0.0.5")

		tests := []struct {
			proxyName string
			want      []string
		}{
			{"", []string{"selection/plain:p=10.0.0.1:8080"}},
			{"uproxy", []string{"selection/mine:p=10.0.0.2:8080"}},
		}
		for _, tt := range tests {
			t.Run(fmt.Sprintf("name=%q", tt.proxyName), func(t *testing.T) {
				w := runSource(t, &Source{Client: client, ServiceProxyName: tt.proxyName})
				// Everything existed before Run: the first Snapshot already holds
				// it, since nothing is sent before both kinds are listed.
				s := w.await("the first snapshot", func(*service.Snapshot) bool { return true })
				if got := portsOf(onlyNamespace(s, "selection")); !slices.Equal(got, tt.want) {
					t.Errorf("first snapshot: got %q, want %q", got, tt.want)
				}
				if len(s.Errors) != 0 {
					t.Errorf("got errors %v, want none (stray slices are ignored silently)", s.Errors)
				}
			})
		}
	})

	t.Run("changes follow", func(t *testing.T) {
		api := newNamespace(t, client, "changes")
		w := runSource(t, &Source{Client: client, NodeName: "node-a"})
		inNS := func(want ...string) func(*service.Snapshot) bool {
			return func(s *service.Snapshot) bool { return hasPorts(want...)(onlyNamespace(s, "changes")) }
		}
		api.service("web", nil)
		w.await("the new Service without endpoints", inNS("changes/web:p="))
		sl := api.slice("web-1", "web", nil, "10.0.1.1")
		w.await("the first endpoint", inNS("changes/web:p=10.0.1.1:8080"))

		sl.Endpoints = append(sl.Endpoints, discoveryv1.Endpoint{Addresses: []string{"10.0.1.2"}, NodeName: ptr.To("node-a")})
		sl = api.updateSlice(sl)
		s := w.await("a second endpoint", inNS("changes/web:p=10.0.1.1:8080,10.0.1.2:8080"))
		p := s.Lookup(service.PortName{Namespace: "changes", Name: "web", Port: "p"})
		if local := p.LocalEndpoints(); len(local) != 1 || local[0].Addr.String() != "10.0.1.2:8080" {
			t.Errorf("got local endpoints %v, want [10.0.1.2:8080] (nodeName node-a)", local)
		}

		// Scaled to zero: the slice stays, its endpoints go.
		sl.Endpoints = nil
		sl = api.updateSlice(sl)
		w.await("no endpoints", inNS("changes/web:p="))
		sl.Endpoints = []discoveryv1.Endpoint{{Addresses: []string{"10.0.1.3"}}}
		api.updateSlice(sl)
		w.await("scaled back", inNS("changes/web:p=10.0.1.3:8080"))

		// Labelling the Service for another proxy takes it away.
		svc, err := client.CoreV1().Services("changes").Get(context.Background(), "web", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		svc.Labels = map[string]string{LabelServiceProxyName: "other"}
		if _, err := client.CoreV1().Services("changes").Update(context.Background(), svc, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		w.await("the Service handed to another proxy", inNS())
	})

	t.Run("node", func(t *testing.T) {
		node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-z", Labels: map[string]string{LabelZone: "zone-1"}}}
		if _, err := client.CoreV1().Nodes().Create(context.Background(), node, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		w := runSource(t, &Source{Client: client, NodeName: "node-z"})
		// The first Snapshot already has the Node's zone.
		w.mu.Lock()
		for w.latest == nil {
			w.mu.Unlock()
			time.Sleep(10 * time.Millisecond)
			w.mu.Lock()
		}
		if first := w.latest.Zone; first != "zone-1" {
			t.Errorf("first Snapshot's Zone: got %q, want zone-1", first)
		}
		w.mu.Unlock()
		// The Node informer's first event must be the Node as created: changing it
		// before the informer has listed it would let the list see the change first.
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			w.mu.Lock()
			seen := len(w.nodes)
			w.mu.Unlock()
			if seen > 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("no Node event within 30s")
			}
		}
		n, err := client.CoreV1().Nodes().Get(context.Background(), "node-z", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		// A new zone label reaches the Snapshots without a restart.
		n.Labels[LabelZone] = "zone-2"
		if n, err = client.CoreV1().Nodes().Update(context.Background(), n, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		w.await("the Node's new zone", func(s *service.Snapshot) bool { return s.Zone == "zone-2" })
		n.Spec.Taints = []v1.Taint{{Key: ToBeDeletedTaint, Effect: v1.TaintEffectNoSchedule}}
		if _, err := client.CoreV1().Nodes().Update(context.Background(), n, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		if err := client.CoreV1().Nodes().Delete(context.Background(), "node-z", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(30 * time.Second)
		want := []string{"eligible zone-1", "eligible zone-2", "not eligible zone-2", "deleted"}
		for {
			w.mu.Lock()
			var got []string
			for _, n := range w.nodes {
				switch {
				case n == nil:
					got = append(got, "deleted")
				case NodeEligible(n):
					got = append(got, "eligible "+n.Labels[LabelZone])
				default:
					got = append(got, "not eligible "+n.Labels[LabelZone])
				}
			}
			w.mu.Unlock()
			if slices.Equal(got, want) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("got node events %q, want %q", got, want)
			}
			time.Sleep(10 * time.Millisecond)
		}
		w.await("no zone once the Node is deleted", func(s *service.Snapshot) bool { return s.Zone == "" })
	})

	t.Run("duplicate ExternalIPs", func(t *testing.T) {
		// The API server allocates ClusterIPs without duplicates but takes any
		// ExternalIP: the second Service to claim one is left out, even when it
		// is the older one, until the first lets it go.
		api := newNamespace(t, client, "externals")
		w := runSource(t, &Source{Client: client})
		ctx := context.Background()
		create := func(name, externalIP string) {
			svc := &v1.Service{
				ObjectMeta: metav1.ObjectMeta{Name: name},
				Spec: v1.ServiceSpec{ExternalIPs: []string{externalIP},
					Ports: []v1.ServicePort{{Name: "p", Protocol: v1.ProtocolTCP, Port: 80}}},
			}
			if _, err := client.CoreV1().Services(api.ns).Create(ctx, svc, metav1.CreateOptions{}); err != nil {
				t.Fatalf("create Service %s: %v", name, err)
			}
		}
		inNS := func(want ...string) func(*service.Snapshot) bool {
			return func(s *service.Snapshot) bool { return hasPorts(want...)(onlyNamespace(s, api.ns)) }
		}
		conflict := "externals/older port p: 192.0.2.10:80/TCP is already served by externals/web port p"
		hasConflict := func(s *service.Snapshot) bool {
			return slices.ContainsFunc(s.Errors, func(err error) bool { return err.Error() == conflict })
		}

		create("older", "192.0.2.99")
		create("web", "192.0.2.10")
		w.await("both Services", inNS("externals/older:p=", "externals/web:p="))
		older, err := client.CoreV1().Services(api.ns).Get(ctx, "older", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		older.Spec.ExternalIPs = []string{"192.0.2.10"}
		if _, err := client.CoreV1().Services(api.ns).Update(ctx, older, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		s := w.await("the older Service left out", func(s *service.Snapshot) bool {
			return inNS("externals/web:p=")(s) && hasConflict(s)
		})
		if len(s.Conflicts) != 1 || s.Conflicts[0].Claim.String() != "192.0.2.10:80/TCP" {
			t.Errorf("got conflicts %v, want one on 192.0.2.10:80/TCP", s.Conflicts)
		}

		if err := client.CoreV1().Services(api.ns).Delete(ctx, "web", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		w.await("the older Service taking over", func(s *service.Snapshot) bool {
			return inNS("externals/older:p=")(s) && !hasConflict(s)
		})
	})

	t.Run("policy annotations", func(t *testing.T) {
		// A Service's uproxy.io/ annotations reach its Ports; a bad one is an
		// error naming the Service and the annotation, and the Service is
		// still served, with the flag in place of the bad value.
		api := newNamespace(t, client, "policy")
		w := runSource(t, &Source{Client: client})
		ctx := context.Background()
		svc := &v1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: "web", Annotations: map[string]string{
				service.AnnotationDialHedge: "30ms", service.AnnotationScheduler: "fastest"}},
			Spec: v1.ServiceSpec{Ports: []v1.ServicePort{{Name: "p", Protocol: v1.ProtocolTCP, Port: 80}}},
		}
		if _, err := client.CoreV1().Services(api.ns).Create(ctx, svc, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		name := service.PortName{Namespace: api.ns, Name: "web", Port: "p"}
		badScheduler := "Service policy/web: metadata.annotations[uproxy.io/scheduler]: \"fastest\""
		s := w.await("the Service with its policy and the bad annotation's error", func(s *service.Snapshot) bool {
			return s.Lookup(name) != nil && slices.ContainsFunc(s.Errors, func(err error) bool {
				return strings.HasPrefix(err.Error(), badScheduler)
			})
		})
		if pol := s.Lookup(name).Policy; pol.DialHedge == nil || *pol.DialHedge != 30*time.Millisecond || pol.Scheduler != "" {
			t.Errorf("policy: got %+v, want hedge 30ms and no scheduler (the bad one left to the flag)", pol)
		}
		got, err := client.CoreV1().Services(api.ns).Get(ctx, "web", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		got.Annotations[service.AnnotationScheduler] = "lc"
		if _, err := client.CoreV1().Services(api.ns).Update(ctx, got, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		s = w.await("the fixed annotation", func(s *service.Snapshot) bool {
			p := s.Lookup(name)
			return p != nil && p.Policy.Scheduler == "lc"
		})
		for _, err := range s.Errors {
			if strings.HasPrefix(err.Error(), "Service policy/") {
				t.Errorf("error after the fix: %v, want none for policy/web", err)
			}
		}
	})

	t.Run("API server restart", func(t *testing.T) {
		api := newNamespace(t, client, "restart")
		w := runSource(t, &Source{Client: client})
		inNS := func(want ...string) func(*service.Snapshot) bool {
			return func(s *service.Snapshot) bool { return hasPorts(want...)(onlyNamespace(s, "restart")) }
		}
		api.service("web", nil)
		sl := api.slice("web-1", "web", nil, "10.0.2.1")
		w.await("the Service before the restart", inNS("restart/web:p=10.0.2.1:8080"))

		srv.Restart(t)
		client := srv.Client(t)
		api.client = client
		sl, err := client.DiscoveryV1().EndpointSlices("restart").Get(context.Background(), sl.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		sl.Endpoints = []discoveryv1.Endpoint{{Addresses: []string{"10.0.2.2"}}}
		api.updateSlice(sl)
		api.service("after", nil)
		w.await("changes after the restart", inNS("restart/after:p=", "restart/web:p=10.0.2.2:8080"))
	})
}

// onlyNamespace keeps the ports of one namespace, so that subtests sharing a
// server see only their own Services.
func onlyNamespace(s *service.Snapshot, ns string) *service.Snapshot {
	out := &service.Snapshot{Errors: s.Errors, Built: s.Built}
	for _, p := range s.Ports {
		if p.Name.Namespace == ns {
			out.Ports = append(out.Ports, p)
		}
	}
	return out
}
