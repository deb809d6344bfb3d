package ab

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/uproxy/uproxy/measure/chart"
)

// Percentiles are the quantiles every metric reports, in the order of its rows.
var Percentiles = []float64{0.5, 0.9, 0.99, 0.999}

// minTail is how many samples must lie beyond a percentile on each side for
// its verdict: fewer, and the percentile is one of the last few samples, which
// the bootstrap cannot vary enough to give an honest interval.
const minTail = 5

// Verdicts of a row.
const (
	VerdictSlower   = "B slower, significant"
	VerdictFaster   = "B faster, significant"
	VerdictNone     = "no significant difference"
	VerdictTooFew   = "too few samples"
	VerdictNoSample = "no samples"
)

// Report is the outcome of a Run.
type Report struct {
	Settings Settings `json:"settings"`
	A        Side     `json:"a"`
	B        Side     `json:"b"`
	// Metrics are connect, exchange and connection, in that order; connect
	// alone in ModeConnect, which makes no exchange.
	Metrics []Metric `json:"metrics"`
	// Stopped says why the run ended before every connection was made; empty
	// when it did not.
	Stopped string `json:"stopped,omitempty"`
	// ElapsedSeconds is the duration of the measurement.
	ElapsedSeconds float64 `json:"elapsedSeconds"`
}

// Settings are the Config the report was measured with.
type Settings struct {
	Mode                  string  `json:"mode"`
	Path                  string  `json:"path,omitempty"`
	HTTPClose             bool    `json:"httpClose,omitempty"`
	Connections           int     `json:"connections"`
	RequestsPerConnection int     `json:"requestsPerConnection"`
	Payload               int     `json:"payloadBytes,omitempty"`
	Interleave            int     `json:"interleave"`
	DialTimeoutSeconds    float64 `json:"dialTimeoutSeconds"`
	TimeoutSeconds        float64 `json:"timeoutSeconds"`
	Resamples             int     `json:"resamples"`
	Confidence            float64 `json:"confidence"`
	Seed                  uint64  `json:"seed"`
}

// Side is what happened at one address.
type Side struct {
	Address string `json:"address"`
	// Dialed is the address every connection went to (Address resolved).
	Dialed string `json:"dialed"`
	// Connections were attempted; Failed of them failed (at connect or in an
	// exchange), counted by kind in Errors.
	Connections int            `json:"connections"`
	Failed      int            `json:"failed"`
	Exchanges   int            `json:"exchanges"`
	Errors      map[string]int `json:"errors"`
	// ErrorExamples holds the first error message of each kind.
	ErrorExamples map[string]string `json:"errorExamples,omitempty"`
}

// Metric is one latency compared between A and B.
type Metric struct {
	// Name is "connect" (dial to established), "exchange" (write the request
	// to the last byte of the reply) or "connection" (dial to the end of the
	// last exchange).
	Name string       `json:"name"`
	A    Distribution `json:"a"`
	B    Distribution `json:"b"`
	Rows []Row        `json:"rows"`
	a, b []time.Duration
}

// Distribution summarizes one side's samples of a metric, in microseconds.
type Distribution struct {
	Count int     `json:"count"`
	Mean  float64 `json:"meanUs"`
	Max   float64 `json:"maxUs"`
}

// Row compares one percentile, in microseconds.
type Row struct {
	Percentile string  `json:"percentile"`
	Q          float64 `json:"q"`
	A          float64 `json:"aUs"`
	B          float64 `json:"bUs"`
	// Diff is B−A; CILow and CIHigh bound it at Settings.Confidence (absent
	// when either side has no sample).
	Diff    float64  `json:"diffUs"`
	CILow   *float64 `json:"ciLowUs,omitempty"`
	CIHigh  *float64 `json:"ciHighUs,omitempty"`
	Verdict string   `json:"verdict"`
}

func micros(d time.Duration) float64 { return float64(d) / 1e3 }

