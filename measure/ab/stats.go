package ab

import (
	"math"
	"math/rand/v2"
	"slices"
	"time"
)

// Percentile returns the q-quantile (0 < q ≤ 1) of sorted by the nearest-rank
// definition: the smallest sample with at least a fraction q of the samples at
// or below it, sorted[ceil(q·n)-1]. It returns 0 for no samples. Nearest rank
// always reports a latency that was measured, and the bootstrap uses the same
// definition, so a row's estimate and its interval agree.
func Percentile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	return sorted[rank(len(sorted), q)-1]
}

// rank is the 1-based nearest rank of the q-quantile of n samples.
func rank(n int, q float64) int {
	// The epsilon keeps q·n that should be whole (0.9·1000) from rounding up.
	r := int(math.Ceil(q*float64(n) - 1e-9))
	return min(max(r, 1), n)
}

// Interval is a confidence interval of the difference B−A of a percentile.
type Interval struct {
	Low, High time.Duration
}

// Significant reports whether the interval excludes zero, and on which side:
// +1 when B is slower (the whole interval above zero), -1 when B is faster.
func (iv Interval) Significant() int {
	switch {
	case iv.Low > 0:
		return 1
	case iv.High < 0:
		return -1
	}
	return 0
}

// Bootstrap estimates, for every quantile in qs, a confidence interval (at
// level, e.g. 0.95) of Percentile(b, q) − Percentile(a, q). Each of resamples
// rounds draws len(a) samples from a and len(b) from b with replacement and
// takes the difference of their percentiles; the interval is the middle level
// of those differences (the percentile bootstrap). a and b must be sorted and
// non-empty; rng makes the result reproducible.
func Bootstrap(a, b []time.Duration, qs []float64, resamples int, level float64, rng *rand.Rand) []Interval {
	diffs := make([][]time.Duration, len(qs))
	for i := range diffs {
		diffs[i] = make([]time.Duration, resamples)
	}
	ra, rb := newResampler(a, qs), newResampler(b, qs)
	for r := 0; r < resamples; r++ {
		qa, qb := ra.draw(rng), rb.draw(rng)
		for i := range qs {
			diffs[i][r] = qb[i] - qa[i]
		}
	}
	out := make([]Interval, len(qs))
	tail := (1 - level) / 2
	for i, d := range diffs {
		slices.Sort(d)
		out[i] = Interval{Low: Percentile(d, tail), High: Percentile(d, 1-tail)}
	}
	return out
}

// resampler draws bootstrap resamples of one sorted sample set and returns
// their percentiles without sorting: a resample is a count per original index,
// and since the originals are sorted, the running sum of the counts finds
// every rank in one pass. A round costs O(n), not O(n log n).
type resampler struct {
	sorted []time.Duration
	// order visits qs in increasing order; ranks[j] belongs to qs[order[j]].
	order  []int
	ranks  []int
	counts []int32
	out    []time.Duration
}

func newResampler(sorted []time.Duration, qs []float64) *resampler {
	r := &resampler{sorted: sorted, counts: make([]int32, len(sorted)), out: make([]time.Duration, len(qs))}
	r.order = make([]int, len(qs))
	for i := range r.order {
		r.order[i] = i
	}
	slices.SortFunc(r.order, func(x, y int) int { return cmpFloat(qs[x], qs[y]) })
	for _, i := range r.order {
		r.ranks = append(r.ranks, rank(len(sorted), qs[i]))
	}
	return r
}

func cmpFloat(x, y float64) int {
	switch {
	case x < y:
		return -1
	case x > y:
		return 1
	}
	return 0
}

// draw returns the percentiles of one resample, indexed as qs; the slice is
// reused by the next draw.
func (r *resampler) draw(rng *rand.Rand) []time.Duration {
	n := len(r.sorted)
	clear(r.counts)
	for range n {
		r.counts[rng.IntN(n)]++
	}
	seen, j := 0, 0
	for i, c := range r.counts {
		seen += int(c)
		for j < len(r.ranks) && seen >= r.ranks[j] {
			r.out[r.order[j]] = r.sorted[i]
			j++
		}
		if j == len(r.ranks) {
			break
		}
	}
	return r.out
}
