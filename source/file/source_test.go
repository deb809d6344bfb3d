package file

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/test/testbed/logs"
)

// svcYAML is a Service manifest with one port per entry of ports.
func svcYAML(name, clusterIP string, ports ...int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "apiVersion: v1\nkind: Service\nmetadata:\n  name: %s\nspec:\n  clusterIP: %s\n  ports:\n", name, clusterIP)
	for _, p := range ports {
		fmt.Fprintf(&b, "  - name: p%d\n    port: %d\n", p, p)
	}
	return b.String()
}

func sliceYAML(name, svc string, port int, addrs ...string) string {
	return fmt.Sprintf(`apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: %s
  labels:
    kubernetes.io/service-name: %s
addressType: IPv4
ports:
- name: p%d
  port: %d
endpoints:
%s`, name, svc, port, port+8000, endpointsYAML(addrs))
}

// endpointsYAML lists an endpoint per address, as the EndpointSlice
// controller writes them.
func endpointsYAML(addrs []string) string {
	var b strings.Builder
	for _, a := range addrs {
		fmt.Fprintf(&b, "- addresses: [%q]\n", a)
	}
	return b.String()
}

// summary renders a Snapshot's ports as "ns/name:port=80/TCP[endpoints]", sorted.
func summary(s *service.Snapshot) []string {
	var out []string
	for _, p := range s.Ports {
		var eps []string
		for _, e := range p.Endpoints {
			eps = append(eps, e.Addr.String())
		}
		out = append(out, fmt.Sprintf("%s=%d/%s%v", p.Name, p.Port, p.Protocol, eps))
	}
	return out
}

func errorStrings(s *service.Snapshot) []string {
	var out []string
	for _, err := range s.Errors {
		out = append(out, err.Error())
	}
	return out
}

func writeFile(t *testing.T, path, data string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestLoad(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "a.yaml"), svcYAML("web", "10.96.0.10", 80, 443)+"---\n"+sliceYAML("web-1", "web", 80, "10.0.0.1"))
	writeFile(t, filepath.Join(dir, "b.yml"), svcYAML("db", "10.96.0.11", 5432))
	writeFile(t, filepath.Join(dir, "c.json"), `{"apiVersion": "v1", "kind": "List", "items": [
		{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "api", "namespace": "prod"}, "spec": {"clusterIP": "10.96.0.15", "ports": [{"port": 8080}]}}]}`)
	// Not read: other extensions, dotfiles, subdirectories (not recursive).
	writeFile(t, filepath.Join(dir, "notes.txt"), svcYAML("txt", "10.96.0.12", 1))
	writeFile(t, filepath.Join(dir, ".tmp.yaml"), svcYAML("hidden", "10.96.0.13", 1))
	if err := os.Mkdir(filepath.Join(dir, "sub.yaml"), 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "sub.yaml", "d.yaml"), svcYAML("nested", "10.96.0.14", 1))

	tests := []struct {
		name string
		path string
		want []string
	}{
		{
			name: "directory",
			path: dir,
			want: []string{
				"default/db:p5432=5432/TCP[]",
				"default/web:p443=443/TCP[]",
				"default/web:p80=80/TCP[10.0.0.1:8080]",
				"prod/api=8080/TCP[]",
			},
		},
		{
			name: "single file",
			path: filepath.Join(dir, "b.yml"),
			want: []string{"default/db:p5432=5432/TCP[]"},
		},
		{
			name: "single file of another extension",
			path: filepath.Join(dir, "notes.txt"),
			want: []string{"default/txt:p1=1/TCP[]"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			snap, err := Load(tt.path, service.BuildOptions{})
			if err != nil {
				t.Fatalf("got error %v, want none", err)
			}
			if len(snap.Errors) > 0 {
				t.Errorf("got snapshot errors %q, want none", errorStrings(snap))
			}
			if got := summary(snap); !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got ports %q, want %q", got, tt.want)
			}
		})
	}

	t.Run("missing path", func(t *testing.T) {
		missing := filepath.Join(dir, "nope")
		if _, err := Load(missing, service.BuildOptions{}); err == nil || !strings.Contains(err.Error(), missing) {
			t.Errorf("got error %v, want one naming %s", err, missing)
		}
	})
}

