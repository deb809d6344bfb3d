package file

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/test/testbed/logs"
)

// TestRunLogs: what the source logs at the default verbosity, step by step: a
// summary of every load, each problem once when it appears, its fix, and a
// deleted file as deleted.
func TestRunLogs(t *testing.T) {
	dir := t.TempDir()
	web, db := filepath.Join(dir, "web.yaml"), filepath.Join(dir, "db.yaml")
	writeFile(t, web, svcYAML("web", "10.96.0.10", 80)+"---\n"+sliceYAML("web-1", "web", 80, "10.0.0.1"))
	writeFile(t, db, svcYAML("db", "10.96.0.11", 5432))
	log := logs.Capture(t)
	w := startWatch(t, dir)

	steps := []struct {
		name   string
		change func()
		await  func(*watch)
		// want are the lines logged, each matched by its substrings.
		want [][]string
	}{
		{
			name: "first load",
			await: func(w *watch) {
				w.await("the first load", hasPorts("default/db:p5432=5432/TCP[]", "default/web:p80=80/TCP[10.0.0.1:8080]"))
			},
			want: [][]string{{"I", `"Manifests loaded"`, `path="` + dir + `"`, "services=2", "ports=2", "endpoints=1", "problems=0"}},
		},
		{
			name: "a port added, an endpoint changed",
			change: func() {
				replaceFile(t, web, svcYAML("web", "10.96.0.10", 80, 81)+"---\n"+sliceYAML("web-1", "web", 80, "10.0.0.1", "10.0.0.2"))
			},
			await: func(w *watch) {
				w.await("the new port", hasPorts("default/db:p5432=5432/TCP[]", "default/web:p80=80/TCP[10.0.0.1:8080 10.0.0.2:8080]", "default/web:p81=81/TCP[]"))
			},
			want: [][]string{{"I", `"Manifests reloaded"`, "services=2", "ports=3", "endpoints=2",
				`added="default/web:p81"`, `removed=""`, `changed="default/web:p80"`, "problems=0"}},
		},
		{
			name:   "an invalid edit",
			change: func() { replaceFile(t, db, svcYAML("db", "10.96.0.11", 70000)) },
			await: func(w *watch) {
				w.await("the error", hasPortsAndError("70000", "default/db:p5432=5432/TCP[]", "default/web:p80=80/TCP[10.0.0.1:8080 10.0.0.2:8080]", "default/web:p81=81/TCP[]"))
			},
			want: [][]string{
				{"E", `"Manifest problem"`, `err="` + db + `: document 1 (line 1): Service default/db: spec.ports[0].port: 70000 is out of range 1-65535"`},
				{"I", `"Manifests reloaded"`, "ports=3", `added=""`, `removed=""`, `changed=""`, "problems=1"},
			},
		},
		{
			name: "another change while the problem stays: not logged again",
			change: func() {
				replaceFile(t, web, svcYAML("web", "10.96.0.10", 80)+"---\n"+sliceYAML("web-1", "web", 80, "10.0.0.1", "10.0.0.2"))
			},
			await: func(w *watch) {
				w.await("the port removed", hasPortsAndError("70000", "default/db:p5432=5432/TCP[]", "default/web:p80=80/TCP[10.0.0.1:8080 10.0.0.2:8080]"))
			},
			want: [][]string{{"I", `"Manifests reloaded"`, "ports=2", `removed="default/web:p81"`, "problems=1"}},
		},
		{
			name:   "the problem fixed",
			change: func() { replaceFile(t, db, svcYAML("db", "10.96.0.11", 5433)) },
			await: func(w *watch) {
				w.await("the fix", hasPorts("default/db:p5433=5433/TCP[]", "default/web:p80=80/TCP[10.0.0.1:8080 10.0.0.2:8080]"))
			},
			want: [][]string{
				{"I", `"Manifest problem fixed"`, `was="` + db + `: document 1 (line 1): Service default/db: spec.ports[0].port: 70000 is out of range 1-65535"`},
				{"I", `"Manifests reloaded"`, `added="default/db:p5433"`, `removed="default/db:p5432"`, "problems=0"},
			},
		},
		{
			name: "a file deleted",
			change: func() {
				if err := os.Remove(db); err != nil {
					t.Fatal(err)
				}
			},
			await: func(w *watch) { w.await("db gone", hasPorts("default/web:p80=80/TCP[10.0.0.1:8080 10.0.0.2:8080]")) },
			want: [][]string{
				{"I", `"Manifest file deleted; its objects are gone"`, `file="` + db + `"`},
				{"I", `"Manifests reloaded"`, "services=1", `removed="default/db:p5433"`, "problems=0"},
			},
		},
		{
			name:   "a file with a problem",
			change: func() { replaceFile(t, db, svcYAML("db", "10.96.0.11", 70000)) },
			await: func(w *watch) {
				w.await("its problem", hasPortsAndError("70000", "default/web:p80=80/TCP[10.0.0.1:8080 10.0.0.2:8080]"))
			},
			want: [][]string{{"E", `"Manifest problem"`, "70000"}, {"I", `"Manifests reloaded"`, "problems=1"}},
		},
		{
			name: "that file deleted: its problem goes with it, not fixed",
			change: func() {
				if err := os.Remove(db); err != nil {
					t.Fatal(err)
				}
			},
			await: func(w *watch) {
				w.await("no problem", func(s *service.Snapshot) bool { return len(s.Errors) == 0 })
			},
			want: [][]string{
				{"I", `"Manifest file deleted; its objects are gone"`, `file="` + db + `"`},
				{"I", `"Manifest problem gone with its file"`, `was="` + db + `: document 1 (line 1): Service default/db: spec.ports[0].port: 70000 is out of range 1-65535"`},
				{"I", `"Manifests reloaded"`, "problems=0"},
			},
		},
	}
	for _, st := range steps {
		if st.change != nil {
			st.change()
		}
		st.await(w)
		logs.Check(t, st.name, log.Since(), st.want)
	}
}

// TestRunLogsDeletedFile: the file that Path names, deleted, is reported as
// deleted (its Services stay), and its return as the problem fixed.
func TestRunLogsDeletedFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "web.yaml")
	writeFile(t, path, svcYAML("web", "10.96.0.10", 80))
	log := logs.Capture(t)
	w := startWatch(t, path)
	w.await("the first load", hasPorts("default/web:p80=80/TCP[]"))
	log.Since()

	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	w.await("the deletion", hasPortsAndError(path+": deleted; its last content is used until it is back", "default/web:p80=80/TCP[]"))
	logs.Check(t, "deleted", log.Since(), [][]string{
		{"I", `"Manifest file deleted; its last content is used until it is back"`, `file="` + path + `"`},
		{"I", `"Manifests reloaded"`, `changed=""`, "problems=1"},
	})

	replaceFile(t, path, svcYAML("web", "10.96.0.10", 80))
	w.await("the file back", func(s *service.Snapshot) bool { return len(s.Errors) == 0 })
	logs.Check(t, "back", log.Since(), [][]string{
		{"I", `"Manifest problem fixed"`, `was="` + path + `: deleted; its last content is used until it is back"`},
		{"I", `"Manifests reloaded"`, "problems=0"},
	})
}

// replaceFile writes path at once, as deploy tools do (a temporary file renamed
// over it), so that no reload sees it half written.
func replaceFile(t *testing.T, path, data string) {
	t.Helper()
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".tmp")
	writeFile(t, tmp, data)
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}
