package file

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/service"
)

// loadOne loads one manifest file of data and returns its Snapshot, with the
// file's path cut from the errors.
func loadOne(t *testing.T, data string) (*service.Snapshot, []string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "m.yaml")
	writeFile(t, path, data)
	snap, err := Load(path, service.BuildOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var errs []string
	for _, e := range errorStrings(snap) {
		errs = append(errs, strings.TrimPrefix(e, path+": "))
	}
	return snap, errs
}

// slice of Service web for the tests below: port p80 to 8080.
func webSliceYAML(addrs ...string) string { return sliceYAML("web-1", "web", 80, addrs...) }

// TestLoadRefusesSpecialServiceAddresses: an address of the node itself, or
// of no one host, is refused in every field that makes a Service address, as
// the API server refuses it; the Service is then not served, and the problem
// names the field and what the address is.
func TestLoadRefusesSpecialServiceAddresses(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		spec string // the Service's spec and status, YAML flow style
		want []string
	}{
		{
			name: "loopback external IP",
			spec: `spec: {clusterIP: 10.96.0.10, externalIPs: [127.0.0.1], ports: [{name: p80, port: 80}]}`,
			want: []string{"document 1 (line 1): Service default/web: spec.externalIPs[0]: 127.0.0.1 is a loopback address"},
		},
		{
			name: "unspecified and multicast external IPs, after a good one",
			spec: `spec: {clusterIP: 10.96.0.10, externalIPs: [192.0.2.1, 0.0.0.0, 224.0.0.1, "::"], ports: [{name: p80, port: 80}]}`,
			want: []string{
				"document 1 (line 1): Service default/web: spec.externalIPs[1]: 0.0.0.0 is an unspecified address",
				"document 1 (line 1): Service default/web: spec.externalIPs[2]: 224.0.0.1 is a multicast address",
				"document 1 (line 1): Service default/web: spec.externalIPs[3]: :: is an unspecified address",
			},
		},
		{
			name: "loopback cluster IP",
			spec: `spec: {clusterIP: 127.0.0.1, ports: [{name: p80, port: 80}]}`,
			want: []string{"document 1 (line 1): Service default/web: spec.clusterIP: 127.0.0.1 is a loopback address"},
		},
		{
			name: "link-local cluster IP, also in clusterIPs: said once",
			spec: `spec: {clusterIP: 169.254.1.1, clusterIPs: [169.254.1.1], ports: [{name: p80, port: 80}]}`,
			want: []string{"document 1 (line 1): Service default/web: spec.clusterIPs[0]: 169.254.1.1 is a link-local address"},
		},
		{
			name: "IPv6 link-local secondary cluster IP",
			spec: `spec: {clusterIP: 10.96.0.10, clusterIPs: [10.96.0.10, "fe80::1"], ports: [{name: p80, port: 80}]}`,
			want: []string{"document 1 (line 1): Service default/web: spec.clusterIPs[1]: fe80::1 is a link-local address"},
		},
		{
			name: "IPv4-mapped loopback",
			spec: `spec: {clusterIP: 10.96.0.10, externalIPs: ["::ffff:127.0.0.1"], ports: [{name: p80, port: 80}]}`,
			want: []string{"document 1 (line 1): Service default/web: spec.externalIPs[0]: ::ffff:127.0.0.1 is a loopback address"},
		},
		{
			name: "broadcast loadBalancerIP",
			spec: `spec: {type: LoadBalancer, clusterIP: 10.96.0.10, loadBalancerIP: 255.255.255.255, ports: [{name: p80, port: 80, nodePort: 30080}]}`,
			want: []string{"document 1 (line 1): Service default/web: spec.loadBalancerIP: 255.255.255.255 is the broadcast address"},
		},
		{
			name: "loopback load balancer ingress IP",
			spec: `spec: {type: LoadBalancer, clusterIP: 10.96.0.10, ports: [{name: p80, port: 80, nodePort: 30080}]}
status: {loadBalancer: {ingress: [{hostname: lb.example}, {ip: 127.0.0.1}]}}`,
			want: []string{"document 1 (line 1): Service default/web: status.loadBalancer.ingress[1].ip: 127.0.0.1 is a loopback address"},
		},
		{
			name: "ordinary addresses",
			spec: `spec: {type: LoadBalancer, clusterIP: 10.96.0.10, externalIPs: [192.0.2.1, "2001:db8::1"], loadBalancerIP: 198.51.100.1, ports: [{name: p80, port: 80, nodePort: 30080}]}
status: {loadBalancer: {ingress: [{ip: 198.51.100.1}]}}`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			snap, errs := loadOne(t, "apiVersion: v1\nkind: Service\nmetadata: {name: web}\n"+tt.spec+"\n---\n"+webSliceYAML("10.0.0.1"))
			if !slices.Equal(errs, tt.want) {
				t.Errorf("errors:\ngot  %q\nwant %q", errs, tt.want)
			}
			served := snap.Lookup(service.PortName{Namespace: "default", Name: "web", Port: "p80"}) != nil
			if served != (len(tt.want) == 0) {
				t.Errorf("got served %v, want %v (ports %q)", served, len(tt.want) == 0, summary(snap))
			}
		})
	}
}

