package bench

import (
	"math"
	"math/bits"
	"time"

	"github.com/uproxy/uproxy/measure/chart"
)

// subBits sets the histogram's precision: every power-of-two range of durations is
// split into 2^subBits equal buckets, so a bucket is at most 1/64 (1.6%) wide
// relative to its values, and quantiles are exact to that.
const subBits = 6

// histBuckets covers 0 to 2^40 ns (18 minutes): 64 linear buckets below 64 ns,
// then 64 per power of two.
const histBuckets = (40 - subBits + 1) << subBits

// Histogram counts durations in log-linear buckets. The zero value is empty and
// ready; it is not safe for concurrent use (each load generator owns one, and
// they are merged after the measurement).
type Histogram struct {
	counts [histBuckets]uint64
	n      uint64
	sum    time.Duration
	max    time.Duration
}

func bucketOf(ns uint64) int {
	if ns < 1<<subBits {
		return int(ns)
	}
	// exp is the power of two at or below ns; the top subBits bits below it pick
	// the linear sub-bucket.
	exp := bits.Len64(ns) - 1
	sub := int(ns>>(exp-subBits)) & (1<<subBits - 1)
	b := (exp-subBits+1)<<subBits + sub
	if b >= histBuckets {
		return histBuckets - 1
	}
	return b
}

// bucketMid is the middle of bucket b's range, the value a quantile in it reports.
func bucketMid(b int) float64 {
	if b < 1<<subBits {
		return float64(b)
	}
	exp := b>>subBits + subBits - 1
	sub := b & (1<<subBits - 1)
	width := math.Ldexp(1, exp-subBits)
	low := math.Ldexp(1, exp) + float64(sub)*width
	return low + width/2
}

// Record adds one duration; negative durations count as zero.
func (h *Histogram) Record(d time.Duration) {
	if d < 0 {
		d = 0
	}
	h.counts[bucketOf(uint64(d))]++
	h.n++
	h.sum += d
	if d > h.max {
		h.max = d
	}
}

// Merge adds o's counts to h.
func (h *Histogram) Merge(o *Histogram) {
	for i, c := range o.counts {
		h.counts[i] += c
	}
	h.n += o.n
	h.sum += o.sum
	if o.max > h.max {
		h.max = o.max
	}
}

// Count is the number of recorded durations.
func (h *Histogram) Count() uint64 { return h.n }

// Quantile returns the duration below which a fraction q of the recorded ones
// fall (0 when empty); q=1 returns the maximum.
func (h *Histogram) Quantile(q float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	if q >= 1 {
		return h.max
	}
	rank := uint64(math.Ceil(q * float64(h.n)))
	if rank == 0 {
		rank = 1
	}
	var seen uint64
	for b, c := range h.counts {
		seen += c
		if seen >= rank {
			return h.value(b)
		}
	}
	return h.max
}

// value is what a quantile falling in bucket b reports: its middle, but never
// more than the maximum, and the maximum for the last bucket, which also holds
// everything beyond the range.
func (h *Histogram) value(b int) time.Duration {
	d := time.Duration(bucketMid(b))
	if d > h.max || b == histBuckets-1 {
		d = h.max
	}
	return d
}

// Mean is the average recorded duration.
func (h *Histogram) Mean() time.Duration {
	if h.n == 0 {
		return 0
	}
	return h.sum / time.Duration(h.n)
}

// CDF returns (duration, fraction at or below it) for every non-empty bucket,
// in increasing order: the points of the chart's distribution curve.
func (h *Histogram) CDF() []CDFPoint {
	var pts []CDFPoint
	var seen uint64
	for b, c := range h.counts {
		if c == 0 {
			continue
		}
		seen += c
		d := h.value(b)
		pts = append(pts, CDFPoint{Micros: float64(d) / 1e3, Fraction: float64(seen) / float64(h.n)})
	}
	return pts
}

// CDFPoint is one point of a latency distribution.
type CDFPoint = chart.Point
