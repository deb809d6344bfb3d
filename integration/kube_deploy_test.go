package integration

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	v1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"

	"github.com/uproxy/uproxy/proxyconfig"
	"github.com/uproxy/uproxy/test/testbed/kubeapi"
)

// deployObjects decodes deploy/uproxy.yaml.
func deployObjects(t *testing.T) []runtime.Object {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("..", "deploy", "uproxy.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var objs []runtime.Object
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("deploy/uproxy.yaml: %v", err)
		}
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		obj, _, err := scheme.Codecs.UniversalDeserializer().Decode(doc, nil, nil)
		if err != nil {
			t.Fatalf("deploy/uproxy.yaml: decode %q: %v", firstLine(doc), err)
		}
		objs = append(objs, obj)
	}
	return objs
}

func firstLine(b []byte) string {
	line, _, _ := strings.Cut(strings.TrimSpace(string(b)), "\n")
	return line
}

// createObject creates obj through client; dryRun asks the server to check it
// completely (admission and validation) without storing it.
func createObject(ctx context.Context, client kubernetes.Interface, obj runtime.Object, dryRun bool) error {
	opts := metav1.CreateOptions{}
	if dryRun {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	var err error
	switch o := obj.(type) {
	case *v1.ServiceAccount:
		_, err = client.CoreV1().ServiceAccounts(o.Namespace).Create(ctx, o, opts)
	case *v1.ConfigMap:
		_, err = client.CoreV1().ConfigMaps(o.Namespace).Create(ctx, o, opts)
	case *rbacv1.ClusterRole:
		_, err = client.RbacV1().ClusterRoles().Create(ctx, o, opts)
	case *rbacv1.ClusterRoleBinding:
		_, err = client.RbacV1().ClusterRoleBindings().Create(ctx, o, opts)
	case *appsv1.DaemonSet:
		_, err = client.AppsV1().DaemonSets(o.Namespace).Create(ctx, o, opts)
	default:
		return errors.New("unexpected kind in deploy/uproxy.yaml")
	}
	return err
}

// TestDeployManifestsAccepted asks the API server to accept every object of
// deploy/ (server-side dry run), and checks the ConfigMap's configuration is
// one uproxy reads without error.
func TestDeployManifestsAccepted(t *testing.T) {
	srv := kubeapi.Start(t)
	client := srv.Client(t)
	objs := deployObjects(t)
	kinds := map[string]bool{}
	for _, obj := range objs {
		kind := obj.GetObjectKind().GroupVersionKind().Kind
		kinds[kind] = true
		t.Run(kind, func(t *testing.T) {
			if err := createObject(context.Background(), client, obj, true); err != nil {
				t.Errorf("server-side dry run: got %v, want accepted", err)
			}
			if cm, ok := obj.(*v1.ConfigMap); ok {
				if _, ignored, err := proxyconfig.Parse([]byte(cm.Data["config.conf"])); err != nil || len(ignored) != 0 {
					t.Errorf("config.conf: got error %v, ignored %q; want neither", err, ignored)
				}
			}
		})
	}
	for _, k := range []string{"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet"} {
		if !kinds[k] {
			t.Errorf("deploy/uproxy.yaml has no %s", k)
		}
	}
}

// TestKubeRBACFromDeploy runs uproxy with the ServiceAccount token and the
// ClusterRole of deploy/, so that the role is proven sufficient: uproxy syncs,
// follows a change, and is never refused.
func TestKubeRBACFromDeploy(t *testing.T) {
	w := newKubeWorld(t)
	for _, obj := range deployObjects(t) {
		switch obj.(type) {
		case *rbacv1.ClusterRole, *rbacv1.ClusterRoleBinding:
			if err := createObject(context.Background(), w.srv.Client(t), obj, false); err != nil {
				t.Fatalf("create %s: %v", obj.GetObjectKind().GroupVersionKind().Kind, err)
			}
		}
	}
	token := w.srv.TokenFor(t, "kube-system", "uproxy")
	kubeconfig := writeKubeconfig(t, w.srv, w.apiURL, token)

	c := newCluster(t, w.srv, "rbac")
	b1, b2 := w.backend(t, "b1"), w.backend(t, "b2")
	web := clusterAddr(c.service("web", nil))
	c.endpoints("web", endpoint{b: b1})
	px := w.startKubeProxy(t, kubeconfig, 1)
	w.awaitServed(t, web, "b1")
	c.endpoints("web", endpoint{b: b2})
	w.awaitServed(t, web, "b2")
	if px.logContains("forbidden") {
		t.Errorf("uproxy's log mentions a refused request; the ClusterRole is missing a permission")
	}
}

// TestKubeAPIServerRestart restarts kube-apiserver under a running uproxy:
// traffic keeps flowing meanwhile, and changes made after the restart arrive,
// since the watches resume.
func TestKubeAPIServerRestart(t *testing.T) {
	w := newKubeWorld(t)
	c := newCluster(t, w.srv, "restart")
	b1, b2 := w.backend(t, "b1"), w.backend(t, "b2")
	web := clusterAddr(c.service("web", nil))
	c.endpoints("web", endpoint{b: b1})
	px := w.startKubeProxy(t, w.kubeconfig, 1)
	w.awaitServed(t, web, "b1")

	w.srv.Restart(t)
	w.awaitServed(t, web, "b1") // nothing lost while the server was away
	c = newCluster(t, w.srv, "restart-after")
	c.ns = "restart"
	c.endpoints("web", endpoint{b: b2})
	w.awaitServed(t, web, "b2")
	api := clusterAddr(c.service("api", nil))
	c.endpoints("api", endpoint{b: b1})
	w.awaitServed(t, api, "b1")
	select {
	case <-px.exited:
		t.Fatalf("uproxy exited across the restart")
	default:
	}
}

// TestKubeInvalidServiceDoesNotStopOthers creates, through the API, a Service
// that the API server accepts but uproxy cannot program: it is reported and
// left out, and every other Service keeps working and following changes.
func TestKubeInvalidServiceDoesNotStopOthers(t *testing.T) {
	// Clusters before 1.36 (and any with this gate off) accept, with a warning,
	// IPv4 addresses with leading zeros; uproxy refuses them, since such an
	// address reads as decimal to some tools and octal to others.
	w := newKubeWorld(t, "--feature-gates=StrictIPCIDRValidation=false")
	c := newCluster(t, w.srv, "invalid")
	b1, b2 := w.backend(t, "b1"), w.backend(t, "b2")
	web := clusterAddr(c.service("web", nil))
	c.endpoints("web", endpoint{b: b1})
	px := w.startKubeProxy(t, w.kubeconfig, 1)
	w.awaitServed(t, web, "b1")

	c.service("odd", func(s *v1.Service) { s.Spec.ExternalIPs = []string{"010.1.2.3"} })
	c.endpoints("odd", endpoint{b: b2})
	deadline := time.Now().Add(30 * time.Second)
	for !px.logContains(`spec.externalIPs[0]`) {
		if time.Now().After(deadline) {
			t.Fatalf("uproxy did not report the invalid Service")
		}
		time.Sleep(50 * time.Millisecond)
	}
	c.endpoints("web", endpoint{b: b2})
	w.awaitServed(t, web, "b2")
	if got := withProxyPorts(px.waitFor(func([]serviceState) bool { return true }, "state")); len(got) != 1 || got[0] != "invalid/web:p" {
		t.Errorf("got Service ports %q, want only invalid/web:p", got)
	}
}
