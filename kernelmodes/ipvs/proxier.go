// Package ipvs is uproxy's IPVS kernel mode (--proxy-mode ipvs): every Service
// IP:port (and NodePort on every node IP) becomes an IPVS virtual server whose
// real servers are the endpoints, and the Service IPs live on a dummy
// interface so the node accepts their traffic.
//
//	p, err := ipvs.New(ipvs.Config{Common: proxymode.Common{NodeIPs: nodeIPs}, Scheduler: "rr"})
//	...
//	err = p.Sync(snapshot)
//
// What IPVS cannot do is left to iptables (one iptables-restore per family):
//
//	nat    P-IPVS-SERVICES     from PREROUTING and OUTPUT: mark traffic to masquerade
//	nat    P-IPVS-POSTROUTING  MASQUERADE marked and hairpin traffic
//	filter P-IPVS-FILTER       refuse new connections to Service IPs on ports no Service has
//	filter P-IPVS-FIREWALL     loadBalancerSourceRanges
//	filter P-IPVS-NODEPORTS    accept NodePorts through a restrictive INPUT
//	nat    P-IPVS-CANARY       one rule; its loss means someone flushed the table
//
// Removed TCP endpoints terminate gracefully: their weight drops to 0 and they
// are deleted on a later sync once IPVS counts no connection on them.
package ipvs

import (
	"cmp"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"github.com/hashicorp/go-multierror"
	"github.com/moby/ipvs"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/service"
)

// DummyName is the interface holding the Service IPs.
const DummyName = "uproxy-ipvs0"

// Schedulers are the IPVS schedulers --scheduler accepts.
var Schedulers = []string{"rr", "wrr", "lc", "wlc", "sh", "dh", "sed", "nq"}

// flagPersistent is IP_VS_SVC_F_PERSISTENT: ClientIP affinity.
const flagPersistent = 0x1

// Config configures the IPVS mode. The zero value programs IPv4 with the rr
// scheduler and no NodePorts (NodeIPs is empty).
type Config struct {
	// Common is what every mode takes; NodePorts get a virtual server on each
	// of its NodeIPs inside NodePortAddresses (all of them when that is empty).
	proxymode.Common
	// Scheduler is the IPVS scheduler of every virtual server; "rr" when empty.
	Scheduler string
	// MasqueradeBit is the mark bit (0-31); 0 means 14.
	MasqueradeBit int
	// Kernel is IPVS and netlink; nil opens the real one (NewNetlinkKernel).
	Kernel Kernel
	// IPTables is iptables and ip6tables; nil runs the commands (iptables.Commands).
	IPTables iptables.Kernel
}

// Proxier is the IPVS mode.
type Proxier struct {
	cfg   Config
	k     Kernel
	n     names
	fams  []bool // false: IPv4, true: IPv6
	sched string
	mark  string

	// mu serializes Sync and Cleanup and guards everything below.
	mu sync.Mutex
	// owned are the virtual servers this proxier created (nil before the first
	// sync: then the ones on the dummy link's addresses count as ours).
	owned map[vsKey]bool
	// written is the last iptables input per family that succeeded.
	written [2][]byte
	last    *service.Snapshot
	byPort  map[service.PortName][]vsKey
}

// vsKey identifies a virtual server.
type vsKey struct {
	addr  netip.Addr
	proto uint16
	port  uint16
}

func (k vsKey) String() string {
	return netip.AddrPortFrom(k.addr, k.port).String() + "/" + protoString(k.proto)
}

func protoString(p uint16) string {
	switch p {
	case syscall.IPPROTO_TCP:
		return "TCP"
	case syscall.IPPROTO_UDP:
		return "UDP"
	case syscall.IPPROTO_SCTP:
		return "SCTP"
	}
	return strconv.Itoa(int(p))
}

func protoNumber(p service.Protocol) uint16 {
	switch p {
	case service.TCP:
		return syscall.IPPROTO_TCP
	case service.UDP:
		return syscall.IPPROTO_UDP
	case service.SCTP:
		return syscall.IPPROTO_SCTP
	}
	return 0
}

