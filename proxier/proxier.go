// Package proxier is the userspace mode: for every Service port it holds a proxy
// listener (TCP or UDP), keeps the port's backend choice up to date, and asks the
// portals (rules) to steer the Service's virtual IPs to the listener, or to
// refuse those whose balancer has no endpoint of their family (rules.RefusalOf
// of the endpoints the balancers were given); the listener stays open either way.
//
// A connection gets endpoints by the way it came in, as in kube-proxy: through
// a ClusterIP the port's ClusterEndpoints, through a NodePort, ExternalIP or
// LoadBalancer IP its ExternalEndpoints, and of its own address family only.
// The traffic class is told apart by proxy port, not by each connection's
// original destination: a Service port whose traffic policies differ gets a
// second proxy port for its external addresses, which costs nothing per
// connection and works for UDP, where SO_ORIGINAL_DST has no counterpart. The
// family is the client address's. route.go has the details.
package proxier

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hashicorp/go-multierror"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/affinity"
	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/rules"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/socket"
	"github.com/uproxy/uproxy/socket/poll"
)

// Config configures a Proxier. Zero values give the documented defaults.
type Config struct {
	// Common is what every mode takes. The proxier itself reads ClusterCIDRs
	// and MasqueradeAll (which decide whose address a dial carries, with
	// KeepClientAddress); the rest is its portals' (rules.Config), built with
	// it by the mode registry.
	proxymode.Common
	// BindAddress is where proxy listeners bind. Unset or unspecified (0.0.0.0, ::)
	// binds every address of both families, which REDIRECT portals need.
	BindAddress netip.Addr
	// PortRange bounds the proxy ports; zero: the kernel's ephemeral port range.
	PortRange PortRange
	// Scheduler is the backend scheduler name (affinity.Schedulers); "": rr.
	Scheduler string
	// DialTimeouts has one per-attempt timeout per TCP dial attempt; nil: socket defaults.
	DialTimeouts []time.Duration
	// DialHedge hedges TCP dials after that long (socket.DialPolicy.Hedge); 0: off.
	DialHedge time.Duration
	// RetryBudget bounds TCP retries and hedges to that percentage of first
	// attempts, per Service port (socket.DialPolicy.RetryBudget); 0: off.
	RetryBudget float64
	// TCPKeepAlive is the keepalive idle time and probe interval on both sockets
	// of every TCP connection; 0: socket.DefaultKeepAlive (15s), negative: off.
	TCPKeepAlive time.Duration
	// TCPIdleTimeout resets a TCP connection through which no byte moved either
	// way for that long; 0: never, as kube-proxy.
	TCPIdleTimeout time.Duration
	// UDPTimeout is the idle expiry of UDP client entries; 0: socket default (250ms).
	UDPTimeout time.Duration
	// UDPMaxClients bounds each UDP Service's client table; 0: socket default.
	UDPMaxClients int
	// Portals programs the rules that steer virtual IPs to proxy ports; nil: none.
	Portals rules.Portals
	// Holding, when set, is told of every proxy socket opened and closed
	// (holding.go): a crash holder keeps copies through a crash.
	Holding Holding
	// KeepClientAddress dials endpoints from the client's address where
	// kube-proxy would not masquerade the connection, while the Portals bring
	// the replies back (clientaddress.go); Common.ClusterCIDRs and
	// MasqueradeAll, kube-proxy's --cluster-cidr and --masquerade-all,
	// decide where.
	KeepClientAddress bool
	// DialMark is the packet mark of every socket dialed to an endpoint
	// (socket.TCPProxy.DialMark), by which the Portals let the proxy's own
	// connections pass (rules.Config.DialMark); 0: none.
	DialMark uint32
	// Events, if set, records every connection and every ejection.
	Events *observe.Events
	// EjectAfter is how many consecutive failed dials eject an endpoint from new
	// picks for a while (1s, doubling up to 30s while it keeps failing); 0 turns
	// outlier ejection off. See affinity.Ejection.
	EjectAfter int
	// EjectBase and EjectMax are the first ejection's length and the cap of its
	// doubling; 0: affinity.DefaultEjectionBase (1s) and DefaultEjectionMax (30s).
	EjectBase, EjectMax time.Duration
	// EventLoops is how many event loops carry the TCP connections and UDP flows
	// of every Service port; 0: poll.DefaultLoops (one per P but one, at least
	// one). The program keeps GOMAXPROCS above it (see poll.DefaultLoops).
	EventLoops int
}