// watch runs a Source on path and collects its Snapshots.
type watch struct {
	t     *testing.T
	snaps chan *service.Snapshot
	last  *service.Snapshot
}

func startWatch(t *testing.T, path string) *watch {
	t.Helper()
	return startSource(t, &Source{Path: path, Debounce: 20 * time.Millisecond})
}

// startSource runs src and collects its Snapshots.
func startSource(t *testing.T, src *Source) *watch {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	w := &watch{t: t, snaps: make(chan *service.Snapshot, 128)}
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx, func(s *service.Snapshot) { w.snaps <- s }) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: got %v, want nil after cancel", err)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("Run did not return after cancel")
		}
	})
	return w
}

// await returns the first Snapshot for which ok is true, failing the test after a deadline.
func (w *watch) await(what string, ok func(*service.Snapshot) bool) *service.Snapshot {
	w.t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		select {
		case s := <-w.snaps:
			if w.last != nil && w.last.Equal(s) {
				w.t.Errorf("got an update identical to the previous one: ports %q, errors %q", summary(s), errorStrings(s))
			}
			w.last = s
			if ok(s) {
				return s
			}
		case <-deadline:
			var got, errs []string
			if w.last != nil {
				got, errs = summary(w.last), errorStrings(w.last)
			}
			w.t.Fatalf("timed out waiting for %s; last snapshot: ports %q, errors %q", what, got, errs)
			return nil
		}
	}
}

func hasPorts(want ...string) func(*service.Snapshot) bool {
	return func(s *service.Snapshot) bool { return slices.Equal(summary(s), want) }
}

func hasPortsAndError(errPart string, want ...string) func(*service.Snapshot) bool {
	return func(s *service.Snapshot) bool {
		return slices.Equal(summary(s), want) && slices.ContainsFunc(errorStrings(s), func(e string) bool {
			return strings.Contains(e, errPart)
		})
	}
}

