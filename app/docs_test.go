package app

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"
)

// moduleRoot is the repository's root, which holds README.md and docs/: the
// tests of a package run in its directory, app/.
const moduleRoot = ".."

// readme is the README's path from app/.
var readme = filepath.Join(moduleRoot, "README.md")

// markdownFiles returns README.md and every Markdown file under docs/.
func markdownFiles(t *testing.T) []string {
	t.Helper()
	files := []string{readme}
	err := filepath.WalkDir(filepath.Join(moduleRoot, "docs"), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(p, ".md") {
			files = append(files, p)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// proseLines returns a Markdown file's lines outside fenced code blocks.
func proseLines(text string) []string {
	var out []string
	fenced := false
	for _, l := range strings.Split(text, "\n") {
		if strings.HasPrefix(strings.TrimSpace(l), "```") {
			fenced = !fenced
			continue
		}
		if !fenced {
			out = append(out, l)
		}
	}
	return out
}

// anchor is the fragment a heading gets on GitHub: lower case, punctuation
// other than hyphens and underscores dropped, spaces as hyphens.
func anchor(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(strings.TrimSpace(heading)) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// anchors returns the fragments of a Markdown file's headings.
func anchors(t *testing.T, file string) []string {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, l := range proseLines(string(b)) {
		if h, ok := strings.CutPrefix(strings.TrimLeft(l, "#"), " "); ok && strings.HasPrefix(l, "#") {
			out = append(out, anchor(h))
		}
	}
	return out
}

// Every relative link in the README and under docs/ names a file or directory
// that exists, and a #fragment names a heading of the file it points to.
func TestDocsRelativeLinksResolve(t *testing.T) {
	link := regexp.MustCompile(`\]\(([^)\s]+)\)`)
	checked := 0
	for _, file := range markdownFiles(t) {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range proseLines(string(b)) {
			for _, m := range link.FindAllStringSubmatch(l, -1) {
				target := m[1]
				if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
					continue
				}
				checked++
				path, frag, _ := strings.Cut(target, "#")
				resolved := file
				if path != "" {
					resolved = filepath.Join(filepath.Dir(file), path)
				}
				info, err := os.Stat(resolved)
				if err != nil {
					t.Errorf("%s: link %s: %s does not exist", file, target, resolved)
					continue
				}
				if frag != "" && !info.IsDir() && !slices.Contains(anchors(t, resolved), frag) {
					t.Errorf("%s: link %s: %s has no heading #%s", file, target, resolved, frag)
				}
			}
		}
	}
	if checked == 0 {
		t.Fatal("no relative link found in README.md or docs/: the link pattern is wrong")
	}
}

// notYetNamingAReader are documents whose first line is not this change's to
// write; the test fails once one names its reader, so the entry goes.
var notYetNamingAReader = map[string]string{}

// Every document but the README opens with "# Title (for reader)": who it is
// for is the first thing it says.
func TestDocsNameTheirReader(t *testing.T) {
	first := regexp.MustCompile(`^# .+ \(for [^)]+\)$`)
	for _, file := range markdownFiles(t) {
		if file == readme {
			continue
		}
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		line, _, _ := strings.Cut(string(b), "\n")
		rel, err := filepath.Rel(moduleRoot, file)
		if err != nil {
			t.Fatal(err)
		}
		_, exempt := notYetNamingAReader[filepath.ToSlash(rel)]
		switch ok := first.MatchString(line); {
		case !ok && !exempt:
			t.Errorf("%s: first line %q: want \"# Title (for reader)\"", file, line)
		case ok && exempt:
			t.Errorf("%s names its reader now: remove it from notYetNamingAReader", file)
		}
	}
}

// The README stays a user's guide: about 350 lines, the rest in docs/.
func TestREADMEIsAGuideNotALog(t *testing.T) {
	b, err := os.ReadFile(readme)
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(b), "\n"); n > 400 {
		t.Errorf("README.md has %d lines, want at most 400: move detail to the document under docs/ that its reader opens", n)
	}
}
