package app

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
)

// The import rules are the table under "## Import rules" in
// docs/architecture.md: the document and this test are one list. The graph
// checked is the whole module's, listed from moduleRoot.
const architectureDoc = moduleRoot + "/docs/architecture.md"

// importRule is one row of the table: the packages From matches may depend
// (directly or not) on nothing of this module but what Packages match (Only),
// or on nothing Packages match (neither Only nor OnlyBy); or (OnlyBy) no
// package of this module but those Packages match may depend on them.
type importRule struct {
	From     string
	Only     bool
	OnlyBy   bool
	Packages []string
	line     int // in the document, for messages
}

func (r importRule) String() string {
	kind := "not"
	switch {
	case r.Only:
		kind = "only"
	case r.OnlyBy:
		kind = "only by"
	}
	return fmt.Sprintf("%s:%d: %s %s [%s]", architectureDoc, r.line, r.From, kind, strings.Join(r.Packages, ", "))
}

// parseImportRules reads the rules' table: the first table after the heading
// "## Import rules", whose columns are package, rule (only, only by or not), packages
// and why; a cell's packages are in backquotes.
func parseImportRules(doc io.Reader) ([]importRule, error) {
	var rules []importRule
	sc := bufio.NewScanner(doc)
	section, inTable, n := false, false, 0
	for sc.Scan() {
		n++
		line := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(line, "## ") {
			if section && inTable {
				break
			}
			section = line == "## Import rules"
			continue
		}
		if !section {
			continue
		}
		if !strings.HasPrefix(line, "|") {
			if inTable {
				break
			}
			continue
		}
		cells := strings.Split(strings.Trim(line, "|"), "|")
		for i := range cells {
			cells[i] = strings.TrimSpace(cells[i])
		}
		if !inTable {
			// The header row, then its separator.
			if len(cells) < 3 || cells[0] != "package" || cells[1] != "rule" || cells[2] != "packages" {
				return nil, fmt.Errorf("%s:%d: the import rules' header: got %q, want package | rule | packages | why", architectureDoc, n, line)
			}
			inTable = true
			continue
		}
		if strings.HasPrefix(cells[0], "---") {
			continue
		}
		if len(cells) < 3 {
			return nil, fmt.Errorf("%s:%d: an import rule has %d cells, want at least 3", architectureDoc, n, len(cells))
		}
		from := backquoted(cells[0])
		if len(from) != 1 {
			return nil, fmt.Errorf("%s:%d: an import rule's package: got %q, want one `package`", architectureDoc, n, cells[0])
		}
		r := importRule{From: from[0], Packages: backquoted(cells[2]), line: n}
		switch cells[1] {
		case "only":
			r.Only = true
		case "only by":
			r.OnlyBy = true
		case "not":
			if len(r.Packages) == 0 {
				return nil, fmt.Errorf("%s:%d: a rule \"not\" without packages forbids nothing", architectureDoc, n)
			}
		default:
			return nil, fmt.Errorf("%s:%d: rule %q: want only, only by or not", architectureDoc, n, cells[1])
		}
		rules = append(rules, r)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(rules) == 0 {
		return nil, fmt.Errorf("%s: no table of import rules under \"## Import rules\"", architectureDoc)
	}
	return rules, nil
}

// backquoted returns the `quoted` words of s.
func backquoted(s string) []string {
	var out []string
	for {
		_, rest, ok := strings.Cut(s, "`")
		if !ok {
			return out
		}
		word, after, ok := strings.Cut(rest, "`")
		if !ok {
			return out
		}
		out = append(out, word)
		s = after
	}
}

// matches reports whether import path pkg is what pattern names: a path
// relative to module ("." is the module itself), with "/..." for the package
// and everything below it, or a path outside the module (the standard
// library's testing), taken as it is.
func matches(module, pattern, pkg string) bool {
	full := module
	if base, ok := strings.CutSuffix(pattern, "/..."); ok {
		if base != "." {
			full = module + "/" + base
		}
		return pkg == full || strings.HasPrefix(pkg, full+"/") || pkg == base
	}
	if pattern != "." {
		full = module + "/" + pattern
	}
	return pkg == full || pkg == pattern
}

func inModule(module, pkg string) bool { return pkg == module || strings.HasPrefix(pkg, module+"/") }

// importViolations checks the dependency graph deps (each package of the module
// and everything it depends on, as go list -deps reports it) against rules. A
// rule that matches no package, or names a package that is not in the graph,
// is itself a violation: the table would check nothing.
func importViolations(module string, deps map[string][]string, rules []importRule) []string {
	var out []string
	known := map[string]bool{}
	for pkg, ds := range deps {
		known[pkg] = true
		for _, d := range ds {
			known[d] = true
		}
	}
	names := func(pattern string) bool {
		for pkg := range known {
			if matches(module, pattern, pkg) {
				return true
			}
		}
		return false
	}
	for _, r := range rules {
		if !names(r.From) {
			out = append(out, fmt.Sprintf("%v: no package is %s", r, r.From))
		}
		for _, p := range r.Packages {
			if !names(p) {
				out = append(out, fmt.Sprintf("%v: no package is %s", r, p))
			}
		}
		if r.OnlyBy {
			out = append(out, dependents(module, deps, r)...)
			continue
		}
		for _, pkg := range sortedKeys(deps) {
			if !matches(module, r.From, pkg) {
				continue
			}
			for _, d := range deps[pkg] {
				forbidden := false
				if r.Only {
					own := matches(module, r.From, d) || strings.HasPrefix(d, pkg+"/")
					forbidden = inModule(module, d) && !own && !slices.ContainsFunc(r.Packages, func(p string) bool { return matches(module, p, d) })
				} else {
					forbidden = slices.ContainsFunc(r.Packages, func(p string) bool { return matches(module, p, d) })
				}
				if forbidden {
					out = append(out, fmt.Sprintf("%v: %s depends on %s", r, pkg, d))
				}
			}
		}
	}
	return out
}

// dependents checks a rule "only by": a package of the module that depends on
// what r.From matches must be one of r.Packages, or what r.From matches.
func dependents(module string, deps map[string][]string, r importRule) []string {
	var out []string
	for _, pkg := range sortedKeys(deps) {
		if !inModule(module, pkg) || matches(module, r.From, pkg) || slices.ContainsFunc(r.Packages, func(p string) bool { return matches(module, p, pkg) }) {
			continue
		}
		for _, d := range deps[pkg] {
			if matches(module, r.From, d) {
				out = append(out, fmt.Sprintf("%v: %s depends on %s", r, pkg, d))
			}
		}
	}
	return out
}

func sortedKeys(m map[string][]string) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// moduleDeps runs go list -deps over the module: every package of it and
// everything each depends on (test files excluded: a test may import what its
// package may not).
func moduleDeps(t *testing.T) (module string, deps map[string][]string) {
	t.Helper()
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the go command, to list the import graph: %v", err)
	}
	out, err := exec.Command(goTool, "list", "-m").Output()
	if err != nil {
		t.Fatalf("go list -m: %v", err)
	}
	module = strings.TrimSpace(string(out))
	cmd := exec.Command(goTool, "list", "-json=ImportPath,Deps", "./...")
	cmd.Dir = moduleRoot
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if out, err = cmd.Output(); err != nil {
		t.Fatalf("go list -json ./...: %v\n%s", err, stderr.Bytes())
	}
	deps = map[string][]string{}
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p struct {
			ImportPath string
			Deps       []string
		}
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("go list output: %v", err)
		}
		deps[p.ImportPath] = p.Deps
	}
	return module, deps
}

