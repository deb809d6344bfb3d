package proxier

import (
	"testing"
	"time"

	"github.com/uproxy/uproxy/service"
)

// TestZoneChangeAppliesLive: the zone a snapshot carries picks the endpoints
// hinted for it, and a later snapshot with the same ports and another zone
// (the Node's zone label edited) moves new connections to that zone's
// endpoint, without a restart or a change of proxy port.
func TestZoneChangeAppliesLive(t *testing.T) {
	w := newWorld(t)
	a := w.tcpBackend("a", "127.0.0.2")
	b := w.tcpBackend("b", "127.0.0.3")
	p := newProxier(t, Config{})
	sp := port("web", service.TCP, a, b)
	sp.Endpoints[0].ZoneHints = []string{"zone-a"}
	sp.Endpoints[1].ZoneHints = []string{"zone-b"}
	for i, zone := range []string{"zone-a", "zone-b", "zone-a"} {
		mustSync(t, p, &service.Snapshot{Ports: []*service.Port{sp}, Zone: zone, Built: time.Now()})
		want := zone[len(zone)-1:]
		for range 4 {
			if name, err := getTCP(t, p.ProxyPort(sp.Name)); err != nil || name != want {
				t.Fatalf("step %d, zone %s: got %q, %v, want %s", i, zone, name, err, want)
			}
		}
	}
}
