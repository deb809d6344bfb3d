package observe_test

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/proxier"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/test/testbed"
)

// Metric values after scripted traffic: every data path series a dashboard reads.
func TestMetricsAfterTraffic(t *testing.T) {
	t.Run("tcp retries, outcomes, bytes, histograms", func(t *testing.T) {
		w := mkWorld(t, proxier.Config{})
		live, refused := echoBackend(t, "127.0.0.2"), refusedAddr(t, "127.0.0.3")
		svc, pp := w.addService(service.TCP, false, live, refused)
		// rr over [live, refused]: the first connection gets live; every later
		// one is offered refused first, then retried on live.
		for i := range 4 {
			msg := fmt.Sprintf("hello %d", i)
			if got, err := echoThrough(t, pp, msg); err != nil || got != msg {
				t.Fatalf("connection %d: got %q, %v, want %q", i, got, err, msg)
			}
		}
		s := map[string]string{"service": svc}
		testbed.Await(t, awaitTimeout, "4 connections counted", func() bool {
			return metricOr0(t, "uproxy_connections_total", map[string]string{"service": svc, "result": "success"})+
				metricOr0(t, "uproxy_connections_total", map[string]string{"service": svc, "result": "retried"}) == 4
		})
		for _, c := range []struct {
			name   string
			labels map[string]string
			want   float64
		}{
			{"uproxy_connections_total", map[string]string{"service": svc, "protocol": "TCP", "result": "success"}, 1},
			{"uproxy_connections_total", map[string]string{"service": svc, "protocol": "TCP", "result": "retried"}, 3},
			{"uproxy_dial_attempts_total", map[string]string{"service": svc, "endpoint": live.String(), "result": "success"}, 4},
			{"uproxy_dial_attempts_total", map[string]string{"service": svc, "endpoint": refused.String(), "result": "refused"}, 3},
			{"uproxy_retries_total", s, 3},
			{"uproxy_bytes_total", map[string]string{"service": svc, "direction": "in"}, 4 * 7},
			{"uproxy_bytes_total", map[string]string{"service": svc, "direction": "out"}, 4 * 7},
			{"uproxy_connection_duration_seconds", s, 4},
			{"uproxy_dial_duration_seconds", map[string]string{"service": svc, "endpoint": live.String()}, 4},
			{"uproxy_dial_duration_seconds", map[string]string{"service": svc, "endpoint": refused.String()}, 3},
			{"uproxy_active_connections", s, 0},
			{"uproxy_endpoint_active_connections", map[string]string{"service": svc, "endpoint": live.String()}, 0},
			{"uproxy_endpoint_consecutive_failures", map[string]string{"service": svc, "endpoint": refused.String()}, 3},
			{"uproxy_endpoint_ejected", map[string]string{"service": svc, "endpoint": refused.String()}, 0},
		} {
			got, ok := metric(t, c.name, c.labels)
			if !ok || got != c.want {
				t.Errorf("%s%v: got %v (present %v), want %v", c.name, c.labels, got, ok, c.want)
			}
		}
	})

	t.Run("affinity hits, misses, resets", func(t *testing.T) {
		w := mkWorld(t, proxier.Config{})
		refused, live := refusedAddr(t, "127.0.0.3"), echoBackend(t, "127.0.0.2")
		svc, pp := w.addService(service.TCP, true, refused, live)
		// 1: miss -> refused, whose entry is reset; miss -> live. 2, 3: hits.
		for i := range 3 {
			if _, err := echoThrough(t, pp, "x"); err != nil {
				t.Fatalf("connection %d: %v", i, err)
			}
		}
		s := map[string]string{"service": svc}
		for name, want := range map[string]float64{
			"uproxy_affinity_hits_total":   2,
			"uproxy_affinity_misses_total": 2,
			"uproxy_affinity_resets_total": 1,
		} {
			if got, ok := metric(t, name, s); !ok || got != want {
				t.Errorf("%s: got %v (present %v), want %v", name, got, ok, want)
			}
		}
	})

	t.Run("udp clients and expiries", func(t *testing.T) {
		w := mkWorld(t, proxier.Config{UDPTimeout: 100 * time.Millisecond})
		backend := udpEcho(t, "127.0.0.2")
		svc, pp := w.addService(service.UDP, false, backend)
		for i := range 2 {
			c, err := net.Dial("udp", fmt.Sprintf("127.0.0.1:%d", pp))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(5 * time.Second))
			if _, err := c.Write([]byte("ping")); err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, 16)
			if n, err := c.Read(buf); err != nil || string(buf[:n]) != "ping" {
				t.Fatalf("client %d: got %q, %v, want ping", i, buf[:n], err)
			}
		}
		s := map[string]string{"service": svc}
		testbed.Await(t, awaitTimeout, "both UDP sessions expired", func() bool { return metricOr0(t, "uproxy_udp_client_expiries_total", s) == 2 })
		for _, c := range []struct {
			name   string
			labels map[string]string
			want   float64
		}{
			{"uproxy_udp_clients", s, 0},
			{"uproxy_connections_total", map[string]string{"service": svc, "protocol": "UDP", "result": "success"}, 2},
			{"uproxy_bytes_total", map[string]string{"service": svc, "direction": "in"}, 8},
			{"uproxy_bytes_total", map[string]string{"service": svc, "direction": "out"}, 8},
			{"uproxy_active_connections", s, 0},
		} {
			if got, ok := metric(t, c.name, c.labels); !ok || got != c.want {
				t.Errorf("%s%v: got %v (present %v), want %v", c.name, c.labels, got, ok, c.want)
			}
		}
	})

	t.Run("series of a removed Service port are dropped", func(t *testing.T) {
		w := mkWorld(t, proxier.Config{})
		svc, pp := w.addService(service.TCP, false, echoBackend(t, "127.0.0.2"))
		if _, err := echoThrough(t, pp, "x"); err != nil {
			t.Fatal(err)
		}
		s := map[string]string{"service": svc}
		testbed.Await(t, awaitTimeout, "connection counted", func() bool { return metricOr0(t, "uproxy_connection_duration_seconds", s) == 1 })
		if err := w.px.Sync(&service.Snapshot{Built: time.Now()}); err != nil {
			t.Fatal(err)
		}
		for _, name := range []string{"uproxy_connections_total", "uproxy_dial_attempts_total", "uproxy_dial_duration_seconds", "uproxy_affinity_hits_total", "uproxy_endpoint_active_connections"} {
			if _, ok := metric(t, name, s); ok {
				t.Errorf("%s{service=%q}: still present after the Service port was removed", name, svc)
			}
		}
	})
}