func TestRunReloads(t *testing.T) {
	tests := []struct {
		name string
		// file mode watches the file instead of the directory.
		fileMode bool
		// configMap adds a ConfigMap-volume-style linked file before the change.
		configMap bool
		change    func(t *testing.T, dir string)
		want      func(*service.Snapshot) bool
	}{
		{
			name: "in-place write",
			change: func(t *testing.T, dir string) {
				writeFile(t, filepath.Join(dir, "web.yaml"), svcYAML("web", "10.96.0.10", 80, 8080))
			},
			want: hasPorts("default/web:p80=80/TCP[]", "default/web:p8080=8080/TCP[]"),
		},
		{
			name:     "in-place write, file mode",
			fileMode: true,
			change: func(t *testing.T, dir string) {
				writeFile(t, filepath.Join(dir, "web.yaml"), svcYAML("web", "10.96.0.10", 81))
			},
			want: hasPorts("default/web:p81=81/TCP[]"),
		},
		{
			name: "atomic rename-over",
			change: func(t *testing.T, dir string) {
				tmp := filepath.Join(dir, ".web.yaml.tmp")
				writeFile(t, tmp, svcYAML("web", "10.96.0.10", 80)+"---\n"+sliceYAML("web-1", "web", 80, "10.0.0.7"))
				if err := os.Rename(tmp, filepath.Join(dir, "web.yaml")); err != nil {
					t.Fatal(err)
				}
			},
			want: hasPorts("default/web:p80=80/TCP[10.0.0.7:8080]"),
		},
		{
			name:     "atomic rename-over, file mode",
			fileMode: true,
			change: func(t *testing.T, dir string) {
				tmp := filepath.Join(dir, "web.yaml.new")
				writeFile(t, tmp, svcYAML("web", "10.96.0.10", 82))
				if err := os.Rename(tmp, filepath.Join(dir, "web.yaml")); err != nil {
					t.Fatal(err)
				}
			},
			want: hasPorts("default/web:p82=82/TCP[]"),
		},
		{
			name: "new file",
			change: func(t *testing.T, dir string) {
				writeFile(t, filepath.Join(dir, "db.json"), `{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "db"}, "spec": {"ports": [{"port": 5432}]}}`)
			},
			want: hasPorts("default/db=5432/TCP[]", "default/web:p80=80/TCP[]"),
		},
		{
			name: "file removal",
			change: func(t *testing.T, dir string) {
				if err := os.Remove(filepath.Join(dir, "web.yaml")); err != nil {
					t.Fatal(err)
				}
			},
			want: hasPorts(),
		},
		{
			name:     "file removal, file mode: last state kept and the error reported",
			fileMode: true,
			change: func(t *testing.T, dir string) {
				if err := os.Remove(filepath.Join(dir, "web.yaml")); err != nil {
					t.Fatal(err)
				}
			},
			want: hasPortsAndError("web.yaml: deleted; its last content is used until it is back", "default/web:p80=80/TCP[]"),
		},
		{
			name:      "ConfigMap volume update (symlinked directory swapped)",
			configMap: true,
			change: func(t *testing.T, dir string) {
				// A ConfigMap volume's files are links through "..data" to a
				// timestamped directory; an update writes a new one and renames a
				// new "..data" link over the old.
				v2 := filepath.Join(dir, "..v2")
				if err := os.Mkdir(v2, 0o755); err != nil {
					t.Fatal(err)
				}
				writeFile(t, filepath.Join(v2, "cm.yaml"), svcYAML("cm", "10.96.0.30", 2))
				if err := os.Symlink("..v2", filepath.Join(dir, "..data_tmp")); err != nil {
					t.Fatal(err)
				}
				if err := os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")); err != nil {
					t.Fatal(err)
				}
			},
			want: hasPorts("default/cm:p2=2/TCP[]", "default/web:p80=80/TCP[]"),
		},
		{
			name: "malformed YAML keeps the file's last good state",
			change: func(t *testing.T, dir string) {
				writeFile(t, filepath.Join(dir, "web.yaml"), svcYAML("web", "10.96.0.10", 9999)+"---\nkind: Service\n  bad: indent\n")
			},
			want: hasPortsAndError("web.yaml: document 2 (line 11): yaml: line 12: mapping values are not allowed in this context",
				"default/web:p80=80/TCP[]"),
		},
		{
			name: "invalid object keeps its last good version",
			change: func(t *testing.T, dir string) {
				writeFile(t, filepath.Join(dir, "web.yaml"), svcYAML("web", "10.96.0.10", 70000))
			},
			want: hasPortsAndError("web.yaml: document 1 (line 1): Service default/web: spec.ports[0].port: 70000 is out of range 1-65535",
				"default/web:p80=80/TCP[]"),
		},
		{
			name: "unknown kind reported, rest of the file used",
			change: func(t *testing.T, dir string) {
				writeFile(t, filepath.Join(dir, "web.yaml"), "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: c\n---\n"+svcYAML("web", "10.96.0.10", 83))
			},
			want: hasPortsAndError("web.yaml: document 1 (line 1): unsupported kind ConfigMap",
				"default/web:p83=83/TCP[]"),
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			path := dir
			if tt.fileMode {
				path = filepath.Join(dir, "web.yaml")
			}
			writeFile(t, filepath.Join(dir, "web.yaml"), svcYAML("web", "10.96.0.10", 80))
			w := startWatch(t, path)
			w.await("the initial state", hasPorts("default/web:p80=80/TCP[]"))
			if tt.configMap {
				// cm.yaml -> ..data/cm.yaml, ..data -> ..v1
				v1 := filepath.Join(dir, "..v1")
				if err := os.Mkdir(v1, 0o755); err != nil {
					t.Fatal(err)
				}
				writeFile(t, filepath.Join(v1, "cm.yaml"), svcYAML("cm", "10.96.0.30", 1))
				for link, target := range map[string]string{"..data": "..v1", "cm.yaml": filepath.Join("..data", "cm.yaml")} {
					if err := os.Symlink(target, filepath.Join(dir, link)); err != nil {
						t.Fatal(err)
					}
				}
				w.await("the ConfigMap's first version", hasPorts("default/cm:p1=1/TCP[]", "default/web:p80=80/TCP[]"))
			}
			tt.change(t, dir)
			w.await("the change", tt.want)
		})
	}
}