// Proxier is the userspace mode. Sync is called from one goroutine (the sync
// loop); DebugServices from any.
type Proxier struct {
	cfg   Config
	alloc *allocator
	// loops carry every proxy's traffic; Shutdown closes them.
	loops *poll.Group

	// syncMu orders Sync and Shutdown: a Sync in flight finishes before Shutdown
	// begins, and none starts after it (shutDown), so no proxy opens on closed loops.
	syncMu   sync.Mutex
	shutDown bool

	// mu guards ports; Sync holds it only while changing the map, never while
	// dialing or writing rules, so debug readers do not wait on the kernel.
	mu    sync.RWMutex
	ports map[service.PortName]*servicePort
	// zone is the node's topology zone of the last Sync's Snapshot.
	zone string
	// portErrors are the per-Service-port problems of the last sync.
	portErrors []error
	// synced holds, for each Port of the last Sync's Snapshot in order, its
	// running state (nil for a protocol not proxied). It is nil when that Sync
	// left a port without a listener: the next Sync then takes the long way,
	// which retries what failed.
	synced []syncedPort

	// socketFailed is set when a proxy socket has failed for good: the next Sync
	// takes the long way, which reopens it.
	socketFailed atomic.Bool

	// own are the proxy sockets, which no proxy dials (own.go).
	own ownSockets
	// clientAddr decides whose address each dial carries.
	clientAddr clientAddress
	// adopt holds the proxy sockets handed by a predecessor (adopt.go).
	adopt  adoption
	recall recalls
}

type syncedPort struct {
	port *service.Port
	sp   *servicePort
}

// servicePort is the running state of one Service port. Everything but port and
// external is set before the port is published in Proxier.ports and never
// changes.
type servicePort struct {
	name     service.PortName
	protocol service.Protocol
	// port is the Port of the last sync. Ports are immutable, so readers on any
	// goroutine (the /debug handlers) load it without a lock, and Sync's short
	// way pays one atomic store per changed port.
	port     atomic.Pointer[service.Port]
	observer *observe.PortObserver
	// cluster serves the ClusterIPs, and every address while external is nil.
	cluster *route
	// external serves the NodePort, ExternalIPs and LoadBalancer IPs while the
	// port SplitsExternal (see route.go); only Sync's long way sets or clears it.
	external atomic.Pointer[route]
	// refusal is what the portals refuse of the port for want of endpoints,
	// from what its balancers were last given (updatePort): a portal leads to
	// the proxy port only while the balancer behind it has an endpoint of the
	// portal's family. The proxy port stays open either way.
	refusal atomic.Pointer[rules.Refusal]
}

// New returns a Proxier with no Service ports, with its event loops running; call
// Shutdown to stop them.
func New(cfg Config) (*Proxier, error) {
	if cfg.Scheduler == "" {
		cfg.Scheduler = "rr"
	}
	if err := affinity.ValidScheduler(cfg.Scheduler); err != nil {
		return nil, err
	}
	if cfg.Portals == nil {
		cfg.Portals = rules.None{}
	}
	loops, err := poll.New(poll.Config{Loops: cfg.EventLoops})
	if err != nil {
		return nil, fmt.Errorf("userspace proxier: %w", err)
	}
	p := &Proxier{cfg: cfg, alloc: newAllocator(cfg.PortRange), loops: loops}
	p.clientAddr = clientAddress{keep: cfg.KeepClientAddress, clusterCIDRs: cfg.ClusterCIDRs, masqueradeAll: cfg.MasqueradeAll, portals: cfg.Portals}
	p.ports = make(map[service.PortName]*servicePort)
	p.own.bind = cfg.BindAddress
	p.own.refresh()
	return p, nil
}

// Sync makes the listeners and portals match s. A problem confined to one
// Service port (its proxy port cannot be opened, its NodePort is taken) is logged
// and leaves that port out until a later sync; it does not fail the sync, so one
// bad Service never marks the whole node unhealthy. Sync fails only when the
// portals as a whole could not be written, or after Shutdown.
func (p *Proxier) Sync(s *service.Snapshot) error {
	p.syncMu.Lock()
	defer p.syncMu.Unlock()
	if p.shutDown {
		return errors.New("userspace proxier is shut down")
	}
	// The node's addresses may have changed: they spell the proxy sockets too.
	p.own.refresh()
	var errs, portErrs *multierror.Error
	// A proxy socket failed for good since the last sync: the whole long way
	// reopens it.
	failed := p.socketFailed.Swap(false)
	portals, ok := p.syncSameListeners(s, failed)
	if !ok {
		portals, portErrs = p.syncListeners(s, failed)
	}
	p.steerOwn(portals)
	if err := p.cfg.Portals.Sync(portals); err != nil {
		for _, e := range flatten(err) {
			var pe *rules.PortalError
			if errors.As(e, &pe) {
				portErrs = multierror.Append(portErrs, e)
				continue
			}
			observe.IPTablesRestoreFailures.Inc()
			errs = multierror.Append(errs, fmt.Errorf("portals: %w", e))
		}
	}
	var left []error
	if portErrs != nil {
		left = portErrs.Errors
	}
	p.mu.Lock()
	was := p.portErrors
	p.portErrors = left
	p.mu.Unlock()
	logPortErrors(was, left)
	return errs.ErrorOrNil()
}

