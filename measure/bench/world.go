package bench

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/measure/topology"
)

// Roles of the benchmark's namespaces, mapped onto the topology's: the client
// sits where a pod would (routed through the node), the backends where the
// topology puts the external host (the node reaches it directly, and it routes back through
// the node, so kernel-mode DNAT is undone on the way back).
const (
	clientRole  = topology.Pod
	nodeRole    = topology.Node
	backendRole = topology.External
)

// teardown collects what closes a benchmark run (namespaces, processes,
// pipes) and runs it in reverse order.
type teardown struct {
	log io.Writer

	mu       sync.Mutex
	cleanups []func()
}

// Cleanup registers f to run at teardown, before everything registered earlier.
func (t *teardown) Cleanup(f func()) {
	t.mu.Lock()
	t.cleanups = append(t.cleanups, f)
	t.mu.Unlock()
}

// run calls every cleanup, newest first.
func (t *teardown) run() {
	t.mu.Lock()
	fs := t.cleanups
	t.cleanups = nil
	t.mu.Unlock()
	for i := len(fs) - 1; i >= 0; i-- {
		fs[i]()
	}
}

// launcher starts child processes from one OS thread that lives as long as the
// run: children get SIGKILL when the thread that forked them ends
// (PR_SET_PDEATHSIG), so a benchmark killed outright still takes its proxies and
// backends with it, while a thread Go retires mid-run (the namespace-locked
// load generators end theirs) never does.
// With a placement, the thread moves onto the proxy CPUs for the fork of a
// proxy and back onto the rest after it: a child keeps the CPUs of the thread
// that forked it, through exec.
type launcher struct {
	reqs  chan func()
	place *placement // nil: no placement
}

func newLauncher(place *placement) *launcher {
	l := &launcher{reqs: make(chan func()), place: place}
	go l.loop()
	return l
}

func (l *launcher) loop() {
	// Never unlocked: the thread ends with the goroutine, after every child has
	// been stopped.
	runtime.LockOSThread()
	for f := range l.reqs {
		f()
	}
}

// start starts cmd, on the proxy CPUs when proxy is set and there is a
// placement.
func (l *launcher) start(cmd *exec.Cmd, proxy bool) error {
	done := make(chan error, 1)
	l.reqs <- func() {
		if proxy && l.place != nil {
			if err := unix.SchedSetaffinity(0, &l.place.proxy); err != nil {
				done <- fmt.Errorf("move onto the proxy CPUs: %w", err)
				return
			}
			defer unix.SchedSetaffinity(0, &l.place.rest)
		}
		done <- cmd.Start()
	}
	return <-done
}

func (l *launcher) close() { close(l.reqs) }

// process is a child running in one of the namespaces.
type process struct {
	name    string
	role    string // the namespace it runs in, as start was given it
	cmd     *exec.Cmd
	pid     int
	logPath string
	exited  chan struct{}
	once    sync.Once
}

// stop ends the process group (the child and anything it forked) with SIGTERM,
// then SIGKILL after grace.
func (p *process) stop(grace time.Duration) {
	p.once.Do(func() {
		syscall.Kill(-p.pid, syscall.SIGTERM)
		select {
		case <-p.exited:
		case <-time.After(grace):
			syscall.Kill(-p.pid, syscall.SIGKILL)
			<-p.exited
		}
	})
}

func (p *process) running() bool {
	select {
	case <-p.exited:
		return false
	default:
		return true
	}
}

// logTail is the end of the process's log, for error messages.
func (p *process) logTail() string {
	b, _ := os.ReadFile(p.logPath)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > 15 {
		lines = lines[len(lines)-15:]
	}
	return strings.Join(lines, "\n")
}

// world is one topology: client, node and backend namespaces, the backend
// servers, and the processes started in it. A loopback world puts all three in
// the node namespace on 127.0.0.1: no routing, no netfilter rule, the plain
// path a proxy port is measured on.
type world struct {
	name     string
	loopback bool
	t        *teardown
	tp       *topology.Topology
	dir      string
	launch   *launcher
	backend  *process
	ports    backendPorts
	// fileLimit is the open-file limit every process of the run has.
	fileLimit int
	ip        struct{ client, node, nodeClientSide, backend netip.Addr }
}

// sysctls make many short connections sustainable in every namespace: TIME_WAIT
// sockets are reused for new outgoing connections, the whole port range is
// available, and conntrack forgets closed connections sooner than its default
// two minutes (a full run opens several hundred thousand connections). The
// peers' listening ports (haproxyBase, nginxBase) are kept out of that range:
// a connection of an earlier workload holding one as its source port made the
// next HAProxy fail to bind it, and so did a proxy port of uproxy's before it
// left reserved ports out of its choice.
var sysctls = []string{
	"net.ipv4.tcp_tw_reuse=1",
	"net.ipv4.ip_local_port_range=1024 65000",
	fmt.Sprintf("net.ipv4.ip_local_reserved_ports=%d-%d,%d-%d", haproxyBase, haproxyBase+peerPorts-1, nginxBase, nginxBase+peerPorts-1),
}