func newReport(cfg Config, sides [2]*side, stopped string, elapsed time.Duration) *Report {
	rep := &Report{
		Settings: Settings{
			Mode:                  cfg.Mode,
			Path:                  cfg.Path,
			HTTPClose:             cfg.HTTPClose,
			Connections:           cfg.Connections,
			RequestsPerConnection: cfg.RequestsPerConnection,
			Payload:               cfg.Payload,
			Interleave:            cfg.Interleave,
			DialTimeoutSeconds:    cfg.DialTimeout.Seconds(),
			TimeoutSeconds:        cfg.Timeout.Seconds(),
			Resamples:             cfg.Resamples,
			Confidence:            cfg.Confidence,
			Seed:                  cfg.Seed,
		},
		Stopped:        stopped,
		ElapsedSeconds: elapsed.Seconds(),
	}
	for i, s := range sides {
		out := Side{
			Address: s.address, Dialed: s.dialed, Connections: s.attempted, Failed: s.failed,
			Exchanges: len(s.exchange), Errors: s.errors, ErrorExamples: s.examples,
		}
		if i == 0 {
			rep.A = out
		} else {
			rep.B = out
		}
	}
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x9e3779b97f4a7c15))
	metrics := []struct {
		name string
		a, b []time.Duration
	}{
		{"connect", sides[0].connect, sides[1].connect},
		{"exchange", sides[0].exchange, sides[1].exchange},
		{"connection", sides[0].connection, sides[1].connection},
	}
	if cfg.Mode == ModeConnect {
		metrics = metrics[:1]
	}
	for _, m := range metrics {
		rep.Metrics = append(rep.Metrics, compare(m.name, m.a, m.b, cfg, rng))
	}
	return rep
}

// Compare builds the metric's rows from two sample sets (which it sorts):
// the percentiles, B−A, its bootstrap interval and the verdict.
func compare(name string, a, b []time.Duration, cfg Config, rng *rand.Rand) Metric {
	slices.Sort(a)
	slices.Sort(b)
	m := Metric{Name: name, A: distribution(a), B: distribution(b), a: a, b: b}
	var ivs []Interval
	if len(a) > 0 && len(b) > 0 {
		ivs = Bootstrap(a, b, Percentiles, cfg.Resamples, cfg.Confidence, rng)
	}
	for i, q := range Percentiles {
		pa, pb := Percentile(a, q), Percentile(b, q)
		row := Row{Percentile: percentileName(q), Q: q, A: micros(pa), B: micros(pb), Diff: micros(pb - pa)}
		switch {
		case ivs == nil:
			row.Verdict = VerdictNoSample
		default:
			lo, hi := micros(ivs[i].Low), micros(ivs[i].High)
			row.CILow, row.CIHigh = &lo, &hi
			row.Verdict = verdict(ivs[i], q, len(a), len(b))
		}
		m.Rows = append(m.Rows, row)
	}
	return m
}

func verdict(iv Interval, q float64, na, nb int) string {
	if need := samplesFor(q); na < need || nb < need {
		return fmt.Sprintf("%s (want %d a side)", VerdictTooFew, need)
	}
	switch iv.Significant() {
	case 1:
		return VerdictSlower
	case -1:
		return VerdictFaster
	}
	return VerdictNone
}

// samplesFor is the number of samples that puts minTail of them beyond the
// q-quantile.
func samplesFor(q float64) int {
	return int(math.Ceil(minTail/(1-q) - 1e-9))
}

func distribution(sorted []time.Duration) Distribution {
	d := Distribution{Count: len(sorted)}
	if len(sorted) == 0 {
		return d
	}
	var sum time.Duration
	for _, v := range sorted {
		sum += v
	}
	d.Mean = micros(sum / time.Duration(len(sorted)))
	d.Max = micros(sorted[len(sorted)-1])
	return d
}

func percentileName(q float64) string {
	return "p" + fmt.Sprintf("%.4g", q*100)
}

