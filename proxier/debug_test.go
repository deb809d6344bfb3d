package proxier

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"sync"
	"sync/atomic"
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
	var reads atomic.Int64
	errs := make(chan error, 4)
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				rec := httptest.NewRecorder()
				handler.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/debug/services", nil))
				var view struct{ Services []observe.ServiceState }
				if err := json.Unmarshal(rec.Body.Bytes(), &view); err != nil {
					errs <- fmt.Errorf("decode /debug/services: %v", err)
					return
				}
				st := view.Services
				if len(st) != 2 || len(st[0].Endpoints) != 2 || len(st[1].Endpoints) != 1 {
					errs <- fmt.Errorf("/debug/services during churn: got %+v, want 2 endpoints of tcp, 1 of udp", st)
					return
				}
				reads.Add(1)
			}
		}()
	}
	// The churn goes on until the readers have read a good many times during it.
	for i := 1; i <= 200 || (reads.Load() < 200 && len(errs) == 0); i++ {
		mustSync(t, p, snap(i))
	}
	cancel()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}
