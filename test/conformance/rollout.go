package conformance

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
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
// did to the load, and then the kills of each node's serving uproxy.
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
	// Crash is the second phase, when asked for.
	Crash *CrashReport
}

// CrashReport is what SIGKILLs of the serving uproxy on every node, one at a
// time (--crash-holder starts it again), did to a load of short
// connections.
type CrashReport struct {
	Kills int
	// Short counts the short connections; Refused those that never
	// connected or timed out (none is allowed), Cut those the killed
	// process was relaying (a crash loses established connections: at most
	// one per client per kill, the clients making one at a time).
	Short, Refused, Cut int64
	// Restarts are the lines of the servers started again.
	Restarts []string
	Errors   []string
	clients  int
}

// Clean reports whether the update, and the kills, lost nothing they may not.
func (r RolloutReport) Clean() bool {
	ok := r.LongLost == 0 && r.ShortFailed == 0 && r.Short > 0 && r.Exchanges > 0
	if r.Crash != nil {
		ok = ok && r.Crash.Short > 0 && r.Crash.Refused == 0 && r.Crash.Kills > 0 && r.Crash.Cut <= int64(r.Crash.Kills*r.Crash.clients)
	}
	return ok
}

func (r RolloutReport) String() string {
	s := fmt.Sprintf("%s; long-lived connections %d, lost %d (%d requests on them); short connections %d, failed %d; %s",
		strings.Join(r.Steps, ", "), r.Long, r.LongLost, r.Exchanges, r.Short, r.ShortFailed, strings.Join(r.Resumed, "; "))
	if len(r.Errors) > 0 {
		s += "\nfirst errors:\n  " + strings.Join(r.Errors, "\n  ")
	}
	if c := r.Crash; c != nil {
		s += fmt.Sprintf("\nthen %d kills of the serving uproxy: short connections %d, refused or timed out %d, cut while relayed %d; %s",
			c.Kills, c.Short, c.Refused, c.Cut, strings.Join(c.Restarts, "; "))
		if len(c.Errors) > 0 {
			s += "\nfirst errors:\n  " + strings.Join(c.Errors, "\n  ")
		}
	}
	return s
}

// RollOutUnderLoad updates the uproxy DaemonSet twice under load, as an
// operator would: `kubectl rollout restart` (a new annotation on the pod
// template), then a new image (next, the same uproxy under another name).
// The load goes through a NodePort Service from every node's host network
// (to the ClusterIP and to the node's own NodePort) and from outside the
// nodes (to every node's NodePort): long-lived connections that make a
// request every 100 ms, and a short connection every 20 ms per client.
// With crash, it then SIGKILLs the serving uproxy of each node in turn
// under a load of short connections, and waits for it to serve again. It
// returns what the load saw; an error is a cluster that would not do it.
func (c *Cluster) RollOutUnderLoad(ctx context.Context, next string, crash bool, logf func(string, ...any)) (RolloutReport, error) {
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

	var clients []loadClient
	var outside []string
	for _, i := range c.nodes() {
		clients = append(clients, loadClient{NodeName(i), []string{clusterIP, net.JoinHostPort(NodeIP(i), nodePort)}})
		outside = append(outside, net.JoinHostPort(NodeIP(i), nodePort))
	}
	clients = append(clients, loadClient{ExtNS, outside})

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

	l, err := startLoad(ctx, clients, 2)
	if err != nil {
		return rep, err
	}
	defer l.stop()
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
	l.stop()
	for _, lc := range l.longs {
		rep.Long++
		switch {
		case lc.err != nil:
			rep.LongLost++
		case time.Unix(0, lc.lastOK.Load()).Before(rolledOut):
			rep.LongLost++
			l.note("long-lived connection %s: no answer since %s", lc.name, time.Unix(0, lc.lastOK.Load()).Format("15:04:05.000"))
		}
	}
	rep.Exchanges, rep.Short, rep.ShortFailed, rep.Errors = l.exchanges.Load(), l.short.Load(), l.shortRefused.Load()+l.shortCut.Load(), l.errs
	rep.Resumed = c.podLines(ctx, "Resumed the established connections")
	if !crash {
		return rep, nil
	}

	cr := &CrashReport{clients: len(clients)}
	rep.Crash = cr
	l, err = startLoad(ctx, clients, 0)
	if err != nil {
		return rep, err
	}
	defer l.stop()
	pause()
	for _, i := range c.nodes() {
		before := len(c.podLines(ctx, restartedLine))
		pid, err := servingUProxy(NodeName(i))
		if err != nil {
			return rep, err
		}
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			return rep, fmt.Errorf("kill the serving uproxy of %s (process %d): %w", NodeName(i), pid, err)
		}
		cr.Kills++
		err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, false, func(ctx context.Context) (bool, error) {
			return len(c.podLines(ctx, restartedLine)) > before, nil
		})
		if err != nil {
			return rep, fmt.Errorf("the uproxy of %s killed, none serves again: %w\n%s", NodeName(i), err, c.PodProblems(ctx, "kube-system"))
		}
		logf("crash: the serving uproxy of %s (process %d) killed, and started again", NodeName(i), pid)
		pause()
	}
	l.stop()
	cr.Short, cr.Refused, cr.Cut, cr.Errors = l.short.Load(), l.shortRefused.Load(), l.shortCut.Load(), l.errs
	cr.Restarts = c.podLines(ctx, restartedLine)
	return rep, nil
}

