package app

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/source/file"
)

// The demo's table says, for each Service port, what serves it (a proxy port,
// or the kernel) and which Service addresses lead there, then what to try.
func TestPrintDemo(t *testing.T) {
	eps := []demoEndpoint{{"127.0.0.2", 8080}}
	path := filepath.Join(t.TempDir(), "demo.yaml")
	manifests := demoService("web", "TCP", "10.96.0.10", 80, "", eps) + "---\n" + demoService("echo", "UDP", "10.96.0.12", 53, "", eps)
	if err := os.WriteFile(path, []byte(manifests), 0o644); err != nil {
		t.Fatal(err)
	}
	// The demo's proxy ports listen on 127.0.0.1, so its loopback endpoints are taken.
	snap, err := (&file.Source{Path: path, LoopbackEndpoints: true}).Load()
	if err != nil || len(snap.Errors) > 0 {
		t.Fatalf("load the demo's manifests: %v %v", err, snap.Errors)
	}
	proxyPorts := map[string]int{"web": 41000, "echo": 41001}
	userspace := demoView{mode: "userspace", rules: "none", chainPrefix: "UPROXY", path: path, metrics: "127.0.0.1:10249",
		proxyPort: func(n service.PortName) int { return proxyPorts[n.Name] }}
	withPortals := userspace
	withPortals.rules = "iptables"
	for _, tc := range []struct {
		name string
		view demoView
		want [][]string
	}{
		{"userspace, no portals", userspace, [][]string{
			{"SERVICE", "PROTOCOL", "PROXY PORT", "SERVICE ADDRESSES", "ENDPOINTS"},
			{"demo/echo:main", "UDP", "41001", "10.96.0.12:53/UDP", "2 echo servers"},
			{"demo/web:main", "TCP", "41000", "10.96.0.10:80/TCP", "3 live + 1 dead", "retried around"},
			{"--rules none"},
			{"curl -s 127.0.0.1:41000/"},
			{"Ctrl-C stops."},
		}},
		{"userspace with portals", withPortals, [][]string{
			{"demo/web:main", "TCP", "41000", "10.96.0.10:80/TCP"},
			{"--rules iptables: the Service addresses reach the proxy ports too"},
			{"Ctrl-C stops and removes the rules."},
		}},
		{"iptables mode", demoView{mode: "iptables", chainPrefix: "UPROXY", path: path, metrics: "127.0.0.1:10249"}, [][]string{
			{"SERVICE", "PROTOCOL", "SERVICE ADDRESSES", "ENDPOINTS"},
			{"demo/web:main", "TCP", "10.96.0.10:80/TCP", "3 live + 1 dead", "not retried"},
			{"demo/echo:main", "UDP", "10.96.0.12:53/UDP"},
			{"--proxy-mode iptables: the kernel sends the Service addresses to the endpoints"},
			{"curl -s -m1 10.96.0.10/"},
			{"iptables-save -t nat | grep UPROXY"},
			{"Ctrl-C stops and removes the rules."},
		}},
		{"nftables mode", demoView{mode: "nftables", chainPrefix: "UPROXY", path: path, metrics: "127.0.0.1:10249"}, [][]string{
			{"nft list table inet uproxy-kernel"},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			printDemo(&out, tc.view, snap)
			lines := strings.Split(out.String(), "\n")
			for _, want := range tc.want {
				if !slices.ContainsFunc(lines, func(l string) bool { return containsAll(l, want) }) {
					t.Errorf("got no line with %q:\n%s", want, out.String())
				}
			}
			if tc.view.proxyPort == nil && strings.Contains(out.String(), "PROXY PORT") {
				t.Errorf("a kernel mode's table has a PROXY PORT column:\n%s", out.String())
			}
		})
	}
}

// The demo lists only the run flags it uses; one it has no use for is refused
// as unknown, not accepted and ignored.
func TestDemoFlags(t *testing.T) {
	listed := helpFlags(t, "demo")
	for _, f := range demoUnused {
		if slices.Contains(listed, f) {
			t.Errorf("uproxy demo --help lists --%s, which the demo does not use", f)
		}
		// Were the flag taken, the demo would run: the timeout ends it.
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, _, err := runCommand(ctx, "demo", "--"+f+"=x", "--metrics-bind-address=", "--healthz-bind-address=")
		cancel()
		if err == nil || !strings.Contains(err.Error(), "unknown flag: --"+f) {
			t.Errorf("uproxy demo --%s=x: got %v, want an unknown flag", f, err)
		}
	}
	for _, f := range []string{"proxy-mode", "rules", "bind-address", "metrics-bind-address", "dial-timeouts", "chain-prefix"} {
		if !slices.Contains(listed, f) {
			t.Errorf("uproxy demo --help lacks --%s", f)
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