// logPortErrors logs what changed between the per-port problems of two syncs:
// each new one once, while every sync retries it, and each one gone once. A
// problem that lasts (a NodePort another program holds) is not logged again at
// every sync; /debug/services and uproxy explain show it meanwhile.
func logPortErrors(was, now []error) {
	texts := func(errs []error) map[string]bool {
		m := make(map[string]bool, len(errs))
		for _, e := range errs {
			m[e.Error()] = true
		}
		return m
	}
	before, after := texts(was), texts(now)
	for _, e := range now {
		if !before[e.Error()] {
			klog.ErrorS(e, "Service port left out of the sync, whole or in part; retried at every sync, logged again when it is gone")
		}
	}
	for _, e := range was {
		if !after[e.Error()] {
			klog.InfoS("Service port problem gone", "was", e.Error())
		}
	}
}

// steerOwn tells the own-socket check what portals steer, when the proxy's
// dials carry no mark to pass the portals (own.go).
func (p *Proxier) steerOwn(portals []rules.Portal) {
	if _, none := p.cfg.Portals.(rules.None); none || p.cfg.DialMark != 0 {
		portals = nil
	}
	p.own.steer(portals)
}

// syncSameListeners is Sync's short way, for the common case of a Snapshot with
// the same Service ports as the last one (names and protocols, in the same
// order), every one of which has its listener: it hands the Ports that changed to
// their balancers without any lookup by name. It reports false, having changed
// nothing, when the long way is needed.
func (p *Proxier) syncSameListeners(s *service.Snapshot, socketFailed bool) ([]rules.Portal, bool) {
	p.mu.RLock()
	synced := p.synced
	p.mu.RUnlock()
	if synced == nil || len(synced) != len(s.Ports) || socketFailed {
		return nil, false
	}
	p.mu.RLock()
	zoneChanged := p.zone != s.Zone
	p.mu.RUnlock()
	for i, port := range s.Ports {
		if prev := synced[i].port; prev != port && (!service.IdentityEqual(prev, port) || prev.NodePort != port.NodePort) {
			// A NodePort that changed may now be a proxy socket's port, which
			// the long way moves.
			return nil, false
		}
		// Opening or closing an external route is the long way's job.
		if sp := synced[i].sp; sp != nil && p.splits(port) != (sp.external.Load() != nil) {
			return nil, false
		}
	}
	if zoneChanged {
		p.mu.Lock()
		p.zone = s.Zone
		p.mu.Unlock()
	}
	portals := make([]rules.Portal, 0, len(s.Ports))
	for i, port := range s.Ports {
		synced[i].port = port
		sp := synced[i].sp
		if sp == nil {
			klog.V(2).InfoS("Skipping Service port: protocol not proxied in userspace", "service", port.Name, "protocol", port.Protocol)
			continue
		}
		// Snapshots are never modified, so a port whose Port is the one it last
		// synced with has nothing new: with a builder that reuses the Ports of
		// unchanged Services, an endpoint change costs one balancer update, not
		// one per Service port.
		if zoneChanged || sp.port.Load() != port {
			p.updatePort(sp, port)
		}
		portals = append(portals, sp.portal(port))
	}
	return portals, true
}

// syncListeners is Sync's long way: it closes the listeners of Service ports that
// are gone or changed identity, opens the missing ones and updates the rest.
func (p *Proxier) syncListeners(s *service.Snapshot, socketFailed bool) ([]rules.Portal, *multierror.Error) {
	if portals, errs, ok := p.syncChangedListeners(s, socketFailed); ok {
		return portals, errs
	}
	synced := make([]syncedPort, len(s.Ports))
	desired := make(map[service.PortName]*service.Port, len(s.Ports))
	for _, port := range s.Ports {
		desired[port.Name] = port
	}

	// Close what is gone or changed identity first, so a re-opened port may reuse
	// the proxy port range; and what holds a port that is now a NodePort, to
	// be reopened on another.
	p.alloc.setNodePorts(s.Ports)
	p.mu.Lock()
	var closing []*servicePort
	var moving []*service.Port
	for name, sp := range p.ports {
		d := desired[name]
		if d != nil && service.IdentityEqual(sp.port.Load(), d) {
			if !p.holdsNodePort(sp) {
				continue
			}
			klog.InfoS("Moving a proxy port: a Service declares it as its NodePort", "service", name)
			moving = append(moving, d)
		}
		closing = append(closing, sp)
		delete(p.ports, name)
	}
	p.mu.Unlock()
	for _, sp := range closing {
		p.closePort(sp)
	}
	// A Service port that served goes on serving, on another port, before new
	// Service ports take what the range has left (an error is the loop's to
	// report, as for any port it opens).
	for _, port := range moving {
		if sp, err := p.openPort(port); err == nil {
			p.mu.Lock()
			p.ports[port.Name] = sp
			p.mu.Unlock()
		}
	}

	p.mu.Lock()
	zoneChanged := p.zone != s.Zone
	p.zone = s.Zone
	p.mu.Unlock()
	portals := make([]rules.Portal, 0, len(s.Ports))
	st := portSync{zoneChanged: zoneChanged, complete: true}
	for i, port := range s.Ports {
		synced[i].port = port
		if sp := p.syncPort(port, &st); sp != nil {
			synced[i].sp = sp
			portals = append(portals, sp.portal(port))
		}
	}
	return portals, p.endSync(s, synced, &st)
}