var conntrackSysctls = []string{
	"net.netfilter.nf_conntrack_tcp_timeout_time_wait=10",
}

// newWorld builds a topology and starts the backend servers in it. Everything
// it creates is registered with t, also when it fails halfway.
func newWorld(name string, t *teardown, launch *launcher, exe, dir string, fileLimit int) (*world, error) {
	return buildWorld(&world{name: name, t: t, launch: launch, dir: dir, fileLimit: fileLimit}, exe)
}

// newLoopbackWorld builds a loopback world (see world).
func newLoopbackWorld(name string, t *teardown, launch *launcher, exe, dir string, fileLimit int) (*world, error) {
	return buildWorld(&world{name: name, loopback: true, t: t, launch: launch, dir: dir, fileLimit: fileLimit}, exe)
}

func buildWorld(w *world, exe string) (*world, error) {
	name, t := w.name, w.t
	tp, err := topology.Build()
	if err != nil {
		return nil, fmt.Errorf("build topology %s: %w", name, err)
	}
	w.tp = tp
	t.Cleanup(func() {
		if err := tp.Close(); err != nil {
			fmt.Fprintf(t.log, "remove topology %s: %v\n", name, err)
		}
	})
	w.ip.client = w.tp.NS(clientRole).IPv4
	w.ip.nodeClientSide = w.tp.NS(clientRole).GatewayIPv4
	w.ip.node = w.tp.NS(nodeRole).IPv4
	w.ip.backend = w.tp.NS(backendRole).IPv4
	if w.loopback {
		lo := netip.MustParseAddr("127.0.0.1")
		w.ip.client, w.ip.nodeClientSide, w.ip.node, w.ip.backend = lo, lo, lo, lo
	}
	for _, role := range []string{clientRole, nodeRole, backendRole} {
		for _, s := range sysctls {
			if out, err := w.tp.Exec(role, "sysctl", "-q", "-w", s); err != nil {
				return nil, fmt.Errorf("sysctl %s in %s: %w: %s", s, role, err, out)
			}
		}
	}
	if err := w.startBackend(exe); err != nil {
		return nil, err
	}
	return w, nil
}

// segmentsSent sums the TCP segments sent in the world's namespaces (its node
// namespace alone, in a loopback world): every segment of a path, the client's,
// the proxy's and the backends', counted once where it was sent. node is the
// node namespace's part, which is the proxy's own in a world of three
// namespaces (the kernel's forwarding sends none of its own).
func (w *world) segmentsSent() (total, node uint64, err error) {
	roles := []string{clientRole, nodeRole, backendRole}
	if w.loopback {
		roles = []string{nodeRole}
	}
	for _, role := range roles {
		var n uint64
		err := w.tp.Run(role, func() (err error) {
			n, err = tcpOutSegs()
			return err
		})
		if err != nil {
			return 0, 0, fmt.Errorf("TCP segments in %s: %w", role, err)
		}
		total += n
		if role == nodeRole {
			node = n
		}
	}
	return total, node, nil
}

// tuneConntrack applies conntrackSysctls in the node namespace; they exist only
// once something there uses conntrack, so it is called after a proxy started.
func (w *world) tuneConntrack() {
	for _, s := range conntrackSysctls {
		w.tp.Exec(nodeRole, "sysctl", "-q", "-w", s)
	}
}

