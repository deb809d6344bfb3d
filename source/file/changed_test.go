package file

import (
	"path/filepath"
	"testing"

	"github.com/uproxy/uproxy/test/testbed/logs"
)

// TestRunLogsChangedProblem: a problem that replaces another of the same object
// is logged once as changed, naming the one it replaces; a problem of another
// object beside it is new, and the one it replaced is not logged as fixed.
func TestRunLogsChangedProblem(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "svcs.yaml")
	writeFile(t, path, svcYAML("db", "10.96.0.11", 70000)+"---\n"+svcYAML("web", "10.96.0.10", 80))
	log := logs.Capture(t)
	w := startWatch(t, dir)
	w.await("the first load", hasPortsAndError("70000", "default/web:p80=80/TCP[]"))
	log.Since()

	replaceFile(t, path, svcYAML("db", "10.96.0.11", 70001)+"---\n"+svcYAML("web", "10.96.0.10", 0))
	w.await("the new problems", hasPortsAndError("70001", "default/web:p80=80/TCP[]"))
	logs.Check(t, "one problem replaced, one new", log.Since(), [][]string{
		{"E", `"Manifest problem changed"`, `err="` + path + `: document 1 (line 1): Service default/db: spec.ports[0].port: 70001 is out of range 1-65535"`,
			`was="` + path + `: document 1 (line 1): Service default/db: spec.ports[0].port: 70000 is out of range 1-65535"`},
		{"E", `"Manifest problem"`, `err="` + path + `: document 2 (line 11): Service default/web: spec.ports[0].port: 0 is out of range`},
		{"I", `"Manifests reloaded"`, "problems=2"},
	})
}