// maxChangedPorts bounds the Service ports a sync may add, remove or change
// and still take syncChangedListeners; more take the whole long way.
const maxChangedPorts = 256

// syncChangedListeners is the long way for a few Service ports added, removed
// or changed, after a sync that left every port with its listener: it walks
// s beside the last Snapshot (both in name order), keeps the listener and
// portal of every Port that is the same pointer, and opens, closes or updates
// the others as syncListeners would, so one new Service costs about one
// Service port. It reports false, having changed nothing, when the whole long
// way is needed: a NodePort among the changes (which may move other ports'
// proxy sockets), another zone, a proxy socket that failed, more than
// maxChangedPorts changes.
func (p *Proxier) syncChangedListeners(s *service.Snapshot, socketFailed bool) ([]rules.Portal, *multierror.Error, bool) {
	p.mu.RLock()
	last, zone := p.synced, p.zone
	p.mu.RUnlock()
	if last == nil || zone != s.Zone || socketFailed {
		return nil, nil, false
	}
	// prev is the index in last of each Port's name, -1 for a new name.
	prev := make([]int, len(s.Ports))
	var gone []*service.Port
	changed, j := 0, 0
	for i, port := range s.Ports {
		if i > 0 && !s.Ports[i-1].Name.Less(port.Name) {
			return nil, nil, false
		}
		for ; j < len(last) && last[j].port.Name.Less(port.Name); j++ {
			gone = append(gone, last[j].port)
		}
		prev[i] = -1
		if j < len(last) && last[j].port.Name == port.Name {
			prev[i] = j
			j++
			if last[prev[i]].port == port {
				continue
			}
			if last[prev[i]].port.NodePort != 0 {
				return nil, nil, false
			}
		}
		if changed++; port.NodePort != 0 || changed > maxChangedPorts {
			return nil, nil, false
		}
	}
	for ; j < len(last); j++ {
		gone = append(gone, last[j].port)
	}
	for _, port := range gone {
		if changed++; port.NodePort != 0 || changed > maxChangedPorts {
			return nil, nil, false
		}
	}

	// Close what is gone or changed identity first, as syncListeners does.
	var closing []*servicePort
	p.mu.Lock()
	for _, port := range gone {
		if sp := p.ports[port.Name]; sp != nil {
			closing = append(closing, sp)
			delete(p.ports, port.Name)
		}
	}
	for i, port := range s.Ports {
		if k := prev[i]; k >= 0 && last[k].port != port {
			if sp := p.ports[port.Name]; sp != nil && !service.IdentityEqual(sp.port.Load(), port) {
				closing = append(closing, sp)
				delete(p.ports, port.Name)
			}
		}
	}
	p.mu.Unlock()
	for _, sp := range closing {
		p.closePort(sp)
	}

	synced := make([]syncedPort, len(s.Ports))
	portals := make([]rules.Portal, 0, len(s.Ports))
	st := portSync{complete: true}
	for i, port := range s.Ports {
		synced[i].port = port
		if k := prev[i]; k >= 0 && last[k].port == port {
			sp := last[k].sp
			if sp == nil {
				klog.V(2).InfoS("Skipping Service port: protocol not proxied in userspace", "service", port.Name, "protocol", port.Protocol)
				continue
			}
			synced[i].sp = sp
			portals = append(portals, sp.portal(port))
			continue
		}
		if sp := p.syncPort(port, &st); sp != nil {
			synced[i].sp = sp
			portals = append(portals, sp.portal(port))
		}
	}
	return portals, p.endSync(s, synced, &st), true
}

// portSync is the state of one pass of the long way over the Service ports.
type portSync struct {
	zoneChanged bool
	errs        *multierror.Error
	// complete is whether every Service port proxied has its listener.
	complete bool
	// starved counts the Service ports left without a working proxy socket
	// because the process is out of file descriptors, starvedReopens the
	// reopens of sockets that failed that way.
	starved, starvedReopens int
}

