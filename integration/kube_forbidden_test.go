package integration

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/uproxy/uproxy/test/testbed"
)

// TestKubeForbiddenEndpointSlices runs uproxy with a ClusterRole that grants
// Services and Nodes but not EndpointSlices, as a role short of a rule does.
// The log names what is missing, once per 30 s however often the informers
// retry, and alone (client-go's "Failed to watch" lines stay at -v=2); the
// Service requests that succeed meanwhile are no recovery. /livez and
// /healthz fail once the first sync is two --sync-periods late, and recover
// with the first sync once the rule is granted, when the log says so.
func TestKubeForbiddenEndpointSlices(t *testing.T) {
	w := newKubeWorld(t)
	client := w.srv.Client(t)
	ctx := context.Background()
	role := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: "uproxy-noslices"},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"services", "nodes"}, Verbs: []string{"get", "list", "watch"}}}}
	if _, err := client.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	binding := &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "uproxy-noslices"},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role.Name},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: "kube-system", Name: "uproxy"}}}
	if _, err := client.RbacV1().ClusterRoleBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	createNode(t, client, kubeNode, w.tp.NS(testbed.Node).IPv4)
	kubeconfig := writeKubeconfig(t, w.srv, w.apiURL, w.srv.TokenFor(t, "kube-system", "uproxy"))

	const syncPeriod = 2 * time.Second
	px := startUnsynced(t, w.tp, "--kubeconfig", kubeconfig, "--hostname-override", kubeNode, "--rules", "none",
		"--sync-period", syncPeriod.String())
	start := time.Now()
	get := func(path string) int {
		resp, err := px.client.Get("http://127.0.0.1:10256" + path)
		if err != nil {
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	testbed.Await(t, 30*time.Second, "/livez and /healthz answering 503", func() bool {
		return get("/livez") == http.StatusServiceUnavailable && get("/healthz") == http.StatusServiceUnavailable
	})
	if took := time.Since(start); took < 2*syncPeriod {
		t.Errorf("/livez failed %v after the start, before two --sync-periods (%v)", took, 2*syncPeriod)
	}
	time.Sleep(5 * time.Second) // several retries of the slice informer

	const failed = `"API server request failed; retrying"`
	log := px.logText()
	var fails []string
	for _, line := range strings.Split(log, "\n") {
		if strings.Contains(line, failed) {
			fails = append(fails, line)
		}
	}
	if len(fails) != 1 || !strings.Contains(fails[0], "endpointslices.discovery.k8s.io: the ClusterRole needs list and watch") ||
		!strings.Contains(fails[0], `resource="endpointslices.discovery.k8s.io"`) {
		t.Errorf("failure lines: got %d, want one naming endpointslices.discovery.k8s.io and the ClusterRole's list and watch:\n%s", len(fails), tail(log, 30))
	}
	for _, unwanted := range []string{"answers again", "succeed again", "Failed to watch"} {
		if strings.Contains(log, unwanted) {
			t.Errorf("log has %q while EndpointSlices are forbidden:\n%s", unwanted, tail(log, 30))
		}
	}

	role.Rules = append(role.Rules, rbacv1.PolicyRule{APIGroups: []string{"discovery.k8s.io"}, Resources: []string{"endpointslices"}, Verbs: []string{"list", "watch"}})
	if _, err := client.RbacV1().ClusterRoles().Update(ctx, role, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	testbed.Await(t, 60*time.Second, "/livez and /healthz answering 200 after the grant", func() bool {
		return get("/livez") == http.StatusOK && get("/healthz") == http.StatusOK
	})
	if log := px.logText(); !strings.Contains(log, `"API server requests succeed again"`) || !strings.Contains(log, "Services and EndpointSlices synced") {
		t.Errorf("log after the grant lacks the recovery or the sync:\n%s", tail(log, 20))
	}
}
