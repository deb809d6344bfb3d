package affinity

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/uproxy/uproxy/service"
)

// Schedulers lists the scheduler names accepted, default first: the names a
// Service may ask for (service.Schedulers, the one list). They mean what IPVS
// means by them:
//
//	rr   round robin: rotate over the endpoints
//	lc   least connection: fewest active connections
//	sh   source hashing: a fixed table maps the client IP to an endpoint
//	dh   destination hashing: the same table, over the Service's virtual IP
//	sed  shortest expected delay: least (active+1)/weight
//	nq   never queue: an idle endpoint if there is one, else sed
var Schedulers = service.Schedulers

// DefaultScheduler is the scheduler used when none is named.
const DefaultScheduler = "rr"

type scheduler uint8

// The order matches Schedulers.
const (
	roundRobin scheduler = iota
	leastConnection
	sourceHashing
	destinationHashing
	shortestExpectedDelay
	neverQueue
)

func (s scheduler) String() string { return Schedulers[s] }

// hashed reports whether s chooses through the bucket table.
func (s scheduler) hashed() bool { return s == sourceHashing || s == destinationHashing }

// ValidScheduler returns nil if name is a scheduler Balancer accepts. The empty name
// is valid and means DefaultScheduler.
func ValidScheduler(name string) error {
	_, err := parseScheduler(name)
	return err
}

func parseScheduler(name string) (scheduler, error) {
	if name == "" {
		name = DefaultScheduler
	}
	i := slices.Index(Schedulers, name)
	if i < 0 {
		return 0, fmt.Errorf("unknown scheduler %q: valid schedulers are %s", name, strings.Join(Schedulers, ", "))
	}
	return scheduler(i), nil
}

// minBucketBits sizes the hash table at 256 buckets, IPVS's default for sh and dh.
// With more endpoints than buckets the table grows to the next power of two so that
// every endpoint owns at least one bucket: otherwise endpoints beyond the 256th could
// never be chosen, and the tried-fallback walk could miss an untried endpoint.
const minBucketBits = 8

// buildBuckets maps every bucket to an endpoint index. Buckets are dealt round-robin
// over the endpoints sorted by address, so the table depends only on the endpoint
// set, not on the order Update received it in.
func buildBuckets(eps []backend) (buckets []int32, bits uint) {
	if len(eps) == 0 {
		return nil, 0
	}
	bits = minBucketBits
	for 1<<bits < len(eps) {
		bits++
	}
	order := make([]int32, len(eps))
	for i := range order {
		order[i] = int32(i)
	}
	slices.SortFunc(order, func(a, b int32) int { return eps[a].addr.Compare(eps[b].addr) })
	buckets = make([]int32, 1<<bits)
	for i := range buckets {
		buckets[i] = order[i%len(order)]
	}
	return buckets, bits
}

// hashAddr folds an address to 32 bits (IPv6: XOR of its four words) and scrambles
// it with the golden-ratio multiplier, as IPVS's sh and dh do. The table index is
// taken from the high bits, which the multiplication mixes best. The zero Addr
// hashes to 0, so a Service without a virtual IP still has a fixed dh choice.
func hashAddr(a netip.Addr) uint32 {
	var v uint32
	switch {
	case a.Is4():
		b := a.As4()
		v = binary.BigEndian.Uint32(b[:])
	case a.Is6():
		b := a.As16()
		v = binary.BigEndian.Uint32(b[0:4]) ^ binary.BigEndian.Uint32(b[4:8]) ^
			binary.BigEndian.Uint32(b[8:12]) ^ binary.BigEndian.Uint32(b[12:16])
	}
	return v * 2654435761
}

// schedule runs the scheduler over the endpoints, skipping those in tried. The caller
// holds mu, has checked that there is at least one endpoint and has cleared tried if
// it covers every endpoint, so schedule always finds one.
// skip, when on, also excludes ejected endpoints; ejectFilter turns it on only when
// an endpoint that is neither tried nor ejected exists.
func (b *Balancer) schedule(client netip.Addr, tried []netip.AddrPort, skip ejectFilter) int {
	switch b.sched {
	case leastConnection, shortestExpectedDelay:
		return b.leastLoaded(tried, skip, false)
	case neverQueue:
		return b.leastLoaded(tried, skip, true)
	case sourceHashing:
		return b.walkBuckets(hashAddr(client), tried, skip)
	case destinationHashing:
		return b.walkBuckets(b.dstHash, tried, skip)
	default:
		n := len(b.eps)
		for k := range n {
			i := b.after(k)
			if !b.excluded(i, tried, skip) {
				return i
			}
		}
		panic("affinity: no untried endpoint although tried does not cover the set")
	}
}

// after returns the index k places after the last scheduled pick.
func (b *Balancer) after(k int) int {
	i := b.next + k
	if i >= len(b.eps) {
		i -= len(b.eps)
	}
	return i
}

func (b *Balancer) excluded(i int, tried []netip.AddrPort, skip ejectFilter) bool {
	return (len(tried) > 0 && slices.Contains(tried, b.eps[i].addr)) || skip.skips(&b.eps[i])
}

// leastLoaded implements lc, sed and nq. lc orders by active connections, sed by
// (active+1)/weight (compared by cross-multiplying, as IPVS does, to stay in
// integers); with every weight 1 the two agree, but they stay distinct in case
// weights ever come from the endpoints. Ties go to the first endpoint after the last
// scheduled pick, so equal endpoints take turns instead of the first one taking all.
// idleFirst (nq) returns the first idle endpoint in that same order, if any.
//
// This scan is the only per-Pick cost that grows with the endpoint count, so it
// walks the slice directly and tests tried only when there is one.
func (b *Balancer) leastLoaded(tried []netip.AddrPort, skip ejectFilter, idleFirst bool) int {
	n := len(b.eps)
	lc := b.sched == leastConnection
	best, bestActive, bestWeight := -1, 0, 0
	i := b.next
	for range n {
		e := &b.eps[i]
		if (len(tried) == 0 || !slices.Contains(tried, e.addr)) && !skip.skips(e) {
			switch {
			case idleFirst && e.active == 0:
				return i
			case best < 0,
				lc && e.active < bestActive,
				!lc && (e.active+1)*bestWeight < (bestActive+1)*e.weight:
				best, bestActive, bestWeight = i, e.active, e.weight
			}
		}
		if i++; i == n {
			i = 0
		}
	}
	if best < 0 {
		panic("affinity: no untried endpoint although tried does not cover the set")
	}
	return best
}

// walkBuckets returns the endpoint of bucket h, or, when that one was tried, of the
// next bucket whose endpoint was not. Every endpoint owns a bucket, so the walk ends.
func (b *Balancer) walkBuckets(h uint32, tried []netip.AddrPort, skip ejectFilter) int {
	mask := uint32(len(b.buckets) - 1)
	start := h >> (32 - b.bucketBits)
	for off := range uint32(len(b.buckets)) {
		i := int(b.buckets[(start+off)&mask])
		if !b.excluded(i, tried, skip) {
			return i
		}
	}
	panic("affinity: no untried endpoint in the bucket table although tried does not cover the set")
}
