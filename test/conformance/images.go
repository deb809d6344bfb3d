package conformance

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// The images every node holds, under the names upstream's suite asks for
// (test/utils/image/manifest.go of the pinned release) and those of the
// cluster's own pods. No registry is reachable: kubelet must find each one
// already imported, so a name missing here is a pod stuck in ErrImagePull.
const (
	PauseImage       = "registry.k8s.io/pause:3.10.2"
	agnhostImage     = "registry.k8s.io/e2e-test-images/agnhost:2.63.0"
	busyboxImage     = "registry.k8s.io/e2e-test-images/busybox:1.37.0-1"
	nginxImage       = "registry.k8s.io/e2e-test-images/nginx:1.15-4"
	iptablesImage    = "registry.k8s.io/build-image/distroless-iptables:v0.9.6"
	regressionImage  = "registry.k8s.io/e2e-test-images/regression-issue-74839:1.4"
	dnsTestingImage  = "registry.k8s.io/e2e-test-images/glibc-dns-testing:2.0.0"
	CoreDNSImage     = "registry.k8s.io/coredns/coredns:v1.15.0"
	DefaultUProxyTag = "ghcr.io/uproxy/uproxy:conformance"
	// NextUProxyTag is the same uproxy under another name and image ID: the
	// new image of the rolling update (RollOutUnderLoad).
	NextUProxyTag = "ghcr.io/uproxy/uproxy:conformance-next"
)

// debianSuite is the release of the Dockerfile's runtime stage (debian:bookworm-slim),
// and of every test image's root filesystem.
const debianSuite = "bookworm"

// toolPackages are what upstream's test images carry and the tests run inside them:
// sh (dash, already in the base), nc -v, curl, wget, dig, ip, iptables, nft,
// conntrack, ps, bash. getent comes with libc-bin in the base.
var toolPackages = []string{
	"netcat-openbsd", "curl", "wget", "bind9-dnsutils", "iproute2", "iptables",
	"nftables", "conntrack", "procps", "bash",
}

// ImageSet is what BuildImages needs: the directory of the Kubernetes binaries, the
// uproxy binary for the runtime image, the Dockerfile it follows, and a cache
// directory for the Debian root filesystems (they take a minute or two to make).
type ImageSet struct {
	BinDir     string // agnhost, coredns, regression-issue-74839
	Pause      string // the sandbox's pause binary (test/conformance/pause)
	UProxy     string // a static uproxy binary
	UProxyTag  string // the name deploy/uproxy.yaml's image is replaced with
	Dockerfile string // deploy/Dockerfile
	RepoRoot   string // the Dockerfile's build context
	CacheDir   string
	WorkDir    string
	Logf       func(format string, args ...any)
}

