package integration

import (
	"bufio"
	"context"
	"debug/elf"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// TestServingLogsTheAddressAsked: the log names the HTTP addresses as their
// flags give them. Go listens on 0.0.0.0 with a socket of both families, whose
// own address reads [::]; the log said that for a 0.0.0.0 flag.
func TestServingLogsTheAddressAsked(t *testing.T) {
	tp := testbed.New(t)
	px := runUproxy(t, tp, webService(t, tp), launch{want: 1, defaultAddrs: true, flags: []string{"--rules", "none"}})
	log := px.logText()
	for _, want := range []string{`"Serving" address="0.0.0.0:10256"`, `"Serving" address="127.0.0.1:10249"`} {
		if !regexp.MustCompile(regexp.QuoteMeta(want)).MatchString(log) {
			t.Errorf("log lacks %s:\n%s", want, tail(log, 20))
		}
	}
}

// TestMakeBuild: `make build` gives a stripped binary (no symbol table, no
// DWARF) that reports the checkout's version from git, not "dev".
func TestMakeBuild(t *testing.T) {
	testbed.Needs(t, testbed.Build, testbed.Commands("make"))
	bin := t.TempDir()
	if out, err := exec.Command("make", "-C", "..", "build", "BIN="+bin).CombinedOutput(); err != nil {
		t.Fatalf("make build: %v\n%s", err, out)
	}
	exe := filepath.Join(bin, "uproxy")
	describe, err := exec.Command("git", "-C", "..", "describe", "--tags", "--always", "--dirty").Output()
	if err != nil {
		t.Fatalf("git describe: %v", err)
	}
	out, err := exec.Command(exe, "version").Output()
	if got, want := strings.TrimSpace(string(out)), "uproxy "+strings.TrimSpace(string(describe)); err != nil || got != want {
		t.Errorf("uproxy version: got %q (%v), want %q", got, err, want)
	}
	f, err := elf.Open(exe)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, name := range []string{".symtab", ".debug_info", ".zdebug_info"} {
		if f.Section(name) != nil {
			t.Errorf("make build's binary has a %s section, want it stripped (-s -w)", name)
		}
	}
	if st, err := os.Stat(exe); err == nil {
		t.Logf("make build: %s, %.1f MB", strings.TrimSpace(string(out)), float64(st.Size())/1e6)
	}
}

// TestDemoInAKernelMode: `uproxy demo --proxy-mode iptables` (and nftables)
// prints its table as the userspace mode does, without proxy ports; its
// Services answer on their addresses from the node; and when it stops, the
// rules it programmed go with it (it left some 70 iptables rules behind, and
// printed nothing).
func TestDemoInAKernelMode(t *testing.T) {
	for _, mode := range []string{"iptables", "nftables"} {
		t.Run(mode, func(t *testing.T) {
			testbed.Needs(t, testbed.IPTables, testbed.NFTables)
			tp := testbed.New(t)
			iptablesBefore, nftBefore := tp.SavedRules(t, false), tp.NFTRuleset(t)
			cmd := exec.Command("ip", "netns", "exec", tp.NS(testbed.Node).Name, uproxyBin, "demo",
				"--proxy-mode", mode, "--conntrack-max-per-core", "0")
			var stderr strings.Builder
			cmd.Stderr = &stderr
			stdout, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			exited := make(chan error, 1)
			t.Cleanup(func() {
				cmd.Process.Kill()
				<-exited
			})
			printed := make(chan string, 1)
			go func() {
				var out strings.Builder
				sc := bufio.NewScanner(stdout)
				for sc.Scan() {
					out.WriteString(sc.Text() + "\n")
					if strings.HasPrefix(sc.Text(), "Manifests:") {
						printed <- out.String()
					}
				}
				exited <- cmd.Wait()
			}()
			var table string
			select {
			case table = <-printed:
			case err := <-exited:
				t.Fatalf("uproxy demo exited (%v) before printing its table:\n%s", err, stderr.String())
			case <-time.After(15 * time.Second):
				t.Fatalf("uproxy demo printed no table within 15s:\n%s", stderr.String())
			}
			for _, want := range []*regexp.Regexp{
				regexp.MustCompile(`(?m)^SERVICE +PROTOCOL +SERVICE ADDRESSES +ENDPOINTS$`),
				regexp.MustCompile(`(?m)^demo/web:main +TCP +10\.96\.0\.10:80/TCP +3 live \+ 1 dead \(127\.0\.0\.5\): not retried$`),
				regexp.MustCompile(`(?m)^demo/echo:main +UDP +10\.96\.0\.12:53/UDP +2 echo servers$`),
				regexp.MustCompile(`--proxy-mode ` + mode + `: the kernel sends the Service addresses to the endpoints`),
				regexp.MustCompile(`Ctrl-C stops and removes the rules\.`),
			} {
				if !want.MatchString(table) {
					t.Errorf("uproxy demo's output lacks %s:\n%s", want, table)
				}
			}
			// The table's first command: the Service address from this node.
			client := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{DisableKeepAlives: true,
				DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
					return tp.Dial(testbed.Node, network, addr)
				}}}
			answered := 0
			for range 8 {
				resp, err := client.Get("http://10.96.0.10/")
				if err != nil {
					continue // the dead endpoint's share: the kernel retries nothing
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if strings.HasPrefix(string(body), "web-") {
					answered++
				}
			}
			if answered == 0 {
				t.Errorf("no answer from web at 10.96.0.10:80 in 8 requests from the node; uproxy's log:\n%s", stderr.String())
			}

			cmd.Process.Signal(os.Interrupt)
			select {
			case err := <-exited:
				if err != nil {
					t.Errorf("uproxy demo after Ctrl-C: %v, want exit 0:\n%s", err, stderr.String())
				}
			case <-time.After(15 * time.Second):
				t.Fatalf("uproxy demo still running 15s after Ctrl-C")
			}
			exited <- nil // for the cleanup
			// iptables leaves its built-in tables and chains, empty: no rule
			// and nothing of uproxy's may stay.
			if got := rulesOf(tp.SavedRules(t, false)); got != rulesOf(iptablesBefore) || strings.Contains(got, "UPROXY") {
				t.Errorf("iptables rules after the demo stopped:\n%s\nwant as before it:\n%s", got, rulesOf(iptablesBefore))
			}
			if got := tp.NFTRuleset(t); strings.Contains(got, "uproxy") || nftRulesOf(got) != nftRulesOf(nftBefore) {
				t.Errorf("nft list ruleset after the demo stopped:\n%s\nwant no table of uproxy's and the rules of before it:\n%s", got, nftBefore)
			}
		})
	}
}

// rulesOf keeps the rules (-A lines) and user chains of iptables-save output.
func rulesOf(saved string) string {
	var b strings.Builder
	for _, l := range strings.Split(saved, "\n") {
		if strings.HasPrefix(l, "-A ") || strings.HasPrefix(l, ":") && !regexp.MustCompile(`^:(PREROUTING|INPUT|FORWARD|OUTPUT|POSTROUTING) `).MatchString(l) {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}

// nftRulesOf keeps the rules of nft list ruleset output: the lines inside a
// chain but its type line.
func nftRulesOf(ruleset string) string {
	var b strings.Builder
	for _, l := range strings.Split(ruleset, "\n") {
		if strings.HasPrefix(l, "\t\t") && !strings.HasPrefix(l, "\t\ttype ") {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}
