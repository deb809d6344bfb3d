package conformance

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	v1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/wait"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/yaml"
)

// dnsManifest is the cluster DNS: CoreDNS answering cluster.local from Services and
// EndpointSlices, behind the kube-dns Service the kubelets name (DNSIP). Its
// queries to the API go through the nodes' service proxy, as in any cluster.
const dnsManifest = `apiVersion: v1
kind: ServiceAccount
metadata: {name: coredns, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: uconf-coredns}
rules:
- apiGroups: [""]
  resources: [services, namespaces, pods]
  verbs: [list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: uconf-coredns}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: uconf-coredns}
subjects:
- {kind: ServiceAccount, name: coredns, namespace: kube-system}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: coredns, namespace: kube-system}
data:
  Corefile: |
    .:53 {
        errors
        health :8080
        ready :8181
        kubernetes cluster.local in-addr.arpa ip6.arpa {
            pods insecure
            fallthrough in-addr.arpa ip6.arpa
            ttl 30
        }
        cache 30
        loadbalance
        reload
    }
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: coredns
  namespace: kube-system
  labels: {k8s-app: kube-dns}
spec:
  replicas: 1
  selector:
    matchLabels: {k8s-app: kube-dns}
  template:
    metadata:
      labels: {k8s-app: kube-dns}
    spec:
      serviceAccountName: coredns
      priorityClassName: system-cluster-critical
      tolerations:
      - {operator: Exists}
      containers:
      - name: coredns
        image: ` + CoreDNSImage + `
        imagePullPolicy: Never
        args: [-conf, /etc/coredns/Corefile]
        ports:
        - {name: dns, containerPort: 53, protocol: UDP}
        - {name: dns-tcp, containerPort: 53, protocol: TCP}
        readinessProbe:
          httpGet: {path: /ready, port: 8181}
          periodSeconds: 2
        livenessProbe:
          httpGet: {path: /health, port: 8080}
          initialDelaySeconds: 30
        volumeMounts:
        - {name: config, mountPath: /etc/coredns, readOnly: true}
      volumes:
      - name: config
        configMap: {name: coredns}
---
apiVersion: v1
kind: Service
metadata:
  name: kube-dns
  namespace: kube-system
  labels: {k8s-app: kube-dns, kubernetes.io/name: CoreDNS}
spec:
  clusterIP: ` + DNSIP + `
  selector: {k8s-app: kube-dns}
  ports:
  - {name: dns, port: 53, protocol: UDP}
  - {name: dns-tcp, port: 53, protocol: TCP}
`

func (c *Cluster) deployDNS(ctx context.Context) error {
	objs, err := decodeManifest("cluster DNS", []byte(dnsManifest))
	if err != nil {
		return err
	}
	return c.apply(ctx, objs)
}

// kubeProxyHealthzPort is kube-proxy's health port (its default healthzBindAddress).
const kubeProxyHealthzPort = 10256

// ProxyMode is how uproxy runs on the nodes: its --proxy-mode, and for the
// userspace mode the portal backend (--rules).
type ProxyMode struct {
	Mode  string // userspace, nftables, iptables
	Rules string // nftables or iptables, for the userspace mode
}

// DeployUProxy applies deploy/uproxy.yaml as a user who runs uproxy as the nodes'
// only service proxy would: the image is the one built here; config.conf says the
// mode and the cluster's pod range, and moves the health and metrics ports back to
// kube-proxy's (the manifest's own keep clear of a kube-proxy beside it); the --service-proxy-name flag, which makes
// uproxy share the nodes with kube-proxy, is dropped so that it serves every
// Service; and the API server is named by its address, since the Service that
// names it is one uproxy has yet to program (kube-proxy's own DaemonSet takes a
// kubeconfig for the same reason).
func (c *Cluster) DeployUProxy(ctx context.Context, manifest, image string, mode ProxyMode) error {
	data, err := os.ReadFile(manifest)
	if err != nil {
		return err
	}
	objs, err := decodeManifest(manifest, data)
	if err != nil {
		return err
	}
	var ds *appsv1.DaemonSet
	for _, obj := range objs {
		switch o := obj.(type) {
		case *v1.ConfigMap:
			conf := map[string]any{}
			if err := yaml.Unmarshal([]byte(o.Data["config.conf"]), &conf); err != nil {
				return fmt.Errorf("%s: ConfigMap %s config.conf: %w", manifest, o.Name, err)
			}
			conf["mode"] = mode.Mode
			conf["clusterCIDR"] = ClusterCIDR
			// kube-proxy's own ports: with no kube-proxy beside it, what asks the
			// node's proxy for /proxyMode, /metrics or /healthz asks there.
			conf["healthzBindAddress"] = "0.0.0.0:" + fmt.Sprint(kubeProxyHealthzPort)
			conf["metricsBindAddress"] = "127.0.0.1:10249"
			out, err := yaml.Marshal(conf)
			if err != nil {
				return err
			}
			o.Data["config.conf"] = string(out)
		case *appsv1.DaemonSet:
			ds = o
			ctr := &o.Spec.Template.Spec.Containers[0]
			ctr.Image = image
			ctr.ImagePullPolicy = v1.PullNever
			var cmd []string
			for _, a := range ctr.Command {
				if !strings.HasPrefix(a, "--service-proxy-name") {
					cmd = append(cmd, a)
				}
			}
			if mode.Rules != "" {
				cmd = append(cmd, "--rules="+mode.Rules)
			}
			ctr.Command = cmd
			if p := ctr.LivenessProbe; p != nil && p.HTTPGet != nil {
				p.HTTPGet.Port = intstr.FromInt32(kubeProxyHealthzPort)
			}
			ctr.Env = append(ctr.Env,
				v1.EnvVar{Name: "KUBERNETES_SERVICE_HOST", Value: NodeIP(1)},
				v1.EnvVar{Name: "KUBERNETES_SERVICE_PORT", Value: fmt.Sprint(apiPort)})
		}
	}
	if ds == nil {
		return fmt.Errorf("%s has no DaemonSet", manifest)
	}
	if err := c.apply(ctx, objs); err != nil {
		return err
	}
	return c.awaitDaemonSet(ctx, ds.Namespace, ds.Name, 3*time.Minute)
}

