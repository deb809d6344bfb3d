package file

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"sigs.k8s.io/yaml"
)

// ErrUnsupportedKind marks a well-formed document of a kind the proxy does not read
// (a Deployment next to its Service, say). Such a document is reported and skipped;
// the rest of its file is still used.
var ErrUnsupportedKind = errors.New("unsupported kind")

// DocumentError is an error about one document of one manifest file.
type DocumentError struct {
	File string
	// Doc is the 1-based index of the document among the file's non-empty documents,
	// and Line the line it starts on; both are 0 for errors about the whole file.
	Doc  int
	Line int
	// Item locates the object inside a List document ("items[2]"), else "".
	Item string
	Err  error
}

func (e *DocumentError) Error() string {
	var b strings.Builder
	b.WriteString(e.File)
	if e.Doc > 0 {
		fmt.Fprintf(&b, ": document %d (line %d)", e.Doc, e.Line)
	}
	if e.Item != "" {
		b.WriteString(": " + e.Item)
	}
	b.WriteString(": " + e.Err.Error())
	return b.String()
}

func (e *DocumentError) Unwrap() error { return e.Err }

// decoder decodes only the kinds the proxy reads, strictly: an unknown or repeated
// field is an error, as kubectl's default validation would make it, so that a typo
// such as "clusterIp" is reported instead of silently dropped.
var decoder = func() runtime.Decoder {
	scheme := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{v1.AddToScheme, discoveryv1.AddToScheme} {
		if err := add(scheme); err != nil {
			panic(fmt.Sprintf("register API types: %v", err))
		}
	}
	return serializer.NewCodecFactory(scheme, serializer.EnableStrict).UniversalDeserializer()
}()

// readKinds are the kinds Decode accepts; every other one is ErrUnsupportedKind.
var readKinds = map[schema.GroupVersionKind]bool{
	v1.SchemeGroupVersion.WithKind("Service"):                    true,
	v1.SchemeGroupVersion.WithKind("ServiceList"):                true,
	v1.SchemeGroupVersion.WithKind("List"):                       true,
	discoveryv1.SchemeGroupVersion.WithKind("EndpointSlice"):     true,
	discoveryv1.SchemeGroupVersion.WithKind("EndpointSliceList"): true,
}

// object is one decoded Service or EndpointSlice and where it came from. A
// file of 10k Services holds 30k of them: they are kept small.
type object struct {
	svc   *v1.Service
	slice *discoveryv1.EndpointSlice
	// doc and line locate the object's document in its file (its 1-based
	// index and first line); item is its index in a List, -1 outside one.
	doc, line, item int32
	// checked holds the object's validation errors once it was validated
	// (valid for none), nil before.
	checked *validation
}

// validation is what validating an object found.
type validation struct{ errs []error }

// valid is the validation of every valid object.
var valid = &validation{}

// newObject returns the object of svc or slice found at (in List item
// item, or -1).
func newObject(svc *v1.Service, slice *discoveryv1.EndpointSlice, at DocumentError, item int) object {
	return object{svc: svc, slice: slice, doc: int32(at.Doc), line: int32(at.Line), item: int32(item)}
}

// at is where o is in file, as a DocumentError without Err.
func (o *object) at(file string) DocumentError {
	at := DocumentError{File: file, Doc: int(o.doc), Line: int(o.line)}
	if o.item >= 0 {
		at = withItem(at, int(o.item))
	}
	return at
}

// Decode reads the Services and EndpointSlices of one manifest file: multi-document
// YAML ("---" separated) or JSON, where a document may also be a List (v1 List,
// ServiceList, EndpointSliceList). name only labels errors. Objects without a
// namespace get "default", as kubectl would give them. Every error is a
// *DocumentError naming name, the document and its line.
func Decode(name string, data []byte) (svcs []*v1.Service, slices []*discoveryv1.EndpointSlice, errs []error) {
	objs, errs, _ := decodeFile(name, data, nil)
	for _, o := range objs {
		if o.svc != nil {
			svcs = append(svcs, o.svc)
		} else {
			slices = append(slices, o.slice)
		}
	}
	return svcs, slices, errs
}