// Events for refused and timed-out attempts, as /debug/events serves them.
func TestEvents(t *testing.T) {
	w := mkWorld(t, proxier.Config{DialTimeouts: []time.Duration{100 * time.Millisecond, 100 * time.Millisecond, 100 * time.Millisecond}})
	refused, unanswered, live := refusedAddr(t, "127.0.0.3"), unansweredAddr(t, "127.0.0.4"), echoBackend(t, "127.0.0.2")
	retried, pp := w.addService(service.TCP, false, refused, unanswered, live)
	failed, ppFailed := w.addService(service.TCP, false, refused, unanswered)

	if got, err := echoThrough(t, pp, "hello"); err != nil || got != "hello" {
		t.Fatalf("through %s: got %q, %v, want hello", retried, got, err)
	}
	if _, err := echoThrough(t, ppFailed, "hello"); err == nil {
		t.Fatalf("through %s: got no error, want a reset (no endpoint answers)", failed)
	}
	testbed.Await(t, awaitTimeout, "both connections recorded", func() bool { return len(w.eventsOf("?kind=connection")) == 2 })

	type wantAttempt struct{ endpoint, result, errHas string }
	for _, tc := range []struct {
		name, service, outcome, endpoint string
		bytes                            int64
		attempts                         []wantAttempt
	}{
		{
			name: "retried past refused and timed out", service: retried, outcome: "retried", endpoint: live.String(), bytes: 5,
			attempts: []wantAttempt{
				{refused.String(), "refused", "connection refused"},
				{unanswered.String(), "timeout", "timeout"},
				{live.String(), "success", ""},
			},
		},
		{
			name: "failed after every endpoint", service: failed, outcome: "failed",
			attempts: []wantAttempt{
				{refused.String(), "refused", "connection refused"},
				{unanswered.String(), "timeout", "timeout"},
				{refused.String(), "refused", "connection refused"},
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			evs := w.eventsOf("?service=" + tc.service)
			if len(evs) != 1 {
				t.Fatalf("events of %s: got %d, want 1: %+v", tc.service, len(evs), evs)
			}
			ev := evs[0]
			if ev.Kind != "connection" || ev.Outcome != tc.outcome || ev.Endpoint != tc.endpoint || ev.Protocol != "TCP" {
				t.Errorf("event: got kind %q outcome %q endpoint %q protocol %q, want connection %q %q TCP", ev.Kind, ev.Outcome, ev.Endpoint, ev.Protocol, tc.outcome, tc.endpoint)
			}
			if ev.BytesIn != tc.bytes || ev.BytesOut != tc.bytes {
				t.Errorf("bytes: got in %d out %d, want %d each", ev.BytesIn, ev.BytesOut, tc.bytes)
			}
			if !strings.HasPrefix(ev.Client, "127.0.0.1:") {
				t.Errorf("client: got %q, want 127.0.0.1:PORT", ev.Client)
			}
			if (tc.outcome == "failed") != (ev.Error != "") {
				t.Errorf("error: got %q, want one only for a failed connection", ev.Error)
			}
			if len(ev.Attempts) != len(tc.attempts) {
				t.Fatalf("attempts: got %s, want %d", attemptsText(ev), len(tc.attempts))
			}
			for i, want := range tc.attempts {
				a := ev.Attempts[i]
				if a.Endpoint != want.endpoint || a.Result != want.result || !strings.Contains(a.Error, want.errHas) {
					t.Errorf("attempt %d: got %s %s (%q), want %s %s with error containing %q", i, a.Endpoint, a.Result, a.Error, want.endpoint, want.result, want.errHas)
				}
				// A timed-out attempt lasts at least its timeout: what a user
				// needs to see to know where the latency went.
				if a.Result == "timeout" && a.DurationMs < 100 {
					t.Errorf("attempt %d: got duration %vms, want >= the 100ms dial timeout", i, a.DurationMs)
				}
			}
		})
	}

	t.Run("filters", func(t *testing.T) {
		for _, c := range []struct {
			query string
			want  int
		}{
			{"", 2},
			{"?outcome=failed", 1},
			{"?outcome=retried&service=" + retried, 1},
			{"?outcome=success", 0},
			{"?limit=1", 1},
			{"?service=nope/nope:p", 0},
		} {
			if got := w.eventsOf(c.query); len(got) != c.want {
				t.Errorf("/debug/events%s: got %d events, want %d", c.query, len(got), c.want)
			}
		}
		newest := w.eventsOf("?limit=1")[0]
		if got := w.eventsOf(fmt.Sprintf("?since=%d", newest.ID)); len(got) != 0 {
			t.Errorf("?since=newest id: got %d events, want 0", len(got))
		}
	})
}

