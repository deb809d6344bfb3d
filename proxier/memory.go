package proxier

import (
	"sync"

	"github.com/uproxy/uproxy/affinity"
)

// What the balancers of a uproxy have learnt goes to its successor twice
// (app/takeover.go): with the listening sockets, to be recalled by each
// route as its first sync gives it its endpoints, before it serves a
// connection (RecallAtSync); and once the connections have moved, for what
// was learnt meanwhile (Recall), a client's newer entry winning.

// RouteMemory is what one family's balancer of a route has learnt.
type RouteMemory struct {
	Route  RouteKey        `json:"route"`
	Family int             `json:"family"` // 0: IPv4, 1: IPv6
	Memory affinity.Memory `json:"memory"`
	// RetryBudgetSpent is the route's retry budget (both families share
	// it), on its family 0 memory: socket.TCPProxy.RetryBudgetSpent.
	RetryBudgetSpent int64 `json:"retryBudgetSpent,omitempty"`
}

// recalls holds memories until the sync that gives their routes endpoints.
type recalls struct {
	mu      sync.Mutex
	pending map[RouteKey][2]*RouteMemory
}

// Remember returns what every route's balancers have learnt, leaving out
// those that learnt nothing.
func (p *Proxier) Remember() []RouteMemory {
	p.mu.RLock()
	ports := make([]*servicePort, 0, len(p.ports))
	for _, sp := range p.ports {
		ports = append(ports, sp)
	}
	p.mu.RUnlock()
	var out []RouteMemory
	for _, sp := range ports {
		for _, r := range sp.routes() {
			var spent int64
			if r.tcp != nil {
				spent = r.tcp.RetryBudgetSpent()
			}
			for i, fb := range r.picker.each() {
				rm := RouteMemory{Route: RouteKey{Service: sp.name, External: r.external}, Family: fb.family, Memory: fb.Remember()}
				if i == 0 {
					rm.RetryBudgetSpent = spent
				}
				if !rm.Memory.Empty() || rm.RetryBudgetSpent > 0 {
					out = append(out, rm)
				}
			}
		}
	}
	return out
}

// RecallAtSync keeps ms for the Syncs to come: each route recalls its
// memory once a Sync has given it its endpoints, before it serves. Call it
// before the first Sync.
func (p *Proxier) RecallAtSync(ms []RouteMemory) {
	p.recall.mu.Lock()
	defer p.recall.mu.Unlock()
	if p.recall.pending == nil {
		p.recall.pending = make(map[RouteKey][2]*RouteMemory, len(ms))
	}
	for _, rm := range ms {
		if rm.Family < 0 || rm.Family > 1 {
			continue
		}
		fams := p.recall.pending[rm.Route]
		fams[rm.Family] = &rm
		p.recall.pending[rm.Route] = fams
	}
}

// recallPending gives r of sp the memory kept for it, once.
func (p *Proxier) recallPending(sp *servicePort, r *route) {
	p.recall.mu.Lock()
	if len(p.recall.pending) == 0 {
		p.recall.mu.Unlock()
		return
	}
	key := RouteKey{Service: sp.name, External: r.external}
	fams, ok := p.recall.pending[key]
	delete(p.recall.pending, key)
	p.recall.mu.Unlock()
	if !ok {
		return
	}
	for _, rm := range fams {
		if rm != nil {
			recallRoute(r, *rm)
		}
	}
}

// recallRoute gives r what rm says its family's balancer, and its retry
// budget, learnt.
func recallRoute(r *route, rm RouteMemory) {
	r.picker.made(rm.Family).Recall(rm.Memory)
	if rm.RetryBudgetSpent > 0 && r.tcp != nil {
		r.tcp.SpendRetryBudget(rm.RetryBudgetSpent)
	}
}

// Recall gives each route's balancers what ms says they learnt, now (see
// affinity.Balancer.Recall); a route this proxier does not have is skipped.
// It returns how many memories were taken.
func (p *Proxier) Recall(ms []RouteMemory) int {
	taken := 0
	for _, rm := range ms {
		if rm.Family < 0 || rm.Family > 1 {
			continue
		}
		p.mu.RLock()
		sp := p.ports[rm.Route.Service]
		p.mu.RUnlock()
		if sp == nil {
			continue
		}
		r := sp.cluster
		if rm.Route.External {
			r = sp.external.Load()
		}
		if r == nil {
			continue
		}
		recallRoute(r, rm)
		taken++
	}
	return taken
}

// EndRecall drops the memories no Sync took (their routes are gone).
func (p *Proxier) EndRecall() {
	p.recall.mu.Lock()
	p.recall.pending = nil
	p.recall.mu.Unlock()
}