// decodeFile is Decode keeping each object's location. broken is true when some
// document could not be decoded at all (as opposed to being of an unsupported kind):
// the file's content as a whole is then not to be trusted.
//
// A document whose text prev (the decoded of the file's previous content;
// nil: none) holds is not decoded again: it keeps its objects, the same
// pointers, at its new place. A file of many Services written anew with one
// of them changed then costs the decoding of one document, and the objects of
// the others stay the ones service.Builder knows, so neither it nor the proxy
// mode does anything for them.
func decodeFile(name string, data []byte, prev *decoded) (objs []object, errs []error, broken bool) {
	docs := splitDocuments(data)
	// kept are the documents of prev by digest, each taken once: a second
	// copy of a document in the file is decoded, into objects of its own, as
	// without prev.
	var kept map[docDigest]docObjects
	if prev != nil && len(prev.docs) > 0 {
		kept = make(map[docDigest]docObjects, len(prev.docs))
		for _, d := range prev.docs {
			if _, dup := kept[d.digest]; !dup {
				kept[d.digest] = d
			}
		}
	}
	var decodedDocs []docObjects
	labels := labelSets{}
	for _, d := range docs {
		at := DocumentError{File: name, Doc: d.index, Line: d.line}
		digest := digestOf(d.text)
		if k, ok := kept[digest]; ok {
			delete(kept, digest)
			start := len(objs)
			for _, o := range prev.objs[k.start:k.end] {
				o.doc, o.line = int32(at.Doc), int32(at.Line)
				objs = append(objs, o)
			}
			decodedDocs = append(decodedDocs, docObjects{digest, int32(start), int32(len(objs))})
			continue
		}
		js, err := toJSON(d)
		if err == nil && js == nil {
			continue // a YAML document that is only "null" or "~"
		}
		if err == nil {
			var items []object
			items, err = decodeObject(js, at, true)
			for _, o := range items {
				if o.slice != nil {
					o.slice.Labels = labels.share(o.slice.Labels)
				}
			}
			if err == nil {
				decodedDocs = append(decodedDocs, docObjects{digest, int32(len(objs)), int32(len(objs) + len(items))})
			}
			objs = append(objs, items...)
		}
		if err == nil {
			continue
		}
		// decodeObject joins per-item errors of a List; report each on its own.
		for _, e := range unjoin(err) {
			var de *DocumentError
			if !errors.As(e, &de) {
				de = &DocumentError{File: at.File, Doc: at.Doc, Line: at.Line, Err: e}
			}
			if !errors.Is(de.Err, ErrUnsupportedKind) {
				broken = true
			}
			errs = append(errs, de)
		}
	}
	// Without the spare room appending left: a loader keeps these.
	objs = slices.Clone(objs)
	if prev != nil {
		*prev = decoded{objs: objs, docs: slices.Clone(decodedDocs)}
	}
	return objs, errs, broken
}

// labelSets are the label maps of the slices decoded so far, by content.
type labelSets map[string]map[string]string

// share returns the map of an earlier slice with the same labels as m, or m:
// the slices of one Service carry the same labels (its name, what manages
// them), and a Go map costs 300 bytes or more however few its entries. The
// maps are never modified once decoded, as no object is.
func (ls labelSets) share(m map[string]string) map[string]string {
	if len(m) == 0 {
		return m
	}
	var b strings.Builder
	for _, k := range slices.Sorted(maps.Keys(m)) {
		// Lengths first: a key or value may hold any byte.
		fmt.Fprintf(&b, "%d:%s%d:%s", len(k), k, len(m[k]), m[k])
	}
	key := b.String()
	if shared, ok := ls[key]; ok {
		return shared
	}
	ls[key] = m
	return m
}

// docDigest is the first half of the SHA-256 of a document's text: 128 bits
// tell documents apart as surely as the whole, at half its memory.
type docDigest [sha256.Size / 2]byte

func digestOf(text []byte) docDigest {
	sum := sha256.Sum256(text)
	return docDigest(sum[:sha256.Size/2])
}

// decoded is what the last decoding of one file found: its objects in file
// order, and which of them each document that decoded whole gave.
type decoded struct {
	objs []object
	docs []docObjects
}

// docObjects are the objects of the document of digest: objs[start:end].
type docObjects struct {
	digest     docDigest
	start, end int32
}

func unjoin(err error) []error {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		return j.Unwrap()
	}
	return []error{err}
}

// document is one YAML document of a file: its text, 1-based index among non-empty
// documents and first line.
type document struct {
	text  []byte
	index int
	line  int
}

// splitDocuments cuts data at "---" separator lines, dropping documents that hold
// nothing but blank lines and comments (such as before a leading "---").
func splitDocuments(data []byte) []document {
	data = bytes.TrimPrefix(data, []byte("\ufeff"))
	var docs []document
	var cur []byte
	start, lineNo := 1, 0
	flush := func() {
		if !onlyComments(cur) {
			docs = append(docs, document{text: cur, index: len(docs) + 1, line: start})
		}
		cur = nil
	}
	for len(data) > 0 {
		lineNo++
		line, rest, found := bytes.Cut(data, []byte("\n"))
		data = rest
		if sep, after := separator(line); sep {
			flush()
			start = lineNo
			if len(after) > 0 {
				// "--- {inline: document}" starts the next document on this line.
				cur = append(cur, after...)
				cur = append(cur, '\n')
			} else {
				start = lineNo + 1
			}
			continue
		}
		cur = append(cur, line...)
		if found {
			cur = append(cur, '\n')
		}
	}
	flush()
	return docs
}

