package file

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
)

const (
	webService = `apiVersion: v1
kind: Service
metadata:
  name: web
spec:
  clusterIP: 10.96.0.10
  ports:
  - port: 80
`
	webSlice = `apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: default
  labels:
    kubernetes.io/service-name: web
addressType: IPv4
ports:
- port: 8080
endpoints:
- addresses: ["10.0.0.1"]
`
)

// names lists the decoded objects as "Kind ns/name".
func names(t *testing.T, name, data string) ([]string, []string) {
	t.Helper()
	svcs, slices, errs := Decode(name, []byte(data))
	var got []string
	for _, s := range svcs {
		got = append(got, "Service "+s.Namespace+"/"+s.Name)
	}
	for _, s := range slices {
		got = append(got, "EndpointSlice "+s.Namespace+"/"+s.Name)
	}
	var msgs []string
	for _, err := range errs {
		var de *DocumentError
		if !errors.As(err, &de) {
			t.Errorf("got error %q of type %T, want *DocumentError", err, err)
		}
		msgs = append(msgs, err.Error())
	}
	return got, msgs
}

func TestDecode(t *testing.T) {
	tests := []struct {
		name     string
		file     string
		data     string
		want     []string
		wantErrs []string
	}{
		{
			name: "multi-document YAML with comments and empty documents",
			file: "web.yaml",
			data: "# Services for the demo\n---\n" + webService + "---\n# nothing here\n---\n" + webSlice + "---\n",
			want: []string{"Service default/web", "EndpointSlice default/web-1"},
		},
		{
			name: "JSON object",
			file: "web.json",
			data: `{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "prod"},
				"spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80}]}}`,
			want: []string{"Service prod/web"},
		},
		{
			name: "JSON v1 List of both kinds",
			file: "all.json",
			data: `{"apiVersion": "v1", "kind": "List", "items": [
				{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"}, "spec": {"ports": [{"port": 80}]}},
				{"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "metadata": {"name": "web-1"}, "addressType": "IPv4", "endpoints": []}
			]}`,
			want: []string{"Service default/web", "EndpointSlice default/web-1"},
		},
		{
			name: "YAML ServiceList and EndpointSliceList",
			file: "lists.yaml",
			data: "apiVersion: v1\nkind: ServiceList\nitems:\n- metadata: {name: a}\n- metadata: {name: b}\n---\n" +
				"apiVersion: discovery.k8s.io/v1\nkind: EndpointSliceList\nitems:\n- metadata: {name: a-1}\n  addressType: IPv4\n  endpoints: []\n",
			want: []string{"Service default/a", "Service default/b", "EndpointSlice default/a-1"},
		},
		{
			name:     "YAML syntax error names file, document and line",
			file:     "web.yaml",
			data:     webService + "---\napiVersion: v1\nkind: Service\nmetadata:\n  name: broken\n   namespace: x\n",
			want:     []string{"Service default/web"},
			wantErrs: []string{"web.yaml: document 2 (line 10): yaml: line 14: mapping values are not allowed in this context"},
		},
		{
			name:     "JSON syntax error with line",
			file:     "web.json",
			data:     "{\n  \"apiVersion\": \"v1\",\n  \"kind\": \"Service\"\n  \"metadata\": {}\n}\n",
			wantErrs: []string{"web.json: document 1 (line 1): line 4: invalid character '\"' after object key:value pair"},
		},
		{
			name:     "unknown kind reported, other documents kept",
			file:     "app.yaml",
			data:     "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: web\n---\n" + webService,
			want:     []string{"Service default/web"},
			wantErrs: []string{"app.yaml: document 1 (line 1): unsupported kind Deployment (apiVersion apps/v1): only Service (v1) and EndpointSlice (discovery.k8s.io/v1) are read, also in a List"},
		},
		{
			name:     "old API version is an unsupported kind",
			file:     "old.yaml",
			data:     strings.Replace(webSlice, "discovery.k8s.io/v1", "discovery.k8s.io/v1beta1", 1),
			wantErrs: []string{"old.yaml: document 1 (line 1): unsupported kind EndpointSlice (apiVersion discovery.k8s.io/v1beta1): only Service (v1) and EndpointSlice (discovery.k8s.io/v1) are read, also in a List"},
		},
		{
			name:     "unknown field is an error",
			file:     "web.yaml",
			data:     strings.Replace(webService, "clusterIP:", "clusterIp:", 1),
			wantErrs: []string{`web.yaml: document 1 (line 1): Service: strict decoding error: unknown field "spec.clusterIp"`},
		},
		{
			name:     "duplicate key is an error",
			file:     "web.yaml",
			data:     webService + "  - port: 81\nspec: {}\n",
			wantErrs: []string{`web.yaml: document 1 (line 1): yaml: unmarshal errors:` + "\n" + `  line 10: key "spec" already set in map`},
		},
		{
			name:     "missing kind",
			file:     "x.yaml",
			data:     "apiVersion: v1\nmetadata:\n  name: x\n",
			wantErrs: []string{"x.yaml: document 1 (line 1): missing kind"},
		},
		{
			name:     "not an object",
			file:     "x.yaml",
			data:     "---\njust a string\n",
			wantErrs: []string{"x.yaml: document 1 (line 2): not a Kubernetes object: json: cannot unmarshal string into Go value of type v1.TypeMeta"},
		},
		{
			name: "List item errors name the item",
			file: "all.json",
			data: `{"apiVersion": "v1", "kind": "List", "items": [
				{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}},
				{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"}, "spec": {"ports": [{"port": "eighty"}]}},
				{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "ok"}}
			]}`,
			want: []string{"Service default/ok"},
			wantErrs: []string{
				"all.json: document 1 (line 1): items[0]: unsupported kind ConfigMap (apiVersion v1): only Service (v1) and EndpointSlice (discovery.k8s.io/v1) are read, also in a List",
				`all.json: document 1 (line 1): items[1]: Service: json: cannot unmarshal string into Go struct field ServicePort.spec.ports.port of type int32`,
			},
		},
		{
			name: "CRLF line ends and a separator with a comment",
			file: "win.yaml",
			data: strings.ReplaceAll(webService+"--- # next\n"+webSlice, "\n", "\r\n"),
			want: []string{"Service default/web", "EndpointSlice default/web-1"},
		},
		{
			name: "empty file",
			file: "empty.yaml",
			data: "",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, errs := names(t, tt.file, tt.data)
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got objects %q, want %q", got, tt.want)
			}
			if !reflect.DeepEqual(errs, tt.wantErrs) {
				t.Errorf("got errors\n%s\nwant\n%s", strings.Join(errs, "\n"), strings.Join(tt.wantErrs, "\n"))
			}
		})
	}
}

