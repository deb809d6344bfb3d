package handover_test

// What a crash of the serving process does to new connections, by who holds
// the listening socket: a holder process that outlives the server, the
// server alone, or a SO_REUSEPORT group with net.ipv4.tcp_migrate_req. Each
// test runs in a network namespace of its own (testbed.InOwnNetns), where its
// sysctls go away with it.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/test/testbed"
)

const (
	serveFDEnv    = "UPROXY_HANDOVER_SERVE_FD"    // "3": serve the inherited listener
	servePortEnv  = "UPROXY_HANDOVER_SERVE_PORT"  // listen on this port (0: any), SO_REUSEPORT
	serveDelayEnv = "UPROXY_HANDOVER_SERVE_DELAY" // between accepts
)

// serve is the serving process of these tests: it answers each connection
// with "ok\n" and closes it, waiting the delay between accepts.
func serve() error {
	var ln net.Listener
	var err error
	if os.Getenv(serveFDEnv) != "" {
		f := os.NewFile(3, "listener")
		ln, err = net.FileListener(f)
		f.Close()
	} else {
		lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
			var serr error
			c.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1) })
			return serr
		}}
		ln, err = lc.Listen(context.Background(), "tcp", "127.0.0.1:"+os.Getenv(servePortEnv))
	}
	if err != nil {
		return err
	}
	delay, _ := time.ParseDuration(os.Getenv(serveDelayEnv))
	fmt.Println(ln.Addr().(*net.TCPAddr).Port)
	for {
		c, err := ln.Accept()
		if err != nil {
			return err
		}
		c.Write([]byte("ok\n"))
		c.Close()
		time.Sleep(delay)
	}
}

// server is a serving child process.
type server struct {
	cmd  *exec.Cmd
	port int
}

func startServer(t *testing.T, listener *os.File, port int, delay time.Duration) *server {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), roleEnv+"=serve", serveDelayEnv+"="+delay.String())
	if listener != nil {
		cmd.ExtraFiles = []*os.File{listener}
		cmd.Env = append(cmd.Env, serveFDEnv+"=3")
	} else {
		cmd.Env = append(cmd.Env, servePortEnv+"="+strconv.Itoa(port))
	}
	cmd.Stderr = io.Discard // a killed server's Accept error is no news
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("server: %v", err)
	}
	p, _ := strconv.Atoi(line[:len(line)-1])
	s := &server{cmd: cmd, port: p}
	t.Cleanup(s.kill)
	return s
}

func (s *server) kill() {
	if s.cmd.ProcessState == nil {
		s.cmd.Process.Signal(unix.SIGKILL)
		s.cmd.Wait()
	}
}

// connectCounts are the outcomes of a loop of connections.
type connectCounts struct {
	ok, refused, reset, timeout, other atomic.Int64
}

func (c *connectCounts) String() string {
	return fmt.Sprintf("%d answered, %d refused, %d reset, %d timed out, %d other",
		c.ok.Load(), c.refused.Load(), c.reset.Load(), c.timeout.Load(), c.other.Load())
}

// connectLoop connects to port every interval until stop closes, each
// connection waiting up to 10s for its answer, and returns once every one has
// ended.
func connectLoop(port int, interval time.Duration, stop <-chan struct{}) *connectCounts {
	counts := &connectCounts{}
	var wg sync.WaitGroup
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			wg.Wait()
			return counts
		case <-tick.C:
		}
		wg.Go(func() {
			c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), 10*time.Second)
			if err == nil {
				defer c.Close()
				c.SetDeadline(time.Now().Add(10 * time.Second))
				var line string
				line, err = bufio.NewReader(c).ReadString('\n')
				if err == nil && line == "ok\n" {
					counts.ok.Add(1)
					return
				}
				if err == nil || errors.Is(err, io.EOF) {
					err = unix.ECONNRESET // closed unanswered: its server died
				}
			}
			var ne net.Error
			switch {
			case errors.Is(err, unix.ECONNREFUSED):
				counts.refused.Add(1)
			case errors.Is(err, unix.ECONNRESET) || errors.Is(err, unix.EPIPE):
				counts.reset.Add(1)
			case errors.As(err, &ne) && ne.Timeout():
				counts.timeout.Add(1)
			default:
				counts.other.Add(1)
			}
		})
	}
}