// Passive outlier ejection end to end: consecutive refusals eject an endpoint,
// connections stop paying for it, and it is re-admitted once it answers again.
func TestEjectionAndReadmission(t *testing.T) {
	w := mkWorld(t, proxier.Config{EjectAfter: 2})
	live := echoBackend(t, "127.0.0.2")
	flaky, fd := boundSocket(t, "127.0.0.3")
	svc, pp := w.addService(service.TCP, false, live, flaky)
	attemptsOf := func(ep fmt.Stringer, result string) float64 {
		return metricOr0(t, "uproxy_dial_attempts_total", map[string]string{"service": svc, "endpoint": ep.String(), "result": result})
	}
	epLabels := map[string]string{"service": svc, "endpoint": flaky.String()}

	// rr: live, then flaky (refused, retried on live) twice: ejected.
	for i := range 3 {
		if _, err := echoThrough(t, pp, "x"); err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
	}
	st := w.endpointState(svc, flaky)
	if !st.Ejected || st.EjectedUntil == "" || st.ConsecutiveFailures != 2 {
		t.Fatalf("after 2 refusals: got %+v, want ejected with an ejectedUntil and 2 consecutive failures", st)
	}
	for name, want := range map[string]float64{"uproxy_endpoint_ejections_total": 1, "uproxy_endpoint_ejected": 1} {
		if got := metricOr0(t, name, epLabels); got != want {
			t.Errorf("%s: got %v, want %v", name, got, want)
		}
	}
	ej := w.eventsOf("?kind=ejection&service=" + svc)
	if len(ej) != 1 || ej[0].Endpoint != flaky.String() || !strings.Contains(ej[0].Reason, "refused") {
		t.Fatalf("ejection events: got %+v, want one for %s naming the refusal", ej, flaky)
	}

	// While ejected, connections go straight to live: no more refused attempts.
	for i := range 4 {
		if _, err := echoThrough(t, pp, "x"); err != nil {
			t.Fatalf("connection %d while ejected: %v", i, err)
		}
	}
	if got := attemptsOf(flaky, "refused"); got != 2 {
		t.Errorf("refused attempts on the ejected endpoint: got %v, want still 2", got)
	}
	if evs := w.eventsOf("?outcome=retried&service=" + svc); len(evs) != 2 {
		t.Errorf("retried connections: got %d, want 2 (none while ejected)", len(evs))
	}

	// The endpoint comes back; once its period ends a pick tries it and the
	// success re-admits it.
	reviveAsEcho(t, fd)
	testbed.Await(t, awaitTimeout, "ejection period to end", func() bool { return !w.endpointState(svc, flaky).Ejected })
	testbed.Await(t, awaitTimeout, "a connection served by the revived endpoint", func() bool {
		if _, err := echoThrough(t, pp, "x"); err != nil {
			t.Fatalf("connection after the period: %v", err)
		}
		return attemptsOf(flaky, "success") > 0
	})
	if st := w.endpointState(svc, flaky); st.Ejected || st.ConsecutiveFailures != 0 {
		t.Errorf("after re-admission: got %+v, want not ejected, 0 failures", st)
	}
	if got := metricOr0(t, "uproxy_endpoint_readmissions_total", epLabels); got != 1 {
		t.Errorf("uproxy_endpoint_readmissions_total: got %v, want 1", got)
	}
	if evs := w.eventsOf("?kind=readmission&service=" + svc); len(evs) != 1 || evs[0].Endpoint != flaky.String() {
		t.Errorf("readmission events: got %+v, want one for %s", evs, flaky)
	}

	t.Run("last endpoint is never ejected", func(t *testing.T) {
		only := refusedAddr(t, "127.0.0.5")
		svc, pp := w.addService(service.TCP, false, only)
		for i := range 3 {
			if _, err := echoThrough(t, pp, "x"); err == nil {
				t.Fatalf("connection %d: got no error, want a reset", i)
			}
		}
		testbed.Await(t, awaitTimeout, "3 failed connections", func() bool {
			return metricOr0(t, "uproxy_connections_total", map[string]string{"service": svc, "result": "failed"}) == 3
		})
		// With one endpoint, each connection spends all four default attempts on it.
		if st := w.endpointState(svc, only); st.Ejected || st.ConsecutiveFailures != 12 {
			t.Errorf("sole endpoint: got %+v, want not ejected with 12 consecutive failures", st)
		}
	})
}

