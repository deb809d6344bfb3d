// Package file reads Services and EndpointSlices from manifests on disk (standalone
// mode) and follows changes to them.
//
//	src := &file.Source{Path: "/etc/uproxy/services", Options: service.BuildOptions{NodeName: node}}
//	err := src.Run(ctx, func(s *service.Snapshot) { proxier.Update(s) })
//
// A broken edit never takes Services away: a file that cannot be decoded keeps its
// previous content, and an object that fails validation keeps its previous version.
// Validation is the API server's as far as the proxy depends on it: what
// service.ValidateService and service.ValidateEndpointSlice check, and names
// and addresses besides (validate.go), which objects from the API server have
// passed already.
// Nor does a file or directory being replaced: while the file that Path names, or
// the directory, is gone, its last content is served, and it is read again once
// it is back (a directory replaced by another of the same name is followed).
// Nor does a file that is not read: one that is not a regular file (a named
// pipe would block the open), one larger than MaxFileSize, or one of 0 bytes
// (taken for a file being written).
// Every problem is still reported in Snapshot.Errors and logged once, when it
// appears; its fix is logged too, and so is a summary of every reload.
package file

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/fsnotify/fsnotify"
	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/regularfile"
	"github.com/uproxy/uproxy/service"
)

// DefaultDebounce is how long file events must pause before a reload: editors and
// deploy tools touch a file several times per save.
const DefaultDebounce = 100 * time.Millisecond

// DefaultMaxDelay bounds how long a reload waits for file events to pause:
// a file rewritten more often than the debounce would otherwise hold every
// reload back for as long as it goes on.
const DefaultMaxDelay = time.Second

// ErrDeleted is the error of a manifest file that Path names and that was
// deleted. Its last Services are kept, as for a file that cannot be read: a
// file being replaced is briefly absent, and taking every Service away then
// would be worse than serving them a little longer.
var ErrDeleted = errors.New("deleted; its last content is used until it is back")

// ErrGone is the error of the manifest directory that Path names while it is
// gone (removed, renamed away, or not a directory any more): the last content of
// its files is used, as for a deleted file (ErrDeleted), and the directory is
// read again, and watched, as soon as it is back under that name.
var ErrGone = errors.New("gone; the last content of its files is used until it is back")

// Source follows the manifests at Path.
type Source struct {
	// Path is a manifest file, or a directory whose *.yaml, *.yml and *.json files
	// (not recursive, dotfiles excluded) are read. A file that is a symbolic
	// link is followed, and its target's directory watched.
	Path    string
	Options service.BuildOptions
	// Debounce is the quiet time after a file event before reloading; if zero,
	// DefaultDebounce.
	Debounce time.Duration
	// MaxDelay is the longest a reload waits after the first file event
	// since the last reload, however many follow; if zero, DefaultMaxDelay.
	MaxDelay time.Duration
	// MaxFileSize bounds what is read of one manifest file; a larger file is
	// reported and not read, and its last content is used. If zero,
	// DefaultMaxFileSize.
	MaxFileSize int64
	// LoopbackEndpoints accepts endpoints at loopback addresses, which are
	// otherwise refused as the API server refuses them (they would let a
	// Service's clients reach servers that listen only on the node). Set it
	// when the proxy ports listen on a loopback address alone, as the demo's
	// do: their only clients are the node's own processes, which reach its
	// loopback servers anyway.
	LoopbackEndpoints bool
}

// Load reads the manifests of Path once and returns their Snapshot, with
// every problem in its Errors.
func (s *Source) Load() (*service.Snapshot, error) {
	info, err := os.Stat(s.Path)
	if err != nil {
		return nil, fmt.Errorf("load manifests: %w", err)
	}
	l := s.newLoader(info.IsDir())
	if info.IsDir() {
		if _, err := os.ReadDir(s.Path); err != nil {
			return nil, fmt.Errorf("load manifests: %w", err)
		}
	}
	return l.load(), nil
}

func (s *Source) debounce() time.Duration {
	if s.Debounce > 0 {
		return s.Debounce
	}
	return DefaultDebounce
}

