package file

import (
	"flag"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/test/testbed/logs"
)

// Files a manifest directory should not hold, and what the source does with
// them: it never blocks, never reads without bound, and never loses the last
// good state because of them.

func mkfifo(t *testing.T, path string) {
	t.Helper()
	if err := syscall.Mkfifo(path, 0o644); err != nil {
		t.Fatal(err)
	}
}

func symlink(t *testing.T, target, link string) {
	t.Helper()
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
}

func hasError(parts ...string) func(*service.Snapshot) bool {
	return func(s *service.Snapshot) bool {
		return slices.ContainsFunc(errorStrings(s), func(e string) bool {
			for _, p := range parts {
				if !strings.Contains(e, p) {
					return false
				}
			}
			return true
		})
	}
}

func all(conds ...func(*service.Snapshot) bool) func(*service.Snapshot) bool {
	return func(s *service.Snapshot) bool {
		for _, c := range conds {
			if !c(s) {
				return false
			}
		}
		return true
	}
}

// TestRunNonRegularFiles: a named pipe or a device named like a manifest
// would block the open, or never end; each is reported by name and skipped,
// and a file replaced by one keeps its last content.
func TestRunNonRegularFiles(t *testing.T) {
	dir := t.TempDir()
	web, pipe, zero := filepath.Join(dir, "web.yaml"), filepath.Join(dir, "pipe.yaml"), filepath.Join(dir, "zero.yaml")
	writeFile(t, web, svcYAML("web", "10.96.0.10", 80))
	mkfifo(t, pipe)
	symlink(t, "/dev/zero", zero)

	w := startWatch(t, dir)
	w.await("the first load, with the named pipe and the device reported", all(
		hasPorts("default/web:p80=80/TCP[]"),
		hasError(pipe+": not a regular file (a named pipe): not read"),
		hasError(zero+": not a regular file (a character device): not read")))

	writeFile(t, filepath.Join(dir, "db.yaml"), svcYAML("db", "10.96.0.11", 5432))
	w.await("a file added after them", hasPorts("default/db:p5432=5432/TCP[]", "default/web:p80=80/TCP[]"))

	if err := os.Remove(web); err != nil {
		t.Fatal(err)
	}
	mkfifo(t, web)
	w.await("web.yaml replaced by a named pipe: its last content kept", all(
		hasPorts("default/db:p5432=5432/TCP[]", "default/web:p80=80/TCP[]"),
		hasError(web+": not a regular file (a named pipe)")))

	if err := os.Remove(web); err != nil {
		t.Fatal(err)
	}
	writeFile(t, web, svcYAML("web", "10.96.0.10", 81))
	w.await("web.yaml a file again", hasPorts("default/db:p5432=5432/TCP[]", "default/web:p81=81/TCP[]"))
}