// An ICMP port unreachable that ends a UDP session before any reply is the
// UDP form of a refused dial: the attempt is counted refused, the session
// failed, and --eject-after such sessions eject the endpoint (its connects,
// which succeed whatever listens, clear nothing). observe records that
// ejection as it records a TCP one, before the session's own record.
func TestUDPRefusalEjection(t *testing.T) {
	const after = 3
	w := mkWorld(t, proxier.Config{EjectAfter: after})
	dead := refusedUDPAddr(t, "127.0.0.2")
	live := udpEcho(t, "127.0.0.3")
	svc, pp := w.addService(service.UDP, false, dead, live)

	// rr gives each new client dead until it is ejected; the client resends
	// until its session ends and the next one is served by live.
	for i := range after {
		c, err := net.Dial("udp", fmt.Sprintf("127.0.0.1:%d", pp))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		buf := make([]byte, 16)
		testbed.Await(t, awaitTimeout, fmt.Sprintf("a reply to client %d", i), func() bool {
			c.SetDeadline(time.Now().Add(50 * time.Millisecond))
			if _, err := c.Write([]byte("ping")); err != nil {
				t.Fatal(err)
			}
			n, err := c.Read(buf)
			return err == nil && string(buf[:n]) == "ping"
		})
	}

	if st := w.endpointState(svc, dead); !st.Ejected || st.EjectedUntil == "" || st.ConsecutiveFailures != after {
		t.Errorf("after %d ICMP refusals: got %+v, want ejected with %d consecutive failures", after, st, after)
	}
	epLabels := map[string]string{"service": svc, "endpoint": dead.String()}
	for name, want := range map[string]float64{"uproxy_endpoint_ejections_total": 1, "uproxy_endpoint_ejected": 1} {
		if got := metricOr0(t, name, epLabels); got != want {
			t.Errorf("%s: got %v, want %v", name, got, want)
		}
	}
	for result, want := range map[string]float64{"refused": after, "success": 0} {
		labels := map[string]string{"service": svc, "endpoint": dead.String(), "result": result}
		if got := metricOr0(t, "uproxy_dial_attempts_total", labels); got != want {
			t.Errorf("uproxy_dial_attempts_total%v: got %v, want %v", labels, got, want)
		}
	}
	if got := metricOr0(t, "uproxy_connections_total", map[string]string{"service": svc, "protocol": "UDP", "result": "failed"}); got != after {
		t.Errorf("uproxy_connections_total{result=failed}: got %v, want %v (the refused sessions)", got, after)
	}
	ej := w.eventsOf("?kind=ejection&service=" + svc)
	if len(ej) != 1 || ej[0].Endpoint != dead.String() || ej[0].Protocol != "UDP" || !strings.Contains(ej[0].Reason, "dial failed (refused)") {
		t.Fatalf("ejection events: got %+v, want one for %s naming the refusal", ej, dead)
	}
	var refused []observe.Event
	for _, ev := range w.eventsOf("?kind=connection&service=" + svc) {
		if len(ev.Attempts) == 1 && ev.Attempts[0].Endpoint == dead.String() {
			refused = append(refused, ev)
		}
	}
	if len(refused) != after {
		t.Fatalf("sessions on %s: got %d events, want %d", dead, len(refused), after)
	}
	for _, ev := range refused {
		if ev.Outcome != observe.OutcomeFailed || ev.Endpoint != "" || ev.Attempts[0].Result != "refused" || !strings.Contains(ev.Error, "refused") {
			t.Errorf("event of a refused session: got outcome %q endpoint %q attempts %s error %q, want failed, none, refused, connection refused",
				ev.Outcome, ev.Endpoint, attemptsText(ev), ev.Error)
		}
	}
	last := refused[0].ID
	for _, ev := range refused {
		last = max(last, ev.ID)
	}
	if last < ej[0].ID {
		t.Errorf("record of the session that ejected: id %d, want after the ejection's (id %d)", last, ej[0].ID)
	}
}

