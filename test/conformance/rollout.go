package conformance

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/wait"
)

// rolloutNS holds the rolling update's backend and its Service.
const rolloutNS = "uproxy-rollout"

// rolloutObjects are the backend of the rolling update's load: agnhost's
// netexec behind a NodePort Service.
func rolloutObjects(replicas int32) (*v1.Namespace, *appsv1.Deployment, *v1.Service) {
	labels := map[string]string{"app": "rollout-echo"}
	ns := &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: rolloutNS}}
	dep := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "echo", Namespace: rolloutNS},
		Spec: appsv1.DeploymentSpec{
			Replicas: &replicas,
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: v1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: v1.PodSpec{Containers: []v1.Container{{
					Name: "netexec", Image: agnhostImage, ImagePullPolicy: v1.PullNever,
					Args:           []string{"netexec", "--http-port=8080"},
					ReadinessProbe: &v1.Probe{ProbeHandler: v1.ProbeHandler{HTTPGet: &v1.HTTPGetAction{Path: "/healthz", Port: intstr.FromInt32(8080)}}, PeriodSeconds: 1},
				}}},
			},
		},
	}
	svc := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "echo", Namespace: rolloutNS},
		Spec: v1.ServiceSpec{
			Type:     v1.ServiceTypeNodePort,
			Selector: labels,
			Ports:    []v1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080), Protocol: v1.ProtocolTCP}},
		},
	}
	return ns, dep, svc
}

// RolloutReport is what a rolling update of the uproxy DaemonSet under load
// did to the load.
type RolloutReport struct {
	// Steps are the updates made, each with how long the DaemonSet took.
	Steps []string
	// Long is the number of long-lived connections, LongLost those that
	// failed (with the first errors in Errors).
	Long, LongLost int
	// Exchanges are the requests made on them.
	Exchanges int64
	// Short and ShortFailed count the short connections (one request each).
	Short, ShortFailed int64
	// Resumed is what the new pods' uproxies logged resuming.
	Resumed []string
	Errors  []string
}

// Clean reports whether the update lost nothing.
func (r RolloutReport) Clean() bool {
	return r.LongLost == 0 && r.ShortFailed == 0 && r.Short > 0 && r.Exchanges > 0
}

func (r RolloutReport) String() string {
	s := fmt.Sprintf("%s; long-lived connections %d, lost %d (%d requests on them); short connections %d, failed %d; %s",
		strings.Join(r.Steps, ", "), r.Long, r.LongLost, r.Exchanges, r.Short, r.ShortFailed, strings.Join(r.Resumed, "; "))
	if len(r.Errors) > 0 {
		s += "\nfirst errors:\n  " + strings.Join(r.Errors, "\n  ")
	}
	return s
}

