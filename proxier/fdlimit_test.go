package proxier

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/service"
)

// TestOutOfFileDescriptors: with fewer descriptors than Service ports, a sync
// opens what it can and reports the rest in one error naming how many and
// the limit; the following syncs reopen at most MaxStarvedReopens of the
// sockets that failed that way (not every one, every sync); and once the
// limit is raised the syncs bring every Service port up.
func TestOutOfFileDescriptors(t *testing.T) {
	w := newWorld(t)
	a := w.tcpBackend("a", "127.0.0.2")
	p := newProxier(t, Config{})
	defer func(n int) { MaxStarvedReopens = n }(MaxStarvedReopens)
	MaxStarvedReopens = 3

	var ports []*service.Port
	for i := range 60 {
		ports = append(ports, port(fmt.Sprintf("svc-%02d", i), service.TCP, a))
	}
	s := snapshot(ports...)

	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
		t.Fatal(err)
	}
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	low := rl
	low.Cur = uint64(len(fds) + 20)
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &low); err != nil {
		t.Fatal(err)
	}
	restored := false
	restore := func() {
		if !restored {
			restored = true
			if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
				t.Fatal(err)
			}
		}
	}
	defer restore()

	// starvedErr is the sync's error about descriptors ("" when none).
	starvedErr := func() string {
		for _, e := range p.PortErrors() {
			if strings.Contains(e.Error(), "out of file descriptors") {
				return e.Error()
			}
		}
		return ""
	}
	mustSync(t, p, s)
	if got := starvedErr(); !strings.Contains(got, fmt.Sprintf("open files limit %d", low.Cur)) {
		t.Fatalf("Sync with %d descriptors for 60 Service ports: port errors %v, want the ports without a socket counted, with the limit", low.Cur, p.PortErrors())
	}
	if n := len(p.PortErrors()); n != 1 {
		t.Errorf("port errors: got %d (%v), want the one about descriptors", n, p.PortErrors())
	}
	reopens := func() int {
		n := 0
		for _, st := range p.DebugServices() {
			n += st.Reopens
		}
		return n
	}
	// Sockets that failed after their open (Serve's descriptor) are noticed
	// once their goroutine ends.
	time.Sleep(100 * time.Millisecond)
	for range 3 {
		before := reopens()
		mustSync(t, p, s)
		if starvedErr() == "" {
			t.Fatalf("Sync still short of descriptors: port errors %v, want the one about descriptors", p.PortErrors())
		}
		if got := reopens() - before; got > MaxStarvedReopens {
			t.Errorf("one sync reopened %d starved sockets, want at most %d", got, MaxStarvedReopens)
		}
		time.Sleep(20 * time.Millisecond)
	}

	restore()
	deadline := time.Now().Add(20 * time.Second)
	for {
		err := p.Sync(s)
		if err == nil && len(p.PortErrors()) > 0 {
			err = p.PortErrors()[0]
		}
		down := 0
		for _, st := range p.DebugServices() {
			if st.ListenerDown {
				down++
			}
		}
		if err == nil && down == 0 && len(p.DebugServices()) == 60 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after raising the limit: Sync %v, %d of %d Service ports down", err, down, len(p.DebugServices()))
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, sp := range []*service.Port{ports[0], ports[59]} {
		if name, err := getTCP(t, p.ProxyPort(sp.Name)); err != nil || name != "a" {
			t.Errorf("%s through its proxy port: got %q, %v, want a", sp.Name, name, err)
		}
	}
}