func TestDecodeFileBroken(t *testing.T) {
	tests := []struct {
		name       string
		data       string
		wantBroken bool
	}{
		{name: "valid", data: webService},
		{name: "unsupported kind only", data: "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n---\n" + webService},
		{name: "syntax error", data: webService + "---\nkind: [\n", wantBroken: true},
		{name: "unknown field", data: webService + "---\n" + strings.Replace(webSlice, "ports:", "portz:", 1), wantBroken: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, _, broken := decodeFile("f.yaml", []byte(tt.data), nil)
			if broken != tt.wantBroken {
				t.Errorf("got broken %v, want %v", broken, tt.wantBroken)
			}
		})
	}
}

func BenchmarkDecode(b *testing.B) {
	// 500 Services and 500 EndpointSlices in one multi-document file.
	var sb strings.Builder
	for i := range 500 {
		sb.WriteString(strings.Replace(webService, "name: web", fmt.Sprintf("name: web-%d", i), 1))
		sb.WriteString("---\n")
		sb.WriteString(strings.Replace(webSlice, "name: web-1", fmt.Sprintf("name: web-%d-1", i), 1))
		sb.WriteString("---\n")
	}
	data := []byte(sb.String())
	b.SetBytes(int64(len(data)))
	b.ReportAllocs()
	for b.Loop() {
		if _, _, errs := Decode("bench.yaml", data); len(errs) > 0 {
			b.Fatal(errs[0])
		}
	}
}