// RollOutUnderLoad updates the uproxy DaemonSet twice under load, as an
// operator would: `kubectl rollout restart` (a new annotation on the pod
// template), then a new image (next, the same uproxy under another name).
// The load goes through a NodePort Service from every node's host network
// (to the ClusterIP and to the node's own NodePort) and from outside the
// nodes (to every node's NodePort): long-lived connections that make a
// request every 100 ms, and a short connection every 20 ms per client. It
// returns what the load saw; an error is a cluster that would not do it.
func (c *Cluster) RollOutUnderLoad(ctx context.Context, next string, logf func(string, ...any)) (RolloutReport, error) {
	var rep RolloutReport
	ns, dep, svc := rolloutObjects(int32(max(2, c.cfg.Nodes)))
	if _, err := c.Client.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil {
		return rep, err
	}
	defer c.Client.CoreV1().Namespaces().Delete(context.Background(), rolloutNS, metav1.DeleteOptions{})
	if _, err := c.Client.AppsV1().Deployments(rolloutNS).Create(ctx, dep, metav1.CreateOptions{}); err != nil {
		return rep, err
	}
	svc, err := c.Client.CoreV1().Services(rolloutNS).Create(ctx, svc, metav1.CreateOptions{})
	if err != nil {
		return rep, err
	}
	clusterIP := net.JoinHostPort(svc.Spec.ClusterIP, "80")
	nodePort := strconv.Itoa(int(svc.Spec.Ports[0].NodePort))

	// The clients: a network namespace and the addresses it uses.
	type client struct {
		ns    string
		addrs []string
	}
	var clients []client
	var outside []string
	for _, i := range c.nodes() {
		clients = append(clients, client{NodeName(i), []string{clusterIP, net.JoinHostPort(NodeIP(i), nodePort)}})
		outside = append(outside, net.JoinHostPort(NodeIP(i), nodePort))
	}
	clients = append(clients, client{ExtNS, outside})

	// Every client reaches every address before the load starts.
	for _, cl := range clients {
		for _, a := range cl.addrs {
			var last error
			err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 3*time.Minute, true, func(ctx context.Context) (bool, error) {
				last = shortRequest(ctx, DialIn(cl.ns), a)
				return last == nil, nil
			})
			if err != nil {
				return rep, fmt.Errorf("%s does not reach the rollout Service at %s: %v\n%s", cl.ns, a, last, c.PodProblems(ctx, rolloutNS))
			}
		}
	}

	loadCtx, stopLoad := context.WithCancel(ctx)
	defer stopLoad()
	var (
		mu        sync.Mutex
		errs      []string
		exchanges atomic.Int64
		short     atomic.Int64
		shortBad  atomic.Int64
		wg        sync.WaitGroup
	)
	note := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		if len(errs) < 10 {
			errs = append(errs, time.Now().Format("15:04:05.000")+" "+fmt.Sprintf(format, args...))
		}
	}
	var longs []*longConn
	for _, cl := range clients {
		for _, a := range cl.addrs {
			for k := range 2 {
				lc, err := dialLong(ctx, DialIn(cl.ns), a, fmt.Sprintf("%s-%s-%d", cl.ns, a, k))
				if err != nil {
					return rep, fmt.Errorf("%s: a long-lived connection to %s: %w", cl.ns, a, err)
				}
				longs = append(longs, lc)
			}
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			tick := time.NewTicker(20 * time.Millisecond)
			defer tick.Stop()
			for n := 0; ; n++ {
				select {
				case <-loadCtx.Done():
					return
				case <-tick.C:
				}
				a := cl.addrs[n%len(cl.addrs)]
				short.Add(1)
				if err := shortRequest(loadCtx, DialIn(cl.ns), a); err != nil && loadCtx.Err() == nil {
					shortBad.Add(1)
					note("short connection from %s to %s: %v", cl.ns, a, err)
				}
			}
		}()
	}
	for _, lc := range longs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer lc.c.Close()
			tick := time.NewTicker(100 * time.Millisecond)
			defer tick.Stop()
			for {
				select {
				case <-loadCtx.Done():
					return
				case <-tick.C:
				}
				if err := lc.exchange(); err != nil {
					lc.err = err
					note("long-lived connection %s: %v", lc.name, err)
					return
				}
				exchanges.Add(1)
				lc.lastOK.Store(time.Now().UnixNano())
			}
		}()
	}

	pause := func() {
		select {
		case <-ctx.Done():
		case <-time.After(3 * time.Second):
		}
	}
	pause()
	ds, err := c.Client.AppsV1().DaemonSets("kube-system").Get(ctx, "uproxy", metav1.GetOptions{})
	if err != nil {
		return rep, err
	}
	steps := []struct {
		what  string
		patch string
	}{
		{"rollout restart", fmt.Sprintf(`{"spec":{"template":{"metadata":{"annotations":{"kubectl.kubernetes.io/restartedAt":%q}}}}}`, time.Now().Format(time.RFC3339))},
		{"image " + next, fmt.Sprintf(`{"spec":{"template":{"spec":{"containers":[{"name":%q,"image":%q}]}}}}`, ds.Spec.Template.Spec.Containers[0].Name, next)},
	}
	for _, st := range steps {
		start := time.Now()
		if _, err := c.Client.AppsV1().DaemonSets("kube-system").Patch(ctx, "uproxy", types.StrategicMergePatchType, []byte(st.patch), metav1.PatchOptions{}); err != nil {
			return rep, fmt.Errorf("%s: %w", st.what, err)
		}
		if err := c.awaitRollout(ctx, "kube-system", "uproxy", 5*time.Minute); err != nil {
			return rep, fmt.Errorf("%s: %w", st.what, err)
		}
		rep.Steps = append(rep.Steps, fmt.Sprintf("%s rolled out in %s", st.what, time.Since(start).Round(100*time.Millisecond)))
		logf("rollout: %s", rep.Steps[len(rep.Steps)-1])
		pause()
	}
	// Each long-lived connection has answered since the last update.
	rolledOut := time.Now().Add(-2 * time.Second)
	stopLoad()
	wg.Wait()

	for _, lc := range longs {
		rep.Long++
		switch {
		case lc.err != nil:
			rep.LongLost++
		case time.Unix(0, lc.lastOK.Load()).Before(rolledOut):
			rep.LongLost++
			note("long-lived connection %s: no answer since %s", lc.name, time.Unix(0, lc.lastOK.Load()).Format("15:04:05.000"))
		}
	}
	rep.Exchanges, rep.Short, rep.ShortFailed, rep.Errors = exchanges.Load(), short.Load(), shortBad.Load(), errs
	rep.Resumed = c.resumedLines(ctx)
	return rep, nil
}

