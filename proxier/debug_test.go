package proxier

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"sync"
	"testing"

	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/service"
)

// /debug/services is read by HTTP handlers while the sync loop hands every
// endpoint change to the running ports (Sync's short way). Under -race this fails
// if any state the view reads is written without ordering; without -race it
// checks that every view shows one of the endpoint sets synced, whole.
func TestDebugServicesDuringEndpointChurn(t *testing.T) {
	w := newWorld(t)
	var eps []netip.AddrPort
	for i := range 3 {
		eps = append(eps, w.tcpBackend(fmt.Sprintf("b%d", i), fmt.Sprintf("127.0.0.%d", i+2)))
	}
	p := newProxier(t, Config{})
	handler := (&observe.Server{Services: p, Debug: true}).MetricsHandler()
	snap := func(i int) *service.Snapshot {
		return snapshot(port("tcp", service.TCP, eps[i%3], eps[(i+1)%3]), port("udp", service.UDP, eps[i%3]))
	}
	mustSync(t, p, snap(0))

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				rec := httptest.NewRecorder()
				handler.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/debug/services", nil))
				var states []observe.ServiceState
				if err := json.Unmarshal(rec.Body.Bytes(), &states); err != nil {
					errs <- fmt.Errorf("decode /debug/services: %v", err)
					return
				}
				if len(states) != 2 || len(states[0].Endpoints) != 2 || len(states[1].Endpoints) != 1 {
					errs <- fmt.Errorf("/debug/services during churn: got %+v, want 2 endpoints of tcp, 1 of udp", states)
					return
				}
			}
		}()
	}
	for i := 1; i <= 200; i++ {
		mustSync(t, p, snap(i))
	}
	cancel()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}
