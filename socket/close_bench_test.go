package socket

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// benchSyscalls makes BenchmarkCloseOrders trace the proxy child's system
// calls (strace -c -f, attached for the timed loop only) and report each per
// connection:
//
//	go test -run '^$' -bench CloseOrders/.*/proxied-child ./socket/ -args -syscalls
var benchSyscalls = flag.Bool("syscalls", false, "BenchmarkCloseOrders: count the proxy child's system calls per connection with strace")

// A closeOrder is how a short connection ends: who sends the first FIN, or a
// reset and no FIN at all. Each is an HTTP-sized exchange: a 100-byte request,
// a 150-byte reply.
type closeOrder struct {
	name string
	// serve is the backend; exchange is the client's side once connected,
	// before its Close.
	serve    func(*net.TCPConn)
	exchange func(*net.TCPConn) error
}

const (
	closeReqSize   = 100
	closeReplySize = 150
)

var closeOrders = []closeOrder{
	{
		// The client closes once it has its reply; the backend closes on
		// the client's FIN.
		name:  "client-closes",
		serve: replyEach,
		exchange: func(c *net.TCPConn) error {
			return requestReply(c, closeReplySize)
		},
	},
	{
		// The backend closes after its reply, as an HTTP/1.1 server does
		// after "Connection: close"; the client reads to its FIN and closes.
		name: "server-closes",
		serve: func(c *net.TCPConn) {
			req := make([]byte, closeReqSize)
			if _, err := io.ReadFull(c, req); err == nil {
				c.Write(make([]byte, closeReplySize))
			}
		},
		exchange: func(c *net.TCPConn) error {
			if err := requestReply(c, closeReplySize+1); err != io.ErrUnexpectedEOF {
				return fmt.Errorf("reply: got %v, want %d bytes and the backend's FIN", err, closeReplySize)
			}
			return nil
		},
	},
	{
		// The client resets once it has its reply: no FIN either way.
		name:  "client-resets",
		serve: replyEach,
		exchange: func(c *net.TCPConn) error {
			if err := requestReply(c, closeReplySize); err != nil {
				return err
			}
			return c.SetLinger(0)
		},
	},
}

// replyEach answers each request with a reply until the client's FIN or reset.
func replyEach(c *net.TCPConn) {
	req, reply := make([]byte, closeReqSize), make([]byte, closeReplySize)
	for {
		if _, err := io.ReadFull(c, req); err != nil {
			return
		}
		if _, err := c.Write(reply); err != nil {
			return
		}
	}
}

// requestReply writes a request and reads want bytes back.
func requestReply(c *net.TCPConn, want int) error {
	if _, err := c.Write(make([]byte, closeReqSize)); err != nil {
		return err
	}
	_, err := io.ReadFull(c, make([]byte, want))
	return err
}

// BenchmarkCloseOrders makes short connections, one at a time, in each close
// order, straight to the backend and through a proxy (in this process, and in a
// child whose CPU time is its own: proxy-cpu-us/conn). With -syscalls it reports
// the child's system calls per connection, each by name and in total: the
// figures of the package doc, and epoll_pwait/conn, the wake-ups.
func BenchmarkCloseOrders(b *testing.B) {
	for _, co := range closeOrders {
		b.Run(co.name, func(b *testing.B) {
			for _, name := range benchNames {
				b.Run(name, func(b *testing.B) { benchCloseOrder(b, co, name) })
			}
		})
	}
}

