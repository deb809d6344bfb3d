package testbed

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// recordingTB stands in for a test inside need, recording whether it was
// skipped or failed; both end the goroutine as the real ones do.
type recordingTB struct {
	testing.TB
	outcome string
}

func (r *recordingTB) Helper() {}
func (r *recordingTB) Fatal(args ...any) {
	r.outcome = "fatal: " + fmt.Sprint(args...)
	runtime.Goexit()
}
func (r *recordingTB) Skip(args ...any) {
	r.outcome = "skip: " + fmt.Sprint(args...)
	runtime.Goexit()
}

// Needs runs a test whose needs are met, skips it with the reason where one is
// not, fails it instead under CI=true, and under -short skips it for a need of
// the upper tiers even where that need is met.
func TestNeeds(t *testing.T) {
	complete := t.TempDir()
	for _, name := range []string{"etcd", "kube-apiserver"} {
		if err := os.WriteFile(filepath.Join(complete, name), []byte("#!/bin/sh\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	partial := t.TempDir()
	if err := os.WriteFile(filepath.Join(partial, "etcd"), []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	absent := t.TempDir()

	tests := []struct {
		name    string
		binDir  string
		ci      string
		short   bool
		needs   []Need
		outcome string // prefix of the outcome; "" means need returned and the test runs
		says    string // in the outcome's message
	}{
		{name: "binaries present", binDir: complete, ci: "true", needs: []Need{APIServer}},
		{name: "binaries absent on a workstation", binDir: absent, needs: []Need{APIServer}, outcome: "skip: ", says: "make kube-bins"},
		{name: "binaries absent in CI", binDir: absent, ci: "true", needs: []Need{APIServer}, outcome: "fatal: ", says: "make kube-bins"},
		{name: "binaries partial in CI", binDir: partial, ci: "true", needs: []Need{APIServer}, outcome: "fatal: ", says: "kube-apiserver"},
		{name: "binaries present under -short", binDir: complete, short: true, needs: []Need{APIServer}, outcome: "skip: ", says: "-short"},
		{name: "-short skips even in CI", binDir: complete, ci: "true", short: true, needs: []Need{APIServer}, outcome: "skip: ", says: "-short"},
		{name: "-short before any check", binDir: absent, ci: "true", short: true, needs: []Need{Commands("sh"), APIServer}, outcome: "skip: ", says: "-short"},
		{name: "a command present under -short", short: true, ci: "true", needs: []Need{Commands("sh")}},
		{name: "a command absent on a workstation", needs: []Need{Commands("uproxy-no-such-command")}, outcome: "skip: ", says: "uproxy-no-such-command"},
		{name: "a command absent in CI", ci: "true", needs: []Need{Commands("uproxy-no-such-command")}, outcome: "fatal: ", says: "uproxy-no-such-command"},
		{name: "a kernel need under -short", short: true, ci: "true", needs: []Need{Netns}, outcome: "skip: ", says: "network namespaces"},
		{name: "a browser under -short", short: true, ci: "true", needs: []Need{Browser}, outcome: "skip: ", says: "-short: this test needs a browser"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv(KubeBinEnv, tc.binDir)
			t.Setenv("CI", tc.ci)
			rec := &recordingTB{TB: t}
			done := make(chan struct{})
			go func() {
				defer close(done)
				need(rec, tc.short, tc.needs)
			}()
			<-done
			if !strings.HasPrefix(rec.outcome, tc.outcome) || (tc.outcome == "") != (rec.outcome == "") {
				t.Fatalf("outcome: got %q, want prefix %q", rec.outcome, tc.outcome)
			}
			if !strings.Contains(rec.outcome, tc.says) {
				t.Errorf("message %q does not say %q", rec.outcome, tc.says)
			}
		})
	}
}

func TestKubeBin(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "kube-proxy"), []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv(KubeBinEnv, dir)
	if got := KubeBin(t, "kube-proxy"); got != dir {
		t.Errorf("KubeBin: got %q, want %q", got, dir)
	}
}