func TestRunLastGoodState(t *testing.T) {
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a.yaml"), filepath.Join(dir, "b.yaml")
	writeFile(t, a, svcYAML("web", "10.96.0.10", 80)+"---\n"+sliceYAML("web-1", "web", 80, "10.0.0.1"))
	writeFile(t, b, svcYAML("db", "10.96.0.11", 5432))
	w := startWatch(t, dir)
	w.await("the initial state", hasPorts("default/db:p5432=5432/TCP[]", "default/web:p80=80/TCP[10.0.0.1:8080]"))

	// An invalid slice keeps its last good version; the other file is unaffected.
	writeFile(t, a, svcYAML("web", "10.96.0.10", 80)+"---\n"+sliceYAML("web-1", "web", 80, "10.0.0.999"))
	w.await("the invalid slice's error", hasPortsAndError(
		`a.yaml: document 2 (line 11): EndpointSlice default/web-1: endpoints[0].addresses[0]: "10.0.0.999" is not a valid IP address`,
		"default/db:p5432=5432/TCP[]", "default/web:p80=80/TCP[10.0.0.1:8080]"))

	// A new invalid object has no earlier version: it is left out, the rest applies.
	writeFile(t, b, svcYAML("db", "10.96.0.11", 5433)+"---\n"+svcYAML("cache", "10.96.0.300", 6379))
	w.await("the new invalid Service's error", hasPortsAndError(
		`b.yaml: document 2 (line 11): Service default/cache: spec.clusterIP: "10.96.0.300" is not a valid IP address`,
		"default/db:p5433=5433/TCP[]", "default/web:p80=80/TCP[10.0.0.1:8080]"))

	// Fixing everything clears the errors.
	writeFile(t, a, svcYAML("web", "10.96.0.10", 80)+"---\n"+sliceYAML("web-1", "web", 80, "10.0.0.2"))
	writeFile(t, b, svcYAML("db", "10.96.0.11", 5433))
	s := w.await("the fixed state", hasPorts("default/db:p5433=5433/TCP[]", "default/web:p80=80/TCP[10.0.0.2:8080]"))
	if errs := errorStrings(s); len(errs) > 0 {
		// The ports can match before both writes land; wait for the errors to clear too.
		w.await("no errors", func(s *service.Snapshot) bool { return len(s.Errors) == 0 })
	}

	// The same object in two files: the first file's definition wins, the second is reported.
	writeFile(t, b, svcYAML("db", "10.96.0.11", 5433)+"---\n"+svcYAML("web", "10.96.0.20", 1))
	w.await("the duplicate's error", hasPortsAndError(
		"b.yaml: document 2 (line 11): Service default/web: metadata.name: already defined in "+a+" document 1; this definition is ignored",
		"default/db:p5433=5433/TCP[]", "default/web:p80=80/TCP[10.0.0.2:8080]"))

	// A removed object is forgotten: brought back invalid, it has nothing to fall back to.
	writeFile(t, a, sliceYAML("web-1", "web", 80, "10.0.0.2"))
	w.await("web gone", hasPorts("default/db:p5433=5433/TCP[]", "default/web:p1=1/TCP[]"))
}