// syncPort opens the listener of port, or updates (and reopens, when it
// failed) the one it has; nil when port has none, for a protocol not proxied
// or a problem recorded in st.
func (p *Proxier) syncPort(port *service.Port, st *portSync) *servicePort {
	if port.Protocol != service.TCP && port.Protocol != service.UDP {
		klog.V(2).InfoS("Skipping Service port: protocol not proxied in userspace", "service", port.Name, "protocol", port.Protocol)
		return nil
	}
	p.mu.RLock()
	sp := p.ports[port.Name]
	p.mu.RUnlock()
	if sp == nil {
		if st.starved > 0 {
			// Out of descriptors: this open would fail the same way.
			st.starved++
			st.complete = false
			return nil
		}
		var err error
		if sp, err = p.openPort(port); err != nil {
			if fdStarved(err) {
				st.starved++
			} else {
				st.errs = multierror.Append(st.errs, err)
			}
			st.complete = false
			return nil
		}
		p.mu.Lock()
		p.ports[port.Name] = sp
		p.mu.Unlock()
		return sp
	}
	if err := p.routeExternal(sp, port); err != nil {
		st.errs = multierror.Append(st.errs, err)
		st.complete = false
		return nil
	}
	if st.zoneChanged || sp.port.Load() != port { // see syncSameListeners
		p.updatePort(sp, port)
	}
	if sp.starvedSocket() {
		// A socket that failed for want of descriptors: at most
		// MaxStarvedReopens such reopens a sync, none once an open
		// failed the same way, so a node that cannot hold every
		// proxy socket does not spend its syncs retrying them all.
		if st.starved > 0 || st.starvedReopens >= MaxStarvedReopens {
			st.starved++
			st.complete = false
			return nil
		}
		st.starvedReopens++
	}
	if err := p.reopenFailed(sp); err != nil {
		if fdStarved(err) {
			st.starved++
		} else {
			st.errs = multierror.Append(st.errs, err)
		}
		st.complete = false
		return nil
	}
	return sp
}

// endSync records synced for the next sync's short ways when the long way
// left every Service port of s with its listener, and returns its errors.
func (p *Proxier) endSync(s *service.Snapshot, synced []syncedPort, st *portSync) *multierror.Error {
	if st.starved > 0 {
		st.errs = multierror.Append(st.errs, starvedError(st.starved))
	}
	p.mu.Lock()
	if st.complete && sortedByName(s.Ports) {
		p.synced = synced
	} else {
		p.synced = nil
	}
	p.mu.Unlock()
	return st.errs
}

// holdsNodePort reports whether one of sp's proxy sockets is on a port a
// Service declares as its NodePort (allocator.setNodePorts).
func (p *Proxier) holdsNodePort(sp *servicePort) bool {
	for _, r := range sp.routes() {
		if ls := r.listener.Load(); ls != nil && p.alloc.isNodePort(sp.protocol, ls.proxyPort) {
			return true
		}
	}
	return false
}

// MaxStarvedReopens bounds the proxy sockets that failed for want of file
// descriptors which one sync reopens (the others wait for later syncs).
var MaxStarvedReopens = 256

// fdStarved reports whether err is the process (EMFILE) or the system (ENFILE)
// out of file descriptors.
func fdStarved(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE)
}

// starvedSocket reports whether a proxy socket of sp failed for want of file
// descriptors.
func (sp *servicePort) starvedSocket() bool {
	for _, r := range sp.routes() {
		if ls := r.listener.Load(); ls != nil && fdStarved(ls.serving.failed()) {
			return true
		}
	}
	return false
}

// starvedError is the one error of a sync that left n Service ports without
// a proxy socket for want of file descriptors.
func starvedError(n int) error {
	limit := "unknown"
	var rl unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &rl) == nil {
		limit = strconv.FormatUint(rl.Cur, 10)
	}
	return fmt.Errorf("%d Service ports have no working proxy socket: out of file descriptors (open files limit %s; each Service port needs one, each open connection two): raise the limit or serve fewer Service ports", n, limit)
}

// sortedByName reports whether ports are in strictly increasing name order, as
// Snapshots promise: only then does an equal sequence of names mean an equal set.
func sortedByName(ports []*service.Port) bool {
	for i := 1; i < len(ports); i++ {
		if !ports[i-1].Name.Less(ports[i].Name) {
			return false
		}
	}
	return true
}

// PortErrors returns the problems of single Service ports found by the last sync.
func (p *Proxier) PortErrors() []error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	return p.portErrors
}

// flatten returns the errors inside a *multierror.Error, or err itself.
func flatten(err error) []error {
	var m *multierror.Error
	if errors.As(err, &m) {
		return m.Errors
	}
	return []error{err}
}