func loUp(t *testing.T) {
	t.Helper()
	if out, err := exec.Command("ip", "link", "set", "lo", "up").CombinedOutput(); err != nil {
		t.Fatalf("ip link set lo up: %v: %s", err, out)
	}
}

func setSysctl(t *testing.T, name, value string) {
	t.Helper()
	if err := os.WriteFile("/proc/sys/"+name, []byte(value), 0o644); err != nil {
		t.Fatal(err)
	}
}

// killCycles kills the server that next returns, kills it again after
// restart, cycles times, while connections loop; it returns their outcomes.
func killCycles(t *testing.T, port, cycles int, down time.Duration, start func() *server) *connectCounts {
	stop := make(chan struct{})
	done := make(chan *connectCounts)
	go func() { done <- connectLoop(port, time.Millisecond, stop) }()
	s := start()
	for range cycles {
		time.Sleep(200 * time.Millisecond)
		s.kill()
		time.Sleep(down) // the restart's back-off
		s = start()
	}
	time.Sleep(200 * time.Millisecond)
	close(stop)
	return <-done
}

// TestCrashHolderKeepsListener: a holder process (this one) owns the
// listening socket and gives it to a server child; the child is SIGKILLed
// three times and restarted after 300 ms, under a connection every
// millisecond. With the holder, no connection is refused: they wait in the
// backlog. The control, where the server owns its listener, shows the loop
// counts refusals when there are.
func TestCrashHolderKeepsListener(t *testing.T) {
	if !testbed.InOwnNetns(t) {
		return
	}
	loUp(t)
	t.Run("holder", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		f, err := ln.(*net.TCPListener).File()
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		counts := killCycles(t, ln.Addr().(*net.TCPAddr).Port, 3, 300*time.Millisecond, func() *server {
			return startServer(t, f, 0, 0)
		})
		t.Logf("holder, 3 kills, 300 ms down each: %v", counts)
		if counts.refused.Load() > 0 || counts.timeout.Load() > 0 || counts.other.Load() > 0 {
			t.Errorf("got %v; want none refused or timed out", counts)
		}
	})
	t.Run("server owns the listener", func(t *testing.T) {
		first := startServer(t, nil, 0, 0)
		port := first.port
		first.kill()
		counts := killCycles(t, port, 3, 300*time.Millisecond, func() *server {
			return startServer(t, nil, port, 0)
		})
		t.Logf("no holder, 3 kills, 300 ms down each: %v", counts)
		if counts.refused.Load() == 0 {
			t.Errorf("got %v; want refusals while no process listened", counts)
		}
	})
}

