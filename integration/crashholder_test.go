package integration

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// childOf returns the child uproxy of pid, the server of a holder (0 when
// it has none).
func childOf(t *testing.T, pid int) int {
	t.Helper()
	// The holder's threads are many; the server may be a child of any.
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		t.Fatalf("threads of %d: %v", pid, err)
	}
	for _, task := range tasks {
		data, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/children", pid, task.Name()))
		for _, f := range strings.Fields(string(data)) {
			child, _ := strconv.Atoi(f)
			if comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", child)); strings.TrimSpace(string(comm)) == "uproxy" {
				return child
			}
		}
	}
	return 0
}

// Under --crash-holder, a SIGKILL of the serving uproxy refuses no
// connection: the holder keeps the proxy sockets open, the kernel queues
// the new connections in their backlogs, and the server it starts again
// adopts them on the same proxy ports and serves what waited. Three kills
// in a row, under a loop of short TCP connections and a UDP flow; then a
// SIGTERM of the holder ends both with 0.
func TestCrashHolderRefusesNothing(t *testing.T) {
	for _, backend := range []string{"nftables", "iptables"} {
		t.Run(backend, func(t *testing.T) {
			tp := testbed.New(t)
			manifests := takeOverServices(t, tp)
			flags := []string{"--rules", backend, "--crash-holder"}
			a := runUproxy(t, tp, manifests, launch{want: 2, flags: flags})
			before := proxyPorts(a.waitFor(func([]serviceState) bool { return true }, "the state"))
			load := startClientLoad(t, tp)
			testbed.Await(t, 10*time.Second, "traffic through the first server", func() bool {
				tcp, udp := load.counts()
				return tcp >= 20 && udp >= 5
			})
			for kill := 1; kill <= 3; kill++ {
				server := childOf(t, a.cmd.Process.Pid)
				if server == 0 {
					t.Fatalf("kill %d: the holder (process %d) has no server child", kill, a.cmd.Process.Pid)
				}
				if err := syscall.Kill(server, syscall.SIGKILL); err != nil {
					t.Fatal(err)
				}
				testbed.Await(t, 20*time.Second, fmt.Sprintf("the server's start %d", kill+1), func() bool {
					return strings.Count(a.logText(), "Serving again on the proxy sockets the crash holder kept") >= kill
				})
				tcp0, udp0 := load.counts()
				testbed.AwaitNoError(t, 10*time.Second, "traffic through the restarted server", func() error {
					tcp, udp := load.counts()
					if tcp >= tcp0+20 && udp >= udp0+5 {
						return nil
					}
					return fmt.Errorf("%d TCP and %d UDP exchanges since the restart", tcp-tcp0, udp-udp0)
				})
			}
			// The loop makes one connection at a time: a kill may cut the one
			// the server was relaying (a crash loses established
			// connections), never more, and no connection is refused.
			failures := load.end()
			refused := 0
			for _, f := range failures {
				if strings.Contains(f, "refused") || !strings.Contains(f, "read back") {
					refused++
				}
			}
			if len(failures) > 3 || refused > 0 {
				t.Errorf("%d short TCP connections failed across three kills of the server (%d not once connected), want at most 3, each one the server relayed when killed; the first: %s",
					len(failures), refused, strings.Join(failures[:min(5, len(failures))], "; "))
			}
			for _, f := range failures {
				t.Logf("a connection the killed server relayed: %s", f)
			}
			for _, line := range strings.Split(a.logText(), "\n") {
				if strings.Contains(line, "crash holder kept") || strings.Contains(line, "serving uproxy died") {
					t.Log(line)
				}
			}
			after := proxyPorts(a.waitFor(func([]serviceState) bool { return true }, "the state after"))
			for name, pp := range before {
				if after[name] != pp {
					t.Errorf("proxy port of %s: %d before the kills, %d after, want the same", name, pp, after[name])
				}
			}
			if out, err := a.get("/metrics"); err != nil || !strings.Contains(out, "uproxy_server_starts 4") {
				t.Errorf("the server's metrics (%v) lack uproxy_server_starts 4", err)
			}
			server := childOf(t, a.cmd.Process.Pid)
			a.signal(syscall.SIGTERM)
			if code := a.awaitExit(15 * time.Second); code != 0 {
				t.Errorf("the holder exited %d on SIGTERM, want 0", code)
			}
			if err := syscall.Kill(server, 0); err == nil {
				t.Errorf("the server (process %d) outlived its holder", server)
			}
		})
	}
}