// start runs args in role's namespace, in its own process group (a Ctrl-C at
// the terminal reaches only the benchmark, which stops its children in order),
// with output in a log file. stdout, if not nil, receives the child's stdout
// instead, and stdin, if not nil, feeds it. A proxy runs on the proxy CPUs of
// the run's placement, if any. The process is stopped at teardown.
func (w *world) start(name, role string, proxy bool, env []string, stdin io.Reader, stdout io.Writer, args ...string) (*process, error) {
	logPath := filepath.Join(w.dir, w.name+"-"+name+".log")
	logf, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command("ip", append([]string{"netns", "exec", w.tp.NS(w.role(role)).Name}, args...)...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = stdin, logf, logf
	if stdout != nil {
		cmd.Stdout = stdout
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := w.launch.start(cmd, proxy); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	// `ip netns exec` execs the command in place, so this pid is the proxy's.
	p := &process{name: name, role: role, cmd: cmd, pid: cmd.Process.Pid, logPath: logPath, exited: make(chan struct{})}
	go func() {
		cmd.Wait()
		logf.Close()
		close(p.exited)
	}()
	w.t.Cleanup(func() { p.stop(5 * time.Second) })
	return p, nil
}

// threads is a peer's setting of its worker count: format with one worker per
// proxy CPU under a placement, or byDefault without one.
func (w *world) threads(format, byDefault string) string {
	if w.launch.place == nil {
		return byDefault
	}
	return fmt.Sprintf(format, w.launch.place.workers())
}

// dialer is the load generators' dialer: keepalive off, as in the proxies, so
// the client spends no syscalls the measurement does not need.
var dialer = net.Dialer{KeepAlive: -1, Timeout: topology.DialTimeout}

// inClient runs fn on a thread inside the client namespace; sockets fn opens
// are the client's.
func (w *world) inClient(fn func() error) error { return w.tp.Run(w.role(clientRole), fn) }

// role is the namespace that plays role: itself, or the node's in a loopback
// world.
func (w *world) role(role string) string {
	if w.loopback {
		return nodeRole
	}
	return role
}

// probeDialer gives up on a connection attempt soon. A SYN sent before the
// rules exist creates a conntrack entry without NAT, and its retransmissions
// match that entry instead of the new rules, so waiting for them would hide the
// moment the path starts working; a new attempt has a new source port.
var probeDialer = net.Dialer{KeepAlive: -1, Timeout: 250 * time.Millisecond}

// probeDial opens a fresh connection from the client namespace with
// probeDialer.
func (w *world) probeDial(network string, to netip.AddrPort) (c net.Conn, err error) {
	err = w.inClient(func() error {
		c, err = probeDialer.Dial(network, to.String())
		return err
	})
	return c, err
}

// roundTrip sends msg on a fresh connection and checks the echo: the probe that
// a path carries traffic.
func (w *world) roundTrip(network string, to netip.AddrPort, msg string) error {
	c, err := w.probeDial(network, to)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Second))
	if _, err := io.WriteString(c, msg); err != nil {
		return err
	}
	buf := make([]byte, len(msg)+1)
	n, err := io.ReadAtLeast(c, buf, len(msg))
	if err != nil {
		return err
	}
	if string(buf[:n]) != msg {
		return fmt.Errorf("echo: got %q, want %q", buf[:n], msg)
	}
	return nil
}

// halfCloseTrip sends msg on a fresh connection, half-closes it and reads until
// EOF: the echo must come back whole. Every path must pass a client's FIN on
// and still carry the reply, so that each one is measured doing the same work.
func (w *world) halfCloseTrip(to netip.AddrPort, msg string) error {
	err := func() error {
		nc, err := w.probeDial("tcp", to)
		if err != nil {
			return err
		}
		defer nc.Close()
		c := nc.(*net.TCPConn)
		c.SetDeadline(time.Now().Add(2 * time.Second))
		if _, err := io.WriteString(c, msg); err != nil {
			return err
		}
		if err := c.CloseWrite(); err != nil {
			return err
		}
		got, err := io.ReadAll(c)
		if err != nil {
			return fmt.Errorf("read after the client's FIN: %w", err)
		}
		if string(got) != msg {
			return fmt.Errorf("the reply to a client that half-closed after its request: got %q, want %q", got, msg)
		}
		return nil
	}()
	if err != nil {
		return fmt.Errorf("half-close check: %w", err)
	}
	return nil
}

// waitTraffic waits until every target carries a round trip, or p (if not nil)
// exits, or timeout passes.
func (w *world) waitTraffic(ctx context.Context, p *process, timeout time.Duration, targets ...target) error {
	deadline := time.Now().Add(timeout)
	for _, tg := range targets {
		var last error
		for {
			if last = w.roundTrip(tg.network, tg.addr, "ready?"); last == nil {
				break
			}
			if p != nil && !p.running() {
				return w.exited(p)
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("no traffic through %s %s within %v: %w", tg.network, tg.addr, timeout, last)
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(20 * time.Millisecond):
			}
		}
	}
	return nil
}

// exited is the error of process p that ended before it carried traffic: the
// end of its log, and when it could not bind, the sockets listening in its
// namespace with their owners (a port taken by another process of the run is
// otherwise gone from view by the time anyone looks).
func (w *world) exited(p *process) error {
	msg := p.logTail()
	if strings.Contains(msg, "Address already in use") {
		if out, err := w.tp.Exec(w.role(p.role), "ss", "-Hltunp"); err != nil {
			msg += fmt.Sprintf("\n(ss -ltunp in its namespace failed: %v)", err)
		} else {
			msg += "\nlistening in its namespace (ss -ltunp):\n" + strings.TrimSpace(string(out))
		}
	}
	return fmt.Errorf("%s exited: %s", p.name, msg)
}

type target struct {
	network string
	addr    netip.AddrPort
}