// TestImportRules checks the module's import graph against the table of
// docs/architecture.md.
func TestImportRules(t *testing.T) {
	f, err := os.Open(architectureDoc)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	rules, err := parseImportRules(f)
	if err != nil {
		t.Fatal(err)
	}
	module, deps := moduleDeps(t)
	for _, v := range importViolations(module, deps, rules) {
		t.Error(v)
	}
	t.Logf("%d import rules over %d packages", len(rules), len(deps))
}

// The checker finds an edge a rule forbids, directly or through another
// package, and a rule that names nothing; and it lets pass what the rules allow.
func TestImportViolations(t *testing.T) {
	const m = "example.com/p"
	table := "# x\n\n## Import rules\n\n| package | rule | packages | why |\n|---|---|---|---|\n" +
		"| `observe` | only | `service` | records |\n" +
		"| `kernelmodes/...` | not | `socket/...` | no data path |\n" +
		"| `app/...` | only by | `.` | the program |\n" +
		"| `.` | not | `testing` | no test helper |\n\n## Next\n"
	rules, err := parseImportRules(strings.NewReader(table))
	if err != nil || len(rules) != 4 {
		t.Fatalf("parse: got %d rules, %v; want 4", len(rules), err)
	}
	clean := map[string][]string{
		m:                           {m + "/app", m + "/app/registry", m + "/observe", m + "/service", m + "/kernelmodes/iptables"},
		m + "/app":                  {m + "/app/registry", m + "/observe", m + "/service"},
		m + "/app/registry":         {m + "/service"},
		m + "/observe":              {m + "/service", "net/http"},
		m + "/service":              nil,
		m + "/socket":               {m + "/socket/poll"},
		m + "/socket/poll":          nil,
		m + "/kernelmodes/iptables": {m + "/service"},
		m + "/testbed":              {"testing"},
	}
	if v := importViolations(m, clean, rules); len(v) != 0 {
		t.Errorf("a graph the rules allow: got violations %q", v)
	}
	tests := []struct {
		name string
		pkg  string
		deps []string
		want string
	}{
		{"only: another package of the module", m + "/observe", []string{m + "/service", m + "/socket"}, "observe depends on " + m + "/socket"},
		{"not: a subpackage of the pattern", m + "/kernelmodes/iptables", []string{m + "/service", m + "/socket/poll"}, "kernelmodes/iptables depends on " + m + "/socket/poll"},
		{"not: the standard library", m, []string{m + "/observe", "testing"}, "depends on testing"},
		{"only by: a package it does not list", m + "/socket", []string{m + "/socket/poll", m + "/app/registry"}, "socket depends on " + m + "/app/registry"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := map[string][]string{}
			for k, v := range clean {
				g[k] = v
			}
			g[tt.pkg] = tt.deps
			v := importViolations(m, g, rules)
			if len(v) != 1 || !strings.Contains(v[0], tt.want) {
				t.Errorf("got %q, want one violation containing %q", v, tt.want)
			}
		})
	}
	stale := append(slices.Clone(rules), importRule{From: "gone", Packages: []string{"service"}, line: 99})
	if v := importViolations(m, clean, stale); len(v) != 1 || !strings.Contains(v[0], "no package is gone") {
		t.Errorf("a rule of a package that does not exist: got %q, want it reported", v)
	}
}