func (s *Source) maxDelay() time.Duration {
	if s.MaxDelay > 0 {
		return s.MaxDelay
	}
	return DefaultMaxDelay
}

// Load reads the manifests at path once. Problems with single files or objects are in
// Snapshot.Errors; an error is returned only when path itself cannot be read.
func Load(path string, opts service.BuildOptions) (*service.Snapshot, error) {
	return (&Source{Path: path, Options: opts}).Load()
}

// Run calls update with the Snapshot of Path, then again after every change of the
// files that changes the Snapshot, until ctx is done; it then returns nil. It fails
// at once when Path cannot be read or watched.
//
// The directory is watched rather than the file, so that replacing a file (writing a
// temporary file and renaming it over, as editors, kubectl-style tools and ConfigMap
// volumes do) is seen like writing it in place. The directory is followed by name
// (see dirWatch): replaced by another (removed and made again, or renamed away
// and back), it is the new one that is read and watched; while it is gone, its
// files' last content is served.
func (s *Source) Run(ctx context.Context, update func(*service.Snapshot)) error {
	info, err := os.Stat(s.Path)
	if err != nil {
		return fmt.Errorf("file source: %w", err)
	}
	dir := s.Path
	if !info.IsDir() {
		dir = filepath.Dir(s.Path)
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("file source %s: %w", s.Path, err)
	}
	defer w.Close()
	dw, err := watchDir(w, dir)
	if err != nil {
		return fmt.Errorf("file source %s: %w", s.Path, err)
	}

	l := s.newLoader(info.IsDir())
	lw := newLinkWatch(w, dw)
	last := l.load()
	klog.InfoS("Manifests loaded", loadSummary(s.Path, nil, last)...)
	update(last)

	reload := time.NewTimer(time.Hour)
	reload.Stop()
	defer reload.Stop()
	// pending is when the first event since the last reload came; zero when
	// none did. The reload waits for events to pause (debounce), but no
	// longer than maxDelay after pending.
	var pending time.Time
	schedule := func() {
		now := time.Now()
		if pending.IsZero() {
			pending = now
		}
		reload.Reset(max(0, min(s.debounce(), pending.Add(s.maxDelay()).Sub(now))))
	}
	if lw.update(l.fileNames()) {
		schedule() // what changed in a target before its watch was not seen
	}
	// Events that matter: about the directory itself (from its parent), a
	// manifest's name in it (a new file), or a name on the way from a linked
	// manifest to its target (a ConfigMap volume swaps the "..data" link, not
	// the file). Those of other names are not even logged: a log file
	// written in the directory must not make events by being written to.
	relevant := func(name string) bool {
		name = filepath.Clean(name)
		if name == dw.dir || lw.relevant(name) {
			return true
		}
		return info.IsDir() && filepath.Dir(name) == dw.dir && isManifest(filepath.Base(name))
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case ev, ok := <-w.Events:
			if !ok {
				return fmt.Errorf("file source %s: watcher closed", s.Path)
			}
			if relevant(ev.Name) {
				klog.V(5).InfoS("Manifest event", "path", ev.Name, "op", ev.Op.String())
				schedule()
			}
		case err, ok := <-w.Errors:
			if !ok {
				return fmt.Errorf("file source %s: watcher closed", s.Path)
			}
			// Usually an event queue overflow: events were lost, so reread everything.
			klog.ErrorS(err, "Watching manifests", "dir", dir)
			schedule()
		case <-reload.C:
			pending = time.Time{}
			// Before the load, so that whatever changes in a directory that
			// came back after its listing is announced by the new watch.
			if err := dw.follow(); err != nil {
				klog.ErrorS(err, "Watching manifests", "dir", dir)
			}
			snap := l.load()
			if lw.update(l.fileNames()) {
				schedule()
			}
			if last.Equal(snap) {
				continue
			}
			klog.InfoS("Manifests reloaded", loadSummary(s.Path, last, snap)...)
			last = snap
			update(snap)
		}
	}
}