// TestLoadUnchanged checks what Run relies on to update only on effective changes:
// reloading unchanged, rewritten-but-equal or unrelated files gives the same state.
func TestLoadUnchanged(t *testing.T) {
	dir := t.TempDir()
	web := filepath.Join(dir, "web.yaml")
	writeFile(t, web, svcYAML("web", "10.96.0.10", 80)+"---\n"+svcYAML("bad", "x", 1))
	l := newLoader(dir, true, service.BuildOptions{})
	prev := l.load()
	steps := []struct {
		name   string
		change func()
		same   bool
	}{
		{name: "nothing", change: func() {}, same: true},
		{name: "same content rewritten", change: func() { writeFile(t, web, svcYAML("web", "10.96.0.10", 80)+"---\n"+svcYAML("bad", "x", 1)) }, same: true},
		{name: "trailing comment added", change: func() {
			writeFile(t, web, svcYAML("web", "10.96.0.10", 80)+"---\n"+svcYAML("bad", "x", 1)+"# the end\n")
		}, same: true},
		// Errors name lines: moving the invalid document is a change of the state.
		{name: "leading comment added", change: func() { writeFile(t, web, "# c\n"+svcYAML("web", "10.96.0.10", 80)+"---\n"+svcYAML("bad", "x", 1)) }},
		{name: "unrelated file", change: func() { writeFile(t, filepath.Join(dir, "notes.txt"), "hi") }, same: true},
		{name: "port changed", change: func() { writeFile(t, web, svcYAML("web", "10.96.0.10", 81)+"---\n"+svcYAML("bad", "x", 1)) }},
		{name: "error fixed", change: func() { writeFile(t, web, svcYAML("web", "10.96.0.10", 81)) }},
	}
	for _, st := range steps {
		st.change()
		next := l.load()
		if got := prev.Equal(next); got != st.same {
			t.Errorf("%s: got same %v, want %v (ports %q -> %q)", st.name, got, st.same, summary(prev), summary(next))
		}
		prev = next
	}
}

func TestRunFailsOnMissingPath(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "absent", "services.yaml")
	src := &Source{Path: missing}
	err := src.Run(context.Background(), func(*service.Snapshot) { t.Error("got an update, want none") })
	if err == nil || !strings.Contains(err.Error(), missing) {
		t.Errorf("got error %v, want one naming %s", err, missing)
	}
}

// TestRunConflicts: a Service appended to a manifest with the address and port
// of a working one is left out with an error saying where it is defined, even
// when its name sorts first; the working one keeps serving until it goes away,
// and then the other takes over.
func TestRunConflicts(t *testing.T) {
	dir := t.TempDir()
	web := svcYAML("web", "10.96.0.10", 80) + "---\n" + sliceYAML("web-1", "web", 80, "10.0.0.1")
	copied := svcYAML("api", "10.96.0.10", 80, 443)
	path := filepath.Join(dir, "services.yaml")
	writeFile(t, path, web)
	w := startWatch(t, dir)
	w.await("web", hasPorts("default/web:p80=80/TCP[10.0.0.1:8080]"))

	writeFile(t, path, web+"---\n"+copied)
	s := w.await("api's conflict", hasPortsAndError("api", "default/api:p443=443/TCP[]", "default/web:p80=80/TCP[10.0.0.1:8080]"))
	want := path + ": document 3 (line 24): default/api port p80: 10.96.0.10:80/TCP is already served by default/web port p80"
	if got := errorStrings(s); !slices.Equal(got, []string{want}) {
		t.Errorf("got errors %q, want %q", got, want)
	}
	if len(s.Conflicts) != 1 || s.Conflicts[0].ServedBy.Name != "web" {
		t.Errorf("got conflicts %v, want api's with web", s.Conflicts)
	}

	writeFile(t, path, copied)
	s = w.await("api taking over", hasPorts("default/api:p443=443/TCP[]", "default/api:p80=80/TCP[]"))
	if len(s.Errors) != 0 {
		t.Errorf("got errors %q, want none", errorStrings(s))
	}
}

