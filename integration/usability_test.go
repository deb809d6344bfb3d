package integration

import (
	"debug/elf"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/testbed"
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
	if testing.Short() {
		testbed.Skip(t, "-short: this test runs make build")
	}
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
