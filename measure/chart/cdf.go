// Package chart draws latency distributions as SVG, written by hand with the
// standard library: one panel per measurement, a cumulative curve per series
// on a logarithmic latency axis. `uproxy bench` and `uproxy ab` draw with it.
//
//	err := chart.WriteCDF(w, []chart.Panel{{
//		Title:  "connect",
//		Series: []chart.Series{{Name: "A", Color: "#1f77b4", CDF: pts, P50: 45, P999: 180}},
//	}})
package chart

import (
	"bytes"
	"fmt"
	"html"
	"io"
	"math"
)

// Point is one point of a latency distribution: the fraction of the
// measurements at or below Micros.
type Point struct {
	Micros   float64 `json:"us"`
	Fraction float64 `json:"fraction"`
}

// Series is one curve of a panel.
type Series struct {
	// Name labels the curve in the legend.
	Name string
	// Color is an SVG color; empty is black.
	Color string
	// CDF holds the curve's points in increasing order of Micros; a series
	// without points is left out.
	CDF []Point
	// P50 is shown in the legend when positive; P999 ends the latency axis
	// (the axis spans every series up to its P999, so one outlier does not
	// flatten the rest).
	P50, P999 float64
}

// Panel is one chart: a title and its curves.
type Panel struct {
	Title  string
	Series []Series
}

// Geometry, in SVG user units.
const (
	chartWidth  = 960
	panelHeight = 280
	padLeft     = 70
	padRight    = 210 // legend: "userspace p50 1234.5µs" fits
	padTop      = 36
	padBottom   = 44
)

// WriteCDF draws the panels that have at least one series with points, one
// below the other, as one SVG document.
func WriteCDF(w io.Writer, panels []Panel) error {
	var drawn []Panel
	for _, p := range panels {
		for _, s := range p.Series {
			if len(s.CDF) > 0 {
				drawn = append(drawn, p)
				break
			}
		}
	}
	var b bytes.Buffer
	height := max(1, len(drawn)) * panelHeight
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n",
		chartWidth, height, chartWidth, height)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	if len(drawn) == 0 {
		fmt.Fprintf(&b, `<text x="20" y="40">no latency measurements in this run</text>`+"\n")
	}
	for i, p := range drawn {
		drawPanel(&b, p, float64(i*panelHeight))
	}
	b.WriteString("</svg>\n")
	_, err := w.Write(b.Bytes())
	return err
}

func drawPanel(b *bytes.Buffer, p Panel, y0 float64) {
	lo, hi := math.Inf(1), 0.0
	for _, s := range p.Series {
		for _, pt := range s.CDF {
			lo = math.Min(lo, pt.Micros)
		}
		hi = math.Max(hi, s.P999)
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

	fmt.Fprintf(b, `<text x="%g" y="%g" font-size="14" font-weight="bold">%s</text>`+"\n", x0, y0+20, html.EscapeString(p.Title))
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
			fmt.Fprintf(b, `<text x="%.1f" y="%.1f" text-anchor="middle" fill="#555">%s</text>`+"\n", x, bottom+15, Micros(v))
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
	for _, s := range p.Series {
		if len(s.CDF) == 0 {
			continue
		}
		color := s.Color
		if color == "" {
			color = "#000000"
		}
		// A step curve: each point's fraction holds until the next point.
		fmt.Fprintf(b, `<polyline fill="none" stroke="%s" stroke-width="1.8" points="`, color)
		prev := 0.0
		for _, pt := range s.CDF {
			x := xOf(pt.Micros)
			fmt.Fprintf(b, "%.1f,%.1f %.1f,%.1f ", x, yOf(prev), x, yOf(pt.Fraction))
			prev = pt.Fraction
		}
		b.WriteString(`"/>` + "\n")
		ly := top + 10 + float64(legend)*18
		fmt.Fprintf(b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s" stroke-width="3"/>`+"\n", x1+12, ly, x1+32, ly, color)
		label := s.Name
		if s.P50 > 0 {
			label = fmt.Sprintf("%s p50 %s", s.Name, Micros(s.P50))
		}
		fmt.Fprintf(b, `<text x="%.1f" y="%.1f">%s</text>`+"\n", x1+38, ly+4, html.EscapeString(label))
		legend++
	}
}

// Micros formats a latency in microseconds with a unit that keeps it short:
// "12.3µs", "4.56ms", "1.2s".
func Micros(us float64) string {
	switch {
	case us >= 1e6:
		return fmt.Sprintf("%.3gs", us/1e6)
	case us >= 1e3:
		return fmt.Sprintf("%.3gms", us/1e3)
	default:
		return fmt.Sprintf("%gµs", math.Round(us*10)/10)
	}
}
