package conformance

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Suites are the parts of upstream's test/e2e/network that judge a service proxy.
var Suites = []string{
	`\[sig-network\] Services`,
	`\[sig-network\] EndpointSlice`,
	`\[sig-network\] Conntrack`,
	`\[sig-network\] Networking Granular Checks: Services`,
	`\[sig-network\] KubeProxy`,
}

// Skip leaves out what no conformance run includes: tests that need the cluster to
// themselves, that break it on purpose, or that upstream marks unreliable.
const Skip = `\[Serial\]|\[Disruptive\]|\[Flaky\]`

// SkipSCTP leaves out the SCTP connectivity tests, for a kernel without SCTP: their
// pods cannot listen, whatever the proxy (each waits 5 minutes, then fails).
const SkipSCTP = `\[Feature:SCTPConnectivity\]`

// KernelHasSCTP reports whether this kernel opens SCTP sockets.
func KernelHasSCTP() bool {
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, syscall.IPPROTO_SCTP)
	if err != nil {
		return false
	}
	syscall.Close(fd)
	return true
}

// Run says how to run the suite.
type Run struct {
	BinDir     string // ginkgo and e2e-network.test
	Kubeconfig string
	Nodes      int // the cluster's: tests that need several nodes read it (--num-nodes)
	Focus      []string
	Skip       string // a regular expression of the tests to leave out
	Procs      int
	ReportDir  string
	Timeout    time.Duration
}

// Spec is one test's outcome.
type Spec struct {
	Name    string
	State   string // passed, failed, skipped
	Reason  string // the failure or skip message, first line
	Seconds float64
}

// Result is one run of the suite against one proxy.
type Result struct {
	Proxy string
	Specs []Spec
	Wall  time.Duration
}

// Count returns how many specs ended in state.
func (r Result) Count(state string) int {
	n := 0
	for _, s := range r.Specs {
		if s.State == state {
			n++
		}
	}
	return n
}

// Passed is the set of passing test names.
func (r Result) Passed() map[string]bool {
	m := map[string]bool{}
	for _, s := range r.Specs {
		if s.State == "passed" {
			m[s.Name] = true
		}
	}
	return m
}

// RunSuite runs the suite from ExtNS, outside every node, and reads ginkgo's report.
func RunSuite(ctx context.Context, r Run, proxy string, logf func(string, ...any)) (Result, error) {
	start := time.Now()
	if err := os.MkdirAll(r.ReportDir, 0o755); err != nil {
		return Result{}, err
	}
	if r.Procs < 1 {
		r.Procs = 1
	}
	args := []string{"--net=/run/netns/" + ExtNS, "--",
		filepath.Join(r.BinDir, "ginkgo"),
		"--procs=" + strconv.Itoa(r.Procs),
		"--focus=" + strings.Join(r.Focus, "|"),
		"--skip=" + r.Skip,
		"--timeout=" + r.Timeout.String(),
		"--no-color", "--silence-skips",
		"--output-dir=" + r.ReportDir, "--json-report=report.json",
		filepath.Join(r.BinDir, "e2e-network.test"), "--",
		"--kubeconfig=" + r.Kubeconfig,
		"--provider=skeleton",
		"--num-nodes=" + strconv.Itoa(r.Nodes),
		"--report-dir=" + r.ReportDir,
		"--allowed-not-ready-nodes=0",
		"--dump-logs-on-failure=false",
		"--node-os-distro=debian",
	}
	logPath := filepath.Join(r.ReportDir, "ginkgo.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		return Result{}, err
	}
	defer logFile.Close()
	cmd := exec.CommandContext(ctx, "nsenter", args...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.Dir = r.ReportDir
	logf("suite (%s): ginkgo with %d processes, log in %s", proxy, r.Procs, logPath)
	runErr := cmd.Run()
	res := Result{Proxy: proxy, Wall: time.Since(start)}
	specs, err := readReport(filepath.Join(r.ReportDir, "report.json"))
	if err != nil {
		return res, fmt.Errorf("suite for %s ended (%v) without a report: %w; its log:\n%s", proxy, runErr, err, LogFileTail(logPath, 40))
	}
	res.Specs = specs
	return res, nil
}

// LogFileTail returns the last n lines of a file.
func LogFileTail(path string, n int) string {
	data, _ := os.ReadFile(path)
	return tail(data, n)
}

// ginkgoReport is the part of ginkgo's JSON report read here.
type ginkgoReport struct {
	SpecReports []struct {
		ContainerHierarchyTexts []string
		LeafNodeText            string
		LeafNodeType            string
		State                   string
		RunTime                 int64 // nanoseconds
		Failure                 struct {
			Message string
		}
	}
}

func readReport(path string) ([]Spec, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var reports []ginkgoReport
	if err := json.Unmarshal(data, &reports); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	var specs []Spec
	for _, rep := range reports {
		for _, s := range rep.SpecReports {
			if s.LeafNodeType != "It" {
				continue
			}
			// A spec the focus left out is "skipped" with no message and never ran:
			// it is not part of the suite.
			if s.State == "skipped" && s.Failure.Message == "" {
				continue
			}
			reason, _, _ := strings.Cut(strings.TrimSpace(s.Failure.Message), "\n")
			specs = append(specs, Spec{
				Name:    strings.Join(append(append([]string{}, s.ContainerHierarchyTexts...), s.LeafNodeText), " "),
				State:   normalState(s.State),
				Reason:  reason,
				Seconds: float64(s.RunTime) / 1e9,
			})
		}
	}
	sort.Slice(specs, func(a, b int) bool { return specs[a].Name < specs[b].Name })
	return specs, nil
}

// normalState folds ginkgo's states into passed, failed and skipped.
func normalState(s string) string {
	switch s {
	case "passed", "skipped":
		return s
	case "pending":
		return "skipped"
	default: // failed, panicked, interrupted, aborted, timedout
		return "failed"
	}
}

// Table renders the results as markdown: one row per proxy, then every failure
// and skip with its reason.
func Table(results []Result) string {
	var b strings.Builder
	b.WriteString("| proxy | passed | failed | skipped | wall time |\n|---|---|---|---|---|\n")
	for _, r := range results {
		fmt.Fprintf(&b, "| %s | %d | %d | %d | %s |\n", r.Proxy, r.Count("passed"), r.Count("failed"), r.Count("skipped"), r.Wall.Round(time.Second))
	}
	for _, r := range results {
		for _, state := range []string{"failed", "skipped"} {
			var lines []string
			for _, s := range r.Specs {
				if s.State == state {
					lines = append(lines, fmt.Sprintf("- %s — %s", s.Name, s.Reason))
				}
			}
			if len(lines) > 0 {
				fmt.Fprintf(&b, "\n%s, %s:\n%s\n", r.Proxy, state, strings.Join(lines, "\n"))
			}
		}
	}
	return b.String()
}