func (c *Cluster) awaitDaemonSet(ctx context.Context, ns, name string, within time.Duration) error {
	var last string
	err := wait.PollUntilContextTimeout(ctx, time.Second, within, true, func(ctx context.Context) (bool, error) {
		ds, err := c.Client.AppsV1().DaemonSets(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			last = err.Error()
			return false, nil
		}
		st := ds.Status
		last = fmt.Sprintf("%d of %d pods ready", st.NumberReady, st.DesiredNumberScheduled)
		return st.DesiredNumberScheduled == int32(c.cfg.Nodes) && st.NumberReady == st.DesiredNumberScheduled, nil
	})
	if err != nil {
		return fmt.Errorf("DaemonSet %s/%s: %s: %w\n%s", ns, name, last, err, c.PodProblems(ctx, ns))
	}
	return nil
}

// AwaitDNS waits for the cluster DNS to be ready, which needs the service proxy:
// CoreDNS reaches the API server through the kubernetes Service.
func (c *Cluster) AwaitDNS(ctx context.Context, within time.Duration) error {
	var last string
	err := wait.PollUntilContextTimeout(ctx, time.Second, within, true, func(ctx context.Context) (bool, error) {
		d, err := c.Client.AppsV1().Deployments("kube-system").Get(ctx, "coredns", metav1.GetOptions{})
		if err != nil {
			last = err.Error()
			return false, nil
		}
		last = fmt.Sprintf("%d of %d replicas ready", d.Status.ReadyReplicas, *d.Spec.Replicas)
		return d.Status.ReadyReplicas == *d.Spec.Replicas, nil
	})
	if err != nil {
		return fmt.Errorf("cluster DNS: %s: %w\n%s", last, err, c.PodProblems(ctx, "kube-system"))
	}
	return nil
}

// PodProblems describes the pods of a namespace that are not ready, with their
// last events, for an error message.
func (c *Cluster) PodProblems(ctx context.Context, ns string) string {
	pods, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, p := range pods.Items {
		ready := false
		for _, cond := range p.Status.Conditions {
			if cond.Type == v1.PodReady && cond.Status == v1.ConditionTrue {
				ready = true
			}
		}
		if ready {
			continue
		}
		fmt.Fprintf(&b, "pod %s/%s on %q: %s", ns, p.Name, p.Spec.NodeName, p.Status.Phase)
		for _, cs := range p.Status.ContainerStatuses {
			if w := cs.State.Waiting; w != nil {
				fmt.Fprintf(&b, "; %s waiting: %s %s", cs.Name, w.Reason, w.Message)
			}
			if t := cs.LastTerminationState.Terminated; t != nil {
				fmt.Fprintf(&b, "; %s exited %d: %s", cs.Name, t.ExitCode, t.Message)
			}
		}
		b.WriteString("\n")
		events, err := c.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + p.Name})
		if err == nil {
			for _, e := range events.Items {
				fmt.Fprintf(&b, "  event %s: %s\n", e.Reason, e.Message)
			}
		}
		if logs, err := c.Client.CoreV1().Pods(ns).GetLogs(p.Name, &v1.PodLogOptions{TailLines: ptr(int64(20))}).DoRaw(ctx); err == nil {
			fmt.Fprintf(&b, "  log:\n%s\n", logs)
		}
	}
	return b.String()
}

func ptr[T any](v T) *T { return &v }

func decodeManifest(what string, data []byte) ([]runtime.Object, error) {
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var objs []runtime.Object
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return objs, nil
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		obj, _, err := scheme.Codecs.UniversalDeserializer().Decode(doc, nil, nil)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		objs = append(objs, obj)
	}
}

// apply creates the objects (or replaces them where they exist), in order.
func (c *Cluster) apply(ctx context.Context, objs []runtime.Object) error {
	for _, obj := range objs {
		var err error
		switch o := obj.(type) {
		case *v1.ServiceAccount:
			_, err = c.Client.CoreV1().ServiceAccounts(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		case *v1.ConfigMap:
			_, err = c.Client.CoreV1().ConfigMaps(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
			if apierrors.IsAlreadyExists(err) {
				_, err = c.Client.CoreV1().ConfigMaps(o.Namespace).Update(ctx, o, metav1.UpdateOptions{})
			}
		case *v1.Service:
			_, err = c.Client.CoreV1().Services(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.ClusterRole:
			_, err = c.Client.RbacV1().ClusterRoles().Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.ClusterRoleBinding:
			_, err = c.Client.RbacV1().ClusterRoleBindings().Create(ctx, o, metav1.CreateOptions{})
		case *appsv1.Deployment:
			_, err = c.Client.AppsV1().Deployments(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		case *appsv1.DaemonSet:
			_, err = c.Client.AppsV1().DaemonSets(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
			if apierrors.IsAlreadyExists(err) {
				_, err = c.Client.AppsV1().DaemonSets(o.Namespace).Update(ctx, o, metav1.UpdateOptions{})
			}
		default:
			return fmt.Errorf("apply: %T is not handled", obj)
		}
		if err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("apply %T: %w", obj, err)
		}
	}
	return nil
}