// refusedUDPAddr returns a UDP address on ip where nothing listens: datagrams
// sent there draw an ICMP port unreachable.
func refusedUDPAddr(t testing.TB, ip string) netip.AddrPort {
	t.Helper()
	pc, err := net.ListenPacket("udp", ip+":0")
	if err != nil {
		t.Fatal(err)
	}
	addr := pc.LocalAddr().(*net.UDPAddr).AddrPort()
	pc.Close()
	return addr
}

// /debug/services?client= says which endpoint that client gets next, and why.
func TestNextForClient(t *testing.T) {
	w := mkWorld(t, proxier.Config{})
	a, b := echoBackend(t, "127.0.0.2"), echoBackend(t, "127.0.0.3")
	svc, pp := w.addService(service.TCP, true, a, b)
	if _, err := echoThrough(t, pp, "x"); err != nil { // 127.0.0.1 pinned to a
		t.Fatal(err)
	}
	for _, c := range []struct {
		client, endpoint, reasonHas string
		sticky                      bool
	}{
		{"127.0.0.1", a.String(), "ClientIP affinity: 127.0.0.1 is pinned to " + a.String(), true},
		{"192.0.2.9", b.String(), "no affinity entry for 192.0.2.9 yet; scheduler rr: " + b.String() + " is next in the rotation", false},
	} {
		sts := w.services("?service=" + svc + "&client=" + c.client)
		if len(sts) != 1 || sts[0].NextForClient == nil {
			t.Fatalf("client %s: got %+v, want one Service with nextForClient", c.client, sts)
		}
		got := sts[0].NextForClient
		if got.Endpoint != c.endpoint || got.Sticky != c.sticky || !strings.Contains(got.Reason, c.reasonHas) {
			t.Errorf("client %s: got %+v, want endpoint %s sticky %v, reason containing %q", c.client, got, c.endpoint, c.sticky, c.reasonHas)
		}
	}
}

