// Package servicetest builds service values for tests in a line each.
package servicetest

import (
	"net/netip"
	"time"

	"github.com/uproxy/uproxy/service"
)

// Endpoint is a ready, serving endpoint at s ("ip:port"), on this node when
// local.
func Endpoint(s string, local bool) service.Endpoint {
	return service.Endpoint{Addr: netip.MustParseAddrPort(s), Ready: true, Serving: true, Local: local}
}

// Endpoints are ready, serving endpoints at ss ("ip:port"), on other nodes.
func Endpoints(ss ...string) []service.Endpoint {
	var out []service.Endpoint
	for _, s := range ss {
		out = append(out, Endpoint(s, false))
	}
	return out
}

// LocalEndpoints are ready, serving endpoints at ss ("ip:port") on this node.
func LocalEndpoints(ss ...string) []service.Endpoint {
	var out []service.Endpoint
	for _, s := range ss {
		out = append(out, Endpoint(s, true))
	}
	return out
}

// Port is a Service port without addresses or endpoints.
func Port(ns, name, portName string, proto service.Protocol, port int) *service.Port {
	return &service.Port{Name: service.PortName{Namespace: ns, Name: name, Port: portName}, Protocol: proto, Port: port}
}

// Addrs parses addresses.
func Addrs(ss ...string) []netip.Addr {
	var out []netip.Addr
	for _, s := range ss {
		out = append(out, netip.MustParseAddr(s))
	}
	return out
}

// Snapshot is a snapshot of ports, sorted by name in place as snapshots are.
func Snapshot(ports ...*service.Port) *service.Snapshot {
	s := &service.Snapshot{Ports: ports, Built: time.Now()}
	for i := 1; i < len(ports); i++ {
		for j := i; j > 0 && ports[j].Name.Less(ports[j-1].Name); j-- {
			ports[j], ports[j-1] = ports[j-1], ports[j]
		}
	}
	return s
}