// dirWatch keeps a directory watched by name, across its replacement. inotify
// watches an inode, not a name: a directory removed and made again (rm -rf d;
// mkdir d) leaves the watch with the removed one, and one renamed away and back
// loses it (fsnotify drops the watch of a directory that moves). So the parent
// is watched too, for the directory's own removal, renaming and return, and
// every reload first makes sure the watch is on the directory the name now
// stands for (follow).
type dirWatch struct {
	w           *fsnotify.Watcher
	dir, parent string // parent is "" when dir has none to watch (the root)
	// watched is the directory under the watch; nil while dir is gone.
	watched os.FileInfo
}

// watchDir starts watching dir and its parent; dir must exist.
func watchDir(w *fsnotify.Watcher, dir string) (*dirWatch, error) {
	dir = filepath.Clean(dir)
	d := &dirWatch{w: w, dir: dir}
	if parent := filepath.Dir(dir); parent != dir {
		d.parent = parent
	}
	if err := d.follow(); err != nil {
		return nil, err
	}
	if d.watched == nil {
		return nil, fmt.Errorf("watch %s: gone", dir)
	}
	if d.parent != "" {
		if err := w.Add(d.parent); err != nil {
			// The directory itself is watched: only its replacement goes unseen.
			klog.ErrorS(err, "Watching the manifest directory's parent: a replaced directory will not be followed", "dir", dir, "parent", d.parent)
		}
	}
	return d, nil
}

// follow puts the watch on the directory that dir names now, or takes it off
// while there is none. Adding a watch that exists only updates it, so the watch
// is renewed each time: a directory made again may have the inode of the one
// removed, whose watch is gone all the same.
func (d *dirWatch) follow() error {
	info, err := os.Stat(d.dir)
	if err != nil || !info.IsDir() {
		if d.watched != nil {
			d.w.Remove(d.dir) // already gone with it, most often
			d.watched = nil
		}
		return nil
	}
	if d.watched != nil && !os.SameFile(d.watched, info) {
		// The watch may still be on the old directory, renamed elsewhere.
		d.w.Remove(d.dir)
	}
	if err := d.w.Add(d.dir); err != nil {
		d.watched = nil
		return fmt.Errorf("watch %s: %w", d.dir, err)
	}
	d.watched = info
	return nil
}

// objectKey names an object across files.
type objectKey struct {
	kind, namespace, name string
}

// loader holds what must survive between reloads: each file's last content and last
// decodable objects, and the last valid version of each object. It is used by one
// goroutine.
type loader struct {
	path  string
	isDir bool
	// maxSize bounds what is read of one file; if zero, DefaultMaxFileSize.
	maxSize int64
	// loopbackEndpoints is Source.LoopbackEndpoints.
	loopbackEndpoints bool

	files map[string]*fileState // by file path
	// snaps builds incrementally: the objects of a file whose content did not
	// change are the same objects on every reload, and a reread file's objects are
	// new ones, never modified, which is what service.Builder relies on.
	snaps *service.Builder
	// svcs and slices are what the previous load built from: the last valid
	// version of each object.
	svcs   []*v1.Service
	slices []*discoveryv1.EndpointSlice
	// loops caches, by slice, the previous load's finding of endpoints at
	// the virtual IPs of the slice's Service (see withoutLoops).
	loops map[*discoveryv1.EndpointSlice]loopCheck
	// where is where the previous load took each object from.
	where objectPlaces
	// logged holds the errors of the previous load, each with what it is about
	// (problemSubject), so that a broken file is logged when it breaks, when
	// it is fixed and when another problem of the same object replaces it, not
	// on every reload.
	logged map[string]loggedProblem
}

// loggedProblem is what log keeps of a problem it reported: what it is about
// (problemSubject) and its file ("" for none).
type loggedProblem struct {
	subject, file string
}

type fileState struct {
	// sum is the digest of the content last read; read is false when the
	// last attempt read nothing (the file deleted or unreadable).
	sum  [sha256.Size]byte
	read bool
	objs []object // objects of the last content that decoded
	errs []error  // errors of the content last read
	// decoded is what the last decoding found, by document: a document
	// unchanged in the next content keeps its objects (decodeFile).
	decoded decoded
}

