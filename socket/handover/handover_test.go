package handover_test

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/socket/handover"
	"github.com/uproxy/uproxy/test/testbed"
)

// roleEnv names what a child process of these tests does instead of running
// tests (see TestMain); addrEnv the handover address it uses.
const (
	roleEnv = "UPROXY_HANDOVER_ROLE"
	addrEnv = "UPROXY_HANDOVER_ADDR"
)

func TestMain(m *testing.M) {
	if role := os.Getenv(roleEnv); role != "" {
		if err := runRole(role, os.Getenv(addrEnv)); err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", role, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func runRole(role, addr string) error {
	switch role {
	case "take":
		return takeOver(addr)
	case "dial":
		c, err := handover.Dial(addr)
		if err != nil {
			return err
		}
		_, err = c.Receive()
		return err
	case "bench-old", "bench-new", "bench-echo":
		return benchRole(role, addr)
	case "serve":
		return serve()
	case "listen":
		ln, err := handover.Listen(addr)
		if err != nil {
			return err
		}
		fmt.Println("listening") // the parent dials once it reads this
		c, err := ln.Accept()
		if err == nil {
			c.Close()
		}
		return err
	}
	return fmt.Errorf("unknown role %q", role)
}

// handoverAddr is an abstract address no other test uses.
func handoverAddr(t testing.TB) string {
	return fmt.Sprintf("@uproxy-handover-test-%d-%s", os.Getpid(), strings.ReplaceAll(t.Name(), "/", "-"))
}

// pair returns the two ends of a handover connection in this process.
func pair(t testing.TB) (sender, receiver *handover.Conn) {
	t.Helper()
	ln, err := handover.Listen(handoverAddr(t))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	type result struct {
		c   *handover.Conn
		err error
	}
	accepted := make(chan result, 1)
	go func() {
		c, err := ln.Accept()
		accepted <- result{c, err}
	}()
	receiver, err = handover.Dial(handoverAddr(t))
	if err != nil {
		t.Fatal(err)
	}
	r := <-accepted
	if r.err != nil {
		t.Fatal(r.err)
	}
	t.Cleanup(func() { r.c.Close(); receiver.Close() })
	return r.c, receiver
}

func mustPipe(t testing.TB) (r, w int) {
	t.Helper()
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	return p[0], p[1]
}

// TestPipeBytesSurvive: bytes written into a pipe before its ends are handed
// over are read after, in order, from the receiver's descriptor, and the
// items' metadata arrives as it was sent.
func TestPipeBytesSurvive(t *testing.T) {
	testbed.Needs(t, testbed.Root)
	sender, receiver := pair(t)
	r, w := mustPipe(t)
	want := []byte("first, second, third")
	if _, err := unix.Write(w, want[:7]); err != nil {
		t.Fatal(err)
	}
	if _, err := unix.Write(w, want[7:]); err != nil {
		t.Fatal(err)
	}
	if err := sender.Send([]handover.Item{{FD: r, Meta: []byte("read end")}, {FD: -1, Meta: []byte("no descriptor")}, {FD: w, Meta: nil}}); err != nil {
		t.Fatal(err)
	}
	unix.Close(r)
	unix.Close(w)
	items, err := receiver.Receive()
	if err != nil {
		t.Fatal(err)
	}
	if len(items) != 3 {
		t.Fatalf("got %d items, want 3", len(items))
	}
	for i, want := range []string{"read end", "no descriptor", ""} {
		if string(items[i].Meta) != want {
			t.Errorf("item %d: got metadata %q, want %q", i, items[i].Meta, want)
		}
	}
	if items[1].FD != -1 {
		t.Errorf("item 1: got descriptor %d, want -1", items[1].FD)
	}
	defer unix.Close(items[0].FD)
	// The write end came along, so the pipe has a writer until it is closed.
	if _, err := unix.Write(items[2].FD, []byte(", fourth")); err != nil {
		t.Fatal(err)
	}
	unix.Close(items[2].FD)
	got, err := io.ReadAll(os.NewFile(uintptr(items[0].FD), "pipe"))
	if err != nil {
		t.Fatal(err)
	}
	if want := string(want) + ", fourth"; string(got) != want {
		t.Errorf("got %q from the pipe, want %q", got, want)
	}
}

// TestListenerKeepsBacklog: connections that completed their handshake while
// nobody accepted are accepted from the handed-over listener, with the bytes
// their clients sent; the sender closing its copy loses none of them.
func TestListenerKeepsBacklog(t *testing.T) {
	testbed.Needs(t, testbed.Root)
	sender, receiver := pair(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	const clients = 5
	for i := range clients {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		fmt.Fprintf(c, "client %d\n", i)
	}
	f, err := ln.(*net.TCPListener).File()
	if err != nil {
		t.Fatal(err)
	}
	if err := sender.Send([]handover.Item{{FD: int(f.Fd())}}); err != nil {
		t.Fatal(err)
	}
	f.Close()
	ln.Close()
	items, err := receiver.Receive()
	if err != nil {
		t.Fatal(err)
	}
	got, err := net.FileListener(os.NewFile(uintptr(items[0].FD), "listener"))
	if err != nil {
		t.Fatal(err)
	}
	defer got.Close()
	seen := map[string]bool{}
	for range clients {
		c, err := got.Accept()
		if err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		line, err := bufio.NewReader(c).ReadString('\n')
		c.Close()
		if err != nil {
			t.Fatal(err)
		}
		seen[line] = true
	}
	for i := range clients {
		if want := fmt.Sprintf("client %d\n", i); !seen[want] {
			t.Errorf("no accepted connection sent %q", want)
		}
	}
}

// TestEstablishedConnection: both ends of a relayed TCP connection's proxy
// side carry on after the handover, with the bytes that waited in them.
func TestEstablishedConnection(t *testing.T) {
	testbed.Needs(t, testbed.Root)
	sender, receiver := pair(t)
	client, proxySide := tcpPair(t)
	defer client.Close()
	fmt.Fprint(client, "before")
	f, err := proxySide.(*net.TCPConn).File()
	if err != nil {
		t.Fatal(err)
	}
	if err := sender.Send([]handover.Item{{FD: int(f.Fd())}}); err != nil {
		t.Fatal(err)
	}
	f.Close()
	proxySide.Close()
	fmt.Fprint(client, " and after")
	client.(*net.TCPConn).CloseWrite()
	items, err := receiver.Receive()
	if err != nil {
		t.Fatal(err)
	}
	c, err := fileConn(items[0].FD)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != "before and after" {
		t.Errorf("got %q, want %q", got, "before and after")
	}
	fmt.Fprint(c, "reply")
	c.Close()
	client.SetDeadline(time.Now().Add(10 * time.Second))
	reply, err := io.ReadAll(client)
	if err != nil || string(reply) != "reply" {
		t.Errorf("the client read %q (%v), want %q", reply, err, "reply")
	}
}

func tcpPair(t testing.TB) (client, server net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	client, err = net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	server, err = ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	return client, server
}

// TestBatchLimits: a batch takes MaxFDs descriptors and no more; a batch of
// MaxFDs arrives whole.
func TestBatchLimits(t *testing.T) {
	testbed.Needs(t, testbed.Root)
	sender, receiver := pair(t)
	raiseNoFile(t, 4096)
	var items []handover.Item
	for i := range handover.MaxFDs + 1 {
		r, w := mustPipe(t)
		unix.Close(w)
		defer unix.Close(r)
		items = append(items, handover.Item{FD: r, Meta: binary.AppendUvarint(nil, uint64(i))})
	}
	if err := sender.Send(items); err == nil {
		t.Fatalf("a batch of %d descriptors was sent, want a refusal", len(items))
	}
	if err := sender.Send(items[:handover.MaxFDs]); err != nil {
		t.Fatal(err)
	}
	got, err := receiver.Receive()
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != handover.MaxFDs {
		t.Fatalf("got %d items, want %d", len(got), handover.MaxFDs)
	}
	for i, it := range got {
		if n, _ := binary.Uvarint(it.Meta); n != uint64(i) || it.FD < 0 {
			t.Errorf("item %d: got metadata %d and descriptor %d", i, n, it.FD)
		}
		unix.Close(it.FD)
	}
}

// TestVersionRefused: a peer of another protocol version is refused at the
// hello, with both versions named.
func TestVersionRefused(t *testing.T) {
	testbed.Needs(t, testbed.Root)
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	peer := os.NewFile(uintptr(fds[1]), "peer")
	defer peer.Close()
	hello := []byte("uphv\x00\x07\x00\x00")
	if _, err := peer.Write(hello); err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fds[0]), "ours")
	fc, err := net.FileConn(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	_, err = handover.NewConn(fc.(*net.UnixConn))
	var v *handover.VersionError
	if !errors.As(err, &v) || v.Peer != 7 || v.Own != handover.Version {
		t.Fatalf("got %v, want a VersionError naming version 7", err)
	}
}

// TestPull: pidfd_getfd copies a descriptor of another process (here, of
// this one) that reads the same pipe.
func TestPull(t *testing.T) {
	testbed.Needs(t, testbed.Root)
	r, w := mustPipe(t)
	defer unix.Close(r)
	defer unix.Close(w)
	unix.Write(w, []byte("pulled"))
	got, err := handover.Pull(os.Getpid(), []int{r})
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(got[0])
	buf := make([]byte, 16)
	n, err := unix.Read(got[0], buf)
	if err != nil || string(buf[:n]) != "pulled" {
		t.Fatalf("read %q (%v) from the pulled descriptor, want %q", buf[:n], err, "pulled")
	}
}

// TestAcrossProcesses: a child process (this test binary again) takes over a
// pipe with bytes in it, a listener with a connection in its backlog and an
// established connection, plus a pipe it pulls by pidfd_getfd, and proves
// each by what it writes on the established connection.
func TestAcrossProcesses(t *testing.T) {
	testbed.Needs(t, testbed.Root)
	addr := handoverAddr(t)
	ln, err := handover.Listen(addr)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), roleEnv+"=take", addrEnv+"="+addr)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if got := int(c.Peer().Pid); got != cmd.Process.Pid {
		t.Errorf("peer pid: got %d, want %d", got, cmd.Process.Pid)
	}

	pr, pw := mustPipe(t)
	unix.Write(pw, []byte("in the pipe"))
	unix.Close(pw)
	pulledR, pulledW := mustPipe(t)
	unix.Write(pulledW, []byte("pulled"))
	unix.Close(pulledW)
	tln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	waiting, err := net.Dial("tcp", tln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer waiting.Close()
	fmt.Fprint(waiting, "from the backlog")
	waiting.(*net.TCPConn).CloseWrite()
	client, proxySide := tcpPair(t)
	defer client.Close()
	lf, _ := tln.(*net.TCPListener).File()
	cf, _ := proxySide.(*net.TCPConn).File()
	err = c.Send([]handover.Item{
		{FD: pr, Meta: []byte("pipe")},
		{FD: int(lf.Fd()), Meta: []byte("listener")},
		{FD: int(cf.Fd()), Meta: []byte("conn")},
		{FD: -1, Meta: []byte(strconv.Itoa(pulledR))},
	})
	if err != nil {
		t.Fatal(err)
	}
	// The child's acknowledgement comes before this process lets go of the
	// descriptor it pulls.
	if _, err := c.Receive(); err != nil {
		t.Fatalf("acknowledgement: %v (child: %s)", err, stderr.String())
	}
	unix.Close(pr)
	unix.Close(pulledR)
	lf.Close()
	cf.Close()
	tln.Close()
	proxySide.Close()

	client.SetDeadline(time.Now().Add(20 * time.Second))
	got, err := io.ReadAll(client)
	if err != nil {
		t.Fatal(err)
	}
	want := "in the pipe|from the backlog|pulled"
	if string(got) != want {
		t.Errorf("the child wrote %q, want %q (child: %s)", got, want, stderr.String())
	}
}

