package file

import (
	"errors"
	"reflect"
	"testing"

	"github.com/uproxy/uproxy/service"
)

// FuzzDecode feeds Decode arbitrary manifest bytes. It must never panic; every
// error is a *DocumentError naming the file; every object decoded is a complete
// Service or EndpointSlice with a name and a namespace; decoding is deterministic;
// and the objects convert into a Snapshot without panicking either.
func FuzzDecode(f *testing.F) {
	for _, s := range []string{
		webService,
		webSlice,
		webService + "---\n" + webSlice,
		"",
		"---\n---\n",
		"null\n---\n~\n",
		`{"apiVersion":"v1","kind":"Service","metadata":{"name":"a"},"spec":{"ports":[{"port":1}]}}`,
		`{"apiVersion":"v1","kind":"List","items":[{"apiVersion":"v1","kind":"Service","metadata":{"name":"a"}},{"kind":"Pod"}]}`,
		"apiVersion: v1\nkind: ServiceList\nitems:\n- metadata: {name: x}\n  spec: {clusterIP: 10.0.0.1, ports: [{port: 80}]}\n",
		"apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n",
		"apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {clusterIp: 1.2.3.4}\n",
		"apiVersion: v1\nkind: Service\nmetadata: {name: a, name: b}\n",
		"kind: [\n",
		"a: &a [*a, *a]\nb: &b [*a, *a]\n",
		"apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: s, labels: {kubernetes.io/service-name: web}}\naddressType: IPv6\nports: [{port: 0}]\nendpoints: [{addresses: [\"10.0.0.1\"]}]\n",
		"--- # comment\n# only a comment\n---\n",
		"\xff\xfe\x00",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		const name = "fuzz.yaml"
		svcs, slices, errs := Decode(name, data)
		for _, err := range errs {
			var de *DocumentError
			if !errors.As(err, &de) || de.File != name || de.Err == nil {
				t.Fatalf("got error %q (%T), want a *DocumentError for %s with a cause", err, err, name)
			}
		}
		for _, s := range svcs {
			if s == nil || s.Namespace == "" {
				t.Fatalf("got Service %+v, want a non-nil Service with a namespace", s)
			}
		}
		for _, s := range slices {
			if s == nil || s.Namespace == "" {
				t.Fatalf("got EndpointSlice %+v, want a non-nil EndpointSlice with a namespace", s)
			}
		}
		svcs2, slices2, errs2 := Decode(name, data)
		if !reflect.DeepEqual(svcs, svcs2) || !reflect.DeepEqual(slices, slices2) || len(errs) != len(errs2) {
			t.Fatalf("two Decodes of the same bytes differ")
		}
		service.Build(svcs, slices, service.BuildOptions{NodeName: "n1"})
	})
}