func newLoader(path string, isDir bool, opts service.BuildOptions) *loader {
	return &loader{
		path:   path,
		isDir:  isDir,
		files:  make(map[string]*fileState),
		snaps:  service.NewBuilder(opts),
		logged: make(map[string]loggedProblem),
	}
}

// newLoader returns the loader of s, whose Path is a directory when isDir.
func (s *Source) newLoader(isDir bool) *loader {
	l := newLoader(s.Path, isDir, s.Options)
	l.maxSize, l.loopbackEndpoints = s.MaxFileSize, s.LoopbackEndpoints
	return l
}

func (l *loader) maxFileSize() int64 {
	if l.maxSize > 0 {
		return l.maxSize
	}
	return DefaultMaxFileSize
}

// load rereads the manifests and builds a Snapshot, falling back to the last good
// content of broken files and the last good version of invalid objects.
func (l *loader) load() *service.Snapshot {
	var errs []error
	names, err := l.list()
	listed := err == nil
	if !listed {
		// The directory is gone (removed, renamed away, being replaced) or
		// unreadable: keep serving every file's last content, unread, rather
		// than dropping every Service; its files are read again once it can be
		// listed.
		errs = append(errs, err)
		names = slices.Sorted(maps.Keys(l.files))
	}

	present := make(map[string]bool, len(names))
	for _, name := range names {
		present[name] = true
		if !listed {
			continue
		}
		st := l.files[name]
		if st == nil {
			st = &fileState{}
			l.files[name] = st
		}
		data, err := regularfile.Read(name, l.maxFileSize(), "manifest file")
		switch {
		case err != nil && l.isDir && errors.Is(err, os.ErrNotExist):
			delete(present, name) // removed since the listing
			continue
		case errors.Is(err, os.ErrNotExist):
			st.read, st.errs = false, []error{&DocumentError{File: name, Err: ErrDeleted}}
			continue
		case errors.Is(err, regularfile.ErrNotRegular) || errors.Is(err, regularfile.ErrTooLarge):
			st.read, st.errs = false, []error{&DocumentError{File: name, Err: err}}
			continue
		case err != nil:
			// Keep the last good objects of a file that cannot be read right now.
			st.read, st.errs = false, []error{&DocumentError{File: name, Err: fmt.Errorf("read: %w", err)}}
			continue
		case len(data) == 0:
			st.read, st.errs = false, []error{&DocumentError{File: name, Err: ErrEmpty}}
			continue
		}
		// A digest rather than the content: the content would cost as much
		// memory again as the objects decoded from it.
		sum := sha256.Sum256(data)
		if st.read && sum == st.sum {
			continue // unchanged: keep its objects and errors
		}
		objs, derrs, broken := decodeFile(name, data, &st.decoded)
		st.sum, st.read, st.errs = sum, true, derrs
		if broken {
			st.errs = append(st.errs, notUsed(name, derrs, len(st.objs)))
		} else {
			st.objs = objs
		}
	}
	for name, st := range l.files {
		if !present[name] {
			delete(l.files, name)
			if st.read {
				klog.InfoS("Manifest file deleted; its objects are gone", "file", name)
			}
		}
	}

	svcs, epSlices, where, verrs := l.validObjects(names, present)
	for _, name := range names {
		if st := l.files[name]; st != nil {
			errs = append(errs, st.errs...)
		}
	}
	errs = append(errs, verrs...)

	snap := l.snaps.Build(svcs, epSlices)
	for i, err := range snap.Errors {
		// Say where the object is defined: the Service left out, or its
		// port, or the one served with a problem (a bad policy annotation,
		// no cluster IP).
		var k objectKey
		switch e := err.(type) {
		case *service.Conflict:
			k = objectKey{"Service", e.LeftOut.Namespace, e.LeftOut.Name}
		case *service.UnservedError:
			k = objectKey{"Service", e.Port.Name.Namespace, e.Port.Name.Name}
		case *service.FieldError:
			k = objectKey{e.Kind, e.Namespace, e.Name}
		default:
			continue
		}
		if at, ok := where.at(k); ok {
			at.Err = err
			snap.Errors[i] = &at
		}
	}
	snap.Errors = append(errs, snap.Errors...)
	l.log(snap.Errors)
	return snap
}

