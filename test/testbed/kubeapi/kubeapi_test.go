package kubeapi

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/uproxy/uproxy/test/testbed"
)

func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// TestObjectsSurviveRestart stores a Service and its EndpointSlice and reads
// them back before and after kube-apiserver restarts on the same etcd.
func TestObjectsSurviveRestart(t *testing.T) {
	srv := Start(t)
	ctx := testContext(t)
	client := srv.Client(t)

	const ns = "restart"
	if _, err := client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create namespace: %v", err)
	}
	svc, err := client.CoreV1().Services(ns).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web"},
		Spec: corev1.ServiceSpec{
			Type:     corev1.ServiceTypeClusterIP,
			Selector: map[string]string{"app": "web"},
			Ports: []corev1.ServicePort{{
				Name: "http", Protocol: corev1.ProtocolTCP, Port: 80, TargetPort: intstr.FromInt32(8080),
			}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create service: %v", err)
	}
	clusterIP, err := netip.ParseAddr(svc.Spec.ClusterIP)
	if err != nil || !netip.MustParsePrefix(ServiceClusterIPRange).Contains(clusterIP) {
		t.Fatalf("service ClusterIP: got %q, want an address in %s", svc.Spec.ClusterIP, ServiceClusterIPRange)
	}
	ready := true
	if _, err := client.DiscoveryV1().EndpointSlices(ns).Create(ctx, &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{
			Name:   "web-1",
			Labels: map[string]string{discoveryv1.LabelServiceName: "web"},
		},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints: []discoveryv1.Endpoint{
			{Addresses: []string{"10.0.0.1"}, Conditions: discoveryv1.EndpointConditions{Ready: &ready}},
			{Addresses: []string{"10.0.0.2"}, Conditions: discoveryv1.EndpointConditions{Ready: &ready}},
		},
		Ports: []discoveryv1.EndpointPort{{Name: ptr("http"), Protocol: ptr(corev1.ProtocolTCP), Port: ptr(int32(8080))}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create endpointslice: %v", err)
	}

	checks := []struct {
		name  string
		check func(context.Context, kubernetes.Interface) error
	}{
		{"namespace", func(ctx context.Context, c kubernetes.Interface) error {
			got, err := c.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
			if err != nil {
				return err
			}
			if got.Status.Phase != corev1.NamespaceActive {
				return fmt.Errorf("phase: got %q, want %q", got.Status.Phase, corev1.NamespaceActive)
			}
			return nil
		}},
		{"service", func(ctx context.Context, c kubernetes.Interface) error {
			got, err := c.CoreV1().Services(ns).Get(ctx, "web", metav1.GetOptions{})
			if err != nil {
				return err
			}
			if got.Spec.ClusterIP != svc.Spec.ClusterIP {
				return fmt.Errorf("ClusterIP: got %q, want %q", got.Spec.ClusterIP, svc.Spec.ClusterIP)
			}
			if len(got.Spec.Ports) != 1 || got.Spec.Ports[0].Port != 80 || got.Spec.Ports[0].TargetPort.IntVal != 8080 {
				return fmt.Errorf("ports: got %+v, want one port 80 -> 8080", got.Spec.Ports)
			}
			return nil
		}},
		{"endpointslice", func(ctx context.Context, c kubernetes.Interface) error {
			list, err := c.DiscoveryV1().EndpointSlices(ns).List(ctx, metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=web"})
			if err != nil {
				return err
			}
			if len(list.Items) != 1 {
				return fmt.Errorf("slices for service web: got %d, want 1", len(list.Items))
			}
			var addrs []string
			for _, ep := range list.Items[0].Endpoints {
				addrs = append(addrs, ep.Addresses...)
			}
			if got, want := strings.Join(addrs, ","), "10.0.0.1,10.0.0.2"; got != want {
				return fmt.Errorf("addresses: got %s, want %s", got, want)
			}
			if p := list.Items[0].Ports; len(p) != 1 || p[0].Port == nil || *p[0].Port != 8080 {
				return fmt.Errorf("ports: got %+v, want one port 8080", p)
			}
			return nil
		}},
	}
	runChecks := func(phase string) {
		for _, c := range checks {
			t.Run(phase+"/"+c.name, func(t *testing.T) {
				if err := c.check(ctx, client); err != nil {
					t.Fatal(err)
				}
			})
		}
	}

	runChecks("before restart")
	srv.Restart(t)
	// The same client, made before the restart, must keep working: the URL
	// and the serving certificate stay the same.
	runChecks("after restart")
}

// TestServiceAccountTokenIsBoundByRBAC authenticates with a ServiceAccount
// token and checks that RBAC allows exactly what was granted.
func TestServiceAccountTokenIsBoundByRBAC(t *testing.T) {
	srv := Start(t)
	ctx := testContext(t)
	admin := srv.Client(t)

	const ns, name = "proxy", "reader"
	token := srv.TokenFor(t, ns, name)
	if _, err := admin.RbacV1().Roles(ns).Create(ctx, &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: "read-slices"},
		Rules: []rbacv1.PolicyRule{{
			APIGroups: []string{discoveryv1.GroupName}, Resources: []string{"endpointslices"}, Verbs: []string{"get", "list", "watch"},
		}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create role: %v", err)
	}
	if _, err := admin.RbacV1().RoleBindings(ns).Create(ctx, &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "read-slices"},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "read-slices"},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: ns, Name: name}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create role binding: %v", err)
	}

	sa, err := kubernetes.NewForConfig(srv.ConfigForToken(token))
	if err != nil {
		t.Fatalf("service account client: %v", err)
	}

	review, err := sa.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("self subject review: %v", err)
	}
	if got, want := review.Status.UserInfo.Username, "system:serviceaccount:"+ns+":"+name; got != want {
		t.Fatalf("authenticated as %q, want %q", got, want)
	}

	// The authorizer learns of the binding through a watch; once the granted
	// list succeeds, it has the binding, and what is still refused is refused
	// because it was never granted.
	testbed.AwaitNoError(t, time.Minute, "the service account to list endpointslices in "+ns, func() error {
		_, err := sa.DiscoveryV1().EndpointSlices(ns).List(ctx, metav1.ListOptions{})
		return err
	})

	refused := []struct {
		name string
		do   func(context.Context) error
	}{
		{"list services in own namespace", func(ctx context.Context) error {
			_, err := sa.CoreV1().Services(ns).List(ctx, metav1.ListOptions{})
			return err
		}},
		{"list endpointslices in another namespace", func(ctx context.Context) error {
			_, err := sa.DiscoveryV1().EndpointSlices(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{})
			return err
		}},
		{"create endpointslice in own namespace", func(ctx context.Context) error {
			_, err := sa.DiscoveryV1().EndpointSlices(ns).Create(ctx, &discoveryv1.EndpointSlice{
				ObjectMeta:  metav1.ObjectMeta{Name: "x"},
				AddressType: discoveryv1.AddressTypeIPv4,
			}, metav1.CreateOptions{})
			return err
		}},
		{"list nodes", func(ctx context.Context) error {
			_, err := sa.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
			return err
		}},
	}
	for _, tc := range refused {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.do(ctx); !apierrors.IsForbidden(err) {
				t.Errorf("got error %v, want Forbidden", err)
			}
		})
	}
}

// TestKubeconfigReachesServer loads the written kubeconfig as a program given
// --kubeconfig would, and uses it.
func TestKubeconfigReachesServer(t *testing.T) {
	srv := Start(t)
	ctx := testContext(t)
	cfg, err := clientcmd.BuildConfigFromFlags("", srv.Kubeconfig)
	if err != nil {
		t.Fatalf("load kubeconfig %s: %v", srv.Kubeconfig, err)
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatalf("client from kubeconfig: %v", err)
	}
	// The "kubernetes" Service is created by kube-apiserver itself, with the
	// first address of the service range, by a controller that may run a moment
	// after /readyz first answers.
	var svc *corev1.Service
	testbed.AwaitNoError(t, 30*time.Second, "default/kubernetes", func() (err error) {
		svc, err = client.CoreV1().Services(metav1.NamespaceDefault).Get(ctx, "kubernetes", metav1.GetOptions{})
		return err
	})
	if got, want := svc.Spec.ClusterIP, "10.96.0.1"; got != want {
		t.Errorf("default/kubernetes ClusterIP: got %s, want %s", got, want)
	}
}

func ptr[T any](v T) *T { return &v }
