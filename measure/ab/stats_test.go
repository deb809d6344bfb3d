package ab

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

func TestPercentile(t *testing.T) {
	ten := []time.Duration{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	thousand := make([]time.Duration, 1000)
	for i := range thousand {
		thousand[i] = time.Duration(i + 1)
	}
	cases := []struct {
		name   string
		sorted []time.Duration
		q      float64
		want   time.Duration
	}{
		{"empty", nil, 0.5, 0},
		{"one sample", []time.Duration{7}, 0.999, 7},
		{"median of ten is the 5th", ten, 0.5, 5},
		{"p90 of ten is the 9th", ten, 0.9, 9},
		{"p99 of ten is the maximum", ten, 0.99, 10},
		{"q=1 is the maximum", ten, 1, 10},
		{"q near 0 is the minimum", ten, 0.001, 1},
		{"p90 of 1000 is the 900th, not the 901st", thousand, 0.9, 900},
		{"p99.9 of 1000 is the 999th", thousand, 0.999, 999},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := Percentile(tc.sorted, tc.q); got != tc.want {
				t.Errorf("Percentile(q=%g) = %d, want %d", tc.q, got, tc.want)
			}
		})
	}
}

// latencies draws n sorted samples around base: a floor plus exponential
// noise, the shape of a network round trip.
func latencies(seed uint64, n int, base time.Duration) []time.Duration {
	rng := rand.New(rand.NewPCG(seed, 1))
	out := make([]time.Duration, n)
	for i := range out {
		out[i] = base + time.Duration(rng.ExpFloat64()*float64(20*time.Microsecond))
	}
	slices.Sort(out)
	return out
}

func TestBootstrapDetectsAKnownDifference(t *testing.T) {
	a := latencies(1, 2000, 100*time.Microsecond)
	b := latencies(2, 2000, 130*time.Microsecond) // 30µs slower everywhere
	ivs := Bootstrap(a, b, Percentiles, 2000, 0.95, rand.New(rand.NewPCG(7, 7)))
	for i, q := range Percentiles[:3] {
		iv := ivs[i]
		if iv.Significant() != 1 {
			t.Errorf("p%g: interval [%v, %v], want it above 0 (B is 30µs slower)", q*100, iv.Low, iv.High)
		}
		if q == 0.5 && (iv.Low > 30*time.Microsecond || iv.High < 30*time.Microsecond) {
			t.Errorf("p50: interval [%v, %v] excludes the true difference 30µs", iv.Low, iv.High)
		}
	}
	// The same difference the other way round.
	for i, iv := range Bootstrap(b, a, Percentiles[:3], 2000, 0.95, rand.New(rand.NewPCG(7, 7))) {
		if iv.Significant() != -1 {
			t.Errorf("p%g with A and B swapped: interval [%v, %v], want it below 0", Percentiles[i]*100, iv.Low, iv.High)
		}
	}
}

func TestBootstrapIdenticalDistributionsAreNotSignificant(t *testing.T) {
	cases := []struct {
		name string
		a, b []time.Duration
	}{
		{"the same samples", latencies(1, 2000, 100*time.Microsecond), latencies(1, 2000, 100*time.Microsecond)},
		{"two draws of one distribution", latencies(3, 2000, 100*time.Microsecond), latencies(4, 2000, 100*time.Microsecond)},
		{"different counts", latencies(5, 500, 100*time.Microsecond), latencies(6, 3000, 100*time.Microsecond)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ivs := Bootstrap(tc.a, tc.b, Percentiles, 2000, 0.95, rand.New(rand.NewPCG(7, 7)))
			for i, iv := range ivs {
				if iv.Significant() != 0 {
					t.Errorf("p%g: interval [%v, %v], want it to include 0", Percentiles[i]*100, iv.Low, iv.High)
				}
				if iv.Low > iv.High {
					t.Errorf("p%g: interval [%v, %v] upside down", Percentiles[i]*100, iv.Low, iv.High)
				}
			}
		})
	}
}

// The counting resampler returns exactly what sorting an explicit resample
// (the same random draws) and taking its percentiles returns.
func TestResamplerMatchesExplicitResampling(t *testing.T) {
	sorted := latencies(9, 777, 50*time.Microsecond)
	qs := []float64{0.99, 0.5, 0.999, 0.9, 1} // any order
	r := newResampler(sorted, qs)
	counting := rand.New(rand.NewPCG(11, 12))
	explicit := rand.New(rand.NewPCG(11, 12))
	for round := range 50 {
		got := slices.Clone(r.draw(counting))
		res := make([]time.Duration, len(sorted))
		for i := range res {
			res[i] = sorted[explicit.IntN(len(sorted))]
		}
		slices.Sort(res)
		for i, q := range qs {
			if want := Percentile(res, q); got[i] != want {
				t.Fatalf("round %d, q=%g: got %v, want %v", round, q, got[i], want)
			}
		}
	}
}

func TestBootstrapIsReproducible(t *testing.T) {
	a, b := latencies(1, 300, 100*time.Microsecond), latencies(2, 300, 101*time.Microsecond)
	x := Bootstrap(a, b, Percentiles, 500, 0.95, rand.New(rand.NewPCG(3, 3)))
	y := Bootstrap(a, b, Percentiles, 500, 0.95, rand.New(rand.NewPCG(3, 3)))
	if !slices.Equal(x, y) {
		t.Errorf("same seed, different intervals: %v and %v", x, y)
	}
}

func TestVerdict(t *testing.T) {
	above := Interval{Low: 1, High: 5}
	below := Interval{Low: -5, High: -1}
	across := Interval{Low: -1, High: 1}
	cases := []struct {
		name   string
		iv     Interval
		q      float64
		na, nb int
		want   string
	}{
		{"above zero", above, 0.5, 100, 100, VerdictSlower},
		{"below zero", below, 0.5, 100, 100, VerdictFaster},
		{"across zero", across, 0.5, 100, 100, VerdictNone},
		{"p99.9 on 4999 samples", above, 0.999, 4999, 6000, "too few samples (want 5000 a side)"},
		{"p99.9 on 5000 samples", above, 0.999, 5000, 5000, VerdictSlower},
		{"p99 on 499 samples of B", below, 0.99, 500, 499, "too few samples (want 500 a side)"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := verdict(tc.iv, tc.q, tc.na, tc.nb); got != tc.want {
				t.Errorf("got %q, want %q", got, tc.want)
			}
		})
	}
}