// restartedLine is what a server started again by its crash holder logs, in
// every mode (the userspace mode then logs "Serving again" once it adopted
// the held sockets).
const restartedLine = "Started again by the crash holder"

// servingUProxy finds the uproxy that serves node's network namespace: the
// child of the crash holder, both named uproxy.
func servingUProxy(node string) (int, error) {
	var want syscall.Stat_t
	if err := syscall.Stat("/run/netns/"+node, &want); err != nil {
		return 0, err
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0, err
	}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || procComm(pid) != "uproxy" {
			continue
		}
		var st syscall.Stat_t
		if syscall.Stat(fmt.Sprintf("/proc/%d/ns/net", pid), &st) != nil || st.Ino != want.Ino {
			continue
		}
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...
		_, rest, _ := strings.Cut(string(stat), ") ")
		if f := strings.Fields(rest); len(f) > 1 {
			if ppid, _ := strconv.Atoi(f[1]); procComm(ppid) == "uproxy" {
				return pid, nil
			}
		}
	}
	return 0, fmt.Errorf("no uproxy under a crash holder serves %s", node)
}

func procComm(pid int) string {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	return strings.TrimSpace(string(b))
}

// loadClient is a network namespace and the addresses it sends to.
type loadClient struct {
	ns    string
	addrs []string
}

// load is the clients' traffic: per client a short connection every 20 ms,
// round the client's addresses, and perAddr long-lived connections to each.
type load struct {
	cancel                 context.CancelFunc
	wg                     sync.WaitGroup
	mu                     sync.Mutex
	errs                   []string
	exchanges, short       atomic.Int64
	shortRefused, shortCut atomic.Int64
	longs                  []*longConn
}

func startLoad(ctx context.Context, clients []loadClient, perAddr int) (*load, error) {
	ctx, cancel := context.WithCancel(ctx)
	l := &load{cancel: cancel}
	for _, cl := range clients {
		for _, a := range cl.addrs {
			for k := range perAddr {
				lc, err := dialLong(ctx, DialIn(cl.ns), a, fmt.Sprintf("%s-%s-%d", cl.ns, a, k))
				if err != nil {
					l.stop()
					return nil, fmt.Errorf("%s: a long-lived connection to %s: %w", cl.ns, a, err)
				}
				l.longs = append(l.longs, lc)
			}
		}
		l.wg.Go(func() {
			tick := time.NewTicker(20 * time.Millisecond)
			defer tick.Stop()
			for n := 0; ; n++ {
				select {
				case <-ctx.Done():
					return
				case <-tick.C:
				}
				a := cl.addrs[n%len(cl.addrs)]
				l.short.Add(1)
				err := shortRequest(ctx, DialIn(cl.ns), a)
				switch {
				case err == nil || ctx.Err() != nil:
					continue
				case errors.Is(err, syscall.ECONNRESET) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
					l.shortCut.Add(1)
				default:
					l.shortRefused.Add(1)
				}
				l.note("short connection from %s to %s: %v", cl.ns, a, err)
			}
		})
	}
	for _, lc := range l.longs {
		l.wg.Go(func() {
			defer lc.c.Close()
			tick := time.NewTicker(100 * time.Millisecond)
			defer tick.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-tick.C:
				}
				if err := lc.exchange(); err != nil {
					lc.err = err
					l.note("long-lived connection %s: %v", lc.name, err)
					return
				}
				l.exchanges.Add(1)
				lc.lastOK.Store(time.Now().UnixNano())
			}
		})
	}
	return l, nil
}

func (l *load) note(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.errs) < 10 {
		l.errs = append(l.errs, time.Now().Format("15:04:05.000")+" "+fmt.Sprintf(format, args...))
	}
}

// stop ends the load and waits for its clients.
func (l *load) stop() {
	l.cancel()
	l.wg.Wait()
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

// podLines are the uproxy pods' log lines that contain what.
func (c *Cluster) podLines(ctx context.Context, what string) []string {
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
			if strings.Contains(line, what) {
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