// portal is the Portal of sp for port.
func (sp *servicePort) portal(port *service.Port) rules.Portal {
	pt := rules.Portal{Port: port, ProxyPort: sp.cluster.listener.Load().proxyPort, Refuse: *sp.refusal.Load()}
	if ext := sp.external.Load(); ext != nil {
		pt.ExternalProxyPort = ext.listener.Load().proxyPort
	}
	return pt
}

// policy returns the policy port runs with: its annotations over the flags.
// Scheduler, DialTimeouts, DialHedge and RetryBudget of the Config are the flags.
func (p *Proxier) policy(port *service.Port) service.EffectivePolicy {
	timeouts := p.cfg.DialTimeouts
	if len(timeouts) == 0 {
		timeouts = socket.DefaultDialTimeouts
	}
	return port.Policy.Over(service.FlagPolicy(timeouts, p.cfg.DialHedge, p.cfg.RetryBudget, p.cfg.Scheduler))
}

// updatePort hands each route of the port its endpoints, affinity settings
// and policy: the cluster route the ClusterEndpoints, the external route
// (when there is one) the ExternalEndpoints.
func (p *Proxier) updatePort(sp *servicePort, port *service.Port) {
	p.mu.RLock()
	zone := p.zone
	p.mu.RUnlock()
	pol := p.policy(port)
	old := sp.port.Load()
	all := make(map[netip.AddrPort]bool)
	for _, r := range sp.routes() {
		// A Service's scheduler annotation is validated by
		// service.ParsePolicy; the flag by the program: neither can be
		// unknown here.
		if err := r.picker.setScheduler(pol.Scheduler); err != nil {
			klog.ErrorS(err, "Keeping the scheduler", "service", sp.name, "scheduler", r.picker.scheduler())
		}
		if r.tcp != nil {
			r.tcp.SetDialPolicy(dialPolicy(pol))
		}
		classEndpoints := port.ClusterEndpoints
		if r != sp.cluster {
			classEndpoints = port.ExternalEndpoints
		}
		eps := classEndpoints(zone)
		addrs := make([]netip.AddrPort, len(eps))
		for i, e := range eps {
			addrs[i] = e.Addr
			all[e.Addr] = true
		}
		r.picker.update(addrs, port)
		p.recallPending(sp, r)
		// A UDP client that keeps sending would stay on a removed endpoint for
		// as long as it talks: its entry never idles out. End such entries, so
		// its next datagram picks a usable endpoint (what kube-proxy gets by
		// deleting the flows' conntrack entries).
		if r.udp != nil && old != nil && lostEndpoint(r.endpoints, addrs) {
			if n, err := r.udp.Retain(addrs); err != nil {
				klog.ErrorS(err, "Ending UDP clients of removed endpoints", "service", sp.name)
			} else if n > 0 {
				klog.V(1).InfoS("Moved UDP clients off removed endpoints", "service", sp.name, "clients", n)
			}
		}
		r.endpoints = addrs
		r.localPolicy.Store(port.ExternalPolicyLocal)
	}
	kept := make([]netip.AddrPort, 0, len(all))
	for a := range all {
		kept = append(kept, a)
	}
	sp.observer.Retain(kept)
	ext := sp.cluster
	if r := sp.external.Load(); r != nil {
		ext = r
	}
	refusal := rules.RefusalOf(sp.cluster.endpoints, ext.endpoints)
	if ext != sp.cluster && port.ExternalPolicyLocal {
		// The node's own and pods' connections to the external addresses
		// go to the cluster's endpoints (clientaddress.go, shortCircuits):
		// the portal refuses those addresses only when neither route has
		// an endpoint of the family. A client from elsewhere finds the
		// external route without one and is reset.
		for f := range refusal.External {
			refusal.External[f] = refusal.External[f] && refusal.Cluster[f]
		}
	}
	sp.refusal.Store(&refusal)
	sp.port.Store(port)
}

// lostEndpoint reports whether an endpoint of before is not in now.
func lostEndpoint(before, now []netip.AddrPort) bool {
	for _, e := range before {
		if !slices.Contains(now, e) {
			return true
		}
	}
	return false
}

func (p *Proxier) ejection() affinity.Ejection {
	e := affinity.Ejection{After: p.cfg.EjectAfter, Base: p.cfg.EjectBase, Max: p.cfg.EjectMax}
	if e.Base <= 0 {
		e.Base = affinity.DefaultEjectionBase
	}
	if e.Max <= 0 {
		e.Max = affinity.DefaultEjectionMax
	}
	return e
}

// dialPolicy is the socket layer's share of pol.
func dialPolicy(pol service.EffectivePolicy) socket.DialPolicy {
	return socket.DialPolicy{Timeouts: pol.DialTimeouts, Hedge: pol.DialHedge, RetryBudget: pol.RetryBudget}
}

