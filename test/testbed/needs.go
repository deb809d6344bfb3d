package testbed

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/measure/topology"
)

// KubeBinEnv names the environment variable that points at the directory
// holding etcd, kube-apiserver and the other binaries of `make kube-bins` and
// `make cluster-bins`. Unset, bin/ at the root of the repository is used, where
// the Makefile puts them.
const KubeBinEnv = "UPROXY_KUBE_BIN"

// A Need is something of the machine a test cannot run without: root, network
// namespaces, a command, the binaries of a cluster. Needs ends the test when
// one is not met.
type Need struct {
	name string
	// short is true for the needs of the tiers above the unit tests: a test
	// with one of them is skipped under -short even where it could run.
	short bool
	// met reports why the need is not met here, nil when it is.
	met func() error
}

func (n Need) String() string { return n.name }

// The needs of the tiers above the unit tests. IPTables and NFTables include
// Netns, which includes Root.
var (
	// Root is the superuser, for CAP_NET_ADMIN: the socket options that need
	// it (IP_TRANSPARENT, TCP_REPAIR, SO_MARK).
	Root = Need{name: "root", short: true, met: rootMet}
	// Netns is root and a working `ip netns`: what New needs to build a
	// topology.
	Netns = Need{name: "network namespaces", short: true, met: topology.Available}
	// IPTables is Netns and the iptables-restore and -save commands of both
	// families.
	IPTables = Need{name: "iptables", short: true, met: func() error {
		return all(topology.Available, commands("iptables-restore", "ip6tables-restore", "iptables-save", "ip6tables-save"))
	}}
	// NFTables is Netns and the nft command (`make deps` installs it).
	NFTables = Need{name: "nftables", short: true, met: func() error {
		return all(topology.Available, commands("nft"))
	}}
	// APIServer is the etcd and kube-apiserver binaries of `make kube-bins`:
	// what kubeapi.Start runs.
	APIServer = KubeBinaries("etcd", "kube-apiserver")
	// Build is the go command, for a test that builds uproxy and runs it as
	// a process: seconds of compiling even with a warm cache, so not a unit test.
	Build = Need{name: "a build of uproxy", short: true, met: commands("go")}
	// Browser is a headless Chromium (BrowserPath), for a test of a page as a
	// browser renders it: seconds of a browser's start, so not a unit test
	// (`make deps` installs the Debian package chromium).
	Browser = Need{name: "a browser", short: true, met: func() error {
		_, err := browserPath()
		return err
	}}
)

// browsers are the names a headless-capable Chromium goes by.
var browsers = []string{"chromium", "chromium-browser", "google-chrome"}

// BrowserPath returns the path of the browser Browser needs, or ends the test
// as Needs does.
func BrowserPath(t testing.TB) string {
	t.Helper()
	Needs(t, Browser)
	p, err := browserPath()
	if err != nil { // gone since Needs looked
		t.Fatal(err)
	}
	return p
}

func browserPath() (string, error) {
	for _, name := range browsers {
		if p, err := exec.LookPath(name); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("none of %s in PATH", strings.Join(browsers, ", "))
}

// KubeBinaries is the named binaries of `make kube-bins` or `make
// cluster-bins`, in $UPROXY_KUBE_BIN (KubeBinEnv) or bin/ at the repository's
// root.
func KubeBinaries(names ...string) Need {
	return Need{name: strings.Join(names, ", "), short: true, met: func() error {
		_, err := kubeBinDir(names)
		return err
	}}
}

// Commands is the named programs in PATH. It is no tier of its own: a unit
// test may need one too.
func Commands(names ...string) Need {
	return Need{name: strings.Join(names, ", "), met: commands(names...)}
}

// Needs ends the test unless every need is met. Under -short a test with a
// need of the upper tiers (every Need above but Commands) is skipped: -short
// asks for the unit tests alone. Otherwise an unmet need skips the test with
// the reason, or fails it when CI=true: CI never passes by skipping.
func Needs(t testing.TB, needs ...Need) {
	t.Helper()
	need(t, testing.Short(), needs)
}

func need(t testing.TB, short bool, needs []Need) {
	t.Helper()
	for _, n := range needs {
		if short && n.short {
			t.Skip("-short: this test needs " + n.name)
		}
	}
	for _, n := range needs {
		if err := n.met(); err != nil {
			Skip(t, fmt.Sprintf("this test needs %s: %v", n.name, err))
		}
	}
}

// KubeBin returns the directory holding the named binaries (see KubeBinaries),
// or ends the test as Needs does.
func KubeBin(t testing.TB, names ...string) string {
	t.Helper()
	Needs(t, KubeBinaries(names...))
	dir, err := kubeBinDir(names)
	if err != nil { // gone since Needs looked
		t.Fatal(err)
	}
	return dir
}

func kubeBinDir(names []string) (string, error) {
	dir := os.Getenv(KubeBinEnv)
	if dir == "" {
		root, err := repoRoot()
		if err != nil {
			return "", fmt.Errorf("%s is unset and %v", KubeBinEnv, err)
		}
		dir = filepath.Join(root, "bin")
	}
	var absent []string
	for _, name := range names {
		info, err := os.Stat(filepath.Join(dir, name))
		if err != nil || info.IsDir() || info.Mode()&0o111 == 0 {
			absent = append(absent, name)
		}
	}
	if len(absent) > 0 {
		return "", fmt.Errorf("no executable %s in %s: run `make kube-bins` (or `make cluster-bins`) to build them, or point %s at them",
			strings.Join(absent, " or "), dir, KubeBinEnv)
	}
	return dir, nil
}

// repoRoot finds the root of this repository above the working directory,
// which `go test` sets to the directory of the package under test.
func repoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("working directory: %w", err)
	}
	for {
		if data, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil && declaresModule(data, "github.com/uproxy/uproxy") {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod of module github.com/uproxy/uproxy above the working directory")
		}
		dir = parent
	}
}

func declaresModule(gomod []byte, path string) bool {
	for _, line := range strings.Split(string(gomod), "\n") {
		if fields := strings.Fields(line); len(fields) == 2 && fields[0] == "module" {
			return strings.Trim(fields[1], `"`) == path
		}
	}
	return false
}

func rootMet() error {
	if os.Geteuid() != 0 {
		return errors.New("not running as root")
	}
	return nil
}

func commands(names ...string) func() error {
	return func() error {
		for _, c := range names {
			if _, err := exec.LookPath(c); err != nil {
				return err
			}
		}
		return nil
	}
}

func all(checks ...func() error) error {
	for _, c := range checks {
		if err := c(); err != nil {
			return err
		}
	}
	return nil
}