// A connection reset by the idle timeout shows as such in /debug/events (reason
// idle) and in uproxy_idle_timeouts_total; one that ends by itself does not.
func TestIdleTimeoutEventAndMetric(t *testing.T) {
	// Long enough that the first connection ends by itself first, even on a
	// loaded machine.
	const timeout = 300 * time.Millisecond
	w := mkWorld(t, proxier.Config{TCPIdleTimeout: timeout})
	svc, pp := w.addService(service.TCP, false, echoBackend(t, "127.0.0.2"))
	if got, err := echoThrough(t, pp, "ended by the client"); err != nil || got != "ended by the client" {
		t.Fatalf("echo: got %q, %v", got, err)
	}
	c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", pp))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, "idle"); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, 4)); err != nil {
		t.Fatalf("echo before idling: %v", err)
	}
	// Nothing more is sent: the proxy resets the connection after the timeout.
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("read while idle: got %v, want a reset after %v", err, timeout)
	}
	testbed.Await(t, awaitTimeout, "both connections recorded", func() bool { return len(w.eventsOf("?service="+svc)) == 2 })
	evs := w.eventsOf("?service=" + svc) // newest first
	if ev := evs[0]; ev.Reason != observe.ReasonIdle || !strings.Contains(ev.Error, "idle timeout") || ev.Outcome != "success" || ev.BytesIn != 4 {
		t.Errorf("event of the idle connection: got reason %q, error %q, outcome %q, %d bytes in; want %q, an idle timeout, success, 4",
			ev.Reason, ev.Error, ev.Outcome, ev.BytesIn, observe.ReasonIdle)
	}
	if ev := evs[1]; ev.Reason != "" || ev.Error != "" {
		t.Errorf("event of the connection the client ended: got reason %q, error %q; want neither", ev.Reason, ev.Error)
	}
	if got := metricOr0(t, "uproxy_idle_timeouts_total", map[string]string{"service": svc}); got != 1 {
		t.Errorf("uproxy_idle_timeouts_total: got %v, want 1", got)
	}
}