// New returns the IPVS mode. It opens the IPVS netlink socket when cfg.Kernel
// is nil but changes nothing until the first Sync.
func New(cfg Config) (*Proxier, error) {
	prefix, err := iptables.ChainPrefix(cfg.ChainPrefix)
	if err != nil {
		return nil, err
	}
	sched := cfg.Scheduler
	if sched == "" {
		sched = "rr"
	}
	if !slices.Contains(Schedulers, sched) {
		return nil, fmt.Errorf("IPVS scheduler %q: want one of %s", sched, strings.Join(Schedulers, ", "))
	}
	bit, err := iptables.MasqueradeBit(cfg.MasqueradeBit)
	if err != nil {
		return nil, err
	}
	k := cfg.Kernel
	if k == nil {
		nk, err := NewNetlinkKernel()
		if err != nil {
			return nil, err
		}
		k = nk
	}
	cfg.IPTables = cmp.Or[iptables.Kernel](cfg.IPTables, iptables.Commands{})
	p := &Proxier{cfg: cfg, k: k, n: namesOf(prefix), sched: sched, mark: fmt.Sprintf("%#x", uint32(1)<<bit), fams: []bool{false}}
	if cfg.IPv6 {
		p.fams = append(p.fams, true)
	}
	return p, nil
}

func (p *Proxier) enabled(a netip.Addr) bool {
	return a.Is4() || p.cfg.IPv6
}

// desiredVS is one virtual server as the snapshot wants it.
type desiredVS struct {
	key   vsKey
	port  *service.Port
	eps   []netip.AddrPort
	flags uint32
	// timeout is the persistence timeout in seconds (0 without affinity).
	timeout uint32
}

// schedOf returns the scheduler of port's virtual servers: its Service's
// uproxy.io/scheduler annotation, or else --scheduler.
func (p *Proxier) schedOf(port *service.Port) string {
	if port.Policy.Scheduler != "" {
		return port.Policy.Scheduler
	}
	return p.sched
}

func (d *desiredVS) service(sched string) *ipvs.Service {
	s := &ipvs.Service{
		Address:       d.key.addr.AsSlice(),
		Protocol:      d.key.proto,
		Port:          d.key.port,
		SchedName:     sched,
		Flags:         d.flags,
		Timeout:       d.timeout,
		AddressFamily: syscall.AF_INET,
		Netmask:       0xffffffff,
	}
	if d.key.addr.Is6() {
		s.AddressFamily, s.Netmask = syscall.AF_INET6, 128
	}
	return s
}

func epsOfFamily(eps []service.Endpoint, v6 bool) []netip.AddrPort {
	var out []netip.AddrPort
	for _, e := range eps {
		a := e.Addr.Addr().Unmap()
		if e.Addr.IsValid() && a.Is6() == v6 {
			out = append(out, netip.AddrPortFrom(a, e.Addr.Port()))
		}
	}
	return out
}

func cleanAddrs(ips []netip.Addr) []netip.Addr {
	var out []netip.Addr
	for _, ip := range ips {
		if ip.IsValid() && !ip.IsUnspecified() {
			out = append(out, ip.Unmap().WithZone(""))
		}
	}
	return out
}

// familiesOf returns the families a Service port lives in (true: IPv6): those
// of its ClusterIPs, else of its other IPs, else both. A single-stack Service
// gets NodePorts in its own family only.
func familiesOf(sp *service.Port) map[bool]bool {
	for _, ips := range [][]netip.Addr{sp.ClusterIPs, slices.Concat(sp.ExternalIPs, sp.LoadBalancerIPs)} {
		fams := map[bool]bool{}
		for _, ip := range cleanAddrs(ips) {
			fams[ip.Is6()] = true
		}
		if len(fams) > 0 {
			return fams
		}
	}
	return map[bool]bool{false: true, true: true}
}

// nodePortIPs returns the node addresses serving NodePorts.
func (p *Proxier) nodePortIPs() []netip.Addr {
	var out []netip.Addr
	for _, ip := range cleanAddrs(p.cfg.NodeIPs) {
		if !p.enabled(ip) {
			continue
		}
		ok := len(p.cfg.NodePortAddresses) == 0
		for _, pr := range p.cfg.NodePortAddresses {
			ok = ok || pr.Contains(ip)
		}
		if ok {
			out = append(out, ip)
		}
	}
	return out
}