// openPort opens the listener of a new Service port on a proxy port (two when
// the port SplitsExternal) and starts serving.
func (p *Proxier) openPort(port *service.Port) (*servicePort, error) {
	sp := &servicePort{
		name:     port.Name,
		protocol: port.Protocol,
		observer: observe.NewPortObserver(port.Name.String(), string(port.Protocol), p.cfg.Events),
	}
	r, err := p.newRoute(sp, port, false)
	if err != nil {
		sp.observer.Forget()
		return nil, err
	}
	sp.cluster = r
	var udpClients func() int
	if port.Protocol == service.UDP {
		udpClients = sp.udpClients
	}
	sp.observer.Attach(portStats(sp), udpClients)
	// The first connection finds the endpoints, and a reader the Port.
	p.updatePort(sp, port)
	ls, err := p.listenAnywhere(sp, r)
	if err != nil {
		// Nothing was served: the port leaves no series and no scrape behind.
		sp.observer.Forget()
		return nil, fmt.Errorf("open proxy port for %s/%s: %w", port.Name, port.Protocol, err)
	}
	r.listener.Store(ls)
	p.hold(sp, r, ls)
	if err := p.routeExternal(sp, port); err != nil {
		p.closePort(sp)
		return nil, err
	}
	// At the default verbosity: with --rules none the proxy port is the only way
	// to a Service, and this line the only place that says which it is.
	klog.InfoS("Opened proxy port", "service", port.Name, "protocol", port.Protocol, "proxyPort", ls.proxyPort, "serves", port.Claims())
	return sp, nil
}

// newRoute returns a route of sp with its balancers and proxy, not listening
// yet, under port's policy: the external route (NodePort, ExternalIPs,
// LoadBalancer IPs) when external, else the cluster one.
func (p *Proxier) newRoute(sp *servicePort, port *service.Port, external bool) (*route, error) {
	pol := p.policy(port)
	picker, err := newFamilyPicker(pol.Scheduler, p.ejection(), sp.observer, port)
	if err != nil {
		return nil, err
	}
	r := &route{picker: picker, external: external}
	r.localPolicy.Store(port.ExternalPolicyLocal)
	keep := func(client netip.Addr) bool { return p.keepsClient(r, client) }
	// The external route hands the connections it short-circuits to the
	// cluster route's balancers (clientaddress.go).
	var short socket.Picker
	shorts := func(client netip.Addr) bool { return p.shortCircuits(r, client) }
	if external {
		short = sp.cluster.picker
	}
	switch sp.protocol {
	case service.TCP:
		r.tcp = &socket.TCPProxy{
			Service:      sp.name.String(),
			Picker:       picker,
			Loops:        p.loops,
			DialTimeouts: pol.DialTimeouts,
			DialHedge:    pol.DialHedge,
			RetryBudget:  pol.RetryBudget,
			KeepAlive:    p.cfg.TCPKeepAlive,
			IdleTimeout:  p.cfg.TCPIdleTimeout,
			Observer:     sp.observer,
			OwnSocket:    func(ep netip.AddrPort) bool { return p.own.reaches(service.TCP, ep) },

			KeepClientAddress: keep,
			DialMark:          p.cfg.DialMark,
			ShortCircuit:      short,
			ShortCircuits:     shorts,
		}
	case service.UDP:
		r.udp = &socket.UDPProxy{
			Service:    sp.name.String(),
			Picker:     picker,
			Loops:      p.loops,
			Timeout:    p.cfg.UDPTimeout,
			MaxClients: p.cfg.UDPMaxClients,
			Observer:   sp.observer,
			OwnSocket:  func(ep netip.AddrPort) bool { return p.own.reaches(service.UDP, ep) },

			KeepClientAddress: keep,
			DialMark:          p.cfg.DialMark,
			ShortCircuit:      short,
			ShortCircuits:     shorts,
		}
	}
	return r, nil
}

// routeExternal gives sp an external route, listening on a proxy port of its
// own, when port SplitsExternal, and closes the one it has when not.
func (p *Proxier) routeExternal(sp *servicePort, port *service.Port) error {
	ext := sp.external.Load()
	switch split := p.splits(port); {
	case split && ext == nil:
		r, err := p.newRoute(sp, port, true)
		if err != nil {
			return err
		}
		ls, err := p.listenAnywhere(sp, r)
		if err != nil {
			return fmt.Errorf("open external proxy port for %s/%s: %w", port.Name, port.Protocol, err)
		}
		r.listener.Store(ls)
		p.hold(sp, r, ls)
		sp.external.Store(r)
		p.updatePort(sp, port)
		klog.InfoS("Opened external proxy port", "service", port.Name, "protocol", port.Protocol, "proxyPort", ls.proxyPort,
			"externalTrafficPolicyLocal", port.ExternalPolicyLocal, "internalTrafficPolicyLocal", port.InternalPolicyLocal)
	case !split && ext != nil:
		sp.external.Store(nil)
		p.closeRoute(sp, ext)
		p.updatePort(sp, port)
	}
	return nil
}