// takeOver is the child of TestAcrossProcesses.
func takeOver(addr string) error {
	c, err := handover.Dial(addr)
	if err != nil {
		return err
	}
	defer c.Close()
	items, err := c.Receive()
	if err != nil {
		return err
	}
	if len(items) != 4 {
		return fmt.Errorf("got %d items, want 4", len(items))
	}
	pulledNum, err := strconv.Atoi(string(items[3].Meta))
	if err != nil {
		return err
	}
	pulled, err := handover.Pull(int(c.Peer().Pid), []int{pulledNum})
	if err != nil {
		return err
	}
	if err := c.Send([]handover.Item{{FD: -1, Meta: []byte("ack")}}); err != nil {
		return err
	}
	pipe, err := io.ReadAll(os.NewFile(uintptr(items[0].FD), "pipe"))
	if err != nil {
		return err
	}
	ln, err := net.FileListener(os.NewFile(uintptr(items[1].FD), "listener"))
	if err != nil {
		return err
	}
	accepted, err := ln.Accept()
	if err != nil {
		return err
	}
	backlog, err := io.ReadAll(accepted)
	if err != nil {
		return err
	}
	p, err := io.ReadAll(os.NewFile(uintptr(pulled[0]), "pulled"))
	if err != nil {
		return err
	}
	conn, err := fileConn(items[2].FD)
	if err != nil {
		return err
	}
	if _, err := fmt.Fprintf(conn, "%s|%s|%s", pipe, backlog, p); err != nil {
		return err
	}
	return conn.Close()
}