// desired returns every virtual server s calls for, and the addresses the
// dummy link must hold.
func (p *Proxier) desired(s *service.Snapshot) (map[vsKey]*desiredVS, map[netip.Addr]bool, []error) {
	out := map[vsKey]*desiredVS{}
	dummy := map[netip.Addr]bool{}
	var errs []error
	nodeIPs := p.nodePortIPs()
	for _, sp := range s.Ports {
		proto := protoNumber(sp.Protocol)
		if proto == 0 || sp.Port <= 0 || sp.Port > 65535 {
			errs = append(errs, fmt.Errorf("service port %s: protocol %q port %d not supported", sp.Name, sp.Protocol, sp.Port))
			continue
		}
		var flags, timeout uint32
		if sp.AffinityClientIP {
			flags = flagPersistent
			timeout = uint32(max(sp.AffinityTimeout.Seconds(), 1))
		}
		add := func(ip netip.Addr, port int, eps []service.Endpoint, onDummy bool) {
			if !p.enabled(ip) {
				return
			}
			k := vsKey{ip, proto, uint16(port)}
			out[k] = &desiredVS{key: k, port: sp, eps: epsOfFamily(eps, ip.Is6()), flags: flags, timeout: timeout}
			if onDummy {
				dummy[ip] = true
			}
		}
		for _, ip := range cleanAddrs(sp.ClusterIPs) {
			add(ip, sp.Port, sp.ClusterEndpoints(s.Zone), true)
		}
		external := sp.ExternalEndpoints(s.Zone)
		for _, ip := range cleanAddrs(slices.Concat(sp.ExternalIPs, sp.LoadBalancerIPs)) {
			add(ip, sp.Port, external, true)
		}
		if sp.NodePort > 0 && sp.NodePort <= 65535 {
			fams := familiesOf(sp)
			for _, ip := range nodeIPs {
				if fams[ip.Is6()] {
					add(ip, sp.NodePort, external, false)
				}
			}
		}
	}
	return out, dummy, errs
}

// Sync implements syncloop.Mode.
func (p *Proxier) Sync(s *service.Snapshot) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	want, dummy, errs := p.desired(s)

	if err := p.k.SetSysctls(); err != nil {
		return multierror.Append(nil, append(errs, err)...)
	}
	if err := p.k.EnsureDummy(DummyName); err != nil {
		return multierror.Append(nil, append(errs, err)...)
	}
	have, err := p.k.DummyAddrs(DummyName)
	if err != nil {
		return multierror.Append(nil, append(errs, err)...)
	}
	onDummy := map[netip.Addr]bool{}
	for _, a := range have {
		onDummy[a] = true
	}
	if p.owned == nil {
		// First sync: virtual servers on the dummy link's addresses are a
		// previous run's; NodePort ones on node IPs are ours if wanted again.
		p.owned = map[vsKey]bool{}
		current, err := p.k.Services()
		if err != nil {
			return multierror.Append(nil, append(errs, fmt.Errorf("list IPVS services: %w", err))...)
		}
		for _, vs := range current {
			k := keyOf(vs)
			if onDummy[k.addr] {
				p.owned[k] = true
			}
		}
	}
	for a := range dummy {
		if !onDummy[a] {
			if err := p.k.AddAddr(DummyName, a); err != nil {
				errs = append(errs, err)
			}
		}
	}

	errs = append(errs, p.syncServices(want)...)

	// Addresses go after their virtual servers, so no packet reaches a Service
	// IP the node accepts but IPVS does not yet serve.
	for _, a := range have {
		if !dummy[a] {
			if err := p.k.DeleteAddr(DummyName, a); err != nil {
				errs = append(errs, err)
			}
		}
	}

	for _, v6 := range p.fams {
		if err := p.syncRules(s, v6); err != nil {
			errs = append(errs, err)
		}
	}
	byPort := map[service.PortName][]vsKey{}
	for k, d := range want {
		byPort[d.port.Name] = append(byPort[d.port.Name], k)
	}
	p.last, p.byPort = s, byPort
	return multierror.Append(nil, errs...).ErrorOrNil()
}

func keyOf(vs *ipvs.Service) vsKey {
	a, _ := netip.AddrFromSlice(vs.Address)
	if vs.AddressFamily == syscall.AF_INET {
		a = a.Unmap()
	}
	return vsKey{a, vs.Protocol, vs.Port}
}

func destKey(d *ipvs.Destination) netip.AddrPort {
	a, _ := netip.AddrFromSlice(d.Address)
	if d.AddressFamily == syscall.AF_INET || a.Is4In6() {
		a = a.Unmap()
	}
	return netip.AddrPortFrom(a, d.Port)
}