// ErrNotUsed marks the error about a whole file of which some document
// cannot be decoded: its content is not used, and its last content that
// could be decoded stays in force (see notUsed).
var ErrNotUsed = errors.New("not used")

// notUsed is the error of file, whose documents' errors are derrs, when its
// content is not used because one of them cannot be decoded; kept is the
// number of objects of its last content that could be, which stay in force.
// The documents' own errors say what is wrong; this one says what follows
// for the others, which are valid maybe but not used either.
func notUsed(file string, derrs []error, kept int) error {
	doc := "a document"
	for _, err := range derrs {
		var de *DocumentError
		if errors.As(err, &de) && !errors.Is(err, ErrUnsupportedKind) && de.Doc > 0 {
			doc = fmt.Sprintf("document %d", de.Doc)
			break
		}
	}
	var err error
	if kept > 0 {
		err = fmt.Errorf("%w, as %s cannot be decoded: none of its documents is read, and the %d objects of its last content that could be decoded stay in force", ErrNotUsed, doc, kept)
	} else {
		err = fmt.Errorf("%w, as %s cannot be decoded: none of its documents is read (there is no earlier content of it to keep) until it can be", ErrNotUsed, doc)
	}
	return &DocumentError{File: file, Err: err}
}

// fileNames returns the manifest files of the last load.
func (l *loader) fileNames() []string {
	return slices.Collect(maps.Keys(l.files))
}

// list returns the manifest files to read, sorted by name.
func (l *loader) list() ([]string, error) {
	if !l.isDir {
		return []string{l.path}, nil
	}
	entries, err := os.ReadDir(l.path)
	if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
		return nil, &DocumentError{File: l.path, Err: ErrGone}
	}
	if err != nil {
		return nil, &DocumentError{File: l.path, Err: fmt.Errorf("list: %w", err)}
	}
	var names []string
	for _, e := range entries {
		if !isManifest(e.Name()) {
			continue
		}
		name := filepath.Join(l.path, e.Name())
		if e.Type()&fs.ModeSymlink != 0 {
			// Follow links (ConfigMap volumes are made of them) but not to directories.
			if info, err := os.Stat(name); err == nil && info.IsDir() {
				continue
			}
		} else if e.IsDir() {
			continue
		}
		names = append(names, name)
	}
	return names, nil
}

// isManifest selects the files of a directory that are read. Dotfiles are left out:
// tools write their temporary files under such names before renaming them.
func isManifest(name string) bool {
	if strings.HasPrefix(name, ".") {
		return false
	}
	switch strings.ToLower(filepath.Ext(name)) {
	case ".yaml", ".yml", ".json":
		return true
	}
	return false
}

