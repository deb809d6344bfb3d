package observe

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"sync/atomic"
	"testing"

	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/service/servicetest"
)

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func localPort(hc int, eps ...service.Endpoint) *service.Port {
	return &service.Port{
		Name:                service.PortName{Namespace: "ns", Name: "lb", Port: "p"},
		ExternalPolicyLocal: true,
		HealthCheckNodePort: hc,
		Endpoints:           eps,
	}
}

// ep is an endpoint at addr, on this node when local, ready and serving when ready.
func ep(addr string, local, ready bool) service.Endpoint {
	e := servicetest.Endpoint(addr, local)
	e.Ready, e.Serving = ready, ready
	return e
}

type hcAnswer struct {
	status int
	weight string
	body   struct {
		Service struct {
			Namespace string `json:"namespace"`
			Name      string `json:"name"`
		} `json:"service"`
		LocalEndpoints      int  `json:"localEndpoints"`
		ServiceProxyHealthy bool `json:"serviceProxyHealthy"`
	}
}

func askHealth(t *testing.T, port int) (hcAnswer, error) {
	t.Helper()
	var a hcAnswer
	resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/", port))
	if err != nil {
		return a, err
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	a.status, a.weight = resp.StatusCode, resp.Header.Get("X-Load-Balancing-Endpoint-Weight")
	if err := json.Unmarshal(data, &a.body); err != nil {
		t.Fatalf("body %q: %v", data, err)
	}
	return a, nil
}

func TestHealthCheckServer(t *testing.T) {
	var unhealthy atomic.Bool
	h := &HealthCheckServer{IPs: []netip.Addr{netip.MustParseAddr("127.0.0.1")}, Healthy: func() bool { return !unhealthy.Load() }}
	t.Cleanup(func() { h.Close(context.Background()) })
	port := freePort(t)

	tests := []struct {
		name       string
		ports      []*service.Port
		unhealthy  bool
		wantStatus int
		wantLocal  int
	}{
		{"two local ready endpoints", []*service.Port{localPort(port,
			ep("10.0.0.1:80", true, true), ep("10.0.0.2:80", true, true), ep("10.0.0.3:80", false, true), ep("10.0.0.4:80", true, false))}, false, 200, 2},
		{"proxy unhealthy", []*service.Port{localPort(port, ep("10.0.0.1:80", true, true))}, true, 503, 1},
		{"no local endpoint", []*service.Port{localPort(port, ep("10.0.0.3:80", false, true))}, false, 503, 0},
		{"one pod serving two ports counts once", []*service.Port{
			localPort(port, ep("10.0.0.1:80", true, true)),
			func() *service.Port {
				p := localPort(port, ep("10.0.0.1:443", true, true))
				p.Name.Port = "q"
				return p
			}(),
		}, false, 200, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			unhealthy.Store(tt.unhealthy)
			if err := h.Sync(&service.Snapshot{Ports: tt.ports}); err != nil {
				t.Fatal(err)
			}
			a, err := askHealth(t, port)
			if err != nil {
				t.Fatal(err)
			}
			if a.status != tt.wantStatus || a.body.LocalEndpoints != tt.wantLocal || a.weight != fmt.Sprint(tt.wantLocal) {
				t.Errorf("got status %d, localEndpoints %d, weight %q; want %d, %d", a.status, a.body.LocalEndpoints, a.weight, tt.wantStatus, tt.wantLocal)
			}
			if a.body.Service.Namespace != "ns" || a.body.Service.Name != "lb" || a.body.ServiceProxyHealthy == tt.unhealthy {
				t.Errorf("got body %+v, want service ns/lb, serviceProxyHealthy %v", a.body, !tt.unhealthy)
			}
		})
	}

	t.Run("Service without Local policy closes the port", func(t *testing.T) {
		p := localPort(port, ep("10.0.0.1:80", true, true))
		p.ExternalPolicyLocal = false
		if err := h.Sync(&service.Snapshot{Ports: []*service.Port{p}}); err != nil {
			t.Fatal(err)
		}
		if _, err := askHealth(t, port); err == nil {
			t.Errorf("got an answer on a closed health check port, want a refused connection")
		}
	})

	t.Run("a taken port is an error, retried on the next sync", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		taken := ln.Addr().(*net.TCPAddr).Port
		snap := &service.Snapshot{Ports: []*service.Port{localPort(taken, ep("10.0.0.1:80", true, true))}}
		if err := h.Sync(snap); err == nil {
			t.Errorf("Sync with a taken port: got nil, want an error")
		}
		ln.Close()
		if err := h.Sync(snap); err != nil {
			t.Fatalf("Sync after the port was freed: %v", err)
		}
		if a, err := askHealth(t, taken); err != nil || a.status != 200 {
			t.Errorf("got %+v, %v; want 200", a, err)
		}
	})
}
