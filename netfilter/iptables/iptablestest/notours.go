package iptablestest

import (
	"errors"

	"github.com/uproxy/uproxy/netfilter/iptables"
)

// NotOurs returns the chains err says are another program's, as "IPv4
// filter/DOCKER-FORWARD", in the order err holds them at any depth of
// wrapping and joining, and the errors err holds besides.
func NotOurs(err error) (chains []string, others []error) {
	for _, e := range leaves(err) {
		if n, ok := errors.AsType[*iptables.NotOursError](e); ok {
			chains = append(chains, iptables.FamilyName(n.V6)+" "+n.Table+"/"+n.Chain)
		} else {
			others = append(others, e)
		}
	}
	return chains, others
}

// leaves returns the errors err wraps or joins (with errors.Join or
// go-multierror) that wrap nothing, err itself when it wraps nothing; nothing
// for nil.
func leaves(err error) []error {
	var joined []error
	switch e := err.(type) {
	case nil:
		return nil
	case interface{ WrappedErrors() []error }:
		joined = e.WrappedErrors()
	case interface{ Unwrap() []error }:
		joined = e.Unwrap()
	case interface{ Unwrap() error }:
		if inner := e.Unwrap(); inner != nil {
			return leaves(inner)
		}
	}
	if joined != nil {
		var out []error
		for _, inner := range joined {
			out = append(out, leaves(inner)...)
		}
		return out
	}
	return []error{err}
}