// validObjects picks the objects to build from, in file order: the first definition
// of each object, its current version when valid, else its last valid one (the
// one the previous load built from). It returns where each object is first
// defined too. Errors name the file and document of the offending definition.
// An object defined in several files is the one of the file the previous load
// took it from, while that file still defines it, wherever the others sort: a
// new file does not take an object in force away from the file that has it.
func (l *loader) validObjects(names []string, present map[string]bool) ([]*v1.Service, []*discoveryv1.EndpointSlice, objectPlaces, []error) {
	var svcs []*v1.Service
	var epSlices []*discoveryv1.EndpointSlice
	var errs []error
	first := objectPlaces{files: names, places: make(map[objectKey]objectPlace)}
	// The last valid versions, looked up only when an object is invalid.
	var goodSvcs map[objectKey]*v1.Service
	var goodSlices map[objectKey]*discoveryv1.EndpointSlice
	// The definitions of the files of the previous load's objects, by file,
	// looked up only when one of their objects is defined elsewhere too.
	var defs map[string]map[objectKey]DocumentError
	for fi, name := range names {
		st := l.files[name]
		if st == nil || !present[name] {
			continue
		}
		for i := range st.objs {
			o := &st.objs[i]
			k := o.key()
			prev, dup := first.at(k)
			if !dup && k.name != "" {
				if was, ok := l.where.at(k); ok && was.File != name && present[was.File] {
					if defs == nil {
						defs = make(map[string]map[objectKey]DocumentError)
					}
					if defs[was.File] == nil {
						defs[was.File] = l.definitions(was.File)
					}
					prev, dup = defs[was.File][k]
				}
			}
			// Nameless objects are all invalid; validation reports them, not this.
			if dup && k.name != "" {
				at := o.at(name)
				at.Err = &service.FieldError{Kind: k.kind, Namespace: k.namespace, Name: k.name, Field: "metadata.name",
					Msg: fmt.Sprintf("already defined in %s document %d; this definition is ignored", prev.File, prev.Doc)}
				errs = append(errs, &at)
				continue
			}
			first.places[k] = objectPlace{file: int32(fi), doc: o.doc, line: o.line, item: o.item}

			// An object is never modified: its errors hold for as long as
			// it is kept (decodeFile keeps those of unchanged documents).
			if o.checked == nil {
				var verrs []error
				if o.svc != nil {
					verrs = append(service.ValidateService(o.svc), validateServiceManifest(o.svc)...)
				} else if verrs = sliceLimits(o.slice); verrs == nil {
					verrs = append(service.ValidateEndpointSlice(o.slice), validateSliceManifest(o.slice, l.loopbackEndpoints)...)
				}
				o.checked = valid
				if len(verrs) > 0 {
					o.checked = &validation{errs: verrs}
				}
			}
			verrs := o.checked.errs
			for _, err := range verrs {
				at := o.at(name)
				at.Err = err
				errs = append(errs, &at)
			}
			switch {
			case o.svc != nil && len(verrs) == 0:
				svcs = append(svcs, o.svc)
			case o.svc != nil:
				if goodSvcs == nil {
					goodSvcs = keyed(l.svcs, func(s *v1.Service) objectKey { return objectKey{"Service", s.Namespace, s.Name} })
				}
				if good := goodSvcs[k]; good != nil {
					svcs = append(svcs, good)
				}
			case len(verrs) == 0:
				epSlices = append(epSlices, o.slice)
			default:
				if goodSlices == nil {
					goodSlices = keyed(l.slices, func(s *discoveryv1.EndpointSlice) objectKey {
						return objectKey{"EndpointSlice", s.Namespace, s.Name}
					})
				}
				if good := goodSlices[k]; good != nil {
					epSlices = append(epSlices, good)
				}
			}
		}
	}
	epSlices, errs = l.withoutLoops(svcs, epSlices, first, errs)
	// An object that is gone is forgotten: should it come back invalid, there
	// is no earlier version of it to fall back to, as it is not among these.
	l.svcs, l.slices = svcs, epSlices
	l.where = first
	return svcs, epSlices, first, errs
}