// syncServices makes the virtual servers match want.
func (p *Proxier) syncServices(want map[vsKey]*desiredVS) []error {
	var errs []error
	current, err := p.k.Services()
	if err != nil {
		return []error{fmt.Errorf("list IPVS services: %w", err)}
	}
	have := map[vsKey]*ipvs.Service{}
	for _, vs := range current {
		have[keyOf(vs)] = vs
	}
	keys := make([]vsKey, 0, len(want))
	for k := range want {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i].String() < keys[j].String() })
	for _, k := range keys {
		d := want[k]
		vs := d.service(p.schedOf(d.port))
		if cur, ok := have[k]; !ok {
			if err := p.k.AddService(vs); err != nil {
				errs = append(errs, fmt.Errorf("add IPVS service %s (%s): %w", k, d.port.Name, err))
				continue
			}
		} else if cur.SchedName != vs.SchedName || cur.Flags&flagPersistent != vs.Flags || cur.Timeout != vs.Timeout {
			if err := p.k.UpdateService(vs); err != nil {
				errs = append(errs, fmt.Errorf("update IPVS service %s (%s): %w", k, d.port.Name, err))
				continue
			}
		}
		p.owned[k] = true
		errs = append(errs, p.syncDestinations(vs, d)...)
	}
	for k := range p.owned {
		if _, ok := want[k]; ok {
			continue
		}
		if vs, ok := have[k]; ok {
			if err := p.k.DeleteService(vs); err != nil {
				errs = append(errs, fmt.Errorf("delete IPVS service %s: %w", k, err))
				continue
			}
		}
		delete(p.owned, k)
	}
	return errs
}

// syncDestinations makes the real servers of vs match d.eps. A TCP or SCTP real
// server that is no longer wanted keeps its established connections: weight 0
// stops new ones, and it goes once IPVS counts none (active or inactive). UDP
// has no connection end to wait for, so its real servers go at once.
func (p *Proxier) syncDestinations(vs *ipvs.Service, d *desiredVS) []error {
	var errs []error
	current, err := p.k.Destinations(vs)
	if err != nil {
		return []error{fmt.Errorf("list real servers of %s: %w", d.key, err)}
	}
	have := map[netip.AddrPort]*ipvs.Destination{}
	for _, dst := range current {
		have[destKey(dst)] = dst
	}
	for _, ep := range d.eps {
		dst := &ipvs.Destination{Address: ep.Addr().AsSlice(), Port: ep.Port(), Weight: 1, ConnectionFlags: ipvs.ConnectionFlagMasq, AddressFamily: syscall.AF_INET}
		if ep.Addr().Is6() {
			dst.AddressFamily = syscall.AF_INET6
		}
		cur, ok := have[ep]
		switch {
		case !ok:
			err = p.k.AddDestination(vs, dst)
		case cur.Weight != 1:
			// Back from termination, or changed by hand.
			err = p.k.UpdateDestination(vs, dst)
		default:
			continue
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("real server %s of %s: %w", ep, d.key, err))
		}
	}
	wanted := map[netip.AddrPort]bool{}
	for _, ep := range d.eps {
		wanted[ep] = true
	}
	for ep, cur := range have {
		if wanted[ep] {
			continue
		}
		graceful := d.key.proto != syscall.IPPROTO_UDP
		switch {
		case !graceful || cur.ActiveConnections+cur.InactiveConnections == 0:
			err = p.k.DeleteDestination(vs, cur)
		case cur.Weight != 0:
			stopped := *cur
			stopped.Weight = 0
			err = p.k.UpdateDestination(vs, &stopped)
			klog.V(2).InfoS("Real server terminating", "virtualServer", d.key, "endpoint", ep, "active", cur.ActiveConnections, "inactive", cur.InactiveConnections)
		default:
			continue
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("remove real server %s of %s: %w", ep, d.key, err))
		}
	}
	return errs
}

// DebugServices implements observe.ServicesView: every Service port of the last
// sync, with its endpoints' IPVS connection counts summed over its virtual servers.
func (p *Proxier) DebugServices() []observe.ServiceState {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.last == nil {
		return nil
	}
	out := make([]observe.ServiceState, 0, len(p.last.Ports))
	for _, sp := range p.last.Ports {
		st := observe.PortState(sp, p.schedOf(sp))
		active := map[netip.AddrPort]int{}
		programmed := map[netip.AddrPort]bool{}
		for _, k := range p.byPort[sp.Name] {
			vs := (&desiredVS{key: k}).service(p.sched)
			dsts, err := p.k.Destinations(vs)
			if err != nil {
				continue
			}
			for _, d := range dsts {
				ep := destKey(d)
				active[ep] += d.ActiveConnections
				if d.Weight > 0 {
					programmed[ep] = true
				}
			}
		}
		for _, e := range sp.Endpoints {
			a := netip.AddrPortFrom(e.Addr.Addr().Unmap(), e.Addr.Port())
			st.Endpoints = append(st.Endpoints, observe.EndpointState{
				Address:           e.Addr.String(),
				Ready:             e.Ready,
				Serving:           e.Serving,
				Terminating:       e.Terminating,
				Usable:            programmed[a],
				ActiveConnections: active[a],
			})
		}
		out = append(out, st)
	}
	return out
}

// ipNet formats a host address as a prefix for iptables.
func ipNet(a netip.Addr) string {
	return (&net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(a.BitLen(), a.BitLen())}).String()
}