// TestPeerNotRootRefused: a peer running as uid 65534 is refused, whether it
// dials (the root side's Accept refuses it) or listens (the root side's Dial
// refuses it). The peer is a child process started with those credentials.
func TestPeerNotRootRefused(t *testing.T) {
	testbed.Needs(t, testbed.Root)
	bin := binaryForAll(t)

	t.Run("dials", func(t *testing.T) {
		addr := handoverAddr(t)
		ln, err := handover.Listen(addr)
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		cmd := asNobody(t, bin, "dial", addr)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		defer cmd.Wait()
		_, err = ln.Accept()
		if !errors.Is(err, handover.ErrPeerNotRoot) {
			t.Fatalf("accept a peer of uid 65534: got %v, want ErrPeerNotRoot", err)
		}
		if !strings.Contains(err.Error(), "uid 65534") || !strings.Contains(err.Error(), strconv.Itoa(cmd.Process.Pid)) {
			t.Errorf("the refusal %q names neither the uid nor the pid %d", err, cmd.Process.Pid)
		}
		t.Log(err)
	})
	t.Run("listens", func(t *testing.T) {
		addr := handoverAddr(t)
		cmd := asNobody(t, bin, "listen", addr)
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		defer cmd.Wait()
		if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "listening\n" {
			t.Fatalf("the child said %q (%v), want %q", line, err, "listening\n")
		}
		_, err = handover.Dial(addr)
		if !errors.Is(err, handover.ErrPeerNotRoot) {
			t.Fatalf("dial a peer of uid 65534: got %v, want ErrPeerNotRoot", err)
		}
		t.Log(err)
	})
}

