package bench

import (
	"io"

	"github.com/uproxy/uproxy/measure/chart"
)

var pathColors = map[string]string{
	Direct:           "#444444",
	Userspace:        "#d62728",
	UserspaceNFT:     "#9467bd",
	UserspaceNFTNode: "#c5b0d5",
	IPTables:         "#1f77b4",
	NFTables:         "#8c564b",
	IPVS:             "#17becf",
	HAProxy:          "#2ca02c",
	Nginx:            "#ff7f0e",
	LoDirect:         "#999999",
	LoUserspace:      "#f4a6a6",
	LoHAProxy:        "#98df8a",
	LoNginx:          "#ffbb78",
}

// WriteChart draws the latency distribution of every path as an SVG: one
// panel per workload with latencies, a cumulative curve per path on a
// logarithmic latency axis, cut at the 99.9th percentile so one outlier does
// not flatten the rest.
func (r *Report) WriteChart(w io.Writer) error {
	var panels []chart.Panel
	for _, wr := range r.Workloads {
		p := chart.Panel{Title: wr.Title}
		for _, pr := range wr.Results {
			s := chart.Series{Name: pr.Path, Color: pathColors[pr.Path], CDF: pr.CDF}
			if pr.Latency != nil {
				s.P50, s.P999 = pr.Latency.P50, pr.Latency.P999
			}
			p.Series = append(p.Series, s)
		}
		panels = append(panels, p)
	}
	return chart.WriteCDF(w, panels)
}