// withoutLoops leaves out of epSlices each slice with an endpoint at one of
// its own Service's virtual IPs, with an error naming the endpoint at where
// the slice is defined. The slice's last valid version takes its place when
// it has no such endpoint: a Service that changed to an address of its
// endpoints is what made the slice wrong, not the slice. The check depends on
// the Service as well as the slice, so it is made on every load, from the
// cache of the one before when both objects are the same.
func (l *loader) withoutLoops(svcs []*v1.Service, epSlices []*discoveryv1.EndpointSlice, where objectPlaces, errs []error) ([]*discoveryv1.EndpointSlice, []error) {
	if len(epSlices) == 0 {
		l.loops = nil
		return epSlices, errs
	}
	bySvc := keyed(svcs, func(s *v1.Service) objectKey { return objectKey{"Service", s.Namespace, s.Name} })
	vips := make(map[*v1.Service]virtualIPs)
	checked := make(map[*discoveryv1.EndpointSlice]loopCheck, len(epSlices))
	check := func(s *discoveryv1.EndpointSlice) []error {
		svc := bySvc[objectKey{"Service", s.Namespace, s.Labels[discoveryv1.LabelServiceName]}]
		if svc == nil {
			return nil
		}
		if c, ok := checked[s]; ok && c.svc == svc {
			return c.errs
		}
		if c, ok := l.loops[s]; ok && c.svc == svc {
			checked[s] = c
			return c.errs
		}
		v, ok := vips[svc]
		if !ok {
			v = serviceVIPs(svc)
			vips[svc] = v
		}
		c := loopCheck{svc: svc, errs: loops(s, svc.Name, v)}
		checked[s] = c
		return c.errs
	}
	var goodSlices map[objectKey]*discoveryv1.EndpointSlice
	kept := epSlices[:0:0]
	for _, s := range epSlices {
		lerrs := check(s)
		if len(lerrs) == 0 {
			kept = append(kept, s)
			continue
		}
		k := objectKey{"EndpointSlice", s.Namespace, s.Name}
		for _, err := range lerrs {
			at, _ := where.at(k)
			at.Err = err
			errs = append(errs, &at)
		}
		if goodSlices == nil {
			goodSlices = keyed(l.slices, func(s *discoveryv1.EndpointSlice) objectKey {
				return objectKey{"EndpointSlice", s.Namespace, s.Name}
			})
		}
		if good := goodSlices[k]; good != nil && good != s && len(check(good)) == 0 {
			kept = append(kept, good)
		}
	}
	l.loops = checked
	return kept, errs
}

// loopCheck is what withoutLoops found for one slice with its Service svc.
type loopCheck struct {
	svc  *v1.Service
	errs []error
}

// definitions returns where file first defines each of its objects.
func (l *loader) definitions(file string) map[objectKey]DocumentError {
	st := l.files[file]
	if st == nil {
		return nil
	}
	defs := make(map[objectKey]DocumentError, len(st.objs))
	for i := range st.objs {
		o := &st.objs[i]
		if _, ok := defs[o.key()]; !ok {
			defs[o.key()] = o.at(file)
		}
	}
	return defs
}

// objectPlaces is where each object of a load is first defined. A file of
// 10k Service ports holds 30k objects, so a place is four small numbers,
// the file an index into the load's file names, and the DocumentError that
// names it is built only when an error needs it.
type objectPlaces struct {
	files  []string
	places map[objectKey]objectPlace
}

// objectPlace is a file (index into objectPlaces.files), the object's
// document and the line it starts on, and its index in a List (-1: none).
type objectPlace struct{ file, doc, line, item int32 }

// at is where k is defined, as a DocumentError without Err.
func (p objectPlaces) at(k objectKey) (DocumentError, bool) {
	pl, ok := p.places[k]
	if !ok {
		return DocumentError{}, false
	}
	o := object{doc: pl.doc, line: pl.line, item: pl.item}
	return o.at(p.files[pl.file]), true
}

// keyed maps each of objs by its key.
func keyed[T any](objs []T, key func(T) objectKey) map[objectKey]T {
	m := make(map[objectKey]T, len(objs))
	for _, o := range objs {
		m[key(o)] = o
	}
	return m
}

func (o *object) key() objectKey {
	if o.svc != nil {
		return objectKey{"Service", o.svc.Namespace, o.svc.Name}
	}
	return objectKey{"EndpointSlice", o.slice.Namespace, o.slice.Name}
}