func asNobody(t *testing.T, bin, role, addr string) *exec.Cmd {
	cmd := exec.CommandContext(t.Context(), bin, "-test.run=^$")
	cmd.Env = append(os.Environ(), roleEnv+"="+role, addrEnv+"="+addr)
	cmd.Dir = filepath.Dir(bin)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	return cmd
}

// binaryForAll copies the test binary where uid 65534 may run it (go test
// builds it in a directory only its owner may enter).
func binaryForAll(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "uproxy-handover-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	src, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "handover.test")
	if err := os.WriteFile(bin, src, 0o755); err != nil {
		t.Fatal(err)
	}
	return bin
}

// raiseNoFile raises this process's RLIMIT_NOFILE to at least n, and puts it
// back when the test ends.
func raiseNoFile(t testing.TB, n uint64) {
	t.Helper()
	var old unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &old); err != nil {
		t.Fatal(err)
	}
	if old.Cur >= n {
		return
	}
	lim := old
	lim.Cur = n
	if lim.Max < n {
		lim.Max = n
	}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatalf("raise RLIMIT_NOFILE to %d: %v", n, err)
	}
	t.Cleanup(func() { unix.Setrlimit(unix.RLIMIT_NOFILE, &old) })
}

// fileConn makes a net.Conn of fd, which it takes: net.FileConn works on a
// duplicate, and the descriptor left open would hold the connection open.
func fileConn(fd int) (net.Conn, error) {
	f := os.NewFile(uintptr(fd), "conn")
	defer f.Close()
	return net.FileConn(f)
}