// TestLoadRefusesSpecialEndpointAddresses: an endpoint address of the node
// itself, of no one host, or of the slice's own Service refuses the slice,
// naming the endpoint and the address; the Service is served without it.
func TestLoadRefusesSpecialEndpointAddresses(t *testing.T) {
	t.Parallel()
	web := svcYAML("web", "10.96.0.12", 80)
	tests := []struct {
		name  string
		svc   string
		addrs []string
		want  []string
	}{
		{
			name:  "the node's own and no one host's",
			svc:   web,
			addrs: []string{"10.0.0.1", "127.0.0.1", "0.0.0.0", "255.255.255.255", "224.0.0.5", "169.254.1.1"},
			want: []string{
				"document 2 (line 11): EndpointSlice default/web-1: endpoints[1].addresses[0]: 127.0.0.1 is a loopback address" + loopbackEndpointHint,
				"document 2 (line 11): EndpointSlice default/web-1: endpoints[2].addresses[0]: 0.0.0.0 is an unspecified address",
				"document 2 (line 11): EndpointSlice default/web-1: endpoints[3].addresses[0]: 255.255.255.255 is the broadcast address",
				"document 2 (line 11): EndpointSlice default/web-1: endpoints[4].addresses[0]: 224.0.0.5 is a multicast address",
				"document 2 (line 11): EndpointSlice default/web-1: endpoints[5].addresses[0]: 169.254.1.1 is a link-local address",
			},
		},
		{
			name:  "the Service's own cluster IP",
			svc:   web,
			addrs: []string{"10.96.0.12"},
			want: []string{"document 2 (line 11): EndpointSlice default/web-1: endpoints[0].addresses[0]: 10.96.0.12 is Service default/web's own address " +
				"(spec.clusterIP): connections to it would loop back to the Service"},
		},
		{
			name:  "the Service's own external IP",
			svc:   strings.Replace(web, "  ports:", "  externalIPs: [192.0.2.7]\n  ports:", 1),
			addrs: []string{"10.0.0.1", "192.0.2.7"},
			want: []string{"document 2 (line 12): EndpointSlice default/web-1: endpoints[1].addresses[0]: 192.0.2.7 is Service default/web's own address " +
				"(spec.externalIPs[0]): connections to it would loop back to the Service"},
		},
		{
			name:  "another Service's cluster IP: not a loop of its own",
			svc:   web + "---\n" + svcYAML("other", "10.96.0.13", 80),
			addrs: []string{"10.96.0.13"},
		},
		{
			name:  "ordinary",
			svc:   web,
			addrs: []string{"10.0.0.1", "10.0.0.2"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			snap, errs := loadOne(t, tt.svc+"---\n"+webSliceYAML(tt.addrs...))
			if !slices.Equal(errs, tt.want) {
				t.Errorf("errors:\ngot  %q\nwant %q", errs, tt.want)
			}
			p := snap.Lookup(service.PortName{Namespace: "default", Name: "web", Port: "p80"})
			if p == nil {
				t.Fatalf("got ports %q, want default/web:p80 served", summary(snap))
			}
			if want := len(tt.addrs); len(tt.want) > 0 && len(p.Endpoints) != 0 || len(tt.want) == 0 && len(p.Endpoints) != want {
				t.Errorf("got endpoints %v, want none of a refused slice, all of a good one", p.Endpoints)
			}
		})
	}
}