// A manifest's uproxy.io/ annotations reach its Ports; a bad one is an error
// naming the Service and the annotation, and the Service is still served.
func TestLoadPolicyAnnotations(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "a.yaml"), `apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: shop
  annotations:
    uproxy.io/dial-timeouts: "100ms,200ms"
    uproxy.io/dial-hedge: "30ms"
    uproxy.io/retry-budget: "20%"
    uproxy.io/scheduler: "lc"
spec:
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80}]
---
apiVersion: v1
kind: Service
metadata:
  name: odd
  namespace: shop
  annotations:
    uproxy.io/dial-hedge: "soonish"
    uproxy.io/retry-budget: "5"
spec:
  clusterIP: 10.96.0.11
  ports: [{name: http, port: 80}]
`)
	snap, err := Load(dir, service.BuildOptions{})
	if err != nil {
		t.Fatal(err)
	}
	web := snap.Lookup(service.PortName{Namespace: "shop", Name: "web", Port: "http"})
	odd := snap.Lookup(service.PortName{Namespace: "shop", Name: "odd", Port: "http"})
	if web == nil || odd == nil {
		t.Fatalf("ports: got %q, want shop/web:http and shop/odd:http (served despite a bad annotation)", summary(snap))
	}
	if p := web.Policy; !reflect.DeepEqual(p.DialTimeouts, []time.Duration{100 * time.Millisecond, 200 * time.Millisecond}) ||
		p.DialHedge == nil || *p.DialHedge != 30*time.Millisecond || p.RetryBudget == nil || *p.RetryBudget != 20 || p.Scheduler != "lc" {
		t.Errorf("shop/web policy: got %+v, want every annotation's value", p)
	}
	if p := odd.Policy; p.DialHedge != nil || p.RetryBudget == nil || *p.RetryBudget != 5 {
		t.Errorf("shop/odd policy: got %+v, want no hedge (bad) and a 5%% budget", p)
	}
	// Said where the Service is defined, as every problem of a manifest.
	want := filepath.Join(dir, "a.yaml") + `: document 2 (line 15): Service shop/odd: metadata.annotations[uproxy.io/dial-hedge]: "soonish": `
	if errs := errorStrings(snap); len(errs) != 1 || !strings.HasPrefix(errs[0], want) {
		t.Errorf("errors: got %q, want one starting %q", errs, want)
	}
}