// BuildImages writes one docker-archive holding every image and returns its path.
// Layers are shared: the test tools' root filesystem is one layer under agnhost,
// busybox, nginx, distroless-iptables and coredns alike.
func (s ImageSet) BuildImages() (string, error) {
	base, err := s.debianBase()
	if err != nil {
		return "", err
	}
	tools, err := s.derivedRootfs(base, "tools", strings.Join(toolPackages, " "), func(dir string) error {
		return chrootRun(dir, "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "+
			strings.Join(toolPackages, " ")+" && rm -rf /var/lib/apt/lists/*")
	})
	if err != nil {
		return "", err
	}
	dockerfile, err := os.ReadFile(s.Dockerfile)
	if err != nil {
		return "", err
	}
	runtime, err := s.derivedRootfs(base, "uproxy-runtime", string(dockerfile), s.runtimeStage)
	if err != nil {
		return "", err
	}

	layer := func(dir string) (v1.Layer, error) { return dirLayer(dir, s.WorkDir) }
	toolsLayer, err := layer(tools)
	if err != nil {
		return "", err
	}
	runtimeLayer, err := layer(runtime)
	if err != nil {
		return "", err
	}
	binLayer := func(files map[string]string) (v1.Layer, error) {
		dir, err := os.MkdirTemp(s.WorkDir, "layer-")
		if err != nil {
			return nil, err
		}
		for dst, src := range files {
			if err := copyFile(src, filepath.Join(dir, dst), 0o755); err != nil {
				return nil, err
			}
		}
		return layer(dir)
	}
	agnhost, err := binLayer(map[string]string{"agnhost": filepath.Join(s.BinDir, "agnhost"), "agnhost-2": filepath.Join(s.BinDir, "agnhost")})
	if err != nil {
		return "", err
	}
	pause, err := binLayer(map[string]string{"pause": s.Pause})
	if err != nil {
		return "", err
	}
	coredns, err := binLayer(map[string]string{"coredns": filepath.Join(s.BinDir, "coredns")})
	if err != nil {
		return "", err
	}
	regression, err := binLayer(map[string]string{"regression-issue-74839": filepath.Join(s.BinDir, "regression-issue-74839")})
	if err != nil {
		return "", err
	}
	uproxyLayer, err := binLayer(map[string]string{"usr/local/bin/uproxy": s.UProxy})
	if err != nil {
		return "", err
	}

	images := map[string]struct {
		layers     []v1.Layer
		entrypoint []string
		cmd        []string
	}{
		PauseImage:      {[]v1.Layer{pause}, []string{"/pause"}, nil},
		agnhostImage:    {[]v1.Layer{toolsLayer, agnhost}, []string{"/agnhost"}, []string{"pause"}},
		busyboxImage:    {[]v1.Layer{toolsLayer}, nil, []string{"sh"}},
		nginxImage:      {[]v1.Layer{toolsLayer, agnhost}, []string{"/agnhost"}, []string{"netexec", "--http-port=80"}},
		iptablesImage:   {[]v1.Layer{toolsLayer}, nil, []string{"sh"}},
		dnsTestingImage: {[]v1.Layer{toolsLayer}, nil, []string{"sh"}},
		regressionImage: {[]v1.Layer{toolsLayer, regression}, []string{"/regression-issue-74839"}, nil},
		CoreDNSImage:    {[]v1.Layer{toolsLayer, coredns}, []string{"/coredns"}, nil},
		s.UProxyTag:     {[]v1.Layer{runtimeLayer, uproxyLayer}, []string{"/usr/local/bin/uproxy"}, nil},
		NextUProxyTag:   {[]v1.Layer{runtimeLayer, uproxyLayer}, []string{"/usr/local/bin/uproxy"}, []string{"--v=0"}},
	}
	refs := map[name.Reference]v1.Image{}
	for ref, spec := range images {
		img, err := mutate.AppendLayers(empty.Image, spec.layers...)
		if err != nil {
			return "", err
		}
		rootfs, err := diffIDs(spec.layers)
		if err != nil {
			return "", err
		}
		img, err = mutate.ConfigFile(img, &v1.ConfigFile{
			OS: "linux", Architecture: "amd64",
			Config: v1.Config{
				Entrypoint: spec.entrypoint,
				Cmd:        spec.cmd,
				Env:        []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
			},
			RootFS: rootfs,
		})
		if err != nil {
			return "", err
		}
		tag, err := name.NewTag(ref)
		if err != nil {
			return "", fmt.Errorf("image name %q: %w", ref, err)
		}
		refs[tag] = img
	}
	out := filepath.Join(s.WorkDir, "images.tar")
	s.Logf("writing %d images to %s", len(refs), out)
	if err := tarball.MultiRefWriteToFile(out, refs); err != nil {
		return "", fmt.Errorf("write %s: %w", out, err)
	}
	return out, nil
}

// diffIDs lists the layers' uncompressed digests, as an image config must.
func diffIDs(layers []v1.Layer) (v1.RootFS, error) {
	fs := v1.RootFS{Type: "layers"}
	for _, l := range layers {
		d, err := l.DiffID()
		if err != nil {
			return fs, err
		}
		fs.DiffIDs = append(fs.DiffIDs, d)
	}
	return fs, nil
}

// dirLayer makes an uncompressed layer of a directory's tree, numeric owners kept,
// as a tar file in work (the layer reads it again for every digest and copy).
func dirLayer(dir, work string) (v1.Layer, error) {
	f, err := os.CreateTemp(work, "layer-*.tar")
	if err != nil {
		return nil, err
	}
	f.Close()
	if out, err := exec.Command("tar", "--numeric-owner", "--xattrs", "-C", dir, "-cf", f.Name(), ".").CombinedOutput(); err != nil {
		return nil, fmt.Errorf("tar %s: %w: %s", dir, err, out)
	}
	return tarball.LayerFromFile(f.Name(), tarball.WithCompressedCaching)
}

// debianBase is debootstrap's minbase of debianSuite, made once per cache: what
// debian:bookworm-slim is, from Debian's own packages.
func (s ImageSet) debianBase() (string, error) {
	dir := filepath.Join(s.CacheDir, debianSuite+"-minbase")
	if _, err := os.Stat(filepath.Join(dir, ".complete")); err == nil {
		return dir, nil
	}
	if _, err := exec.LookPath("debootstrap"); err != nil {
		return "", fmt.Errorf("debootstrap is needed to make the images' Debian root filesystem (make deps installs it): %w", err)
	}
	os.RemoveAll(dir)
	s.Logf("debootstrap %s into %s", debianSuite, dir)
	cmd := exec.Command("debootstrap", "--variant=minbase", debianSuite, dir, "http://deb.debian.org/debian")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("debootstrap: %w: %s", err, tail(out, 20))
	}
	return dir, os.WriteFile(filepath.Join(dir, ".complete"), nil, 0o644)
}