func benchCloseOrder(b *testing.B, co closeOrder, name string) {
	target := startBenchTarget(b, name, co.serve)
	addr := net.TCPAddrFromAddrPort(target.addr)
	var trace *straceCount
	if *benchSyscalls && target.proxyCPU != nil {
		trace = startStrace(b, target.pid)
	}
	cpu := processCPU(b)
	var proxyCPU time.Duration
	if target.proxyCPU != nil {
		proxyCPU = target.proxyCPU()
	}
	start := time.Now()
	for b.Loop() {
		c, err := net.DialTCP("tcp", nil, addr)
		if err != nil {
			b.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(awaitTimeout))
		err = co.exchange(c)
		c.Close()
		if err != nil {
			b.Fatal(err)
		}
	}
	elapsed := time.Since(start)
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "conns/s")
	b.ReportMetric(float64((processCPU(b)-cpu).Microseconds())/float64(b.N), "cpu-us/conn")
	if target.proxyCPU != nil {
		b.ReportMetric(float64((target.proxyCPU()-proxyCPU).Microseconds())/float64(b.N), "proxy-cpu-us/conn")
	}
	if trace == nil {
		return
	}
	// The proxy's last connection may still be closing.
	time.Sleep(50 * time.Millisecond)
	calls, err := trace.stop()
	if err != nil {
		b.Fatal(err)
	}
	total := 0
	for _, n := range calls {
		total += n
	}
	b.ReportMetric(float64(total)/float64(b.N), "syscalls/conn")
	names := make([]string, 0, len(calls))
	for n := range calls {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		// Below one call per hundred connections is the runtime's own
		// rhythm (its monitor, the collector), not the connection's.
		if per := float64(calls[n]) / float64(b.N); per >= 0.01 {
			b.ReportMetric(per, n+"/conn")
		}
	}
}

// straceCount is strace -c -f attached to a process.
type straceCount struct {
	cmd  *exec.Cmd
	file string
	done chan error
}

// startStrace attaches strace to every thread of pid and returns once it has.
func startStrace(b *testing.B, pid int) *straceCount {
	b.Helper()
	if _, err := exec.LookPath("strace"); err != nil {
		b.Skip("-syscalls: no strace on PATH")
	}
	file := b.TempDir() + "/strace"
	cmd := exec.Command("strace", "-c", "-f", "-o", file, "-p", strconv.Itoa(pid))
	stderr, err := cmd.StderrPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	st := &straceCount{cmd: cmd, file: file, done: make(chan error, 1)}
	attached := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stderr)
		once := false
		for sc.Scan() {
			if !once && strings.Contains(sc.Text(), "attached") {
				once = true
				close(attached)
			}
		}
		st.done <- cmd.Wait()
	}()
	select {
	case <-attached:
	case err := <-st.done:
		b.Fatalf("strace -p %d ended before attaching: %v", pid, err)
	case <-time.After(10 * time.Second):
		cmd.Process.Kill()
		b.Fatalf("strace -p %d did not attach within 10s", pid)
	}
	b.Cleanup(func() { cmd.Process.Kill() })
	return st
}

// stop detaches strace and returns the calls it counted, by system call.
func (st *straceCount) stop() (map[string]int, error) {
	st.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-st.done:
	case <-time.After(10 * time.Second):
		return nil, errors.New("strace did not end within 10s of SIGINT")
	}
	out, err := os.ReadFile(st.file)
	if err != nil {
		return nil, err
	}
	return parseStraceSummary(string(out))
}

// parseStraceSummary reads the table of strace -c: a row per system call,
// "% time, seconds, usecs/call, calls, [errors,] syscall", between dashed
// lines, and a total.
func parseStraceSummary(out string) (map[string]int, error) {
	calls := map[string]int{}
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) < 5 || len(f) > 6 || f[len(f)-1] == "total" {
			continue
		}
		n, err := strconv.Atoi(f[3])
		if err != nil {
			continue // the header
		}
		calls[f[len(f)-1]] = n
	}
	if len(calls) == 0 {
		return nil, fmt.Errorf("no system calls in strace's summary:\n%s", out)
	}
	return calls, nil
}

func TestParseStraceSummary(t *testing.T) {
	out := `% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ------------------
 41.73    1.437730        1610       893        82 futex
  3.10    0.106663          17      6054      6054 connect
  0.39    0.013277           2      6054           setsockopt
------ ----------- ----------- --------- --------- ------------------
100.00    3.445584          39     13001      6136 total
`
	got, err := parseStraceSummary(out)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]int{"futex": 893, "connect": 6054, "setsockopt": 6054}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("got %v, want %v", got, want)
	}
	if _, err := parseStraceSummary("strace: attach: ptrace(PTRACE_SEIZE, 1): Operation not permitted\n"); err == nil {
		t.Error("a summary without a table: got no error, want one")
	}
}
