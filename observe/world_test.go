package observe_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/proxier"
	"github.com/uproxy/uproxy/service"
)

// world is one test's running userspace proxy with its metrics address, on
// loopback: backends on 127.0.0.x, proxy ports on 127.0.0.1.
type world struct {
	t         testing.TB
	px        *proxier.Proxier
	events    *observe.Events
	conflicts *observe.Conflicts
	problems  *observe.Problems
	srv       *httptest.Server
	ports     []*service.Port
}

// serviceSeq makes every test's Service names unique: the metrics are global.
var serviceSeq atomic.Int32

func mkWorld(t testing.TB, cfg proxier.Config) *world {
	t.Helper()
	w := &world{t: t, events: observe.NewEvents(64), conflicts: &observe.Conflicts{}, problems: &observe.Problems{}}
	cfg.BindAddress = netip.MustParseAddr("127.0.0.1")
	cfg.Events = w.events
	px, err := proxier.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	w.px = px
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		px.Shutdown(ctx)
	})
	srv := &observe.Server{Mode: "userspace", Services: px, Conflicts: w.conflicts, Problems: w.problems, Events: w.events,
		Health: &observe.Health{Timeout: time.Minute}, Debug: true}
	w.srv = httptest.NewServer(srv.MetricsHandler())
	t.Cleanup(w.srv.Close)
	return w
}

// addService adds a Service port over eps and syncs; it returns the port's
// unique name (ns/name:p) and proxy port.
func (w *world) addService(proto service.Protocol, clientIP bool, eps ...netip.AddrPort) (string, int) {
	w.t.Helper()
	return w.addPolicyService(service.Policy{}, proto, clientIP, eps...)
}

// addPolicyService is addService for a Service with its own policy, as from
// its annotations.
func (w *world) addPolicyService(policy service.Policy, proto service.Protocol, clientIP bool, eps ...netip.AddrPort) (string, int) {
	w.t.Helper()
	p := &service.Port{
		Policy:     policy,
		Name:       service.PortName{Namespace: "t", Name: fmt.Sprintf("svc%d", serviceSeq.Add(1)), Port: "p"},
		Protocol:   proto,
		Port:       80,
		ClusterIPs: []netip.Addr{netip.MustParseAddr("10.96.0.10")},
	}
	if clientIP {
		p.AffinityClientIP, p.AffinityTimeout = true, time.Hour
	}
	for _, ep := range eps {
		p.Endpoints = append(p.Endpoints, service.Endpoint{Addr: ep, Ready: true, Serving: true})
	}
	w.ports = append(w.ports, p)
	if err := w.px.Sync(&service.Snapshot{Ports: w.ports, Built: time.Now()}); err != nil {
		w.t.Fatalf("Sync: %v", err)
	}
	return p.Name.String(), w.px.ProxyPort(p.Name)
}

// getJSON GETs path from the metrics address into v.
func (w *world) getJSON(path string, v any) {
	w.t.Helper()
	resp, err := http.Get(w.srv.URL + path)
	if err != nil {
		w.t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		w.t.Fatalf("GET %s: got status %d (%s), want 200", path, resp.StatusCode, b)
	}
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		w.t.Fatalf("GET %s: %v", path, err)
	}
}

func (w *world) services(query string) []observe.ServiceState {
	var body struct{ Services []observe.ServiceState }
	w.getJSON("/debug/services"+query, &body)
	return body.Services
}

func (w *world) conflictsOf(query string) []observe.ConflictState {
	var body struct{ Conflicts []observe.ConflictState }
	w.getJSON("/debug/services"+query, &body)
	return body.Conflicts
}

func (w *world) eventsOf(query string) []observe.Event {
	var body struct{ Events []observe.Event }
	w.getJSON("/debug/events"+query, &body)
	return body.Events
}

// endpointState returns the /debug/services view of ep in service.
func (w *world) endpointState(svc string, ep netip.AddrPort) observe.EndpointState {
	w.t.Helper()
	for _, st := range w.services("?service=" + svc) {
		for _, e := range st.Endpoints {
			if e.Address == ep.String() {
				return e
			}
		}
	}
	w.t.Fatalf("endpoint %s of %s not in /debug/services", ep, svc)
	return observe.EndpointState{}
}

// echoBackend serves TCP echo on ip:0 until the test ends.
func echoBackend(t testing.TB, ip string) netip.AddrPort {
	t.Helper()
	ln, err := net.Listen("tcp", ip+":0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go serveEcho(ln)
	return ln.Addr().(*net.TCPAddr).AddrPort()
}

func serveEcho(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go func() {
			io.Copy(c, c)
			c.(*net.TCPConn).CloseWrite()
			c.Close()
		}()
	}
}