// TestLoadRefusesInvalidNames: names are checked as the API server checks
// them: a Service's as a DNS-1035 label, a slice's as a DNS-1123 subdomain,
// namespaces and port names as DNS-1123 labels.
func TestLoadRefusesInvalidNames(t *testing.T) {
	t.Parallel()
	svc := func(meta, portName string) string {
		return "apiVersion: v1\nkind: Service\nmetadata: " + meta + "\nspec: {clusterIP: 10.96.0.10, ports: [{name: " + portName + ", port: 80}]}\n"
	}
	slice := func(meta, portName string) string {
		return "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: " + meta +
			"\naddressType: IPv4\nports: [{name: " + portName + ", port: 8080}]\nendpoints: [{addresses: [10.0.0.1]}]\n"
	}
	const sliceMeta = "{name: web.1, labels: {kubernetes.io/service-name: web}}"
	long := strings.Repeat("a", 64)
	tests := []struct {
		name string
		data string
		want string // the start of the one error; "" for none
	}{
		{"valid", svc("{name: web}", "http") + "---\n" + slice(sliceMeta, "http"), ""},
		{"a quote in a Service name", svc(`{name: 'a"b'}`, "http"),
			`document 1 (line 1): Service default/a"b: metadata.name: "a\"b" is not a valid DNS-1035 label: `},
		{"a Service name starting with a digit", svc("{name: 1web}", "http"),
			`document 1 (line 1): Service default/1web: metadata.name: "1web" is not a valid DNS-1035 label: `},
		{"a Service name too long", svc("{name: "+long+"}", "http"),
			`document 1 (line 1): Service default/` + long + `: metadata.name: "` + long + `" is not a valid DNS-1035 label: must be no more than 63 characters`},
		{"a dot in a namespace", svc("{name: web, namespace: a.b}", "http"),
			`document 1 (line 1): Service a.b/web: metadata.namespace: "a.b" is not a valid DNS-1123 label: `},
		{"an upper-case Service port name", svc("{name: web}", "HTTP"),
			`document 1 (line 1): Service default/web: spec.ports[0].name: "HTTP" is not a valid DNS-1123 label: `},
		{"an underscore in a slice name", slice("{name: web_1, labels: {kubernetes.io/service-name: web}}", "http"),
			`document 1 (line 1): EndpointSlice default/web_1: metadata.name: "web_1" is not a valid DNS-1123 subdomain: `},
		{"a quote in a slice port name", slice(sliceMeta, `'a"b'`),
			`document 1 (line 1): EndpointSlice default/web.1: ports[0].name: "a\"b" is not a valid DNS-1123 label: `},
		{"a quote in a slice's Service name", slice(`{name: web.1, labels: {kubernetes.io/service-name: 'a"b'}}`, "http"),
			`document 1 (line 1): EndpointSlice default/web.1: metadata.labels[kubernetes.io/service-name]: "a\"b" is not a valid label value: `},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			snap, errs := loadOne(t, tt.data)
			switch {
			case tt.want == "" && len(errs) > 0:
				t.Errorf("got errors %q, want none", errs)
			case tt.want != "" && (len(errs) != 1 || !strings.HasPrefix(errs[0], tt.want)):
				t.Errorf("got errors %q, want one starting %q", errs, tt.want)
			case tt.want != "" && len(snap.Ports) > 0:
				t.Errorf("got ports %q, want none: the object is refused", summary(snap))
			}
		})
	}
}