// separator reports whether line is a YAML document separator and returns what
// follows the marker on the same line (without a comment).
func separator(line []byte) (bool, []byte) {
	line = bytes.TrimRight(line, " \t\r")
	if !bytes.HasPrefix(line, []byte("---")) {
		return false, nil
	}
	after := line[3:]
	if len(after) == 0 {
		return true, nil
	}
	if after[0] != ' ' && after[0] != '\t' {
		return false, nil // "----" or "---x" is content, not a separator
	}
	after = bytes.TrimSpace(after)
	if bytes.HasPrefix(after, []byte("#")) {
		return true, nil
	}
	return true, after
}

func onlyComments(text []byte) bool {
	for line := range bytes.Lines(text) {
		line = bytes.TrimSpace(line)
		if len(line) > 0 && line[0] != '#' {
			return false
		}
	}
	return true
}

// toJSON turns a document into JSON, with syntax errors located by file line. It
// returns nil, nil for a document whose value is null.
func toJSON(d document) ([]byte, error) {
	trimmed := bytes.TrimSpace(d.text)
	if trimmed[0] == '{' || trimmed[0] == '[' {
		// JSON is decoded as JSON: a YAML parser would accept it too, but reports
		// JSON mistakes in YAML terms.
		var v any
		if err := json.Unmarshal(d.text, &v); err != nil {
			var se *json.SyntaxError
			if errors.As(err, &se) {
				line := d.line + bytes.Count(d.text[:min(int(se.Offset), len(d.text))], []byte("\n"))
				return nil, fmt.Errorf("line %d: %v", line, err)
			}
			return nil, err
		}
		if v == nil {
			return nil, nil
		}
		return trimmed, nil
	}
	js, err := yaml.YAMLToJSONStrict(d.text)
	if err != nil {
		// Parse again behind leading newlines, which shift the parser's line
		// numbers from the document's own to the file's. Only on this error path:
		// padding every document would make a long file quadratic to read.
		padded := append(bytes.Repeat([]byte("\n"), d.line-1), d.text...)
		if _, perr := yaml.YAMLToJSONStrict(padded); perr != nil {
			err = perr
		}
		return nil, err
	}
	if string(js) == "null" {
		return nil, nil
	}
	return js, nil
}

// decodeObject decodes one JSON object into Services and EndpointSlices; a List's
// items are decoded one by one (allowList is false for items, since Lists do not nest).
func decodeObject(js []byte, at DocumentError, allowList bool) ([]object, error) {
	var tm metav1.TypeMeta
	if err := json.Unmarshal(js, &tm); err != nil {
		return nil, fmt.Errorf("not a Kubernetes object: %v", err)
	}
	switch {
	case tm.Kind == "":
		return nil, errors.New("missing kind")
	case tm.APIVersion == "":
		return nil, fmt.Errorf("%s: missing apiVersion", tm.Kind)
	}
	gvk := schema.FromAPIVersionAndKind(tm.APIVersion, tm.Kind)
	if !readKinds[gvk] || (!allowList && strings.HasSuffix(tm.Kind, "List")) {
		return nil, fmt.Errorf("%w %s (apiVersion %s): only Service (v1) and EndpointSlice (discovery.k8s.io/v1) are read, also in a List",
			ErrUnsupportedKind, tm.Kind, tm.APIVersion)
	}
	obj, _, err := decoder.Decode(js, nil, nil)
	if err != nil {
		return nil, fmt.Errorf("%s: %v", tm.Kind, err)
	}
	switch o := obj.(type) {
	case *v1.Service:
		defaultNamespace(&o.ObjectMeta)
		return []object{newObject(o, nil, at, -1)}, nil
	case *discoveryv1.EndpointSlice:
		defaultNamespace(&o.ObjectMeta)
		return []object{newObject(nil, o, at, -1)}, nil
	case *v1.ServiceList:
		var objs []object
		for i := range o.Items {
			defaultNamespace(&o.Items[i].ObjectMeta)
			objs = append(objs, newObject(&o.Items[i], nil, at, i))
		}
		return objs, nil
	case *discoveryv1.EndpointSliceList:
		var objs []object
		for i := range o.Items {
			defaultNamespace(&o.Items[i].ObjectMeta)
			objs = append(objs, newObject(nil, &o.Items[i], at, i))
		}
		return objs, nil
	case *v1.List:
		var objs []object
		var errs []error
		for i, item := range o.Items {
			itemAt := withItem(at, i)
			got, err := decodeObject(item.Raw, itemAt, false)
			if err != nil {
				itemAt.Err = err
				errs = append(errs, &itemAt)
				continue
			}
			for j := range got {
				got[j].item = int32(i)
			}
			objs = append(objs, got...)
		}
		return objs, errors.Join(errs...)
	}
	return nil, fmt.Errorf("%w %T", ErrUnsupportedKind, obj) // unreachable: readKinds limits the types
}

func withItem(at DocumentError, i int) DocumentError {
	at.Item = fmt.Sprintf("items[%d]", i)
	return at
}

func defaultNamespace(m *metav1.ObjectMeta) {
	if m.Namespace == "" {
		m.Namespace = metav1.NamespaceDefault
	}
}