// TestLoadNonRegularPath: Path itself a named pipe is read as a file that
// cannot be, at once.
func TestLoadNonRegularPath(t *testing.T) {
	pipe := filepath.Join(t.TempDir(), "pipe.yaml")
	mkfifo(t, pipe)
	done := make(chan *service.Snapshot, 1)
	go func() {
		snap, err := Load(pipe, service.BuildOptions{})
		if err != nil {
			t.Errorf("Load: got error %v, want none", err)
		}
		done <- snap
	}()
	select {
	case snap := <-done:
		if snap != nil && !hasError(pipe+": not a regular file (a named pipe)")(snap) {
			t.Errorf("got errors %q, want one naming %s as a named pipe", errorStrings(snap), pipe)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("Load(%s) still blocked after 10s", pipe)
	}
}

// TestLoadSizeLimit: what is read of one file is bounded, by what is read
// and not only by the size the file reports.
func TestLoadSizeLimit(t *testing.T) {
	t.Run("default limit", func(t *testing.T) {
		dir := t.TempDir()
		writeFile(t, filepath.Join(dir, "web.yaml"), svcYAML("web", "10.96.0.10", 80))
		big := filepath.Join(dir, "big.yaml")
		f, err := os.Create(big)
		if err != nil {
			t.Fatal(err)
		}
		// Sparse: nothing is written to disk.
		if err := f.Truncate(DefaultMaxFileSize + 1); err != nil {
			t.Fatal(err)
		}
		f.Close()
		snap, err := Load(dir, service.BuildOptions{})
		if err != nil {
			t.Fatal(err)
		}
		want := big + ": larger than the limit of 64 MiB for a manifest file: not read"
		if got := errorStrings(snap); !slices.Equal(got, []string{want}) {
			t.Errorf("got errors %q, want %q", got, want)
		}
		if got := summary(snap); !slices.Equal(got, []string{"default/web:p80=80/TCP[]"}) {
			t.Errorf("got ports %q, want web's", got)
		}
	})
	t.Run("a file that reports a smaller size", func(t *testing.T) {
		// Files in /proc report 0 bytes.
		dir := t.TempDir()
		proc := filepath.Join(dir, "proc.yaml")
		symlink(t, "/proc/self/maps", proc)
		l := newLoader(dir, true, service.BuildOptions{})
		l.maxSize = 64
		want := proc + ": larger than the limit of 64 bytes for a manifest file: not read"
		if got := errorStrings(l.load()); !slices.Equal(got, []string{want}) {
			t.Errorf("got errors %q, want %q", got, want)
		}
	})
}

// TestRunSizeLimit: a file grown past the limit keeps its last content.
func TestRunSizeLimit(t *testing.T) {
	dir := t.TempDir()
	web := filepath.Join(dir, "web.yaml")
	writeFile(t, web, svcYAML("web", "10.96.0.10", 80))
	w := startSource(t, &Source{Path: dir, Debounce: 20 * time.Millisecond, MaxFileSize: 512})
	w.await("the first load", hasPorts("default/web:p80=80/TCP[]"))
	replaceFile(t, web, svcYAML("web", "10.96.0.10", 81)+"# "+strings.Repeat("x", 512)+"\n")
	w.await("the file too large, its last content kept", all(hasPorts("default/web:p80=80/TCP[]"),
		hasError(web+": larger than the limit of 512 bytes for a manifest file: not read")))
	replaceFile(t, web, svcYAML("web", "10.96.0.10", 82))
	w.await("the file back under the limit", all(hasPorts("default/web:p82=82/TCP[]"),
		func(s *service.Snapshot) bool { return len(s.Errors) == 0 }))
}

// TestRunEmptyFile: a file emptied to 0 bytes ("cmd > file" with a failing
// cmd, a full disk, a write caught half-way) keeps its last content, with a
// problem; one with only a comment has no objects.
func TestRunEmptyFile(t *testing.T) {
	inBothModes(t, func(t *testing.T, fileMode bool) {
		dir := t.TempDir()
		web := filepath.Join(dir, "web.yaml")
		writeFile(t, web, svcYAML("web", "10.96.0.10", 80))
		path := dir
		if fileMode {
			path = web
		}
		w := startWatch(t, path)
		w.await("the first load", hasPorts("default/web:p80=80/TCP[]"))
		if err := os.Truncate(web, 0); err != nil {
			t.Fatal(err)
		}
		w.await("the file emptied, its last content kept", all(hasPorts("default/web:p80=80/TCP[]"),
			hasError(web+": empty (0 bytes): taken for a file being written, its last content is used")))
		writeFile(t, web, "# none\n")
		w.await("the file emptied on purpose", all(hasPorts(),
			func(s *service.Snapshot) bool { return len(s.Errors) == 0 }))
	})
}

// TestRunDuplicateNewFile: a new file that defines an object already served
// from another is the duplicate, whatever the order of their names; the
// object moves to it only once the first file no longer defines it. On a
// fresh start, the first file by name has it.
func TestRunDuplicateNewFile(t *testing.T) {
	dir := t.TempDir()
	web, copied := filepath.Join(dir, "web.yaml"), filepath.Join(dir, "aaa-copy.yaml")
	writeFile(t, web, svcYAML("web", "10.96.0.10", 80))
	w := startWatch(t, dir)
	w.await("the first load", hasPorts("default/web:p80=80/TCP[]"))

	writeFile(t, copied, svcYAML("web", "10.96.0.19", 81))
	w.await("the copy reported, the Service unchanged", all(hasPorts("default/web:p80=80/TCP[]"),
		hasError(copied+": document 1 (line 1): Service default/web: metadata.name: already defined in "+web+" document 1; this definition is ignored")))

	snap, err := Load(dir, service.BuildOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := summary(snap), []string{"default/web:p81=81/TCP[]"}; !slices.Equal(got, want) {
		t.Errorf("a fresh load: got ports %q, want %q (the first file by name)", got, want)
	}

	writeFile(t, web, svcYAML("other", "10.96.0.12", 82))
	w.await("the first file defining another Service: the copy's definition used", all(
		hasPorts("default/other:p82=82/TCP[]", "default/web:p81=81/TCP[]"),
		func(s *service.Snapshot) bool { return len(s.Errors) == 0 }))
}

// TestRunFollowsLinkTargets: a manifest that is a link to a file in another
// directory is reloaded when that file changes, written in place or
// replaced.
func TestRunFollowsLinkTargets(t *testing.T) {
	inBothModes(t, func(t *testing.T, fileMode bool) {
		dir, real := t.TempDir(), t.TempDir()
		target := filepath.Join(real, "svc.yaml")
		writeFile(t, target, svcYAML("web", "10.96.0.10", 80))
		link := filepath.Join(dir, "svc.yaml")
		symlink(t, target, link)
		path := dir
		if fileMode {
			path = link
		}
		w := startWatch(t, path)
		w.await("the first load", hasPorts("default/web:p80=80/TCP[]"))

		writeFile(t, target, svcYAML("web", "10.96.0.10", 81))
		w.await("the target written in place", hasPorts("default/web:p81=81/TCP[]"))
		replaceFile(t, target, svcYAML("web", "10.96.0.10", 82))
		w.await("the target replaced", hasPorts("default/web:p82=82/TCP[]"))

		// The link moved to a file in a third directory: that one is
		// followed now.
		other := filepath.Join(t.TempDir(), "svc.yaml")
		writeFile(t, other, svcYAML("web", "10.96.0.10", 83))
		tmp := filepath.Join(dir, ".svc.yaml.tmp")
		symlink(t, other, tmp)
		if err := os.Rename(tmp, link); err != nil {
			t.Fatal(err)
		}
		w.await("the link moved", hasPorts("default/web:p83=83/TCP[]"))
		writeFile(t, other, svcYAML("web", "10.96.0.10", 84))
		w.await("the new target written", hasPorts("default/web:p84=84/TCP[]"))
	})
}

// writeUntilCleanup calls write every few milliseconds until the test ends.
func writeUntilCleanup(t *testing.T, every time.Duration, write func() error) {
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			case <-time.After(every):
			}
			if err := write(); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	t.Cleanup(func() { close(stop); <-done })
}

// setVerbosity sets klog's -v until the test ends.
func setVerbosity(t *testing.T, v string) {
	fs := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(fs)
	if err := fs.Set("v", v); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fs.Set("v", "0") })
}