func summarizeErrors(errs map[string]int) string {
	var parts []string
	for _, k := range errorKinds {
		if n := errs[k]; n > 0 {
			parts = append(parts, fmt.Sprintf("%s %d", k, n))
		}
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}

// WriteJSON writes the report as indented JSON.
func (r *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// WriteTable writes the report for people: both addresses with their counts
// and errors, then per metric a row per percentile with A, B, B−A, the
// interval and the verdict.
func (r *Report) WriteTable(w io.Writer) error {
	var b strings.Builder
	s := r.Settings
	for _, sd := range []struct {
		name string
		s    Side
	}{{"A", r.A}, {"B", r.B}} {
		addr := sd.s.Address
		if sd.s.Dialed != addr {
			addr += " (" + sd.s.Dialed + ")"
		}
		if s.Mode == ModeConnect {
			fmt.Fprintf(&b, "%s  %s: %d connections, %d failed", sd.name, addr, sd.s.Connections, sd.s.Failed)
		} else {
			fmt.Fprintf(&b, "%s  %s: %d connections, %d exchanges, %d failed", sd.name, addr, sd.s.Connections, sd.s.Exchanges, sd.s.Failed)
		}
		if sd.s.Failed > 0 {
			fmt.Fprintf(&b, ": %s", summarizeErrors(sd.s.Errors))
		}
		b.WriteString("\n")
	}
	fmt.Fprintf(&b, "%s; blocks of %d connections, A B B A A B ...; %.1fs\n", s.perConnection(), s.Interleave, r.ElapsedSeconds)
	fmt.Fprintf(&b, "intervals: %g%% of B-A over %d bootstrap resamples (seed %d)\n", s.Confidence*100, s.Resamples, s.Seed)
	if r.Stopped != "" {
		fmt.Fprintf(&b, "stopped early: %s\n", r.Stopped)
	}
	b.WriteString("\n")
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	for i, m := range r.Metrics {
		if i > 0 {
			fmt.Fprintln(tw, "\t\t\t\t\t")
		}
		fmt.Fprintf(tw, "%s\tA (n=%d)\tB (n=%d)\tB-A\t%g%% interval\tverdict\n", m.Name, m.A.Count, m.B.Count, s.Confidence*100)
		for _, row := range m.Rows {
			if row.CILow == nil {
				fmt.Fprintf(tw, "  %s\t%s\t%s\t-\t-\t%s\n", row.Percentile,
					orDash(m.A.Count, row.A), orDash(m.B.Count, row.B), row.Verdict)
				continue
			}
			fmt.Fprintf(tw, "  %s\t%s\t%s\t%s%s\t[%s, %s]\t%s\n", row.Percentile,
				chart.Micros(row.A), chart.Micros(row.B), signedMicros(row.Diff), relative(row.Diff, row.A),
				signedMicros(*row.CILow), signedMicros(*row.CIHigh), row.Verdict)
		}
	}
	tw.Flush()
	// The padding of the blank separator rows is trailing space.
	lines := strings.Split(b.String(), "\n")
	for i, l := range lines {
		lines[i] = strings.TrimRight(l, " ")
	}
	b.Reset()
	b.WriteString(strings.Join(lines, "\n"))
	for _, sd := range []struct {
		name string
		s    Side
	}{{"A", r.A}, {"B", r.B}} {
		for _, k := range errorKinds {
			if ex, ok := sd.s.ErrorExamples[k]; ok {
				fmt.Fprintf(&b, "\n%s %s, first: %s", sd.name, k, ex)
			}
		}
	}
	if r.A.Failed+r.B.Failed > 0 {
		b.WriteString("\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// perConnection says what each connection did.
func (s Settings) perConnection() string {
	switch s.Mode {
	case ModeConnect:
		return "connect and close (no exchange)"
	case ModeHTTP:
		how := "keep-alive, closed by ab"
		if s.HTTPClose {
			how = "Connection: close"
		}
		return fmt.Sprintf("%d GET %s per connection (%s), a 2xx expected", s.RequestsPerConnection, s.Path, how)
	}
	return fmt.Sprintf("%d %s of %d bytes per connection", s.RequestsPerConnection, plural(s.RequestsPerConnection, "exchange", "exchanges"), s.Payload)
}

func orDash(count int, us float64) string {
	if count == 0 {
		return "-"
	}
	return chart.Micros(us)
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

func signedMicros(us float64) string {
	if us < 0 {
		return "-" + chart.Micros(-us)
	}
	return "+" + chart.Micros(us)
}

func relative(diff, base float64) string {
	if base <= 0 {
		return ""
	}
	return fmt.Sprintf(" (%+.1f%%)", diff/base*100)
}

// Colors of A and B in the chart.
const (
	colorA = "#1f77b4"
	colorB = "#d62728"
)

// chartPoints is the most points a curve gets: enough for a smooth step
// curve, few enough for a small file.
const chartPoints = 400

// WriteChart draws the distributions of A and B as an SVG: a panel per
// metric, a cumulative curve per address on a logarithmic latency axis.
func (r *Report) WriteChart(w io.Writer) error {
	var panels []chart.Panel
	for _, m := range r.Metrics {
		p := chart.Panel{Title: fmt.Sprintf("%s: A %s, B %s", m.Name, r.A.Address, r.B.Address)}
		for _, s := range []struct {
			name, color string
			samples     []time.Duration
		}{{"A", colorA, m.a}, {"B", colorB, m.b}} {
			p.Series = append(p.Series, chart.Series{
				Name: s.name, Color: s.color, CDF: cdf(s.samples),
				P50: micros(Percentile(s.samples, 0.5)), P999: micros(Percentile(s.samples, 0.999)),
			})
		}
		panels = append(panels, p)
	}
	return chart.WriteCDF(w, panels)
}

// cdf samples the empirical distribution of sorted at up to chartPoints
// evenly spaced ranks, the last one the maximum.
func cdf(sorted []time.Duration) []chart.Point {
	n := len(sorted)
	if n == 0 {
		return nil
	}
	steps := min(n, chartPoints)
	pts := make([]chart.Point, 0, steps)
	for i := 1; i <= steps; i++ {
		k := (i*n + steps - 1) / steps // ceil(i·n/steps), 1-based
		pts = append(pts, chart.Point{Micros: micros(sorted[k-1]), Fraction: float64(k) / float64(n)})
	}
	return pts
}