// TestLoadKeepsLastGoodUnderNewRules: an edit that the rules above refuse
// keeps the object's last good version, as any invalid edit does, and so
// does a slice that the edit of its Service turns into a loop.
func TestLoadKeepsLastGoodUnderNewRules(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "web.yaml")
	l := newLoader(path, false, service.BuildOptions{})
	load := func(data string) (ports, errs []string) {
		writeFile(t, path, data)
		snap := l.load()
		for _, e := range errorStrings(snap) {
			errs = append(errs, strings.TrimPrefix(e, path+": "))
		}
		return summary(snap), errs
	}
	good := svcYAML("web", "10.96.0.12", 80) + "---\n" + webSliceYAML("10.0.0.1")
	steps := []struct {
		name      string
		data      string
		wantPorts []string
		wantErr   string // the start of the one error; "" for none
	}{
		{"good", good, []string{"default/web:p80=80/TCP[10.0.0.1:8080]"}, ""},
		{"a loopback external IP: the Service's last good version",
			strings.Replace(good, "  ports:", "  externalIPs: [127.0.0.1]\n  ports:", 1),
			[]string{"default/web:p80=80/TCP[10.0.0.1:8080]"},
			"document 1 (line 1): Service default/web: spec.externalIPs[0]: 127.0.0.1 is a loopback address"},
		{"a loopback endpoint: the slice's last good version",
			svcYAML("web", "10.96.0.12", 80) + "---\n" + webSliceYAML("127.0.0.1"),
			[]string{"default/web:p80=80/TCP[10.0.0.1:8080]"},
			"document 2 (line 11): EndpointSlice default/web-1: endpoints[0].addresses[0]: 127.0.0.1 is a loopback address"},
		{"an endpoint at the cluster IP: the slice's last good version",
			svcYAML("web", "10.96.0.12", 80) + "---\n" + webSliceYAML("10.96.0.12"),
			[]string{"default/web:p80=80/TCP[10.0.0.1:8080]"},
			"document 2 (line 11): EndpointSlice default/web-1: endpoints[0].addresses[0]: 10.96.0.12 is Service default/web's own address"},
		{"a bad Service name: another object, new and refused",
			strings.Replace(good, "name: web\n", "name: Web\n", 1),
			nil,
			`document 1 (line 1): Service default/Web: metadata.name: "Web" is not a valid DNS-1035 label`},
		{"good again", good, []string{"default/web:p80=80/TCP[10.0.0.1:8080]"}, ""},
		{"the Service moved onto its endpoint: the slice has no good version then",
			svcYAML("web", "10.0.0.1", 80) + "---\n" + webSliceYAML("10.0.0.1"),
			[]string{"default/web:p80=80/TCP[]"},
			"document 2 (line 11): EndpointSlice default/web-1: endpoints[0].addresses[0]: 10.0.0.1 is Service default/web's own address"},
		{"and back", good, []string{"default/web:p80=80/TCP[10.0.0.1:8080]"}, ""},
	}
	for _, st := range steps {
		ports, errs := load(st.data)
		if !slices.Equal(ports, st.wantPorts) {
			t.Errorf("%s: got ports %q, want %q", st.name, ports, st.wantPorts)
		}
		switch {
		case st.wantErr == "" && len(errs) > 0:
			t.Errorf("%s: got errors %q, want none", st.name, errs)
		case st.wantErr != "" && (len(errs) != 1 || !strings.HasPrefix(errs[0], st.wantErr)):
			t.Errorf("%s: got errors %q, want one starting %q", st.name, errs, st.wantErr)
		}
	}
}

// TestLoadSaysWhatAFileWithAnUndecodableDocumentDoes: the documents' errors
// are completed by one about the file, saying that none of it is used and
// what stays in force instead.
func TestLoadSaysWhatAFileWithAnUndecodableDocumentDoes(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "two.yaml")
	l := newLoader(path, false, service.BuildOptions{})
	const broken = "kind: Service\nmetadata: {name: typo}\n"
	good := svcYAML("web", "10.96.0.12", 80) + "---\n" + webSliceYAML("10.0.0.1")
	steps := []struct {
		name      string
		data      string
		wantPorts []string
		wantErrs  []string
	}{
		{"new file, its third document broken: nothing of it", good + "---\n" + broken, nil, []string{
			"document 3 (line 24): Service: missing apiVersion",
			"not used, as document 3 cannot be decoded: none of its documents is read (there is no earlier content of it to keep) until it can be",
		}},
		{"fixed", good, []string{"default/web:p80=80/TCP[10.0.0.1:8080]"}, nil},
		{"broken again: its last content stays", svcYAML("web", "10.96.0.12", 81) + "---\n" + broken, []string{"default/web:p80=80/TCP[10.0.0.1:8080]"}, []string{
			"document 2 (line 11): Service: missing apiVersion",
			"not used, as document 2 cannot be decoded: none of its documents is read, and the 2 objects of its last content that could be decoded stay in force",
		}},
		{"an unsupported kind is not a broken document", good + "---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n",
			[]string{"default/web:p80=80/TCP[10.0.0.1:8080]"}, []string{
				"document 3 (line 24): unsupported kind ConfigMap (apiVersion v1): only Service (v1) and EndpointSlice (discovery.k8s.io/v1) are read, also in a List",
			}},
	}
	for _, st := range steps {
		writeFile(t, path, st.data)
		snap := l.load()
		var errs []string
		for _, e := range errorStrings(snap) {
			errs = append(errs, strings.TrimPrefix(e, path+": "))
		}
		if got := summary(snap); !slices.Equal(got, st.wantPorts) {
			t.Errorf("%s: got ports %q, want %q", st.name, got, st.wantPorts)
		}
		if !slices.Equal(errs, st.wantErrs) {
			t.Errorf("%s: errors:\ngot  %q\nwant %q", st.name, errs, st.wantErrs)
		}
	}
}