// TestRunIgnoresOtherFiles: a file that is not a manifest, written all the
// time next to them (a log file, uproxy's own at -v=5 included), neither
// holds reloads back nor is logged: logging its events would write it again.
func TestRunIgnoresOtherFiles(t *testing.T) {
	inBothModes(t, func(t *testing.T, fileMode bool) {
		dir := t.TempDir()
		web, appLog := filepath.Join(dir, "web.yaml"), filepath.Join(dir, "app.log")
		writeFile(t, web, svcYAML("web", "10.96.0.10", 80))
		path := dir
		if fileMode {
			path = web
		}
		log := logs.Capture(t)
		setVerbosity(t, "5")
		// No maximum delay: only the debounce lets a reload through.
		w := startSource(t, &Source{Path: path, Debounce: 300 * time.Millisecond, MaxDelay: time.Hour})
		w.await("the first load", hasPorts("default/web:p80=80/TCP[]"))
		writeUntilCleanup(t, 5*time.Millisecond, func() error {
			f, err := os.OpenFile(appLog, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
			if err != nil {
				return err
			}
			_, err = f.WriteString("a line\n")
			f.Close()
			return err
		})
		time.Sleep(100 * time.Millisecond) // the writes have begun
		replaceFile(t, web, svcYAML("web", "10.96.0.10", 81))
		w.await("the change, while app.log is written", hasPorts("default/web:p81=81/TCP[]"))
		for _, line := range log.Since() {
			if strings.Contains(line, "app.log") {
				t.Errorf("got log line %q, want none about app.log", line)
				break
			}
		}
	})
}

// TestRunMaxDelay: a manifest rewritten more often than the debounce does
// not hold reloads back for longer than MaxDelay.
func TestRunMaxDelay(t *testing.T) {
	dir := t.TempDir()
	web, db := filepath.Join(dir, "web.yaml"), filepath.Join(dir, "db.yaml")
	writeFile(t, web, svcYAML("web", "10.96.0.10", 80))
	writeFile(t, db, svcYAML("db", "10.96.0.11", 5432))
	const maxDelay = time.Second
	w := startSource(t, &Source{Path: dir, Debounce: 500 * time.Millisecond, MaxDelay: maxDelay})
	w.await("the first load", hasPorts("default/db:p5432=5432/TCP[]", "default/web:p80=80/TCP[]"))
	writeUntilCleanup(t, 20*time.Millisecond, func() error {
		return os.WriteFile(db, []byte(svcYAML("db", "10.96.0.11", 5432)), 0o644)
	})
	time.Sleep(100 * time.Millisecond) // the writes have begun
	start := time.Now()
	replaceFile(t, web, svcYAML("web", "10.96.0.10", 81))
	w.await("the change, while db.yaml is rewritten", func(s *service.Snapshot) bool {
		return slices.Contains(summary(s), "default/web:p81=81/TCP[]")
	})
	// Slack for a loaded machine; without a maximum, the reload waits for
	// the writes to stop, at the end of the test.
	if took := time.Since(start); took > maxDelay+3*time.Second {
		t.Errorf("got the change after %v, want it within about %v", took, maxDelay)
	}
}

// inBothModes runs f as a subtest with Path a directory ("directory") and
// with Path the file itself ("file").
func inBothModes(t *testing.T, f func(t *testing.T, fileMode bool)) {
	for _, fileMode := range []bool{false, true} {
		name := "directory"
		if fileMode {
			name = "file"
		}
		t.Run(name, func(t *testing.T) { f(t, fileMode) })
	}
}
