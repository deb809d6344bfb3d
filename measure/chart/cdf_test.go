package chart

import (
	"bytes"
	"encoding/xml"
	"io"
	"strings"
	"testing"
)

func TestWriteCDF(t *testing.T) {
	t.Parallel()
	pts := []Point{{Micros: 40, Fraction: 0.5}, {Micros: 90, Fraction: 0.99}, {Micros: 300, Fraction: 1}}
	cases := []struct {
		name          string
		panels        []Panel
		wantPolylines int
		wantText      []string
	}{
		{"two series in two panels", []Panel{
			{Title: "connect", Series: []Series{{Name: "A", Color: "#111111", CDF: pts, P50: 40, P999: 300}, {Name: "B", CDF: pts, P50: 41, P999: 300}}},
			{Title: "exchange", Series: []Series{{Name: "A", CDF: pts, P999: 300}, {Name: "B", CDF: pts, P999: 300}}},
		}, 4, []string{"connect", "exchange", "A p50 40µs", "B p50 41µs", `stroke="#111111"`, `stroke="#000000"`}},
		{"a panel without points is left out", []Panel{
			{Title: "empty", Series: []Series{{Name: "A"}}},
			{Title: "full", Series: []Series{{Name: "A", CDF: pts, P999: 300}, {Name: "B"}}},
		}, 1, []string{"full", `height="280"`}},
		{"nothing to draw", nil, 0, []string{"no latency measurements"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var b bytes.Buffer
			if err := WriteCDF(&b, tc.panels); err != nil {
				t.Fatal(err)
			}
			svg := b.String()
			if n := strings.Count(svg, "<polyline"); n != tc.wantPolylines {
				t.Errorf("got %d curves, want %d", n, tc.wantPolylines)
			}
			for _, s := range tc.wantText {
				if !strings.Contains(svg, s) {
					t.Errorf("SVG lacks %q", s)
				}
			}
			if strings.Contains(svg, "empty") {
				t.Errorf("SVG draws the panel without points")
			}
			d := xml.NewDecoder(strings.NewReader(svg))
			for {
				_, err := d.Token()
				if err == io.EOF {
					break
				}
				if err != nil {
					t.Fatalf("SVG is not well-formed XML: %v", err)
				}
			}
		})
	}
}

func TestMicros(t *testing.T) {
	t.Parallel()
	for us, want := range map[float64]string{12.34: "12.3µs", 4560: "4.56ms", 1.2e6: "1.2s", 0.04: "0µs"} {
		if got := Micros(us); got != want {
			t.Errorf("Micros(%g) = %q, want %q", us, got, want)
		}
	}
}