// A Service port has the series of its own protocol only: the UDP client
// table's for a UDP port, retries and idle timeouts for a TCP port.
func TestSeriesFollowTheProtocol(t *testing.T) {
	w := mkWorld(t, proxier.Config{})
	tcpSvc, tcpPort := w.addService(service.TCP, false, echoBackend(t, "127.0.0.2"))
	udpSvc, udpPort := w.addService(service.UDP, false, udpEcho(t, "127.0.0.3"))
	if got, err := echoThrough(t, tcpPort, "tcp"); err != nil || got != "tcp" {
		t.Fatalf("TCP through the proxy: got %q, %v", got, err)
	}
	c, err := net.Dial("udp", fmt.Sprintf("127.0.0.1:%d", udpPort))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	buf := make([]byte, 16)
	testbed.Await(t, awaitTimeout, "a UDP reply", func() bool {
		c.SetDeadline(time.Now().Add(50 * time.Millisecond))
		c.Write([]byte("udp"))
		n, err := c.Read(buf)
		return err == nil && string(buf[:n]) == "udp"
	})
	testbed.Await(t, awaitTimeout, "the TCP connection counted", func() bool {
		return metricOr0(t, "uproxy_connections_total", map[string]string{"service": tcpSvc, "result": "success"}) == 1
	})
	// The UDP client's entry expires after the UDP timeout without a
	// datagram: each look sends one, so a slow count above cannot outlast it.
	testbed.Await(t, awaitTimeout, "the UDP client counted", func() bool {
		c.Write([]byte("udp"))
		return metricOr0(t, "uproxy_active_connections", map[string]string{"service": udpSvc}) == 1
	})

	for _, m := range []struct {
		name string
		of   string // the protocol whose ports have it
	}{
		{"uproxy_udp_client_expiries_total", "UDP"},
		{"uproxy_udp_clients_moved_total", "UDP"},
		{"uproxy_udp_clients", "UDP"},
		{"uproxy_retries_total", "TCP"},
		{"uproxy_retry_budget_refusals_total", "TCP"},
		{"uproxy_idle_timeouts_total", "TCP"},
		{"uproxy_connections_total", "both"},
		{"uproxy_bytes_total", "both"},
		{"uproxy_active_connections", "both"},
	} {
		for _, p := range []struct{ proto, svc string }{{"TCP", tcpSvc}, {"UDP", udpSvc}} {
			_, has := metric(t, m.name, map[string]string{"service": p.svc})
			if want := m.of == "both" || m.of == p.proto; has != want {
				t.Errorf("%s of the %s port %s: present %v, want %v", m.name, p.proto, p.svc, has, want)
			}
		}
	}
}

// /debug/memory reads the process's memory; ?gc=1 collects first, so freed
// objects are no longer counted and the heap figure is what is live.
func TestDebugMemory(t *testing.T) {
	w := mkWorld(t, proxier.Config{})
	var plain, collected observe.MemoryState
	for range 64 {
		heldGarbage = append(heldGarbage, make([]byte, 1<<20))
	}
	w.getJSON("/debug/memory", &plain)
	heldGarbage = nil
	w.getJSON("/debug/memory?gc=1", &collected)
	if plain.Collected || !collected.Collected {
		t.Errorf("collected: got %v without gc=1 and %v with it, want false and true", plain.Collected, collected.Collected)
	}
	if plain.HeapAllocBytes < 64<<20 || collected.HeapAllocBytes > plain.HeapAllocBytes-60<<20 {
		t.Errorf("heap: %d bytes with 64 MiB held, %d after they were dropped and collected; want the 64 MiB gone", plain.HeapAllocBytes, collected.HeapAllocBytes)
	}
	if collected.RSSBytes <= 0 || collected.SysBytes == 0 || collected.HeapObjects == 0 || collected.Goroutines == 0 {
		t.Errorf("reading %+v, want RSS, runtime and object figures", collected)
	}
	resp, err := http.Get(w.srv.URL + "/debug/memory?gc=yes")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest {
		t.Errorf("/debug/memory?gc=yes: status %d, want 400", resp.StatusCode)
	}
}

// heldGarbage is memory TestDebugMemory holds, then drops for a collection.
var heldGarbage [][]byte
