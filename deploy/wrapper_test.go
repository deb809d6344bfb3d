package deploy

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/uproxy/uproxy/test/testbed"
)

// wrapperWorld is the image's iptables commands rebuilt in a directory: the
// real -legacy and -nft commands linked in, Debian's alternatives for both
// backends (priorities 10 and 20) and uproxy above them (100), which runs the
// wrapper script, as the Dockerfile installs them, in private alternatives
// directories.
type wrapperWorld struct {
	sbin, altdir, admindir, log string
	// uproxy is the binary the commands lead to until the first run.
	uproxy string
}

var (
	uproxyOnce sync.Once
	uproxyBin  string
	uproxyErr  error
)

// buildUproxy builds uproxy once for every test of the package.
func buildUproxy(t *testing.T) string {
	t.Helper()
	uproxyOnce.Do(func() {
		dir, err := os.MkdirTemp("", "uproxy-deploy-test")
		if err != nil {
			uproxyErr = err
			return
		}
		uproxyBin = filepath.Join(dir, "uproxy")
		if out, err := exec.Command("go", "build", "-o", uproxyBin, "..").CombinedOutput(); err != nil {
			uproxyErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if uproxyErr != nil {
		t.Fatal(uproxyErr)
	}
	return uproxyBin
}

func TestMain(m *testing.M) {
	code := m.Run()
	if uproxyBin != "" {
		os.RemoveAll(filepath.Dir(uproxyBin))
	}
	os.Exit(code)
}

func newWrapperWorld(t *testing.T) *wrapperWorld {
	t.Helper()
	dir := t.TempDir()
	w := &wrapperWorld{sbin: filepath.Join(dir, "sbin"), altdir: filepath.Join(dir, "alternatives"),
		admindir: filepath.Join(dir, "admin"), log: filepath.Join(dir, "alternatives.log")}
	for _, d := range []string{w.sbin, w.altdir, w.admindir} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	var names []string
	for _, family := range []string{"iptables", "ip6tables"} {
		for _, backend := range []string{"legacy", "nft"} {
			for _, suffix := range []string{"", "-save", "-restore"} {
				names = append(names, family+"-"+backend+suffix)
			}
		}
	}
	testbed.Needs(t, testbed.Build, testbed.Commands(names...))
	w.uproxy = buildUproxy(t)
	for _, name := range names {
		real, err := exec.LookPath(name)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(real, filepath.Join(w.sbin, name)); err != nil {
			t.Fatal(err)
		}
	}
	script, err := os.ReadFile("iptables-wrapper")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(w.sbin, "iptables-wrapper"), script, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, family := range []string{"iptables", "ip6tables"} {
		link := func(suffix string) string { return filepath.Join(w.sbin, family+suffix) }
		for _, alt := range []struct {
			target, save, restore, priority string
		}{
			{link("-legacy"), link("-legacy-save"), link("-legacy-restore"), "10"},
			{link("-nft"), link("-nft-save"), link("-nft-restore"), "20"},
			{w.uproxy, w.uproxy, w.uproxy, "100"},
		} {
			w.alternatives(t, "--install", link(""), family, alt.target, alt.priority,
				"--slave", link("-save"), family+"-save", alt.save,
				"--slave", link("-restore"), family+"-restore", alt.restore)
		}
	}
	if got := w.resolve(t, "iptables-save"); got != w.uproxy {
		t.Fatalf("before any run, iptables-save leads to %s, want uproxy (%s)", got, w.uproxy)
	}
	return w
}

func (w *wrapperWorld) alternatives(t *testing.T, args ...string) {
	t.Helper()
	args = append([]string{"--altdir", w.altdir, "--admindir", w.admindir, "--log", w.log, "--quiet"}, args...)
	if out, err := exec.Command("update-alternatives", args...).CombinedOutput(); err != nil {
		t.Fatalf("update-alternatives %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// env is the wrapper's environment for this world.
func (w *wrapperWorld) env() []string {
	return []string{"env", "IPTABLES_WRAPPER_SBIN=" + w.sbin, "IPTABLES_WRAPPER_ALTDIR=" + w.altdir,
		"IPTABLES_WRAPPER_ADMINDIR=" + w.admindir, "IPTABLES_WRAPPER_LOG=" + w.log}
}

// resolve returns the file the command name leads to.
func (w *wrapperWorld) resolve(t *testing.T, name string) string {
	t.Helper()
	p, err := filepath.EvalSymlinks(filepath.Join(w.sbin, name))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// The wrapper picks the backend that holds the node's rules, switches every
// command to it, and runs the command it was called as through it.
func TestIPTablesWrapperPicksTheNodesBackend(t *testing.T) {
	testbed.Needs(t, testbed.Netns, testbed.Commands("update-alternatives"))
	tests := []struct {
		name  string
		rules []string // shell commands run in the node namespace first
		want  string
	}{{
		name:  "rules in legacy",
		rules: []string{"iptables-legacy -N TEST-CHAIN", "iptables-legacy -A TEST-CHAIN -j RETURN", "ip6tables-legacy -A INPUT -j ACCEPT"},
		want:  "legacy",
	}, {
		name:  "rules in nft",
		rules: []string{"iptables-nft -N TEST-CHAIN", "iptables-nft -A TEST-CHAIN -j RETURN", "iptables-nft -A TEST-CHAIN -j RETURN"},
		want:  "nft",
	}, {
		name: "more rules in legacy than in nft",
		rules: []string{"iptables-nft -A INPUT -j ACCEPT",
			"iptables-legacy -N TEST-CHAIN", "iptables-legacy -A TEST-CHAIN -j RETURN", "iptables-legacy -A TEST-CHAIN -j RETURN"},
		want: "legacy",
	}, {
		// The kubelet's hint chain decides, whatever the counts.
		name: "the kubelet's hint in nft, more rules in legacy",
		rules: []string{"iptables-nft -t mangle -N KUBE-IPTABLES-HINT",
			"iptables-legacy -N TEST-CHAIN", "iptables-legacy -A TEST-CHAIN -j RETURN", "iptables-legacy -A TEST-CHAIN -j RETURN"},
		want: "nft",
	}, {
		name: "the kubelet's canary in legacy, more rules in nft",
		rules: []string{"iptables-legacy -t mangle -N KUBE-KUBELET-CANARY",
			"iptables-nft -N TEST-CHAIN", "iptables-nft -A TEST-CHAIN -j RETURN", "iptables-nft -A TEST-CHAIN -j RETURN"},
		want: "legacy",
	}, {
		name: "an empty node",
		want: "nft",
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tp := testbed.New(t)
			for _, r := range tt.rules {
				if out, err := tp.Exec(testbed.Node, strings.Fields(r)...); err != nil {
					t.Fatalf("%s: %v\n%s", r, err, out)
				}
			}
			w := newWrapperWorld(t)
			if out, err := tp.Exec(testbed.Node, append(w.env(), filepath.Join(w.sbin, "iptables-wrapper"), "--detect")...); err != nil || strings.TrimSpace(string(out)) != tt.want {
				t.Errorf("--detect: got %q (%v), want %s", out, err, tt.want)
			}

			// The first command run through the wrapper: iptables-save.
			out, err := tp.Exec(testbed.Node, append(w.env(), filepath.Join(w.sbin, "iptables-save"))...)
			if err != nil {
				t.Fatalf("iptables-save through the wrapper: %v\n%s", err, out)
			}
			direct, err := tp.Exec(testbed.Node, "iptables-"+tt.want+"-save")
			if err != nil {
				t.Fatal(err)
			}
			if got, want := rulesOnly(string(out)), rulesOnly(string(direct)); got != want {
				t.Errorf("iptables-save through the wrapper printed\n%s\nwant iptables-%s-save's\n%s", got, tt.want, want)
			}
			if !strings.Contains(string(out), "iptables-wrapper: using iptables' "+tt.want+" backend") {
				t.Errorf("the wrapper did not say which backend it chose:\n%s", out)
			}
			// Every command of both families now leads to the chosen backend.
			for _, name := range []string{"iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore"} {
				family, suffix, _ := strings.Cut(name, "-")
				if suffix != "" {
					suffix = "-" + suffix
				}
				want := w.resolve(t, family+"-"+tt.want+suffix)
				if got := w.resolve(t, name); got != want {
					t.Errorf("%s leads to %s after the first run, want %s", name, got, want)
				}
			}
		})
	}
}

// Commands started together through the wrapper, as uproxy starts them, all
// succeed: one switches the backend, the others wait and then run through it.
func TestIPTablesWrapperConcurrentFirstRuns(t *testing.T) {
	testbed.Needs(t, testbed.Netns, testbed.Commands("update-alternatives"))
	tp := testbed.New(t)
	for _, r := range []string{"iptables-legacy -N TEST-CHAIN", "iptables-legacy -A TEST-CHAIN -j RETURN"} {
		if out, err := tp.Exec(testbed.Node, strings.Fields(r)...); err != nil {
			t.Fatalf("%s: %v\n%s", r, err, out)
		}
	}
	w := newWrapperWorld(t)
	setup, err := os.ReadFile(w.log)
	if err != nil {
		t.Fatal(err)
	}
	names := []string{"iptables-save", "ip6tables-save", "iptables-save", "ip6tables-save", "iptables", "ip6tables"}
	errs := make(chan error, len(names))
	for _, name := range names {
		args := []string{filepath.Join(w.sbin, name)}
		if !strings.HasSuffix(name, "-save") {
			args = append(args, "-w", "5", "-S")
		}
		go func() {
			out, err := tp.Exec(testbed.Node, append(w.env(), args...)...)
			if err == nil && strings.HasPrefix(name, "iptables") && !strings.Contains(string(out), "TEST-CHAIN") {
				err = fmt.Errorf("%s printed no TEST-CHAIN, so not legacy's rules:\n%s", name, out)
			}
			errs <- err
		}()
	}
	for range names {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
	log, err := os.ReadFile(w.log)
	if err != nil {
		t.Fatal(err)
	}
	switched := strings.Count(string(log[len(setup):]), "link group iptables updated to point to "+filepath.Join(w.sbin, "iptables-legacy")+"\n")
	if switched != 1 {
		t.Errorf("the iptables alternative was switched to legacy %d times, want once:\n%s", switched, log)
	}
}

// rulesOnly drops iptables-save's comment lines (timestamps) and counters.
func rulesOnly(s string) string {
	var b strings.Builder
	for _, line := range strings.Split(s, "\n") {
		if line == "" || strings.HasPrefix(line, "#") || strings.HasPrefix(line, "iptables-wrapper:") {
			continue
		}
		if i := strings.Index(line, " ["); strings.HasPrefix(line, ":") && i > 0 {
			line = line[:i]
		}
		b.WriteString(line + "\n")
	}
	return b.String()
}