// derivedRootfs copies base and runs build in the copy, once per cache and
// recipe: the directory is kept under a name made from the label and a hash of
// recipe, the text that decides what build does.
func (s ImageSet) derivedRootfs(base, label, recipe string, build func(dir string) error) (string, error) {
	key := label + "-" + hash(recipe)
	dir := filepath.Join(s.CacheDir, key)
	if _, err := os.Stat(filepath.Join(dir, ".complete")); err == nil {
		return dir, nil
	}
	os.RemoveAll(dir)
	s.Logf("making root filesystem %s", dir)
	if out, err := exec.Command("cp", "-a", base, dir).CombinedOutput(); err != nil {
		return "", fmt.Errorf("copy %s: %w: %s", base, err, out)
	}
	os.Remove(filepath.Join(dir, ".complete"))
	if err := build(dir); err != nil {
		return "", fmt.Errorf("root filesystem %s: %w", label, err)
	}
	return dir, os.WriteFile(filepath.Join(dir, ".complete"), nil, 0o644)
}

// runtimeStage does in dir what the Dockerfile's last stage does: its RUN lines run
// in a chroot as written, its COPY lines copy from the build context, and a COPY
// --from another stage is the binary that stage builds, which BuildImages adds as
// a layer of its own (an empty file holds its place here). Reading the stage
// rather than repeating it is what keeps the image the cluster runs and the one
// `docker build` makes the same; an instruction this reading does not know fails
// the build instead of being skipped.
func (s ImageSet) runtimeStage(dir string) error {
	steps, err := lastStage(s.Dockerfile)
	if err != nil {
		return err
	}
	for _, st := range steps {
		switch st.op {
		case "FROM":
			if !strings.HasPrefix(st.args, "debian:"+debianSuite) {
				return fmt.Errorf("%s: the runtime stage is FROM %s; only debian:%s is made here", s.Dockerfile, st.args, debianSuite)
			}
		case "RUN":
			if err := chrootRun(dir, st.args); err != nil {
				return fmt.Errorf("%s: RUN %s: %w", s.Dockerfile, st.args, err)
			}
		case "COPY":
			fields := strings.Fields(st.args)
			if len(fields) == 3 && strings.HasPrefix(fields[0], "--from=") {
				// The binary is added as a layer of its own, over this one; an
				// empty file holds its place so that the RUN lines after it can
				// name it (update-alternatives checks that its target exists).
				dst := filepath.Join(dir, fields[2])
				if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
					return err
				}
				if err := os.WriteFile(dst, nil, 0o755); err != nil {
					return err
				}
				continue
			}
			if len(fields) != 2 {
				return fmt.Errorf("%s: COPY %s: only COPY SRC DST is read", s.Dockerfile, st.args)
			}
			src, dst := filepath.Join(s.RepoRoot, fields[0]), filepath.Join(dir, fields[1])
			info, err := os.Stat(src)
			if err != nil {
				return err
			}
			if err := copyFile(src, dst, info.Mode().Perm()); err != nil {
				return err
			}
		case "ENTRYPOINT", "ENV", "ARG", "LABEL", "WORKDIR", "CMD":
			// The image config BuildImages writes has the entrypoint; no other is used.
		default:
			return fmt.Errorf("%s: %s in the runtime stage is not read here", s.Dockerfile, st.op)
		}
	}
	return nil
}

type dockerStep struct{ op, args string }

// lastStage reads a Dockerfile's last stage: its instructions with continuation
// lines joined and comments dropped.
func lastStage(path string) ([]dockerStep, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var steps []dockerStep
	var cur strings.Builder
	flush := func() {
		line := strings.TrimSpace(cur.String())
		cur.Reset()
		if line == "" {
			return
		}
		op, args, _ := strings.Cut(line, " ")
		op = strings.ToUpper(op)
		if op == "FROM" {
			steps = nil
		}
		steps = append(steps, dockerStep{op, strings.TrimSpace(args)})
	}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(strings.TrimSpace(line), "#") {
			continue
		}
		if strings.HasSuffix(line, "\\") {
			cur.WriteString(strings.TrimSuffix(line, "\\") + " ")
			continue
		}
		cur.WriteString(line)
		flush()
	}
	flush()
	return steps, sc.Err()
}

// chrootRun runs a shell command in a root filesystem with its own /proc and the
// host's resolver, as a build step would run in a container. apt-get reaches
// only Debian's mirror.
func chrootRun(dir, script string) error {
	if err := copyFile("/etc/resolv.conf", filepath.Join(dir, "etc/resolv.conf"), 0o644); err != nil {
		return err
	}
	wrapped := "mount -t proc proc " + dir + "/proc && chroot " + dir + " /bin/sh -c " + shellQuote(script) + "; rc=$?; umount " + dir + "/proc; exit $rc"
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sh", "-c", wrapped)
	cmd.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C"}
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%w: %s", err, tail(out, 20))
	}
	return nil
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

func copyFile(src, dst string, mode os.FileMode) error {
	data, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	os.Remove(dst)
	return os.WriteFile(dst, data, mode)
}

func hash(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:6])
}

// tail returns the last n lines of out.
func tail(out []byte, n int) string {
	lines := strings.Split(strings.TrimRight(string(out), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// importImages loads the archive into a node's containerd, in the namespace CRI uses.
func importImages(ctrSocket, archive string) error {
	out, err := exec.Command("ctr", "--address", ctrSocket, "--namespace", "k8s.io", "images", "import", archive).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ctr images import: %w: %s", err, tail(out, 10))
	}
	return nil
}
