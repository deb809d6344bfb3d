package file

import (
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/service"
)

// A file rewritten whole with one document changed keeps the objects of the
// others, and so the Ports built from them (the same pointers, which the modes
// skip), wherever they now are in the file; each object's location is its
// new one.
func TestReloadKeepsUnchangedDocuments(t *testing.T) {
	path := filepath.Join(t.TempDir(), "svcs.yaml")
	doc := func(parts ...string) string { return strings.Join(parts, "---\n") }
	writeFile(t, path, doc(
		svcYAML("a", "10.96.0.10", 80), sliceYAML("a-1", "a", 80, "10.0.0.1"),
		svcYAML("b", "10.96.0.11", 80), sliceYAML("b-1", "b", 80, "10.0.0.2"),
		svcYAML("c", "10.96.0.12", 80), sliceYAML("c-1", "c", 80, "10.0.0.3"),
		svcYAML("d", "10.96.0.12", 80)))
	l := newLoader(path, false, service.BuildOptions{})
	before := l.load()
	if len(before.Ports) != 3 || len(before.Errors) != 1 {
		t.Fatalf("first load: got %v (errors %v), want three Service ports and d's conflict", summary(before), before.Errors)
	}

	// A Service more at the top moves every document down; b's endpoint
	// moves; d's conflict and a second definition of a at the end name
	// where d and the first a now are.
	writeFile(t, path, doc(
		svcYAML("z", "10.96.0.9", 80),
		svcYAML("a", "10.96.0.10", 80), sliceYAML("a-1", "a", 80, "10.0.0.1"),
		svcYAML("b", "10.96.0.11", 80), sliceYAML("b-1", "b", 80, "10.0.0.20"),
		svcYAML("c", "10.96.0.12", 80), sliceYAML("c-1", "c", 80, "10.0.0.3"),
		svcYAML("d", "10.96.0.12", 80),
		svcYAML("a", "10.96.0.13", 81)))
	after := l.load()
	want := []string{"default/a:p80=80/TCP[10.0.0.1:8080]", "default/b:p80=80/TCP[10.0.0.20:8080]",
		"default/c:p80=80/TCP[10.0.0.3:8080]", "default/z:p80=80/TCP[]"}
	if got := summary(after); !slices.Equal(got, want) {
		t.Fatalf("second load: got %v, want %v", got, want)
	}
	for _, name := range []string{"a", "c"} {
		pn := service.PortName{Namespace: "default", Name: name, Port: "p80"}
		if before.Lookup(pn) != after.Lookup(pn) {
			t.Errorf("%s: unchanged, but its Port was built again", pn)
		}
	}
	if pn := (service.PortName{Namespace: "default", Name: "b", Port: "p80"}); before.Lookup(pn) == after.Lookup(pn) {
		t.Errorf("%s: its endpoint moved, but it kept its Port", pn)
	}
	wantErrs := []string{
		path + ": document 9 (line 90): Service default/a: metadata.name: already defined in " + path + " document 2; this definition is ignored",
		path + ": document 8 (line 80): ",
	}
	got := errorStrings(after)
	if len(got) != 2 || got[0] != wantErrs[0] || !strings.HasPrefix(got[1], wantErrs[1]) {
		t.Errorf("errors: got %q, want %q and d's conflict at %q", got, wantErrs[0], wantErrs[1])
	}
}

// Two copies of one document decode into objects of their own, as they did
// before any reuse: the second is a repeated definition, reported as such.
func TestReloadRepeatedDocument(t *testing.T) {
	path := filepath.Join(t.TempDir(), "svcs.yaml")
	a := svcYAML("a", "10.96.0.10", 80)
	writeFile(t, path, a)
	l := newLoader(path, false, service.BuildOptions{})
	first := l.load()
	writeFile(t, path, a+"---\n"+a)
	second := l.load()
	if p, q := first.Ports[0], second.Ports[0]; p != q {
		t.Errorf("the first copy: its Port was built again")
	}
	st := l.files[path]
	if len(st.objs) != 2 || st.objs[0].svc == st.objs[1].svc {
		t.Errorf("objects: got %d, the two the same: %v; want two of their own", len(st.objs), len(st.objs) == 2)
	}
	wantErr := path + ": document 2 (line 11): Service default/a: metadata.name: already defined in " + path + " document 1; this definition is ignored"
	if got := errorStrings(second); !slices.Equal(got, []string{wantErr}) {
		t.Errorf("errors: got %q, want %q", got, wantErr)
	}
}

// Slices with the same labels share one map (a Go map costs far more than its
// one or two entries); slices with other labels keep their own, however
// their keys and values would read run together.
func TestSlicesShareEqualLabels(t *testing.T) {
	share := labelSets{}
	a := share.share(map[string]string{"kubernetes.io/service-name": "web"})
	b := share.share(map[string]string{"kubernetes.io/service-name": "web"})
	c := share.share(map[string]string{"kubernetes.io/service-name": "db"})
	if reflect.ValueOf(a).UnsafePointer() != reflect.ValueOf(b).UnsafePointer() {
		t.Errorf("equal labels: two maps, want one")
	}
	if reflect.ValueOf(a).UnsafePointer() == reflect.ValueOf(c).UnsafePointer() || c["kubernetes.io/service-name"] != "db" {
		t.Errorf("other labels: got %v, want their own map", c)
	}
	x := share.share(map[string]string{"a\x00b": "c"})
	y := share.share(map[string]string{"a": "b\x00c"})
	if len(y) != 1 || y["a"] != "b\x00c" || reflect.ValueOf(x).UnsafePointer() == reflect.ValueOf(y).UnsafePointer() {
		t.Errorf("labels that read alike run together: got %q and %q, want each its own", x, y)
	}
	if m := share.share(nil); m != nil {
		t.Errorf("no labels: got %v, want nil", m)
	}

	// Through a file: the two slices of web share theirs, and each keeps
	// its Service.
	path := filepath.Join(t.TempDir(), "svcs.yaml")
	writeFile(t, path, strings.Join([]string{svcYAML("web", "10.96.0.10", 80),
		sliceYAML("web-1", "web", 80, "10.0.0.1"), sliceYAML("web-2", "web", 80, "10.0.0.2"),
		sliceYAML("db-1", "db", 80, "10.0.0.3")}, "---\n"))
	l := newLoader(path, false, service.BuildOptions{})
	snap := l.load()
	objs := l.files[path].objs
	if len(objs) != 4 || reflect.ValueOf(objs[1].slice.Labels).UnsafePointer() != reflect.ValueOf(objs[2].slice.Labels).UnsafePointer() ||
		objs[3].slice.Labels["kubernetes.io/service-name"] != "db" {
		t.Errorf("slices' labels after a load: %v, %v, %v; want web's two shared, db's its own", objs[1].slice.Labels, objs[2].slice.Labels, objs[3].slice.Labels)
	}
	if got := summary(snap); !slices.Equal(got, []string{"default/web:p80=80/TCP[10.0.0.1:8080 10.0.0.2:8080]"}) {
		t.Errorf("Snapshot: got %v", got)
	}
}