// TestRunFollowsAReplacedDirectory: the manifest directory replaced by another
// of the same name, as deploy scripts and people do it, is followed. While it
// is gone its Services stay and the Snapshot says why; once it is back its
// manifests are read, and later edits in it are seen. Each case is run in one
// burst (the shell's `a; b; c`) and step by step, awaiting each state.
func TestRunFollowsAReplacedDirectory(t *testing.T) {
	web := func(port int) string { return svcYAML("web", "10.96.0.10", port) }
	run := func(t *testing.T, name string, args ...string) {
		t.Helper()
		if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
			t.Fatalf("%s %q: %v: %s", name, args, err, out)
		}
	}
	type step struct {
		do func(t *testing.T, dir, away string)
		// want is the state awaited after do (nil: none, in a burst).
		want func(*service.Snapshot) bool
		// logged are lines the step must log, each matched by its substrings.
		logged [][]string
	}
	gone := func(dir string) step {
		return step{want: hasPortsAndError(dir+": gone; the last content of its files is used until it is back", "default/web:p80=80/TCP[]"),
			logged: [][]string{{"I", `"Manifest directory gone; its files' last content is used until it is back"`, `dir="` + dir + `"`}}}
	}
	back := func(dir string, ports ...string) step {
		return step{want: func(s *service.Snapshot) bool { return hasPorts(ports...)(s) && len(s.Errors) == 0 },
			logged: [][]string{{"I", `"Manifest problem fixed"`, `was="` + dir + `: gone`}}}
	}
	tests := []struct {
		name  string
		steps func(dir, away string) []step
	}{
		{
			name: "rm -rf d; mkdir d; cp web.yaml d/",
			steps: func(dir, away string) []step {
				rm, mkdir := gone(dir), step{want: hasPorts()}
				rm.do = func(t *testing.T, dir, _ string) { run(t, "rm", "-rf", dir) }
				mkdir.do = func(t *testing.T, dir, _ string) { run(t, "mkdir", dir) }
				cp := back(dir, "default/web:p81=81/TCP[]")
				cp.logged = nil // the empty directory fixed it
				cp.do = func(t *testing.T, dir, away string) {
					writeFile(t, filepath.Join(away, "web.yaml"), web(81))
					run(t, "cp", filepath.Join(away, "web.yaml"), dir+"/")
				}
				return []step{rm, mkdir, cp}
			},
		},
		{
			name: "mv d away; mv away d",
			steps: func(dir, away string) []step {
				mvAway := gone(dir)
				mvAway.do = func(t *testing.T, dir, away string) {
					run(t, "mv", dir, away)
					// Edited while away: only the directory's return brings it in.
					writeFile(t, filepath.Join(away, "web.yaml"), web(81))
				}
				mvBack := back(dir, "default/web:p81=81/TCP[]")
				mvBack.do = func(t *testing.T, dir, away string) { run(t, "mv", away, dir) }
				return []step{mvAway, mvBack}
			},
		},
	}
	for _, tt := range tests {
		for _, burst := range []bool{true, false} {
			name := tt.name + ", step by step"
			if burst {
				name = tt.name + ", in one burst"
			}
			t.Run(name, func(t *testing.T) {
				base := t.TempDir()
				dir, away := filepath.Join(base, "d"), filepath.Join(base, "away")
				if err := os.Mkdir(dir, 0o755); err != nil {
					t.Fatal(err)
				}
				if strings.HasPrefix(tt.name, "rm") {
					// cp's source.
					if err := os.Mkdir(away, 0o755); err != nil {
						t.Fatal(err)
					}
				}
				writeFile(t, filepath.Join(dir, "web.yaml"), web(80))
				log := logs.Capture(t)
				w := startWatch(t, dir)
				w.await("the first load", hasPorts("default/web:p80=80/TCP[]"))
				log.Since()

				steps := tt.steps(dir, away)
				for i, st := range steps {
					st.do(t, dir, away)
					if burst && i < len(steps)-1 {
						continue
					}
					w.await(fmt.Sprintf("the state after step %d", i+1), st.want)
					if !burst {
						lines := log.Since()
						for _, want := range st.logged {
							if !slices.ContainsFunc(lines, func(l string) bool { return logLineHas(l, want) }) {
								t.Errorf("step %d: no log line with %q among:\n%s", i+1, want, strings.Join(lines, "\n"))
							}
						}
					}
				}
				// The directory now under the name is the one watched.
				writeFile(t, filepath.Join(dir, "web.yaml"), web(82))
				w.await("an edit in the directory that came back", hasPorts("default/web:p82=82/TCP[]"))
				writeFile(t, filepath.Join(dir, "db.yaml"), svcYAML("db", "10.96.0.11", 5432))
				w.await("a file added to it", hasPorts("default/db:p5432=5432/TCP[]", "default/web:p82=82/TCP[]"))
			})
		}
	}
}

// logLineHas reports whether line has severity want[0] and every substring of
// want[1:].
func logLineHas(line string, want []string) bool {
	if !strings.HasPrefix(line, want[0]) {
		return false
	}
	for _, p := range want[1:] {
		if !strings.Contains(line, p) {
			return false
		}
	}
	return true
}
