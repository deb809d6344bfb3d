package app

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/proxier"
	"github.com/uproxy/uproxy/socket/handover"
)

// The crash holder (--crash-holder). uproxy runs as two processes: the
// holder, this small parent, and the server, a child that runs everything
// else. The server gives the holder a copy of every proxy socket it opens
// (proxier.Holding) and says when one closes. When the server dies without
// being asked to (a signal it did not get from the holder, a panic), the
// proxy sockets stay open in the holder: the kernel completes new TCP
// handshakes into their backlogs and queues datagrams, and the server the
// holder starts again adopts the copies, on the same proxy ports, and
// serves what waited. The portals stay as they are throughout. A server that
// exits by itself (0: a successor took over, or a SIGTERM the holder passed
// on; 1: a bad flag) ends the holder with its code.
//
// The wire is a socketpair, the server's end on descriptor 3, spoken with
// package handover: at each start the holder sends what it holds
// (msgProxy items, msgEnd), then the server sends msgHold batches (one
// route's sockets), msgRelease (a route closed) and msgReleaseAll (the
// server handed over to a successor: the holder keeps nothing).

const (
	// holderFDEnv names the server's end of the socketpair; holderStartEnv
	// counts the server's starts under this holder (1 for the first).
	holderFDEnv    = "UPROXY_HOLDER_FD"
	holderStartEnv = "UPROXY_HOLDER_START"
)

// Messages from the server to the holder (after takeover.go's kinds).
const (
	msgHold       byte = 64 + iota // descriptors: one route's proxy sockets, as msgProxy
	msgRelease                     // a route that closed, as msgProxy without a descriptor
	msgReleaseAll                  // the server handed over: nothing is held any more
)

// crashBackoff is the wait before a server that died within
// crashQuickDeath of its start is started again, doubled up to
// crashMaxBackoff while it keeps dying so.
const (
	crashQuickDeath = 10 * time.Second
	crashBackoff    = 250 * time.Millisecond
	crashMaxBackoff = 8 * time.Second
)

// heldKey is a route of a Service port.
type heldKey struct {
	name     string
	protocol string
	external bool
}

func keyOf(h proxier.HandedSocket) heldKey {
	return heldKey{h.Service.String(), string(h.Protocol), h.External}
}

// holder is the parent process's state: the copies it holds, by route.
type holder struct {
	mu   sync.Mutex
	held map[heldKey][]proxier.HandedSocket
}

// runHolder is the process of --crash-holder: it starts the server and
// starts it again each time it crashes, until it exits by itself or is
// signalled. It never returns when the server exits with a code other
// than 0: it exits with that code.
func runHolder() error {
	// The server dies with this thread (Pdeathsig), so it stays the one
	// that starts it.
	runtime.LockOSThread()
	h := &holder{held: map[heldKey][]proxier.HandedSocket{}}
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	backoff := crashBackoff
	for start := 1; ; start++ {
		began := time.Now()
		state, signalled, err := h.serve(start, sigs)
		if err != nil {
			return fmt.Errorf("crash holder: %w", err)
		}
		reapOrphans()
		code := state.ExitCode()
		ws, _ := state.Sys().(syscall.WaitStatus)
		crashed := !signalled && (ws.Signaled() || code == 2)
		if !crashed {
			h.closeAll()
			if code != 0 {
				os.Exit(code)
			}
			return nil
		}
		wait := time.Duration(0)
		if time.Since(began) < crashQuickDeath {
			wait, backoff = backoff, min(2*backoff, crashMaxBackoff)
		} else {
			backoff = crashBackoff
		}
		klog.InfoS("The serving uproxy died; starting it again on the proxy sockets held, where new connections wait",
			"status", state.String(), "ran", time.Since(began).Round(time.Millisecond), "heldSockets", h.count(), "after", wait, "start", start+1)
		select {
		case <-time.After(wait):
		case sig := <-sigs:
			klog.InfoS("Signalled while the serving uproxy was down; exiting", "signal", sig)
			h.closeAll()
			return nil
		}
	}
}

// reapOrphans waits for the processes a dead server left (an iptables-restore
// it had started): as a container's first process the holder inherits them,
// and would keep each as a zombie. No server runs while it is called.
func reapOrphans() {
	for {
		var ws syscall.WaitStatus
		if pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil); pid <= 0 || err != nil {
			return
		}
	}
}

