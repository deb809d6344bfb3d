package conformance

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestReadReportKeepsWhatRan(t *testing.T) {
	report := `[{"SpecReports": [
	 {"ContainerHierarchyTexts": ["[sig-network] Services"], "LeafNodeText": "should serve", "LeafNodeType": "It", "State": "passed", "RunTime": 2000000000},
	 {"ContainerHierarchyTexts": ["[sig-network] Services"], "LeafNodeText": "should be rejected", "LeafNodeType": "It", "State": "failed", "Failure": {"Message": "connected\nmore"}},
	 {"ContainerHierarchyTexts": ["[sig-network] Services"], "LeafNodeText": "needs two nodes", "LeafNodeType": "It", "State": "skipped", "Failure": {"Message": "The test requires at least two ready nodes"}},
	 {"ContainerHierarchyTexts": ["[sig-apps] Deployment"], "LeafNodeText": "not focused", "LeafNodeType": "It", "State": "skipped"},
	 {"LeafNodeText": "", "LeafNodeType": "SynchronizedBeforeSuite", "State": "passed"},
	 {"ContainerHierarchyTexts": ["[sig-network] Conntrack"], "LeafNodeText": "timed out", "LeafNodeType": "It", "State": "timedout"}
	]}]`
	path := filepath.Join(t.TempDir(), "report.json")
	if err := os.WriteFile(path, []byte(report), 0o644); err != nil {
		t.Fatal(err)
	}
	specs, err := readReport(path)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, s := range specs {
		got = append(got, s.State+": "+s.Name+": "+s.Reason)
	}
	want := []string{
		"failed: [sig-network] Conntrack timed out: ",
		"skipped: [sig-network] Services needs two nodes: The test requires at least two ready nodes",
		"failed: [sig-network] Services should be rejected: connected",
		"passed: [sig-network] Services should serve: ",
	}
	if !slices.Equal(got, want) {
		t.Errorf("got\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

func TestVerdict(t *testing.T) {
	spec := func(name, state string) Spec { return Spec{Name: name, State: state} }
	preserve := "[sig-network] Services should preserve source pod IP for traffic thru service cluster IP [LinuxOnly]"
	tests := []struct {
		name    string
		results []Result
		want    int
	}{
		{"uproxy passes what kube-proxy passes", []Result{
			{Proxy: "kube-proxy-iptables", Specs: []Spec{spec("a", "passed"), spec("b", "failed")}},
			{Proxy: "uproxy-nftables", Specs: []Spec{spec("a", "passed"), spec("b", "failed")}},
		}, 0},
		{"uproxy fails what kube-proxy passes", []Result{
			{Proxy: "kube-proxy-iptables", Specs: []Spec{spec("a", "passed")}},
			{Proxy: "uproxy-nftables", Specs: []Spec{spec("a", "failed"), spec("c", "passed")}},
		}, 1},
		{"the userspace mode keeps the client's address: failing the source-IP test is a difference", []Result{
			{Proxy: "kube-proxy-iptables", Specs: []Spec{spec(preserve, "passed")}},
			{Proxy: "uproxy-userspace-nftables", Specs: []Spec{spec(preserve, "failed"), spec("a", "passed")}},
		}, 1},
		{"the same failure is not expected of a kernel mode", []Result{
			{Proxy: "kube-proxy-iptables", Specs: []Spec{spec(preserve, "passed")}},
			{Proxy: "uproxy-nftables", Specs: []Spec{spec(preserve, "failed"), spec("a", "passed")}},
		}, 1},
		{"a test uproxy skips and kube-proxy passes", []Result{
			{Proxy: "kube-proxy-iptables", Specs: []Spec{spec("a", "passed"), spec("b", "skipped")}},
			{Proxy: "uproxy-nftables", Specs: []Spec{spec("a", "skipped"), spec("b", "skipped"), spec("c", "passed")}},
		}, 1},
		{"the nfacct test skips itself under uproxy's nftables and userspace modes, as under kube-proxy-nftables", []Result{
			{Proxy: "kube-proxy-iptables", Specs: []Spec{spec(nfacctTest, "passed")}},
			{Proxy: "kube-proxy-nftables", Specs: []Spec{spec(nfacctTest, "skipped"), spec("a", "passed")}},
			{Proxy: "uproxy-nftables", Specs: []Spec{spec(nfacctTest, "skipped"), spec("a", "passed")}},
			{Proxy: "uproxy-userspace-nftables", Specs: []Spec{spec(nfacctTest, "skipped"), spec("a", "passed")}},
			{Proxy: "uproxy-userspace-iptables", Specs: []Spec{spec(nfacctTest, "skipped"), spec("a", "passed")}},
		}, 0},
		{"uproxy's iptables mode must pass it: its skip is a difference", []Result{
			{Proxy: "kube-proxy-iptables", Specs: []Spec{spec(nfacctTest, "passed")}},
			{Proxy: "uproxy-iptables", Specs: []Spec{spec(nfacctTest, "skipped"), spec("a", "passed")}},
		}, 1},
		{"... and so is its failure", []Result{
			{Proxy: "kube-proxy-iptables", Specs: []Spec{spec(nfacctTest, "passed")}},
			{Proxy: "uproxy-iptables", Specs: []Spec{spec(nfacctTest, "failed"), spec("a", "passed")}},
		}, 1},
		{"a test not applicable to a mode may skip, not fail", []Result{
			{Proxy: "uproxy-nftables", Specs: []Spec{spec(nfacctTest, "failed"), spec("a", "passed")}},
		}, 1},
		{"without kube-proxy every failure counts", []Result{
			{Proxy: "uproxy-userspace-nftables", Specs: []Spec{spec("a", "failed"), spec("b", "passed")}},
		}, 1},
		{"a run that passed nothing fails", []Result{
			{Proxy: "uproxy-userspace-nftables", Specs: []Spec{spec("a", "skipped")}},
		}, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := verdict(tt.results); len(got) != tt.want {
				t.Errorf("got %d problems %q, want %d", len(got), got, tt.want)
			}
		})
	}
}

// The image the cluster runs is made by reading deploy/Dockerfile's last stage:
// every instruction there must be one the reading knows.
func TestLastStageOfTheDockerfile(t *testing.T) {
	steps, err := lastStage(filepath.Join("..", "..", "deploy", "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	if len(steps) == 0 || steps[0].op != "FROM" || !strings.HasPrefix(steps[0].args, "debian:"+debianSuite) {
		t.Fatalf("the last stage starts %v, want FROM debian:%s", steps[:min(1, len(steps))], debianSuite)
	}
	var ops []string
	for _, st := range steps {
		switch st.op {
		case "FROM", "RUN", "COPY", "ENTRYPOINT", "ENV", "ARG", "LABEL", "WORKDIR", "CMD":
		default:
			t.Errorf("%s %s: not an instruction runtimeStage reads", st.op, st.args)
		}
		ops = append(ops, st.op)
		if strings.Contains(st.args, "\\\n") {
			t.Errorf("%s: continuation lines not joined", st.op)
		}
	}
	if !slices.Contains(ops, "RUN") || !slices.Contains(ops, "COPY") {
		t.Errorf("instructions %v: want the apt-get RUN and the binary's COPY", ops)
	}
}
