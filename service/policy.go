package service

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
)

// Annotations of a Service that set its own retry policy, each overriding the
// proxy's flag of the same name for every port of that Service.
const (
	// AnnotationDialTimeouts is a list of per-attempt dial timeouts, in the
	// syntax of --dial-timeouts ("250ms,500ms,1s").
	AnnotationDialTimeouts = "uproxy.io/dial-timeouts"
	// AnnotationDialHedge is the hedging delay, as --dial-hedge ("30ms"; "0": off).
	AnnotationDialHedge = "uproxy.io/dial-hedge"
	// AnnotationRetryBudget is the retry budget in percent of first attempts,
	// as --retry-budget ("20" or "20%"; "0": off).
	AnnotationRetryBudget = "uproxy.io/retry-budget"
	// AnnotationScheduler is the backend scheduler, one of Schedulers.
	AnnotationScheduler = "uproxy.io/scheduler"
)

// Schedulers are the scheduler names a Service may ask for: those that both the
// userspace balancer and IPVS implement, with IPVS's meaning. The first is the
// default. (The balancer's scheduler list is this one.)
var Schedulers = []string{"rr", "lc", "sh", "dh", "sed", "nq"}

// MaxDialAttempts bounds the length of a dial timeout list: beyond it a client would
// wait for minutes before learning that no backend answers.
const MaxDialAttempts = 16

// MaxRetryBudget is the largest retry budget, in percent: a retry for every
// first attempt.
const MaxRetryBudget = 100

// ParseDialTimeouts parses a comma-separated list of durations such as
// "250ms,500ms,1s,2s" (the --dial-timeouts flag and the uproxy.io/dial-timeouts
// annotation): one entry per attempt, each positive, at most MaxDialAttempts of them.
func ParseDialTimeouts(s string) ([]time.Duration, error) {
	if strings.TrimSpace(s) == "" {
		return nil, errors.New("dial timeouts: empty list, want at least one duration such as 250ms")
	}
	fields := strings.Split(s, ",")
	if len(fields) > MaxDialAttempts {
		return nil, fmt.Errorf("dial timeouts %q: %d entries, want at most %d", s, len(fields), MaxDialAttempts)
	}
	out := make([]time.Duration, 0, len(fields))
	for i, f := range fields {
		f = strings.TrimSpace(f)
		if f == "" {
			return nil, fmt.Errorf("dial timeouts %q: entry %d is empty", s, i+1)
		}
		d, err := time.ParseDuration(f)
		if err != nil {
			return nil, fmt.Errorf("dial timeouts %q: entry %d: %w", s, i+1, err)
		}
		if d <= 0 {
			return nil, fmt.Errorf("dial timeouts %q: entry %d is %s, want a positive duration", s, i+1, f)
		}
		out = append(out, d)
	}
	return out, nil
}

// ParseDialHedge parses a hedging delay ("30ms"): a duration, 0 for none.
func ParseDialHedge(s string) (time.Duration, error) {
	s = strings.TrimSpace(s)
	if s == "0" {
		return 0, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, fmt.Errorf("dial hedge %q: %w", s, err)
	}
	if d < 0 {
		return 0, fmt.Errorf("dial hedge %q: negative, want a duration such as 30ms, or 0 for none", s)
	}
	return d, nil
}

// ParseRetryBudget parses a retry budget in percent ("20" or "20%"): a number
// from 0 (no budget) to MaxRetryBudget.
func ParseRetryBudget(s string) (float64, error) {
	num := strings.TrimSuffix(strings.TrimSpace(s), "%")
	v, err := strconv.ParseFloat(strings.TrimSpace(num), 64)
	if err != nil {
		return 0, fmt.Errorf("retry budget %q: want a percentage such as 20 or 20%%", s)
	}
	if !(v >= 0 && v <= MaxRetryBudget) { // also rejects NaN
		return 0, fmt.Errorf("retry budget %q: want a percentage from 0 (no budget) to %d", s, MaxRetryBudget)
	}
	return v, nil
}

// ValidScheduler returns nil if name is one of Schedulers.
func ValidScheduler(name string) error {
	if !slices.Contains(Schedulers, name) {
		return fmt.Errorf("unknown scheduler %q: valid schedulers are %s", name, strings.Join(Schedulers, ", "))
	}
	return nil
}

