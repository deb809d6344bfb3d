package integration

import (
	"context"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/uproxy/uproxy/source/kube"
)

// TestKubeServicesFollowTheAPIServer runs uproxy against a real kube-apiserver
// and changes Services and EndpointSlices through the API, as a controller
// would: traffic from a pod to the ClusterIPs the API server allocated follows
// every change.
func TestKubeServicesFollowTheAPIServer(t *testing.T) {
	w := newKubeWorld(t)
	c := newCluster(t, w.srv, "follow")
	b1, b2, b3 := w.backend(t, "b1"), w.backend(t, "b2"), w.backend(t, "b3")

	// Made before uproxy starts: its first sync already has them.
	web := clusterAddr(c.service("web", nil))
	c.endpoints("web", endpoint{b: b1}, endpoint{b: b2})
	// A Service of another proxy: never handled.
	theirs := clusterAddr(c.service("theirs", func(s *v1.Service) { s.Labels = map[string]string{kube.LabelServiceProxyName: "other"} }))
	c.endpoints("theirs", endpoint{b: b3})

	px := w.startKubeProxy(t, w.kubeconfig, 1)
	w.awaitServed(t, web, "b1", "b2")
	if got := w.served(theirs, 1); len(got) != 1 || got[0] != "error" {
		t.Errorf("Service labelled for another proxy: got answers %q, want only errors", got)
	}

	t.Run("endpoints replaced", func(t *testing.T) {
		c.endpoints("web", endpoint{b: b3})
		w.awaitServed(t, web, "b3")
	})
	t.Run("scaled to zero: connections are refused", func(t *testing.T) {
		c.endpoints("web")
		w.awaitServed(t, web, "error")
	})
	t.Run("scaled back", func(t *testing.T) {
		c.endpoints("web", endpoint{b: b1}, endpoint{b: b2})
		w.awaitServed(t, web, "b1", "b2")
	})
	var api string
	t.Run("new Service", func(t *testing.T) {
		api = clusterAddr(c.service("api", nil))
		c.endpoints("api", endpoint{b: b2})
		w.awaitServed(t, api, "b2")
	})
	t.Run("Service deleted", func(t *testing.T) {
		if err := c.client.CoreV1().Services(c.ns).Delete(context.Background(), "api", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		px.waitFor(func(s []serviceState) bool {
			names := withProxyPorts(s)
			return len(names) == 1 && names[0] == "follow/web:p"
		}, "only follow/web:p left")
		w.awaitServed(t, api, "error")
	})
	t.Run("Service labelled for another proxy goes away", func(t *testing.T) {
		svc, err := c.client.CoreV1().Services(c.ns).Get(context.Background(), "web", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		svc.Labels = map[string]string{kube.LabelServiceProxyName: "other"}
		if _, err := c.client.CoreV1().Services(c.ns).Update(context.Background(), svc, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		px.waitFor(func(s []serviceState) bool { return len(withProxyPorts(s)) == 0 }, "no Service ports")
		w.awaitServed(t, web, "error")
	})
}

// TestKubeServiceProxyName runs uproxy as it runs beside kube-proxy: with
// --service-proxy-name it handles only the Services labelled for it.
func TestKubeServiceProxyName(t *testing.T) {
	w := newKubeWorld(t)
	c := newCluster(t, w.srv, "ab")
	b1 := w.backend(t, "b1")
	// Two Services over the same backend, as in the README's A/B example.
	plain := clusterAddr(c.service("web-kube-proxy", nil))
	c.endpoints("web-kube-proxy", endpoint{b: b1})
	mine := clusterAddr(c.service("web-uproxy", func(s *v1.Service) { s.Labels = map[string]string{kube.LabelServiceProxyName: "uproxy"} }))
	c.endpoints("web-uproxy", endpoint{b: b1})

	px := w.startKubeProxy(t, w.kubeconfig, 1, "--service-proxy-name", "uproxy")
	w.awaitServed(t, mine, "b1")
	if got := w.served(plain, 1); len(got) != 1 || got[0] != "error" {
		t.Errorf("unlabelled Service: got answers %q, want only errors (kube-proxy's)", got)
	}

	// Labelling the other Service hands it to uproxy.
	svc, err := c.client.CoreV1().Services(c.ns).Get(context.Background(), "web-kube-proxy", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	svc.Labels = map[string]string{kube.LabelServiceProxyName: "uproxy"}
	if _, err := c.client.CoreV1().Services(c.ns).Update(context.Background(), svc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.awaitServed(t, plain, "b1")
	if got := withProxyPorts(px.waitFor(func(s []serviceState) bool { return len(withProxyPorts(s)) == 2 }, "both Services")); len(got) != 2 {
		t.Errorf("got Service ports %q, want both", got)
	}
}

// TestKubeEndpointConditionsAndPolicies: ready endpoints carry traffic; when
// none is ready, serving and terminating ones do; internalTrafficPolicy Local
// keeps to this node's endpoints, and refuses without any.
func TestKubeEndpointConditionsAndPolicies(t *testing.T) {
	w := newKubeWorld(t)
	c := newCluster(t, w.srv, "conditions")
	ready := w.backend(t, "ready")
	term := w.backend(t, "terminating")
	dead := w.backend(t, "not-serving")
	local := w.backend(t, "local")
	remote := w.backend(t, "remote")

	cond := clusterAddr(c.service("cond", nil))
	c.endpoints("cond",
		endpoint{b: ready},
		endpoint{b: term, notReady: true, serving: ptr.To(true), terminating: true},
		endpoint{b: dead, notReady: true, serving: ptr.To(false), terminating: true})
	loc := clusterAddr(c.service("local", func(s *v1.Service) {
		s.Spec.InternalTrafficPolicy = ptr.To(v1.ServiceInternalTrafficPolicyLocal)
	}))
	c.endpoints("local", endpoint{b: local, node: kubeNode}, endpoint{b: remote, node: "node-b"})

	w.startKubeProxy(t, w.kubeconfig, 2)

	tests := []struct {
		name   string
		change func()
		addr   string
		want   []string
	}{
		{"ready endpoints only", func() {}, cond, []string{"ready"}},
		{"none ready: serving and terminating", func() {
			c.endpoints("cond",
				endpoint{b: term, notReady: true, serving: ptr.To(true), terminating: true},
				endpoint{b: dead, notReady: true, serving: ptr.To(false), terminating: true})
		}, cond, []string{"terminating"}},
		{"none serving: refused", func() {
			c.endpoints("cond", endpoint{b: dead, notReady: true, serving: ptr.To(false), terminating: true})
		}, cond, []string{"error"}},
		{"internalTrafficPolicy Local: this node's endpoints", func() {}, loc, []string{"local"}},
		{"internalTrafficPolicy Local without local endpoints: refused", func() {
			c.endpoints("local", endpoint{b: remote, node: "node-b"})
		}, loc, []string{"error"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.change()
			w.awaitServed(t, tt.addr, tt.want...)
		})
	}
}
