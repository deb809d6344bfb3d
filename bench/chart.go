package bench

import (
	"bytes"
	"fmt"
	"html"
	"io"
	"math"
)

var pathColors = map[string]string{
	Direct:       "#444444",
	Userspace:    "#d62728",
	UserspaceNFT: "#9467bd",
	IPTables:     "#1f77b4",
	NFTables:     "#8c564b",
	IPVS:         "#17becf",
	HAProxy:      "#2ca02c",
	Nginx:        "#ff7f0e",
	LoDirect:     "#999999",
	LoUserspace:  "#f4a6a6",
	LoHAProxy:    "#98df8a",
	LoNginx:      "#ffbb78",
}

// Chart geometry, in SVG user units.
const (
	chartWidth  = 960
	panelHeight = 280
	padLeft     = 70
	padRight    = 210 // legend: "userspace p50 1234.5µs" fits
	padTop      = 36
	padBottom   = 44
)

// WriteChart draws the latency distribution of every path as an SVG: one
// panel per workload with latencies, a cumulative curve per path on a
// logarithmic latency axis, cut at the 99.9th percentile so one outlier does
// not flatten the rest.
func (r *Report) WriteChart(w io.Writer) error {
	var panels []WorkloadResult
	for _, wr := range r.Workloads {
		for _, pr := range wr.Results {
			if len(pr.CDF) > 0 {
				panels = append(panels, wr)
				break
			}
		}
	}
	var b bytes.Buffer
	height := max(1, len(panels)) * panelHeight
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n",
		chartWidth, height, chartWidth, height)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	if len(panels) == 0 {
		fmt.Fprintf(&b, `<text x="20" y="40">no latency measurements in this run</text>`+"\n")
	}
	for i, wr := range panels {
		drawPanel(&b, wr, float64(i*panelHeight))
	}
	b.WriteString("</svg>\n")
	_, err := w.Write(b.Bytes())
	return err
}

func drawPanel(b *bytes.Buffer, wr WorkloadResult, y0 float64) {
	// The axis spans every path's curve up to its 99.9th percentile.
	lo, hi := math.Inf(1), 0.0
	for _, pr := range wr.Results {
		for _, pt := range pr.CDF {
			lo = math.Min(lo, pt.Micros)
		}
		if pr.Latency != nil {
			hi = math.Max(hi, pr.Latency.P999)
		}
	}
	if math.IsInf(lo, 1) || hi <= 0 {
		return
	}
	lo = math.Pow(10, math.Floor(math.Log10(math.Max(lo, 0.1))))
	hi = math.Pow(10, math.Ceil(math.Log10(math.Max(hi, lo*10))))
	x0, x1 := float64(padLeft), float64(chartWidth-padRight)
	top, bottom := y0+padTop, y0+panelHeight-padBottom
	xOf := func(us float64) float64 {
		us = math.Min(math.Max(us, lo), hi)
		return x0 + (math.Log10(us)-math.Log10(lo))/(math.Log10(hi)-math.Log10(lo))*(x1-x0)
	}
	yOf := func(f float64) float64 { return bottom - f*(bottom-top) }

	fmt.Fprintf(b, `<text x="%g" y="%g" font-size="14" font-weight="bold">%s</text>`+"\n", x0, y0+20, html.EscapeString(wr.Title))
	// Grid: decades with 2x and 5x marks on x; every 10% on y.
	for d := lo; d <= hi*1.0001; d *= 10 {
		for _, m := range []float64{1, 2, 5} {
			v := d * m
			if v > hi*1.0001 {
				break
			}
			x := xOf(v)
			stroke := "#eeeeee"
			if m == 1 {
				stroke = "#cccccc"
			}
			fmt.Fprintf(b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s"/>`+"\n", x, top, x, bottom, stroke)
			fmt.Fprintf(b, `<text x="%.1f" y="%.1f" text-anchor="middle" fill="#555">%s</text>`+"\n", x, bottom+15, fmtMicros(v))
		}
	}
	for f := 0.0; f <= 1.0001; f += 0.1 {
		y := yOf(f)
		fmt.Fprintf(b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#eeeeee"/>`+"\n", x0, y, x1, y)
		fmt.Fprintf(b, `<text x="%.1f" y="%.1f" text-anchor="end" fill="#555">%.0f%%</text>`+"\n", x0-6, y+4, f*100)
	}
	fmt.Fprintf(b, `<text x="%.1f" y="%.1f" text-anchor="middle">latency (µs, log scale)</text>`+"\n", (x0+x1)/2, bottom+34)
	fmt.Fprintf(b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="none" stroke="#888"/>`+"\n", x0, top, x1-x0, bottom-top)

	legend := 0
	for _, pr := range wr.Results {
		if len(pr.CDF) == 0 {
			continue
		}
		color := pathColors[pr.Path]
		if color == "" {
			color = "#000000"
		}
		// A step curve: each bucket's fraction holds until the next bucket.
		fmt.Fprintf(b, `<polyline fill="none" stroke="%s" stroke-width="1.8" points="`, color)
		prev := 0.0
		for _, pt := range pr.CDF {
			x := xOf(pt.Micros)
			fmt.Fprintf(b, "%.1f,%.1f %.1f,%.1f ", x, yOf(prev), x, yOf(pt.Fraction))
			prev = pt.Fraction
		}
		b.WriteString(`"/>` + "\n")
		ly := top + 10 + float64(legend)*18
		fmt.Fprintf(b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s" stroke-width="3"/>`+"\n", x1+12, ly, x1+32, ly, color)
		label := pr.Path
		if pr.Latency != nil {
			label = fmt.Sprintf("%s p50 %s", pr.Path, fmtMicros(pr.Latency.P50))
		}
		fmt.Fprintf(b, `<text x="%.1f" y="%.1f">%s</text>`+"\n", x1+38, ly+4, html.EscapeString(label))
		legend++
	}
}

func fmtMicros(us float64) string {
	switch {
	case us >= 1e6:
		return fmt.Sprintf("%.3gs", us/1e6)
	case us >= 1e3:
		return fmt.Sprintf("%.3gms", us/1e3)
	default:
		return fmt.Sprintf("%gµs", math.Round(us*10)/10)
	}
}