// udpEcho answers every datagram with itself.
func udpEcho(t testing.TB, ip string) netip.AddrPort {
	t.Helper()
	pc, err := net.ListenPacket("udp", ip+":0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	go func() {
		buf := make([]byte, 65536)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			pc.WriteTo(buf[:n], from)
		}
	}()
	return pc.LocalAddr().(*net.UDPAddr).AddrPort()
}

// boundSocket returns a TCP socket bound to ip:0 that does not listen: connects
// to it are refused at once. The caller may make it listen later.
func boundSocket(t testing.TB, ip string) (netip.AddrPort, int) {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("socket: %v", err)
	}
	a := netip.MustParseAddr(ip).As4()
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: a}); err != nil {
		unix.Close(fd)
		t.Fatalf("bind %s:0: %v", ip, err)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		t.Fatalf("getsockname: %v", err)
	}
	return netip.AddrPortFrom(netip.AddrFrom4(a), uint16(sa.(*unix.SockaddrInet4).Port)), fd
}

func refusedAddr(t testing.TB, ip string) netip.AddrPort {
	addr, fd := boundSocket(t, ip)
	t.Cleanup(func() { unix.Close(fd) })
	return addr
}

// reviveAsEcho makes the bound socket fd listen and serve echo: the refused
// endpoint comes back on the same address.
func reviveAsEcho(t testing.TB, fd int) {
	t.Helper()
	if err := unix.Listen(fd, 16); err != nil {
		t.Fatalf("listen: %v", err)
	}
	f := os.NewFile(uintptr(fd), "revived")
	ln, err := net.FileListener(f) // dups fd
	f.Close()
	if err != nil {
		t.Fatalf("file listener: %v", err)
	}
	t.Cleanup(func() { ln.Close() })
	go serveEcho(ln)
}

// unansweredAddr returns an address where connects are never answered: a
// listener with backlog 0 whose queue one connection already fills, so the
// kernel drops further SYNs and a dial ends only by its timeout.
func unansweredAddr(t testing.TB, ip string) netip.AddrPort {
	t.Helper()
	addr, fd := boundSocket(t, ip)
	t.Cleanup(func() { unix.Close(fd) })
	if err := unix.Listen(fd, 0); err != nil {
		t.Fatalf("listen: %v", err)
	}
	filler, err := net.DialTimeout("tcp", addr.String(), 5*time.Second)
	if err != nil {
		t.Fatalf("fill accept queue of %s: %v", addr, err)
	}
	t.Cleanup(func() { filler.Close() })
	return addr
}

// echoThrough sends msg through the proxy port, half-closes and returns the answer.
func echoThrough(t testing.TB, proxyPort int, msg string) (string, error) {
	t.Helper()
	c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", proxyPort), 5*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, msg); err != nil {
		return "", err
	}
	c.(*net.TCPConn).CloseWrite()
	b, err := io.ReadAll(c)
	return string(b), err
}

// awaitTimeout bounds every wait for a condition (testbed.Await).
const awaitTimeout = 10 * time.Second

// metric returns the value of the series name{labels} in observe.Registry
// (counter, gauge, or a histogram's sample count), and whether it exists.
func metric(t testing.TB, name string, labels map[string]string) (float64, bool) {
	t.Helper()
	families, err := observe.Registry.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			got := map[string]string{}
			for _, l := range m.GetLabel() {
				got[l.GetName()] = l.GetValue()
			}
			for k, v := range labels {
				if got[k] != v {
					continue series
				}
			}
			return value(m), true
		}
	}
	return 0, false
}

func value(m *dto.Metric) float64 {
	switch {
	case m.Counter != nil:
		return m.Counter.GetValue()
	case m.Gauge != nil:
		return m.Gauge.GetValue()
	case m.Histogram != nil:
		return float64(m.Histogram.GetSampleCount())
	}
	return 0
}

func metricOr0(t testing.TB, name string, labels map[string]string) float64 {
	v, _ := metric(t, name, labels)
	return v
}

// attemptsText renders an event's attempts as "endpoint result, ..." for messages.
func attemptsText(ev observe.Event) string {
	var parts []string
	for _, a := range ev.Attempts {
		parts = append(parts, a.Endpoint+" "+a.Result)
	}
	return strings.Join(parts, ", ")
}