// TestLoadNamesTheFileOfEveryProblem: the problems of a Service that is
// served all the same (found when it is built, not when it is checked) name
// the file and document too.
func TestLoadNamesTheFileOfEveryProblem(t *testing.T) {
	t.Parallel()
	_, errs := loadOne(t, svcYAML("web", "10.96.0.12", 80)+`---
apiVersion: v1
kind: Service
metadata: {name: ann, annotations: {uproxy.io/scheduler: wrr}}
spec: {ports: [{name: p, port: 80}]}
`)
	want := []string{
		"document 2 (line 11): Service default/ann: metadata.annotations[uproxy.io/scheduler]: ",
		"document 2 (line 11): Service default/ann: spec.clusterIP: not set",
	}
	if len(errs) != len(want) {
		t.Fatalf("got errors %q, want %d", errs, len(want))
	}
	for i := range want {
		if !strings.HasPrefix(errs[i], want[i]) {
			t.Errorf("error %d: got %q, want it to start %q", i, errs[i], want[i])
		}
	}
}

// TestLoadRefusesSlicesOverTheLimits: an EndpointSlice over one of the API
// server's limits (1000 endpoints, 20000 ports, 100 addresses an endpoint) is
// refused whole, naming the list, and its last good version stays; over the
// endpoints' limit its endpoints are not checked one by one.
func TestLoadRefusesSlicesOverTheLimits(t *testing.T) {
	t.Parallel()
	// slice is web's slice of nPorts ports (the first p80) and nEndpoints
	// endpoints at addr(i), the first with addresses addresses.
	slice := func(nPorts, nEndpoints, addresses int, addr func(i int) string) string {
		var b strings.Builder
		b.WriteString("apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports:\n")
		for i := range nPorts {
			fmt.Fprintf(&b, "- {name: p%d, port: %d}\n", 80+i, 8080+i%1000)
		}
		b.WriteString("endpoints:\n")
		for i := range nEndpoints {
			addrs := []string{addr(i)}
			for j := 1; i == 0 && j < addresses; j++ {
				addrs = append(addrs, fmt.Sprintf("10.1.0.%d", j))
			}
			fmt.Fprintf(&b, "- addresses: [%s]\n", strings.Join(addrs, ", "))
		}
		return b.String()
	}
	ordinary := func(i int) string { return fmt.Sprintf("10.0.%d.%d", i/256, i%256) }
	path := filepath.Join(t.TempDir(), "web.yaml")
	l := newLoader(path, false, service.BuildOptions{})
	svc := svcYAML("web", "10.96.0.12", 80) + "---\n"
	const at = "document 2 (line 11): EndpointSlice default/web-1: "
	steps := []struct {
		name          string
		slice         string
		wantEndpoints int // of default/web:p80; 0: not counted
		wantErrs      []string
	}{
		{"an endpoint at the limit", slice(1, 1, 100, ordinary), 0, nil},
		{"the slice at the limits", slice(20000, 1000, 1, ordinary), 1000, nil},
		{"an endpoint over", slice(1, 2, 101, ordinary), 1000, []string{at + "endpoints[0].addresses: 101 items, must have at most 100"}},
		{"endpoints over", slice(1, 1001, 1, ordinary), 1000, []string{at + "endpoints: 1001 items, must have at most 1000"}},
		{"endpoints over, each of them refused too: said once", slice(1, 50000, 1, func(int) string { return "127.0.0.1" }), 1000,
			[]string{at + "endpoints: 50000 items, must have at most 1000"}},
		{"ports over", slice(20001, 1, 1, ordinary), 1000, []string{at + "ports: 20001 items, must have at most 20000"}},
		{"within again", slice(1, 2, 1, ordinary), 2, nil},
	}
	for _, st := range steps {
		writeFile(t, path, svc+st.slice)
		snap := l.load()
		var errs []string
		for _, e := range errorStrings(snap) {
			errs = append(errs, strings.TrimPrefix(e, path+": "))
		}
		if !slices.Equal(errs, st.wantErrs) {
			t.Errorf("%s: errors:\ngot  %q\nwant %q", st.name, errs, st.wantErrs)
		}
		p := snap.Lookup(service.PortName{Namespace: "default", Name: "web", Port: "p80"})
		switch {
		case p == nil:
			t.Errorf("%s: default/web:p80 not served", st.name)
		case st.wantEndpoints > 0 && len(p.Endpoints) != st.wantEndpoints:
			t.Errorf("%s: got default/web:p80 with %d endpoints, want %d", st.name, len(p.Endpoints), st.wantEndpoints)
		}
	}
}

