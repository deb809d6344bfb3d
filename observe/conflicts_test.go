package observe_test

import (
	"fmt"
	"reflect"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/proxier"
	"github.com/uproxy/uproxy/service"
)

// conflictingServices returns three Services, the oldest first: a; b with a's
// ClusterIP; c with a's NodePort.
func conflictingServices() []*v1.Service {
	svc := func(name, clusterIP string, nodePort int32, age int) *v1.Service {
		return &v1.Service{
			ObjectMeta: metav1.ObjectMeta{Namespace: "c", Name: name, CreationTimestamp: metav1.Unix(int64(1e9-age), 0)},
			Spec: v1.ServiceSpec{Type: v1.ServiceTypeNodePort, ClusterIP: clusterIP,
				Ports: []v1.ServicePort{{Name: "http", Port: 80, NodePort: nodePort}}},
		}
	}
	return []*v1.Service{svc("a", "10.96.0.10", 30080, 2), svc("b", "10.96.0.10", 30081, 1), svc("c", "10.96.0.12", 30080, 0)}
}

// /debug/services lists the conflicts of the Snapshot last recorded, all of
// them or those of one Service port, and the gauge counts them.
func TestConflictsView(t *testing.T) {
	w := mkWorld(t, proxier.Config{})
	snap := service.Build(conflictingServices(), nil, service.BuildOptions{})
	w.conflicts.Update(snap)

	bLeftOut := observe.ConflictState{Address: "10.96.0.10:80/TCP", IP: "10.96.0.10", Port: 80, Protocol: "TCP", ServedBy: "c/a:http", LeftOut: "c/b:http"}
	cLeftOut := observe.ConflictState{Address: "nodePort 30080/TCP", Port: 30080, Protocol: "TCP", NodePort: true, ServedBy: "c/a:http", LeftOut: "c/c:http"}
	for _, tt := range []struct {
		query string
		want  []observe.ConflictState
	}{
		{"", []observe.ConflictState{bLeftOut, cLeftOut}},
		{"?service=c/a:http", []observe.ConflictState{bLeftOut, cLeftOut}},
		{"?service=c/c:http", []observe.ConflictState{cLeftOut}},
		{"?service=c/other:http", []observe.ConflictState{}},
	} {
		if got := w.conflictsOf(tt.query); !reflect.DeepEqual(got, tt.want) {
			t.Errorf("/debug/services%s: got conflicts %+v, want %+v", tt.query, got, tt.want)
		}
	}
	if got, ok := metric(t, "uproxy_service_port_conflicts", nil); !ok || got != 2 {
		t.Errorf("uproxy_service_port_conflicts: got %v (present %v), want 2", got, ok)
	}

	w.conflicts.Update(&service.Snapshot{})
	if got := w.conflictsOf(""); got == nil || len(got) != 0 {
		t.Errorf("after a Snapshot without conflicts: got %+v, want []", got)
	}
	if got, _ := metric(t, "uproxy_service_port_conflicts", nil); got != 0 {
		t.Errorf("uproxy_service_port_conflicts after a Snapshot without conflicts: got %v, want 0", got)
	}
}

// /debug/services lists the source's problems of the Snapshot last recorded,
// the first hundred of them with their count, leaving out the unserved
// Service ports (listed with the Service ports), and the gauge counts them.
func TestProblemsView(t *testing.T) {
	w := mkWorld(t, proxier.Config{})
	problems := func() ([]string, int) {
		var body struct {
			Problems     []string
			ProblemCount int
		}
		w.getJSON("/debug/services", &body)
		return body.Problems, body.ProblemCount
	}
	errs := []error{&service.UnservedError{Port: &service.Port{}, Reason: "SCTP"}}
	for i := range 150 {
		errs = append(errs, fmt.Errorf("web.yaml: document %d: Service default/web: spec.ports[0].port: 0 is out of range", i+1))
	}
	w.problems.Update(&service.Snapshot{Errors: errs})
	list, count := problems()
	if count != 150 || len(list) != 100 || list[0] != errs[1].Error() {
		t.Errorf("/debug/services: got %d problems listed of %d, the first %q; want 100 of 150, the first %q", len(list), count, list[0], errs[1].Error())
	}
	if got, ok := metric(t, "uproxy_source_problems", nil); !ok || got != 150 {
		t.Errorf("uproxy_source_problems: got %v (present %v), want 150", got, ok)
	}
	w.problems.Update(&service.Snapshot{})
	if list, count := problems(); list == nil || len(list) != 0 || count != 0 {
		t.Errorf("after a Snapshot without problems: got %q, %d; want [], 0", list, count)
	}
	if got, _ := metric(t, "uproxy_source_problems", nil); got != 0 {
		t.Errorf("uproxy_source_problems after a Snapshot without problems: got %v, want 0", got)
	}
}
