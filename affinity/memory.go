package affinity

import (
	"net/netip"
	"time"
)

// A uproxy that hands over to a successor hands it what its balancers have
// learnt, so that a restart or an upgrade changes no client's endpoint: the
// ClientIP affinity entries (kube-proxy's iptables mode keeps them in the
// kernel's recent lists, which outlive kube-proxy), the endpoints' outlier
// state (an ejected endpoint stays ejected for the rest of its period) and
// where the round robin stands.

// Memory is what a Balancer has learnt: Remember takes it, Recall gives it
// to another Balancer of the same route.
type Memory struct {
	// Next is the endpoint the rotation goes on at (invalid: none).
	Next netip.AddrPort `json:"next,omitzero"`
	// Endpoints are the endpoints with failures or ejections.
	Endpoints []EndpointMemory `json:"endpoints,omitempty"`
	// Entries are the live ClientIP affinity entries.
	Entries []Entry `json:"entries,omitempty"`
}

// EndpointMemory is an endpoint's outlier state.
type EndpointMemory struct {
	Addr         netip.AddrPort `json:"addr"`
	Failures     int            `json:"failures,omitempty"`
	Ejections    int            `json:"ejections,omitempty"`
	EjectedUntil time.Time      `json:"ejectedUntil,omitzero"`
}

// Empty reports whether m holds nothing worth handing over.
func (m Memory) Empty() bool {
	return !m.Next.IsValid() && len(m.Endpoints) == 0 && len(m.Entries) == 0
}

// Remember returns what b has learnt.
func (b *Balancer) Remember() Memory {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.now()
	var m Memory
	if len(b.eps) > 0 && !b.sched.hashed() {
		m.Next = b.eps[b.next].addr
	}
	for _, e := range b.eps {
		if e.failures > 0 || e.ejections > 0 || e.ejectedUntil.After(now) {
			em := EndpointMemory{Addr: e.addr, Failures: e.failures, Ejections: e.ejections}
			if e.ejectedUntil.After(now) {
				em.EjectedUntil = e.ejectedUntil
			}
			m.Endpoints = append(m.Endpoints, em)
		}
	}
	if b.affinity {
		for _, e := range b.entries {
			if b.live(e.lastUsed, now) {
				m.Entries = append(m.Entries, Entry{Client: e.client, Endpoint: b.eps[e.ep].addr, LastUsed: e.lastUsed})
			}
		}
	}
	return m
}

// Recall takes m into b, as far as b's endpoints allow: the rotation goes on
// at m.Next, an endpoint m knows as failing or ejected is so here too, and
// each affinity entry whose endpoint b has is kept, unless b has a newer one
// for the same client (a client that connected here meanwhile). Entries past
// the table's bound, or expired by b's timeout, are left out. Call it once
// b has its endpoints (Update).
func (b *Balancer) Recall(m Memory) {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.now()
	if m.Next.IsValid() && !b.sched.hashed() {
		if i, ok := position(b.eps, b.index, keyOfEndpoint(m.Next)); ok {
			b.next = int(i)
		}
	}
	for _, em := range m.Endpoints {
		i, ok := position(b.eps, b.index, keyOfEndpoint(em.Addr))
		if !ok {
			continue
		}
		e := &b.eps[i]
		wasEjected := !e.ejectedUntil.IsZero()
		e.failures, e.ejections = max(e.failures, em.Failures), max(e.ejections, em.Ejections)
		if em.EjectedUntil.After(now) && em.EjectedUntil.After(e.ejectedUntil) {
			e.ejectedUntil = em.EjectedUntil
			if !wasEjected {
				b.ejected++
			}
		}
	}
	if !b.affinity {
		return
	}
	for _, en := range m.Entries {
		client := en.Client.Unmap()
		i, ok := position(b.eps, b.index, keyOfEndpoint(en.Endpoint))
		if !ok || !b.live(en.LastUsed, now) {
			continue
		}
		e := entry{client: client, ep: i, lastUsed: en.LastUsed}
		if pos, found := b.clients[keyOfClient(client)]; found {
			if b.entries[pos].lastUsed.Before(en.LastUsed) {
				b.entries[pos] = e
			}
			continue
		}
		if len(b.entries) >= MaxAffinityEntries {
			continue
		}
		if b.clients == nil {
			b.clients = map[clientKey]int32{}
		}
		b.clients[keyOfClient(client)] = int32(len(b.entries))
		b.entries = append(b.entries, e)
	}
	b.sweepAt = max(b.sweepAt, 2*len(b.entries))
}
