package service

import (
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
)

func TestParseDialTimeouts(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in      string
		want    []time.Duration
		wantErr string
	}{
		{in: "250ms,500ms,1s,2s", want: []time.Duration{250 * time.Millisecond, 500 * time.Millisecond, time.Second, 2 * time.Second}},
		{in: " 1s , 2s ", want: []time.Duration{time.Second, 2 * time.Second}},
		{in: "100ms", want: []time.Duration{100 * time.Millisecond}},
		{in: strings.Repeat("1s,", 15) + "1s", want: slices.Repeat([]time.Duration{time.Second}, 16)},
		{in: "", wantErr: "empty list"},
		{in: "  ", wantErr: "empty list"},
		{in: "1s,,2s", wantErr: "entry 2 is empty"},
		{in: "1s,fast", wantErr: `entry 2: time: invalid duration "fast"`},
		{in: "1s,0s", wantErr: "entry 2 is 0s, want a positive duration"},
		{in: "-1s", wantErr: "entry 1 is -1s, want a positive duration"},
		{in: "1", wantErr: `entry 1: time: missing unit in duration "1"`},
		{in: strings.Repeat("1s,", 16) + "1s", wantErr: "17 entries, want at most 16"},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := ParseDialTimeouts(tt.in)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("ParseDialTimeouts(%q): got error %v, want one containing %q", tt.in, err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("ParseDialTimeouts(%q): got error %v, want nil", tt.in, err)
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("ParseDialTimeouts(%q): got %v, want %v", tt.in, got, tt.want)
			}
		})
	}
}

func TestParsePolicy(t *testing.T) {
	t.Parallel()
	hedge := func(d time.Duration) *time.Duration { return &d }
	budget := func(f float64) *float64 { return &f }
	tests := []struct {
		name        string
		annotations map[string]string
		want        Policy
		// wantErrs are the annotations named by the errors, in order.
		wantErrs []string
	}{
		{name: "none", want: Policy{}},
		{
			name: "every annotation",
			annotations: map[string]string{
				AnnotationDialTimeouts: "100ms, 200ms", AnnotationDialHedge: "30ms",
				AnnotationRetryBudget: "20%", AnnotationScheduler: "lc",
			},
			want: Policy{DialTimeouts: []time.Duration{100 * time.Millisecond, 200 * time.Millisecond},
				DialHedge: hedge(30 * time.Millisecond), RetryBudget: budget(20), Scheduler: "lc"},
		},
		{
			name:        "zero turns hedging and the budget off",
			annotations: map[string]string{AnnotationDialHedge: "0", AnnotationRetryBudget: "0"},
			want:        Policy{DialHedge: hedge(0), RetryBudget: budget(0)},
		},
		{
			name: "bad values are left unset, good ones kept",
			annotations: map[string]string{
				AnnotationDialTimeouts: "1s,0s", AnnotationDialHedge: "soon",
				AnnotationRetryBudget: "150", AnnotationScheduler: "wrr",
			},
			wantErrs: []string{AnnotationDialTimeouts, AnnotationDialHedge, AnnotationRetryBudget, AnnotationScheduler},
		},
		{
			name:        "a negative hedge and a bad budget beside a good scheduler",
			annotations: map[string]string{AnnotationDialHedge: "-5ms", AnnotationRetryBudget: "x%", AnnotationScheduler: "sh"},
			want:        Policy{Scheduler: "sh"},
			wantErrs:    []string{AnnotationDialHedge, AnnotationRetryBudget},
		},
		{
			name:        "other annotations are ignored",
			annotations: map[string]string{"uproxy.io/other": "x", "example.com/dial-hedge": "soon"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			svc := testService("ns", "web")
			svc.Annotations = tt.annotations
			got, errs := ParsePolicy(svc)
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("policy: got %+v, want %+v", got, tt.want)
			}
			if len(errs) != len(tt.wantErrs) {
				t.Fatalf("errors: got %v, want one for each of %v", errs, tt.wantErrs)
			}
			for i, err := range errs {
				want := "Service ns/web: metadata.annotations[" + tt.wantErrs[i] + "]: "
				if !strings.HasPrefix(err.Error(), want) || !strings.Contains(err.Error(), "keeps the proxy's flag") {
					t.Errorf("error %d: got %q, want it to begin %q and say the flag stays", i, err, want)
				}
				if !IsPolicyError(err) {
					t.Errorf("IsPolicyError(%q): got false, want true", err)
				}
			}
		})
	}
}