// Policy is a Service's own retry and scheduling policy, read from its
// annotations. A field left unset (nil, "") leaves the proxy's flag in force.
type Policy struct {
	// DialTimeouts are the per-attempt dial timeouts (uproxy.io/dial-timeouts).
	DialTimeouts []time.Duration
	// DialHedge is the hedging delay (uproxy.io/dial-hedge); 0 turns hedging off.
	DialHedge *time.Duration
	// RetryBudget is the retry budget in percent (uproxy.io/retry-budget); 0
	// turns the budget off.
	RetryBudget *float64
	// Scheduler is the backend scheduler (uproxy.io/scheduler).
	Scheduler string
}

// IsZero reports whether p sets nothing.
func (p *Policy) IsZero() bool {
	return p.DialTimeouts == nil && p.DialHedge == nil && p.RetryBudget == nil && p.Scheduler == ""
}

// ParsePolicy reads svc's policy annotations. Each annotation that does not
// parse is left unset in the Policy (its flag stays in force for the Service)
// and gives one *FieldError naming the Service and the annotation.
func ParsePolicy(svc *v1.Service) (Policy, []error) {
	var p Policy
	var errs []error
	bad := func(annotation, value string, err error) {
		errs = append(errs, &FieldError{Kind: "Service", Namespace: svc.Namespace, Name: svc.Name,
			Field: "metadata.annotations[" + annotation + "]",
			Msg:   fmt.Sprintf("%q: %v; the Service keeps the proxy's flag for it", value, err)})
	}
	a := svc.Annotations
	if v, ok := a[AnnotationDialTimeouts]; ok {
		if d, err := ParseDialTimeouts(v); err != nil {
			bad(AnnotationDialTimeouts, v, err)
		} else {
			p.DialTimeouts = d
		}
	}
	if v, ok := a[AnnotationDialHedge]; ok {
		if d, err := ParseDialHedge(v); err != nil {
			bad(AnnotationDialHedge, v, err)
		} else {
			p.DialHedge = &d
		}
	}
	if v, ok := a[AnnotationRetryBudget]; ok {
		if b, err := ParseRetryBudget(v); err != nil {
			bad(AnnotationRetryBudget, v, err)
		} else {
			p.RetryBudget = &b
		}
	}
	if v, ok := a[AnnotationScheduler]; ok {
		if err := ValidScheduler(strings.TrimSpace(v)); err != nil {
			bad(AnnotationScheduler, v, err)
		} else {
			p.Scheduler = strings.TrimSpace(v)
		}
	}
	return p, errs
}

// IsPolicyError reports whether err is ParsePolicy's: about an annotation whose
// flag stays in force, not about an object left out.
func IsPolicyError(err error) bool {
	fe, ok := err.(*FieldError)
	return ok && fe.Kind == "Service" && strings.HasPrefix(fe.Field, "metadata.annotations[uproxy.io/")
}

// Where a value of an EffectivePolicy came from.
const (
	FromFlag       = "flag"
	FromAnnotation = "annotation"
)

// EffectivePolicy is the policy a Service port runs with: every value set, and
// where each came from (FromFlag or FromAnnotation).
type EffectivePolicy struct {
	DialTimeouts     []time.Duration
	DialTimeoutsFrom string
	DialHedge        time.Duration
	DialHedgeFrom    string
	RetryBudget      float64
	RetryBudgetFrom  string
	Scheduler        string
	SchedulerFrom    string
}

// FlagPolicy is the policy the flags give every Service.
func FlagPolicy(dialTimeouts []time.Duration, hedge time.Duration, budget float64, scheduler string) EffectivePolicy {
	return EffectivePolicy{
		DialTimeouts: dialTimeouts, DialTimeoutsFrom: FromFlag,
		DialHedge: hedge, DialHedgeFrom: FromFlag,
		RetryBudget: budget, RetryBudgetFrom: FromFlag,
		Scheduler: scheduler, SchedulerFrom: FromFlag,
	}
}

// Over returns flags with every value p sets in its place.
func (p *Policy) Over(flags EffectivePolicy) EffectivePolicy {
	e := flags
	if p.DialTimeouts != nil {
		e.DialTimeouts, e.DialTimeoutsFrom = p.DialTimeouts, FromAnnotation
	}
	if p.DialHedge != nil {
		e.DialHedge, e.DialHedgeFrom = *p.DialHedge, FromAnnotation
	}
	if p.RetryBudget != nil {
		e.RetryBudget, e.RetryBudgetFrom = *p.RetryBudget, FromAnnotation
	}
	if p.Scheduler != "" {
		e.Scheduler, e.SchedulerFrom = p.Scheduler, FromAnnotation
	}
	return e
}