// TestLoadWarnsOfNoNodePort: a manifest's NodePort Service without its
// nodePort (nothing allocates one to a manifest) is served, on its cluster
// IP, and the problem says that the field must be set.
func TestLoadWarnsOfNoNodePort(t *testing.T) {
	t.Parallel()
	snap, errs := loadOne(t, `apiVersion: v1
kind: Service
metadata: {name: web}
spec: {type: NodePort, clusterIP: 10.96.0.12, ports: [{name: p80, port: 80, nodePort: 30080}, {name: p81, port: 81}]}
`)
	want := []string{"document 1 (line 1): Service default/web: spec.ports[1].nodePort: not set: manifests are not allocated NodePorts " +
		"(the API server would have allocated one), so this port of the NodePort Service is reached on no NodePort; set it to a port of the cluster's NodePort range"}
	if !slices.Equal(errs, want) {
		t.Errorf("errors:\ngot  %q\nwant %q", errs, want)
	}
	if got, want := summary(snap), []string{"default/web:p80=80/TCP[]", "default/web:p81=81/TCP[]"}; !slices.Equal(got, want) {
		t.Errorf("got ports %q, want %q: served all the same", got, want)
	}
}

// TestLoopbackEndpointsWhereOnlyTheNodeConnects: with LoopbackEndpoints (proxy
// ports on a loopback address alone, as the demo's) endpoints at loopback
// addresses are taken; the other special addresses are still refused.
func TestLoopbackEndpointsWhereOnlyTheNodeConnects(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "m.yaml")
	writeFile(t, path, svcYAML("web", "10.96.0.12", 80)+"---\n"+webSliceYAML("127.0.0.2", "127.0.0.3"))
	snap, err := (&Source{Path: path, LoopbackEndpoints: true}).Load()
	if err != nil {
		t.Fatal(err)
	}
	if errs := errorStrings(snap); len(errs) > 0 {
		t.Errorf("loopback endpoints with LoopbackEndpoints: got errors %q, want none", errs)
	}
	if p := snap.Lookup(service.PortName{Namespace: "default", Name: "web", Port: "p80"}); p == nil || len(p.Endpoints) != 2 {
		t.Errorf("got %q, want default/web:p80 with both endpoints", summary(snap))
	}
	writeFile(t, path, svcYAML("web", "10.96.0.12", 80)+"---\n"+webSliceYAML("127.0.0.2", "0.0.0.0"))
	snap, err = (&Source{Path: path, LoopbackEndpoints: true}).Load()
	if err != nil {
		t.Fatal(err)
	}
	if errs := errorStrings(snap); len(errs) != 1 || !strings.Contains(errs[0], "0.0.0.0 is an unspecified address") {
		t.Errorf("an unspecified endpoint with LoopbackEndpoints: got errors %q, want it refused", errs)
	}
}

// TestLoopbackEndpointRefusalSaysHowToTakeIt: a loopback endpoint refused
// (the proxy ports on every address) is refused as the API server refuses
// it, and the message names the setting under which uproxy takes it: the one
// that sets LoopbackEndpoints, --bind-address on a loopback address.
func TestLoopbackEndpointRefusalSaysHowToTakeIt(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "m.yaml")
	writeFile(t, path, svcYAML("web", "10.96.0.12", 80)+"---\n"+webSliceYAML("127.0.1.1"))
	snap, err := (&Source{Path: path}).Load()
	if err != nil {
		t.Fatal(err)
	}
	want := "document 2 (line 11): EndpointSlice default/web-1: endpoints[0].addresses[0]: 127.0.1.1 is a loopback address " +
		"(as the API server refuses it); endpoints at loopback addresses are taken only when --bind-address is a loopback address, " +
		"such as --bind-address 127.0.0.1 (the demo's), so that only the node's own processes reach the proxy ports"
	if errs := errorStrings(snap); len(errs) != 1 || !strings.HasSuffix(errs[0], want) {
		t.Errorf("got errors %q, want one ending %q", errs, want)
	}
	// The other special addresses are no matter of --bind-address: their
	// messages say nothing of it.
	writeFile(t, path, svcYAML("web", "10.96.0.12", 80)+"---\n"+webSliceYAML("0.0.0.0"))
	if snap, err = (&Source{Path: path}).Load(); err != nil {
		t.Fatal(err)
	}
	if errs := errorStrings(snap); len(errs) != 1 || strings.Contains(errs[0], "--bind-address") {
		t.Errorf("an unspecified endpoint: got errors %q, want one that does not name --bind-address", errs)
	}
}