// awaitRollout waits until every node runs one pod of the DaemonSet's
// current template, and no other.
func (c *Cluster) awaitRollout(ctx context.Context, ns, name string, within time.Duration) error {
	var last string
	err := wait.PollUntilContextTimeout(ctx, time.Second, within, false, func(ctx context.Context) (bool, error) {
		ds, err := c.Client.AppsV1().DaemonSets(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			last = err.Error()
			return false, nil
		}
		st := ds.Status
		pods, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: metav1.FormatLabelSelector(ds.Spec.Selector)})
		if err != nil {
			last = err.Error()
			return false, nil
		}
		last = fmt.Sprintf("generation %d observed %d, %d updated, %d available of %d, %d pods", ds.Generation, st.ObservedGeneration,
			st.UpdatedNumberScheduled, st.NumberAvailable, st.DesiredNumberScheduled, len(pods.Items))
		return st.ObservedGeneration >= ds.Generation && st.UpdatedNumberScheduled == st.DesiredNumberScheduled &&
			st.NumberAvailable == st.DesiredNumberScheduled && st.NumberUnavailable == 0 &&
			len(pods.Items) == int(st.DesiredNumberScheduled), nil
	})
	if err != nil {
		return fmt.Errorf("DaemonSet %s/%s: %s: %w\n%s", ns, name, last, err, c.PodProblems(ctx, ns))
	}
	return nil
}

// resumedLines are the uproxy pods' lines that say what they took over.
func (c *Cluster) resumedLines(ctx context.Context) []string {
	pods, err := c.Client.CoreV1().Pods("kube-system").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=uproxy"})
	if err != nil {
		return []string{err.Error()}
	}
	var out []string
	for _, p := range pods.Items {
		b, err := c.Client.CoreV1().Pods("kube-system").GetLogs(p.Name, &v1.PodLogOptions{}).DoRaw(ctx)
		if err != nil {
			out = append(out, p.Spec.NodeName+": "+err.Error())
			continue
		}
		for line := range strings.Lines(string(b)) {
			if strings.Contains(line, "Resumed the established connections") {
				_, msg, _ := strings.Cut(line, "] ")
				out = append(out, p.Spec.NodeName+": "+strings.TrimSpace(msg))
			}
		}
	}
	return out
}

// shortRequest makes one request on a connection of its own.
func shortRequest(ctx context.Context, dial func(context.Context, string, string) (net.Conn, error), addr string) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	c, err := dial(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, "GET /hostname HTTP/1.1\r\nHost: echo\r\nConnection: close\r\n\r\n"); err != nil {
		return err
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if _, err := io.ReadAll(resp.Body); err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("status %s", resp.Status)
	}
	return nil
}

// longConn is a long-lived connection: requests, one at a time, on one
// socket, each echoing a message of its own.
type longConn struct {
	name   string
	c      net.Conn
	r      *bufio.Reader
	seq    int
	err    error        // the exchange that failed
	lastOK atomic.Int64 // when the last one succeeded (UnixNano)
}

func dialLong(ctx context.Context, dial func(context.Context, string, string) (net.Conn, error), addr, name string) (*longConn, error) {
	c, err := dial(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	lc := &longConn{name: name, c: c, r: bufio.NewReader(c)}
	if err := lc.exchange(); err != nil {
		c.Close()
		return nil, err
	}
	return lc, nil
}

func (lc *longConn) exchange() error {
	lc.seq++
	msg := fmt.Sprintf("%d", lc.seq)
	lc.c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := fmt.Fprintf(lc.c, "GET /echo?msg=%s HTTP/1.1\r\nHost: echo\r\n\r\n", msg); err != nil {
		return err
	}
	resp, err := http.ReadResponse(lc.r, nil)
	if err != nil {
		return err
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK || string(body) != msg {
		return fmt.Errorf("request %d: status %s, body %q", lc.seq, resp.Status, body)
	}
	return nil
}
