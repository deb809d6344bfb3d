package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/source/file"
)

// The demo's table says, for each Service port, which proxy port serves it and
// which Service addresses the portals would steer there.
func TestPrintDemo(t *testing.T) {
	eps := []demoEndpoint{{"127.0.0.2", 8080}}
	path := filepath.Join(t.TempDir(), "demo.yaml")
	manifests := demoService("web", "TCP", "10.96.0.10", 80, "", eps) + "---\n" + demoService("echo", "UDP", "10.96.0.12", 53, "", eps)
	if err := os.WriteFile(path, []byte(manifests), 0o644); err != nil {
		t.Fatal(err)
	}
	snap, err := file.Load(path, service.BuildOptions{})
	if err != nil || len(snap.Errors) > 0 {
		t.Fatalf("load the demo's manifests: %v %v", err, snap.Errors)
	}
	proxyPorts := map[string]int{"web": 41000, "echo": 41001}
	var out bytes.Buffer
	printDemo(&out, func(n service.PortName) int { return proxyPorts[n.Name] }, snap, path, "127.0.0.1:10249", true)

	lines := strings.Split(out.String(), "\n")
	for _, want := range [][]string{
		{"SERVICE", "PROTOCOL", "PROXY PORT", "SERVICE ADDRESSES", "ENDPOINTS"},
		{"demo/echo:main", "UDP", "41001", "10.96.0.12:53/UDP", "2 echo servers"},
		{"demo/web:main", "TCP", "41000", "10.96.0.10:80/TCP", "3 live + 1 dead"},
		{"--rules none"},
		{"curl -s 127.0.0.1:41000/"},
	} {
		found := false
		for _, l := range lines {
			if containsAll(l, want) {
				found = true
				break
			}
		}
		if !found {
			t.Errorf("got no line with %q:\n%s", want, out.String())
		}
	}
}

func containsAll(s string, parts []string) bool {
	for _, p := range parts {
		if !strings.Contains(s, p) {
			return false
		}
	}
	return true
}
