package file

import (
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/fsnotify/fsnotify"
	"k8s.io/klog/v2"
)

// maxLinkHops bounds the symbolic links followed from one manifest, as the
// kernel's limit (40) does: a loop of links ends there.
const maxLinkHops = 40

// linkWatch watches what the manifests stand for beyond the watched
// directory: a manifest that is a symbolic link to a file elsewhere changes
// when that file does, and only the target's directory tells. It also knows
// every name whose events matter (relevant), so that the events of other
// files (a log file written next to the manifests, say) neither trigger a
// reload nor are logged.
type linkWatch struct {
	w *fsnotify.Watcher
	// own are the directories that dirWatch watches (the directory and its
	// parent): never added or removed here.
	own map[string]bool
	// names are the paths whose events matter: each manifest, and each link
	// and file on the way from a linked manifest to its target.
	names map[string]bool
	// dirs are the directories watched for names, besides own.
	dirs map[string]bool
}

func newLinkWatch(w *fsnotify.Watcher, dw *dirWatch) *linkWatch {
	own := map[string]bool{dw.dir: true}
	if dw.parent != "" {
		own[dw.parent] = true
	}
	return &linkWatch{w: w, own: own, names: map[string]bool{}, dirs: map[string]bool{}}
}

// update watches the targets of files, the manifests just loaded, and
// forgets those of files no longer there. It reports whether a directory
// was added: what changed in it before the watch was not seen, so the
// caller reloads once more.
func (lw *linkWatch) update(files []string) (added bool) {
	names := make(map[string]bool, len(files))
	for _, f := range files {
		linkPath(f, func(p string) { names[p] = true })
	}
	dirs := make(map[string]bool)
	for p := range names {
		if d := filepath.Dir(p); !lw.own[d] {
			dirs[d] = true
		}
	}
	for d := range dirs {
		// Added again when already watched, so that a directory replaced
		// since gets the watch (it only updates a watch that exists).
		err := lw.w.Add(d)
		switch {
		case err != nil && lw.dirs[d]:
			lw.w.Remove(d)
			delete(lw.dirs, d)
		case err != nil:
			// Gone, most often: the link dangles. The link's own event,
			// or the next reload, brings it back.
			klog.V(2).InfoS("Watching a manifest link's target directory", "dir", d, "err", err)
		case !lw.dirs[d]:
			lw.dirs[d] = true
			added = true
			klog.V(2).InfoS("Watching a manifest link's target directory", "dir", d)
		}
	}
	for d := range lw.dirs {
		if !dirs[d] {
			lw.w.Remove(d)
			delete(lw.dirs, d)
		}
	}
	lw.names = names
	return added
}

// relevant reports whether an event on name may change what the
// manifests hold.
func (lw *linkWatch) relevant(name string) bool {
	return lw.names[filepath.Clean(name)]
}

// linkPath calls visit with name and, when name is a symbolic link, with
// every link on the way to the file it stands for and with that file (or the
// first missing name on the way): the paths whose change changes what name
// reads. The directory of name is taken as it is.
func linkPath(name string, visit func(string)) {
	name = filepath.Clean(name)
	visit(name)
	info, err := os.Lstat(name)
	if err != nil || info.Mode()&fs.ModeSymlink == 0 {
		return
	}
	dir, rest := filepath.Dir(name), []string{filepath.Base(name)}
	for hops := 0; len(rest) > 0; {
		c := rest[0]
		rest = rest[1:]
		switch c {
		case "", ".":
			continue
		case "..":
			dir = filepath.Dir(dir)
			continue
		}
		p := filepath.Join(dir, c)
		info, err := os.Lstat(p)
		if err != nil {
			visit(p) // its creation matters
			return
		}
		if info.Mode()&fs.ModeSymlink == 0 {
			if len(rest) == 0 {
				visit(p)
			}
			dir = p
			continue
		}
		if hops++; hops > maxLinkHops {
			return
		}
		visit(p)
		target, err := os.Readlink(p)
		if err != nil {
			return
		}
		if filepath.IsAbs(target) {
			dir = "/"
		}
		rest = append(strings.Split(target, "/"), rest...)
	}
}