// log reports the errors that the previous load did not have, and those of the
// previous load that are gone: as changed, when a new one is about the same
// object (or document), else as fixed.
func (l *loader) log(errs []error) {
	now := make(map[string]loggedProblem, len(errs))
	var appeared []error
	for _, err := range errs {
		msg := err.Error()
		lp := loggedProblem{subject: problemSubject(err)}
		if de, ok := errors.AsType[*DocumentError](err); ok {
			lp.file = de.File
		}
		now[msg] = lp
		if _, ok := l.logged[msg]; !ok {
			appeared = append(appeared, err)
		}
	}
	// gone holds the problems of the previous load that are gone, by subject;
	// removed those whose file is gone too, which were not fixed.
	gone := make(map[string][]string)
	var removed []string
	for msg, lp := range l.logged {
		if _, ok := now[msg]; ok {
			continue
		}
		if lp.file != "" && lp.file != l.path && l.files[lp.file] == nil {
			removed = append(removed, msg)
			continue
		}
		gone[lp.subject] = append(gone[lp.subject], msg)
	}
	slices.Sort(removed)
	for _, msg := range removed {
		klog.InfoS("Manifest problem gone with its file", "path", l.path, "was", msg)
	}
	for _, msgs := range gone {
		slices.Sort(msgs)
	}
	for _, err := range appeared {
		var de *DocumentError
		if errors.Is(err, ErrDeleted) && errors.As(err, &de) {
			klog.InfoS("Manifest file deleted; its last content is used until it is back", "file", de.File)
			continue
		}
		if errors.Is(err, ErrGone) {
			klog.InfoS("Manifest directory gone; its files' last content is used until it is back", "dir", l.path)
			continue
		}
		subject := now[err.Error()].subject
		if was := gone[subject]; len(was) > 0 {
			klog.ErrorS(err, "Manifest problem changed", "path", l.path, "was", was[0])
			gone[subject] = was[1:]
			continue
		}
		klog.ErrorS(err, "Manifest problem", "path", l.path)
	}
	for _, subject := range slices.Sorted(maps.Keys(gone)) {
		for _, msg := range gone[subject] {
			klog.InfoS("Manifest problem fixed", "path", l.path, "was", msg)
		}
	}
	l.logged = now
}

// problemSubject names what a problem is about: its object (kind, namespace
// and name), or else its file and document, or else the problem itself.
func problemSubject(err error) string {
	var fe *service.FieldError
	var c *service.Conflict
	var ue *service.UnservedError
	switch {
	case errors.As(err, &fe) && fe.Name != "":
		return fe.Kind + " " + fe.Namespace + "/" + fe.Name
	case errors.As(err, &c):
		return "Service " + c.LeftOut.Namespace + "/" + c.LeftOut.Name
	case errors.As(err, &ue):
		return "Service " + ue.Port.Name.Namespace + "/" + ue.Port.Name.Name
	}
	var de *DocumentError
	if errors.As(err, &de) && de.Doc > 0 {
		return fmt.Sprintf("%s document %d", de.File, de.Doc)
	}
	return err.Error()
}

// loadSummary describes a Snapshot loaded from path as klog key-value pairs: what it
// serves, how it differs from prev (nil: nothing before), and how many problems
// it has.
func loadSummary(path string, prev, snap *service.Snapshot) []any {
	services, endpoints := 0, 0
	for i, p := range snap.Ports {
		if i == 0 || snap.Ports[i-1].Name.Namespace != p.Name.Namespace || snap.Ports[i-1].Name.Name != p.Name.Name {
			services++
		}
		endpoints += len(p.Endpoints)
	}
	kv := []any{"path", path, "services", services, "ports", len(snap.Ports), "endpoints", endpoints}
	if prev != nil {
		var added, removed, changed []string
		for _, c := range service.Diff(prev, snap) {
			switch name := c.Name().String(); {
			case c.Old == nil:
				added = append(added, name)
			case c.New == nil:
				removed = append(removed, name)
			default:
				changed = append(changed, name)
			}
		}
		kv = append(kv, "added", listed(added), "removed", listed(removed), "changed", listed(changed))
	}
	return append(kv, "problems", len(snap.Errors))
}

// maxListed bounds the names a summary lists of each kind of change: a reload
// that touches thousands of Service ports still logs one readable line.
const maxListed = 10

// listed joins names for a summary, the first maxListed of them.
func listed(names []string) string {
	if len(names) <= maxListed {
		return strings.Join(names, " ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(names[:maxListed], " "), len(names)-maxListed)
}
