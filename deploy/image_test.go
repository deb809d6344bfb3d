// Package deploy checks the image and manifests of this directory without
// docker: the Dockerfile through BuildKit's own parser and linter, the build
// context through Docker's .dockerignore matcher, and the iptables wrapper for
// real in network namespaces.
package deploy

import (
	"bytes"
	"encoding/json"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/linter"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
	"github.com/moby/patternmatcher"
	"github.com/moby/patternmatcher/ignorefile"
	appsv1 "k8s.io/api/apps/v1"
	v1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// root is the build context: the repository root.
const root = ".."

// stages parses deploy/Dockerfile with BuildKit and fails the test on any
// parse error or lint warning.
func stages(t *testing.T) []instructions.Stage {
	t.Helper()
	data, err := os.ReadFile("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	ast, err := parser.Parse(bytes.NewReader(data))
	if err != nil {
		t.Fatalf("Dockerfile: %v", err)
	}
	for _, w := range ast.Warnings {
		t.Errorf("Dockerfile: parser warning: %s", w.Short)
	}
	lint := linter.New(&linter.Config{Warn: func(rule, desc, url, msg string, loc []parser.Range) {
		t.Errorf("Dockerfile: lint %s (%s): %s at %v", rule, url, msg, loc)
	}})
	st, _, err := instructions.Parse(ast.AST, lint)
	if err != nil {
		t.Fatalf("Dockerfile: %v", err)
	}
	return st
}

func TestDockerfileStages(t *testing.T) {
	st := stages(t)
	if len(st) != 2 {
		t.Fatalf("got %d stages, want 2 (build, runtime)", len(st))
	}
	build, runtime := st[0], st[1]

	gomod, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	// The toolchain line, when there is one, names the Go that builds.
	var want string
	for _, line := range strings.Split(string(gomod), "\n") {
		switch f := strings.Fields(line); {
		case len(f) == 2 && f[0] == "go" && want == "":
			want = f[1]
		case len(f) == 2 && f[0] == "toolchain":
			want = strings.TrimPrefix(f[1], "go")
		}
	}
	if want == "" {
		t.Fatal("go.mod has no go line")
	}
	image, tag, _ := strings.Cut(build.BaseName, ":")
	if image != "golang" || (tag != want && !strings.HasPrefix(tag, want+"-")) {
		t.Errorf("build stage FROM %s: want golang:%s[-VARIANT], go.mod's Go", build.BaseName, want)
	}
	if build.Name != "build" {
		t.Errorf("first stage is named %q, want build", build.Name)
	}
	var env []string
	for _, cmd := range build.Commands {
		if e, ok := cmd.(*instructions.EnvCommand); ok {
			for _, kv := range e.Env {
				env = append(env, kv.Key+"="+kv.Value)
			}
		}
	}
	if !slices.Contains(env, "GOTOOLCHAIN=local") || !slices.Contains(env, "CGO_ENABLED=0") {
		t.Errorf("build stage ENV %q: want GOTOOLCHAIN=local (no other toolchain fetched) and CGO_ENABLED=0 (a static binary)", env)
	}

	if !strings.HasPrefix(runtime.BaseName, "debian:") {
		t.Errorf("runtime stage FROM %s: want a Debian image (its iptables package has both backends and update-alternatives)", runtime.BaseName)
	}
	var packages []string
	aptInstall := regexp.MustCompile(`apt-get install ([^&]*)`)
	for _, cmd := range runtime.Commands {
		switch c := cmd.(type) {
		case *instructions.RunCommand:
			for _, m := range aptInstall.FindAllStringSubmatch(strings.Join(c.CmdLine, " "), -1) {
				for _, f := range strings.Fields(m[1]) {
					if !strings.HasPrefix(f, "-") {
						packages = append(packages, f)
					}
				}
			}
		case *instructions.CopyCommand:
			if c.From != "" && c.From != build.Name {
				t.Errorf("COPY --from=%s: no such stage", c.From)
			}
		}
	}
	// The binary runs iptables, ip6tables and their -save and -restore, and nft;
	// nothing else (conntrack entries go over netlink).
	if want := []string{"iptables", "nftables"}; !slices.Equal(packages, want) {
		t.Errorf("runtime packages %q, want exactly %q", packages, want)
	}
}

// ignored loads .dockerignore as docker does.
func ignored(t *testing.T) *patternmatcher.PatternMatcher {
	t.Helper()
	f, err := os.Open(filepath.Join(root, ".dockerignore"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	patterns, err := ignorefile.ReadAll(f)
	if err != nil {
		t.Fatal(err)
	}
	pm, err := patternmatcher.New(patterns)
	if err != nil {
		t.Fatal(err)
	}
	return pm
}

// Every COPY source is in the build context; what the build needs is not
// ignored, and bin/ (the test binaries) and .git are.
func TestBuildContext(t *testing.T) {
	pm := ignored(t)
	excluded := func(path string) bool {
		t.Helper()
		ok, err := pm.MatchesOrParentMatches(filepath.ToSlash(path))
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	for _, st := range stages(t) {
		for _, cmd := range st.Commands {
			c, ok := cmd.(*instructions.CopyCommand)
			if !ok || c.From != "" {
				continue
			}
			for _, src := range c.SourcePaths {
				if src == "." {
					continue
				}
				if _, err := os.Stat(filepath.Join(root, src)); err != nil {
					t.Errorf("COPY %s: %v", src, err)
				}
				if excluded(src) {
					t.Errorf("COPY %s: excluded by .dockerignore", src)
				}
			}
		}
	}

	for _, p := range []string{"bin/kube-apiserver", "bin/etcd", "bin/kube-proxy", ".git/HEAD", "tools/kube-apiserver/go.mod", "uproxy"} {
		if !excluded(p) {
			t.Errorf("%s is in the build context; want it excluded by .dockerignore", p)
		}
	}
	// Every file of every package the binary is built from, embedded files too.
	cmd := exec.Command("go", "list", "-deps", "-json=Dir,Module,GoFiles,EmbedFiles", ".")
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	abs, err := filepath.Abs(root)
	if err != nil {
		t.Fatal(err)
	}
	needed := []string{"go.mod", "go.sum"}
	dec := json.NewDecoder(bytes.NewReader(out))
	for dec.More() {
		var pkg struct {
			Dir                 string
			Module              *struct{ Main bool }
			GoFiles, EmbedFiles []string
		}
		if err := dec.Decode(&pkg); err != nil {
			t.Fatal(err)
		}
		if pkg.Module == nil || !pkg.Module.Main {
			continue
		}
		for _, f := range append(pkg.GoFiles, pkg.EmbedFiles...) {
			rel, err := filepath.Rel(abs, filepath.Join(pkg.Dir, f))
			if err != nil {
				t.Fatal(err)
			}
			needed = append(needed, rel)
		}
	}
	if len(needed) < 10 {
		t.Fatalf("go list found only %q", needed)
	}
	for _, p := range needed {
		if excluded(p) {
			t.Errorf("%s is needed by the build but excluded by .dockerignore", p)
		}
	}

	// The context's size, for the record.
	var files, size int64
	filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if rel != "." && excluded(rel) {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		if info, err := d.Info(); err == nil && d.Type().IsRegular() {
			files++
			size += info.Size()
		}
		return nil
	})
	t.Logf("build context: %d files, %d KiB", files, size/1024)
}

// The DaemonSet runs a release's tag, pulled once per node.
func TestDaemonSetImage(t *testing.T) {
	data, err := os.ReadFile("uproxy.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var ds *appsv1.DaemonSet
	for _, doc := range strings.Split(string(data), "\n---\n") {
		var meta struct{ Kind string }
		if err := yaml.Unmarshal([]byte(doc), &meta); err != nil {
			t.Fatal(err)
		}
		if meta.Kind == "DaemonSet" {
			ds = &appsv1.DaemonSet{}
			if err := yaml.UnmarshalStrict([]byte(doc), ds); err != nil {
				t.Fatal(err)
			}
		}
	}
	if ds == nil {
		t.Fatal("uproxy.yaml has no DaemonSet")
	}
	c := ds.Spec.Template.Spec.Containers[0]
	if !regexp.MustCompile(`^ghcr\.io/uproxy/uproxy:v\d+\.\d+\.\d+$`).MatchString(c.Image) {
		t.Errorf("image %s: want ghcr.io/uproxy/uproxy:vX.Y.Z, a release's tag", c.Image)
	}
	if c.ImagePullPolicy != v1.PullIfNotPresent {
		t.Errorf("imagePullPolicy %s: want IfNotPresent (a release's tag never changes)", c.ImagePullPolicy)
	}
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(readme), "-t "+c.Image+" ") {
		t.Errorf("README: no docker build -t %s; the build instructions and the DaemonSet must agree", c.Image)
	}
}