// TestCrashBacklogLimit: while nobody accepts, connections wait in the
// listener's accept queue up to its backlog (the smaller of listen's argument
// and net.core.somaxconn, set here to 16), and the SYNs beyond it are dropped,
// not refused: their clients retransmit (after 1 s, then 3 s) and are served
// once a server accepts again. None is refused; the log counts those that
// ended otherwise.
func TestCrashBacklogLimit(t *testing.T) {
	if !testbed.InOwnNetns(t) {
		return
	}
	loUp(t)
	setSysctl(t, "net/core/somaxconn", "16")
	ln, err := net.Listen("tcp", "127.0.0.1:0") // Go asks for the most: somaxconn
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	const clients = 40
	begun := time.Now()
	type outcome struct {
		err  error
		took time.Duration
	}
	results := make(chan outcome, clients)
	for range clients {
		go func() {
			c, err := net.DialTimeout("tcp", ln.Addr().String(), 20*time.Second)
			took := time.Since(begun)
			if err == nil {
				c.SetDeadline(time.Now().Add(20 * time.Second))
				var line string
				line, err = bufio.NewReader(c).ReadString('\n')
				if err == nil && line != "ok\n" {
					err = fmt.Errorf("answer %q", line)
				}
				c.Close()
			}
			results <- outcome{err, took}
		}()
	}
	time.Sleep(500 * time.Millisecond) // the handshakes that will complete have
	queued := acceptQueue(t, ln)
	f, _ := ln.(*net.TCPListener).File()
	defer f.Close()
	startServer(t, f, 0, 0)
	var failed, refused, slow int
	for range clients {
		r := <-results
		if r.err != nil {
			failed++
			t.Logf("a connection: %v", r.err)
		}
		if errors.Is(r.err, unix.ECONNREFUSED) {
			refused++
		}
		if r.took > 900*time.Millisecond {
			slow++ // connected only after a SYN's retransmission
		}
	}
	t.Logf("somaxconn 16, %d connections while nobody accepted: %d in the accept queue, %d connected only after a retransmitted SYN, %d failed",
		clients, queued, slow, failed)
	if refused > 0 {
		t.Errorf("%d of %d connections refused; want none", refused, clients)
	}
	if queued > 17 {
		t.Errorf("the accept queue held %d; want at most somaxconn+1 = 17", queued)
	}
}

// acceptQueue is the length of ln's accept queue (a listener's rqueue in
// TCP_INFO: tcpi_unacked).
func acceptQueue(t *testing.T, ln net.Listener) int {
	raw, err := ln.(*net.TCPListener).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var info *unix.TCPInfo
	raw.Control(func(fd uintptr) { info, err = unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO) })
	if err != nil {
		t.Fatal(err)
	}
	return int(info.Unacked)
}

// TestCrashReuseportMigrate: two servers in a SO_REUSEPORT group, one slow
// to accept (10 ms between accepts, so that its queue fills) and SIGKILLed
// three times, restarted after 300 ms, under a connection every millisecond.
// The other serves throughout, so nothing is refused; what the kernel does
// with the dead listener's queue is net.ipv4.tcp_migrate_req: 1 moves those
// connections to the survivor, 0 resets them. Migration does not save a
// connection the dying process had already taken (a kill between its accept
// and its answer), so with it a reset or two remain in some runs: the test
// asks that migration remove nearly all of them (at most a tenth of those
// of the same run without it, which must have some), not every one.
func TestCrashReuseportMigrate(t *testing.T) {
	if !testbed.InOwnNetns(t) {
		return
	}
	loUp(t)
	var withoutMigration int64
	for _, migrate := range []string{"0", "1"} {
		t.Run("tcp_migrate_req="+migrate, func(t *testing.T) {
			setSysctl(t, "net/ipv4/tcp_migrate_req", migrate)
			steady := startServer(t, nil, 0, 0)
			port := steady.port
			counts := killCycles(t, port, 3, 300*time.Millisecond, func() *server {
				return startServer(t, nil, port, 10*time.Millisecond)
			})
			t.Logf("SO_REUSEPORT, tcp_migrate_req=%s, 3 kills of the slow server: %v", migrate, counts)
			if counts.refused.Load() > 0 {
				t.Errorf("got %v; want none refused while a member of the group listened", counts)
			}
			reset := counts.reset.Load()
			switch {
			case migrate == "0" && reset < 20:
				t.Errorf("got %v; want the dead listener's queue reset (20 or more) without migration: the test did not fill it", counts)
			case migrate == "0":
				withoutMigration = reset
			case withoutMigration > 0 && reset*10 > withoutMigration:
				t.Errorf("got %v; want at most a tenth of the %d reset without migration", counts, withoutMigration)
			}
		})
	}
}