// TestLoadRefusesInvalidServiceFields: the fields of a Service's spec that
// the proxy has no use for are still checked as the API server checks them,
// and a Service it would refuse is not served, with the field named. A field
// the API server defaults is accepted unset.
func TestLoadRefusesInvalidServiceFields(t *testing.T) {
	t.Parallel()
	const prefix = "document 1 (line 1): Service default/web: "
	tests := []struct {
		name string
		spec string // the Service's spec, YAML flow style
		want []string
	}{
		{name: "targetPort unset", spec: `{clusterIP: 10.96.0.10, ports: [{name: p80, port: 80}]}`},
		{name: "targetPort 0, defaulted to the port", spec: `{clusterIP: 10.96.0.10, ports: [{name: p80, port: 80, targetPort: 0}]}`},
		{name: `targetPort "", defaulted to the port`, spec: `{clusterIP: 10.96.0.10, ports: [{name: p80, port: 80, targetPort: ""}]}`},
		{name: "targetPort a number", spec: `{clusterIP: 10.96.0.10, ports: [{name: p80, port: 80, targetPort: 65535}]}`},
		{name: "targetPort a name", spec: `{clusterIP: 10.96.0.10, ports: [{name: p80, port: 80, targetPort: http-alt}]}`},
		{
			name: "targetPort out of range",
			spec: `{clusterIP: 10.96.0.10, ports: [{name: p80, port: 80, targetPort: 70000}, {name: p81, port: 81, targetPort: -5}]}`,
			want: []string{
				prefix + "spec.ports[0].targetPort: 70000 is out of range 1-65535",
				prefix + "spec.ports[1].targetPort: -5 is out of range 1-65535",
			},
		},
		{
			name: "targetPort not a port name",
			spec: `{clusterIP: 10.96.0.10, ports: [{name: p80, port: 80, targetPort: http_alt}, {name: p81, port: 81, targetPort: "8080"}]}`,
			want: []string{
				prefix + `spec.ports[0].targetPort: "http_alt" is not a valid port name: must contain only alpha-numeric characters (a-z, 0-9), and hyphens (-)`,
				prefix + `spec.ports[1].targetPort: "8080" is not a valid port name: must contain at least one letter (a-z)`,
			},
		},
		{name: "IP families", spec: `{clusterIP: 10.96.0.10, clusterIPs: [10.96.0.10, "fd00::10"], ipFamilyPolicy: RequireDualStack, ipFamilies: [IPv4, IPv6], ports: [{name: p80, port: 80}]}`},
		{
			name: "ipFamilyPolicy not a policy",
			spec: `{clusterIP: 10.96.0.10, ipFamilyPolicy: DualStack, ports: [{name: p80, port: 80}]}`,
			want: []string{prefix + `spec.ipFamilyPolicy: unsupported value "DualStack" (want SingleStack, PreferDualStack or RequireDualStack)`},
		},
		{
			name: "ipFamilies not families, one beside its cluster IP: said once",
			spec: `{clusterIP: 10.96.0.10, clusterIPs: [10.96.0.10], ipFamilies: [IPv5, ipv6], ports: [{name: p80, port: 80}]}`,
			want: []string{
				prefix + `spec.ipFamilies[0]: unsupported value "IPv5" (want IPv4 or IPv6)`,
				prefix + `spec.ipFamilies[1]: unsupported value "ipv6" (want IPv4 or IPv6)`,
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			snap, errs := loadOne(t, "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec: "+tt.spec+"\n")
			if !slices.Equal(errs, tt.want) {
				t.Errorf("errors:\ngot  %q\nwant %q", errs, tt.want)
			}
			if served := len(snap.Ports) > 0; served != (len(tt.want) == 0) {
				t.Errorf("got served %v, want %v (ports %q)", served, len(tt.want) == 0, summary(snap))
			}
		})
	}
}
