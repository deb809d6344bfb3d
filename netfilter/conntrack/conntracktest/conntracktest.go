// Package conntracktest is the tests' conntrack.Deleter: a Recorder that
// deletes nothing and keeps what it was asked to delete.
package conntracktest

import (
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Recorder is a Deleter for unit tests: it deletes nothing and keeps the filters
// of every call, by family.
type Recorder struct {
	// Filters holds the filters given for IPv4 ([0]) and IPv6 ([1]), in order.
	Filters [2][]netlink.CustomConntrackFilter
}

// ConntrackDeleteFilters implements conntrack.Deleter.
func (r *Recorder) ConntrackDeleteFilters(_ netlink.ConntrackTableType, family netlink.InetFamily, filters ...netlink.CustomConntrackFilter) (uint, error) {
	i := 0
	if family == unix.AF_INET6 {
		i = 1
	}
	r.Filters[i] = append(r.Filters[i], filters...)
	return 0, nil
}
