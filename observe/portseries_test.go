package observe_test

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/record"
)

// A Service port's series, as /metrics shows them: every one from the moment
// its observer exists (at zero), counted from the connections it records, one
// set of series for two observers of the same Service port, and none once it
// is forgotten.
func TestPortSeries(t *testing.T) {
	svc := fmt.Sprintf("t/series%d:p", serviceSeq.Add(1))
	names := []string{"uproxy_active_connections", "uproxy_bytes_total", "uproxy_connection_duration_seconds",
		"uproxy_connections_total", "uproxy_idle_timeouts_total", "uproxy_proxy_port_reopens_total",
		"uproxy_retries_total", "uproxy_retry_budget_refusals_total", "uproxy_udp_client_expiries_total",
		"uproxy_udp_clients_moved_total", "uproxy_udp_dropped_datagrams_total"}
	srv := httptest.NewServer((&observe.Server{}).MetricsHandler())
	defer srv.Close()
	// scrape returns the lines of /metrics of svc's series among names.
	scrape := func() string {
		t.Helper()
		resp, err := http.Get(srv.URL + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("/metrics: status %d, %v: %s", resp.StatusCode, err, body)
		}
		var b strings.Builder
		for line := range strings.Lines(string(body)) {
			name, _, _ := strings.Cut(line, "{")
			name = strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(name, "_bucket"), "_sum"), "_count")
			if slices.Contains(names, name) && strings.Contains(line, `service="`+svc+`"`) {
				b.WriteString(line)
			}
		}
		return b.String()
	}

	// A UDP port: the TCP-only series (retries, retry budget refusals, idle
	// timeouts) are not exported for it (TestSeriesFollowTheProtocol).
	o := observe.NewPortObserver(svc, "UDP", nil)
	zero := scrape()
	for _, want := range []string{
		`uproxy_active_connections{service="` + svc + `"} 0`,
		`uproxy_bytes_total{direction="in",service="` + svc + `"} 0`,
		`uproxy_bytes_total{direction="out",service="` + svc + `"} 0`,
		`uproxy_connection_duration_seconds_bucket{service="` + svc + `",le="0.001"} 0`,
		`uproxy_connection_duration_seconds_bucket{service="` + svc + `",le="+Inf"} 0`,
		`uproxy_connection_duration_seconds_count{service="` + svc + `"} 0`,
		`uproxy_connections_total{protocol="UDP",result="failed",service="` + svc + `"} 0`,
		`uproxy_connections_total{protocol="UDP",result="retried",service="` + svc + `"} 0`,
		`uproxy_connections_total{protocol="UDP",result="success",service="` + svc + `"} 0`,
		`uproxy_proxy_port_reopens_total{service="` + svc + `"} 0`,
		`uproxy_udp_client_expiries_total{service="` + svc + `"} 0`,
		`uproxy_udp_clients_moved_total{service="` + svc + `"} 0`,
		`uproxy_udp_dropped_datagrams_total{reason="client_table_full",service="` + svc + `"} 0`,
		`uproxy_udp_dropped_datagrams_total{reason="no_endpoint",service="` + svc + `"} 0`,
		`uproxy_udp_dropped_datagrams_total{reason="no_local_port",service="` + svc + `"} 0`,
		`uproxy_udp_dropped_datagrams_total{reason="no_socket",service="` + svc + `"} 0`,
	} {
		if !strings.Contains(zero, want+"\n") {
			t.Errorf("before any traffic: no %q in\n%s", want, zero)
		}
	}

	ep := netip.MustParseAddrPort("10.1.0.1:53")
	attempt := func(err error) record.Attempt { return record.Attempt{Endpoint: ep, Err: err} }
	o.ConnOpened(svc, "UDP")
	o.ConnOpened(svc, "UDP")
	o.ConnOpened(svc, "UDP")
	// Served at once, idled out after 2ms: 2ms goes in le=0.004 and above.
	o.ConnClosed(&record.Conn{Service: svc, Protocol: "UDP", Attempts: []record.Attempt{attempt(nil)}, Endpoint: ep,
		BytesIn: 10, BytesOut: 20, Duration: 2 * time.Millisecond})
	// Served after a retry, then its endpoint left the Service.
	o.ConnClosed(&record.Conn{Service: svc, Protocol: "UDP", Attempts: []record.Attempt{attempt(errors.New("refused")), attempt(nil)},
		Endpoint: ep, BytesIn: 1, Duration: 5 * time.Second, Err: record.ErrEndpointRemoved})
	o.Reopened(1, 2, errors.New("gone"))
	// Two datagrams turned away: counted by reason, and as no session.
	for range 2 {
		o.ConnOpened(svc, "UDP")
		o.ConnClosed(&record.Conn{Service: svc, Protocol: "UDP", Err: record.ErrTooManyClients, Dropped: record.DropClientTableFull})
	}

	// A second observer of the same Service port, as a replacement opened
	// before the first is forgotten: its counts add to the same series.
	other := observe.NewPortObserver(svc, "UDP", nil)
	other.ConnOpened(svc, "UDP")
	other.ConnClosed(&record.Conn{Service: svc, Protocol: "UDP", Attempts: []record.Attempt{attempt(errors.New("refused"))},
		Duration: 500 * time.Microsecond, RetryRefused: true})
	got := scrape()
	// Summed as floats, as Prometheus sums (not exactly 5.0025).
	first, second, third := (2 * time.Millisecond).Seconds(), (5 * time.Second).Seconds(), (500 * time.Microsecond).Seconds()
	sum := strconv.FormatFloat(first+second+third, 'g', -1, 64)
	for _, want := range []string{
		`uproxy_active_connections{service="` + svc + `"} 1`,
		`uproxy_bytes_total{direction="in",service="` + svc + `"} 11`,
		`uproxy_bytes_total{direction="out",service="` + svc + `"} 20`,
		`uproxy_connection_duration_seconds_bucket{service="` + svc + `",le="0.001"} 1`,
		`uproxy_connection_duration_seconds_bucket{service="` + svc + `",le="0.004"} 2`,
		`uproxy_connection_duration_seconds_bucket{service="` + svc + `",le="4.096"} 2`,
		`uproxy_connection_duration_seconds_bucket{service="` + svc + `",le="16.384"} 3`,
		`uproxy_connection_duration_seconds_bucket{service="` + svc + `",le="+Inf"} 3`,
		`uproxy_connection_duration_seconds_sum{service="` + svc + `"} ` + sum,
		`uproxy_connection_duration_seconds_count{service="` + svc + `"} 3`,
		`uproxy_connections_total{protocol="UDP",result="failed",service="` + svc + `"} 1`,
		`uproxy_connections_total{protocol="UDP",result="retried",service="` + svc + `"} 1`,
		`uproxy_connections_total{protocol="UDP",result="success",service="` + svc + `"} 1`,
		`uproxy_proxy_port_reopens_total{service="` + svc + `"} 1`,
		`uproxy_udp_client_expiries_total{service="` + svc + `"} 1`,
		`uproxy_udp_clients_moved_total{service="` + svc + `"} 1`,
		`uproxy_udp_dropped_datagrams_total{reason="client_table_full",service="` + svc + `"} 2`,
		`uproxy_udp_dropped_datagrams_total{reason="no_socket",service="` + svc + `"} 0`,
	} {
		if !strings.Contains(got, want+"\n") {
			t.Errorf("after the traffic: no %q in\n%s", want, got)
		}
	}

	o.Forget()
	if got := scrape(); !strings.Contains(got, `uproxy_connections_total{protocol="UDP",result="failed",service="`+svc+`"} 1`) {
		t.Errorf("one of two observers forgotten: the other's series are gone:\n%s", got)
	}
	other.Forget()
	if got := scrape(); got != "" {
		t.Errorf("both forgotten: series left:\n%s", got)
	}
}