// closePort stops accepting for a Service port that went away. Open TCP
// connections carry on to their end; UDP client entries end with the socket.
func (p *Proxier) closePort(sp *servicePort) {
	for _, r := range sp.routes() {
		p.closeRoute(sp, r)
	}
	sp.observer.Forget()
}

// closeRoute stops accepting on one route of sp and releases its proxy port.
func (p *Proxier) closeRoute(sp *servicePort, r *route) {
	if r.tcp != nil {
		r.tcp.Close()
	} else {
		r.udp.Close()
	}
	ls := r.listener.Load()
	if ls == nil {
		return
	}
	<-ls.serving.done
	p.release(sp, r, ls.proxyPort)
	p.releasePort(sp, ls.proxyPort)
	klog.V(1).InfoS("Closed proxy port", "service", sp.name, "proxyPort", ls.proxyPort)
}

// ProxyPort returns the proxy port of a Service port (0 when it has none).
func (p *Proxier) ProxyPort(name service.PortName) int {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if sp := p.ports[name]; sp != nil {
		return sp.cluster.listener.Load().proxyPort
	}
	return 0
}

// ExternalProxyPort returns the proxy port of a Service port's NodePort,
// ExternalIPs and LoadBalancer IPs when it has one of its own (see route.go),
// else 0.
func (p *Proxier) ExternalProxyPort(name service.PortName) int {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if sp := p.ports[name]; sp != nil {
		if ext := sp.external.Load(); ext != nil {
			return ext.listener.Load().proxyPort
		}
	}
	return 0
}

// Shutdown stops accepting on every port, lets open TCP connections finish until
// ctx is done, then resets what remains and closes the event loops. Portals are
// left in place. Later Syncs fail; later Shutdowns do nothing. When ctx ended
// with connections open, the error is a *socket.ShutdownExpiredError counting
// every one reset (joined to the others, if anything failed too).
func (p *Proxier) Shutdown(ctx context.Context) error {
	p.syncMu.Lock()
	defer p.syncMu.Unlock()
	if p.shutDown {
		return nil
	}
	p.shutDown = true
	p.mu.Lock()
	ports := p.ports
	p.ports = make(map[service.PortName]*servicePort)
	p.synced = nil
	p.mu.Unlock()
	var wg sync.WaitGroup
	var mu sync.Mutex
	var errs *multierror.Error
	// expired sums the ShutdownExpiredErrors of the TCP proxies: ctx ended
	// before their connections did, which is no failure of theirs.
	var expired *socket.ShutdownExpiredError
	for _, sp := range ports {
		for _, r := range sp.routes() {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var err error
				if r.tcp != nil {
					err = r.tcp.Shutdown(ctx)
				} else {
					err = r.udp.Close()
				}
				<-r.listener.Load().serving.done
				mu.Lock()
				defer mu.Unlock()
				if se, ok := err.(*socket.ShutdownExpiredError); ok {
					if expired == nil {
						expired = &socket.ShutdownExpiredError{Err: se.Err}
					}
					expired.Reset += se.Reset
					return
				}
				if err != nil && !errors.Is(err, net.ErrClosed) {
					errs = multierror.Append(errs, fmt.Errorf("%s: %w", sp.name, err))
				}
			}()
		}
	}
	wg.Wait()
	// Every proxy has drained: nothing runs on the loops any more.
	if err := p.loops.Close(); err != nil {
		errs = multierror.Append(errs, fmt.Errorf("event loops: %w", err))
	}
	if expired != nil {
		if errs == nil {
			return expired
		}
		errs = multierror.Append(errs, expired)
	}
	return errs.ErrorOrNil()
}

// Cleanup removes the portals.
func (p *Proxier) Cleanup() error { return p.cfg.Portals.Cleanup() }

// unserved are the protocols the userspace mode has no proxy socket for.
var unserved = []service.Unserved{{Protocol: service.SCTP,
	Reason: "the userspace mode has no SCTP proxy; the kernel modes serve SCTP (--proxy-mode iptables, nftables or ipvs)"}}

// Unserved returns the protocols the userspace mode cannot serve, for the
// Snapshots it is given (service.BuildOptions.Unserved): their Service ports
// are then reported, where Sync would skip them without a word.
func (p *Proxier) Unserved() []service.Unserved { return unserved }

// Intact reports whether the portals the last sync wrote are still in place.
func (p *Proxier) Intact() bool { return p.cfg.Portals.Intact() }

// EventLoops is how many event loops carry the Service ports' connections and
// flows (Config.EventLoops, or poll.DefaultLoops for 0): the program keeps a P
// (GOMAXPROCS) more than that.
func (p *Proxier) EventLoops() int { return len(p.loops.Loops()) }