func TestParseRetryBudgetAndHedge(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		in   string
		want float64
		ok   bool
	}{{"20", 20, true}, {"20%", 20, true}, {" 0.5 % ", 0.5, true}, {"100", 100, true}, {"0", 0, true},
		{"101", 0, false}, {"-1", 0, false}, {"NaN", 0, false}, {"", 0, false}, {"%", 0, false}} {
		got, err := ParseRetryBudget(tt.in)
		if (err == nil) != tt.ok || got != tt.want {
			t.Errorf("ParseRetryBudget(%q): got %v, %v, want %v (ok %v)", tt.in, got, err, tt.want, tt.ok)
		}
	}
	for _, tt := range []struct {
		in   string
		want time.Duration
		ok   bool
	}{{"30ms", 30 * time.Millisecond, true}, {"0", 0, true}, {"0s", 0, true}, {"-1ms", 0, false}, {"30", 0, false}, {"", 0, false}} {
		got, err := ParseDialHedge(tt.in)
		if (err == nil) != tt.ok || got != tt.want {
			t.Errorf("ParseDialHedge(%q): got %v, %v, want %v (ok %v)", tt.in, got, err, tt.want, tt.ok)
		}
	}
}

func TestPolicyOver(t *testing.T) {
	t.Parallel()
	flags := FlagPolicy([]time.Duration{time.Second}, 0, 0, "rr")
	hedge := 30 * time.Millisecond
	p := Policy{DialHedge: &hedge, Scheduler: "lc"}
	got := p.Over(flags)
	want := EffectivePolicy{
		DialTimeouts: []time.Duration{time.Second}, DialTimeoutsFrom: FromFlag,
		DialHedge: hedge, DialHedgeFrom: FromAnnotation,
		RetryBudget: 0, RetryBudgetFrom: FromFlag,
		Scheduler: "lc", SchedulerFrom: FromAnnotation,
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Over: got %+v, want %+v", got, want)
	}
	var none Policy
	if got := none.Over(flags); !reflect.DeepEqual(got, flags) || !none.IsZero() {
		t.Errorf("the empty policy over the flags: got %+v, want the flags %+v", got, flags)
	}
}

// TestBuildPolicyAnnotations: the policy reaches every Port of the Service, and
// a bad annotation is an error in the Snapshot while the Service is still served.
func TestBuildPolicyAnnotations(t *testing.T) {
	t.Parallel()
	good := testService("ns", "good", withPorts(v1.ServicePort{Name: "a", Port: 80}, v1.ServicePort{Name: "b", Port: 81}))
	good.Annotations = map[string]string{AnnotationDialHedge: "30ms", AnnotationScheduler: "nq"}
	bad := testService("ns", "bad", withSpec(func(s *v1.ServiceSpec) { s.ClusterIP = "10.96.0.11" }))
	bad.Annotations = map[string]string{AnnotationRetryBudget: "lots", AnnotationDialTimeouts: "50ms"}
	for _, b := range []struct {
		name  string
		build func() *Snapshot
	}{
		{"Build", func() *Snapshot { return Build([]*v1.Service{good, bad}, nil, BuildOptions{}) }},
		{"Builder, twice", func() *Snapshot {
			b := NewBuilder(BuildOptions{})
			b.Build([]*v1.Service{good, bad}, nil)
			return b.Build([]*v1.Service{good, bad}, nil)
		}},
	} {
		t.Run(b.name, func(t *testing.T) {
			snap := b.build()
			if len(snap.Ports) != 3 {
				t.Fatalf("ports: got %d, want 3 (the bad annotation's Service served too)", len(snap.Ports))
			}
			for _, p := range snap.Ports {
				switch p.Name.Name {
				case "good":
					if p.Policy.DialHedge == nil || *p.Policy.DialHedge != 30*time.Millisecond || p.Policy.Scheduler != "nq" {
						t.Errorf("%s: got policy %+v, want hedge 30ms and scheduler nq", p.Name, p.Policy)
					}
				case "bad":
					if p.Policy.RetryBudget != nil || !slices.Equal(p.Policy.DialTimeouts, []time.Duration{50 * time.Millisecond}) {
						t.Errorf("%s: got policy %+v, want the good dial timeouts and no budget", p.Name, p.Policy)
					}
				}
			}
			if len(snap.Errors) != 1 || !strings.Contains(snap.Errors[0].Error(), "Service ns/bad: metadata.annotations[uproxy.io/retry-budget]") {
				t.Errorf("errors: got %v, want one naming ns/bad and uproxy.io/retry-budget", snap.Errors)
			}
		})
	}
}
