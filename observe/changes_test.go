package observe

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/service/servicetest"
)

func TestChanges(t *testing.T) {
	port := func(ns, name, portName string, portNum int, eps ...string) *service.Port {
		p := servicetest.Port(ns, name, portName, service.TCP, portNum)
		p.Endpoints = servicetest.Endpoints(eps...)
		return p
	}
	snap := servicetest.Snapshot
	type want struct{ svcTotal, epTotal, svcPending, epPending float64 }
	var c Changes
	svc0, ep0 := read(ServiceChangesTotal), read(EndpointChangesTotal)
	for _, step := range []struct {
		name   string
		queued *service.Snapshot
		synced *service.Snapshot
		want   want
	}{
		{name: "first snapshot: two Services, one with endpoints",
			queued: snap(port("a", "web", "http", 80, "10.0.0.1:80"), port("a", "web", "https", 443), port("b", "db", "", 5432)),
			want:   want{2, 1, 2, 1}},
		{name: "synced",
			synced: snap(port("a", "web", "http", 80, "10.0.0.1:80"), port("a", "web", "https", 443), port("b", "db", "", 5432)),
			want:   want{2, 1, 0, 0}},
		{name: "endpoints of web change",
			queued: snap(port("a", "web", "http", 80, "10.0.0.2:80"), port("a", "web", "https", 443), port("b", "db", "", 5432)),
			want:   want{2, 2, 0, 1}},
		{name: "db's port changes and it gains an endpoint, before the sync",
			queued: snap(port("a", "web", "http", 80, "10.0.0.2:80"), port("a", "web", "https", 443), port("b", "db", "", 5433, "10.0.0.9:5433")),
			want:   want{3, 3, 1, 2}},
		{name: "web goes away",
			queued: snap(port("b", "db", "", 5433, "10.0.0.9:5433")),
			want:   want{4, 4, 2, 2}},
		{name: "synced again",
			synced: snap(port("b", "db", "", 5433, "10.0.0.9:5433")),
			want:   want{4, 4, 0, 0}},
	} {
		if step.queued != nil {
			c.Queued(step.queued)
		}
		if step.synced != nil {
			step.synced.Built = time.Now()
			c.Synced(step.synced)
		}
		got := want{
			read(ServiceChangesTotal) - svc0, read(EndpointChangesTotal) - ep0,
			read(ServiceChangesPending), read(EndpointChangesPending),
		}
		if got != step.want {
			t.Fatalf("%s: got %+v, want %+v", step.name, got, step.want)
		}
	}
}

// read returns the value of a counter or gauge.
func read(m prometheus.Metric) float64 {
	var d dto.Metric
	if err := m.Write(&d); err != nil {
		panic(err)
	}
	if d.Counter != nil {
		return d.Counter.GetValue()
	}
	return d.Gauge.GetValue()
}