// serve runs the server once, its start-th start, and returns how it ended;
// signalled is true when the holder passed it a signal (it was asked to
// end, and is not started again).
func (h *holder) serve(start int, sigs <-chan os.Signal) (_ *os.ProcessState, signalled bool, _ error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, false, err
	}
	ours, theirs := os.NewFile(uintptr(fds[0]), "holder"), os.NewFile(uintptr(fds[1]), "server")
	defer ours.Close()
	exe, err := os.Executable()
	if err != nil {
		theirs.Close()
		return nil, false, err
	}
	cmd := exec.Command(exe, os.Args[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.ExtraFiles = []*os.File{theirs} // descriptor 3
	cmd.Env = append(os.Environ(), holderFDEnv+"=3", holderStartEnv+"="+strconv.Itoa(start))
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	err = cmd.Start()
	theirs.Close()
	if err != nil {
		return nil, false, err
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	talked := make(chan struct{})
	go func() {
		defer close(talked)
		h.talk(ours)
	}()
	for {
		select {
		case sig := <-sigs:
			signalled = true
			cmd.Process.Signal(sig)
		case <-exited:
			ours.Close()
			<-talked
			return cmd.ProcessState, signalled, nil
		}
	}
}

// talk gives the server what the holder holds, then keeps track of what it
// says, until the connection ends (the server exited).
func (h *holder) talk(f *os.File) {
	fc, err := net.FileConn(f)
	if err != nil {
		klog.ErrorS(err, "Crash holder: the socketpair")
		return
	}
	c, err := handover.NewConn(fc.(*net.UnixConn))
	if err != nil {
		// A server that ended before its hello (a bad flag) said why itself.
		if !errors.Is(err, io.EOF) && !errors.Is(err, syscall.ECONNRESET) && !errors.Is(err, net.ErrClosed) {
			klog.ErrorS(err, "Crash holder: no hello from the serving uproxy")
		}
		return
	}
	defer c.Close()
	h.mu.Lock()
	var items []handover.Item
	for _, socks := range h.held {
		for _, s := range socks {
			items = append(items, handover.Item{FD: s.FD, Meta: encodeProxySocket(msgProxy, s)})
		}
	}
	h.mu.Unlock()
	// Send leaves the holder's descriptors open: it keeps its copies.
	if err := sendBatches(c, append(items, handover.Item{FD: -1, Meta: []byte{msgEnd}})); err != nil {
		klog.ErrorS(err, "Crash holder: handing the held sockets to the serving uproxy")
		return
	}
	for {
		items, err := c.Receive()
		if err != nil {
			return // the server exited; what it did not release stays held
		}
		h.apply(items)
	}
}

// apply takes one batch from the server.
func (h *holder) apply(items []handover.Item) {
	h.mu.Lock()
	defer h.mu.Unlock()
	replaced := map[heldKey]bool{}
	for _, it := range items {
		d := decoder{b: it.Meta[min(1, len(it.Meta)):]}
		switch kindOf(it) {
		case msgHold:
			s := decodeProxySocket(&d, it.FD)
			if d.err != nil || it.FD < 0 {
				closeItems([]handover.Item{it})
				continue
			}
			k := keyOf(s)
			if !replaced[k] {
				// A batch is one route's whole set.
				replaced[k] = true
				proxier.CloseHanded(h.held[k])
				h.held[k] = nil
			}
			h.held[k] = append(h.held[k], s)
		case msgRelease:
			s := decodeProxySocket(&d, -1)
			closeItems([]handover.Item{it})
			if d.err == nil {
				proxier.CloseHanded(h.held[keyOf(s)])
				delete(h.held, keyOf(s))
			}
		case msgReleaseAll:
			closeItems([]handover.Item{it})
			for k, socks := range h.held {
				proxier.CloseHanded(socks)
				delete(h.held, k)
			}
		default:
			closeItems([]handover.Item{it})
		}
	}
}

func (h *holder) count() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, socks := range h.held {
		n += len(socks)
	}
	return n
}

func (h *holder) closeAll() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for k, socks := range h.held {
		proxier.CloseHanded(socks)
		delete(h.held, k)
	}
}

// heldBy is the server's side: its proxier's Holding, which tells the
// holder of each change, and the sockets the holder handed at start.
type heldBy struct {
	mu     sync.Mutex
	c      *handover.Conn
	failed bool
	start  int
}

// dialHolder connects the server to its holder when it has one (nil, nil
// when it does not), and returns the sockets the holder held.
func dialHolder() (*heldBy, []proxier.HandedSocket, error) {
	v := os.Getenv(holderFDEnv)
	if v == "" {
		return nil, nil, nil
	}
	// The server's own children (iptables, nft) inherit neither.
	os.Unsetenv(holderFDEnv)
	fd, err := strconv.Atoi(v)
	if err != nil {
		return nil, nil, fmt.Errorf("%s=%q: not a descriptor", holderFDEnv, v)
	}
	unix.CloseOnExec(fd)
	fc, err := net.FileConn(os.NewFile(uintptr(fd), "holder"))
	if err != nil {
		return nil, nil, fmt.Errorf("crash holder: %w", err)
	}
	uc, ok := fc.(*net.UnixConn)
	if !ok {
		fc.Close()
		return nil, nil, fmt.Errorf("crash holder: descriptor %d is no unix socket", fd)
	}
	c, err := handover.NewConn(uc)
	if err != nil {
		return nil, nil, fmt.Errorf("crash holder: %w", err)
	}
	start, _ := strconv.Atoi(os.Getenv(holderStartEnv))
	os.Unsetenv(holderStartEnv)
	b := &heldBy{c: c, start: max(start, 1)}
	var socks []proxier.HandedSocket
	c.UnixConn().SetDeadline(time.Now().Add(helloTimeout))
	defer c.UnixConn().SetDeadline(time.Time{})
	for {
		items, err := c.Receive()
		if err != nil {
			proxier.CloseHanded(socks)
			c.Close()
			return nil, nil, fmt.Errorf("crash holder: the held sockets: %w", err)
		}
		end := false
		for _, it := range items {
			d := decoder{b: it.Meta[min(1, len(it.Meta)):]}
			switch kindOf(it) {
			case msgProxy:
				if s := decodeProxySocket(&d, it.FD); d.err == nil && it.FD >= 0 {
					socks = append(socks, s)
					continue
				}
				closeItems([]handover.Item{it})
			case msgEnd:
				end = true
			default:
				closeItems([]handover.Item{it})
			}
		}
		if end {
			return b, socks, nil
		}
	}
}

// Hold implements proxier.Holding.
func (b *heldBy) Hold(socks []proxier.HandedSocket) {
	items := make([]handover.Item, len(socks))
	for i, s := range socks {
		items[i] = handover.Item{FD: s.FD, Meta: encodeProxySocket(msgHold, s)}
	}
	b.send(items)
	proxier.CloseHanded(socks) // the holder has its own copies now
}

// Release implements proxier.Holding.
func (b *heldBy) Release(s proxier.HandedSocket) {
	b.send([]handover.Item{{FD: -1, Meta: encodeProxySocket(msgRelease, s)}})
}

// releaseAll tells the holder that a successor serves: it holds nothing
// more, so that a port this process no longer serves is not kept open.
func (b *heldBy) releaseAll() {
	if b != nil {
		b.send([]handover.Item{{FD: -1, Meta: []byte{msgReleaseAll}}})
	}
}

func (b *heldBy) send(items []handover.Item) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.failed {
		return
	}
	if err := sendBatches(b.c, items); err != nil {
		// The holder is gone: this process dies with it (Pdeathsig).
		b.failed = true
		klog.ErrorS(err, "Crash holder: it no longer hears of the proxy sockets")
	}
}

// export says the server's starts under its holder (uproxy_server_starts).
func (b *heldBy) export() {
	if b != nil {
		observe.ServerStarts.Set(float64(b.start))
	}
}

// endHeldAdoption closes, after the first sync, the held sockets no Service
// port took (those removed while no server ran), and says what was adopted.
func (s *server) endHeldAdoption(ctx context.Context, synced <-chan struct{}) {
	select {
	case <-synced:
	case <-ctx.Done():
		return
	}
	m, ok := s.mode.(interface{ EndAdoption() (int, int) })
	if !ok {
		return
	}
	adopted, closed := m.EndAdoption()
	klog.InfoS("Serving again on the proxy sockets the crash holder kept: the connections that waited in them are served now",
		"start", s.held.start, "proxySockets", adopted, "proxySocketsClosed", closed)
}
