package app

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/localnodeports"
	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/proxier"
	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/rules"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/socket"
	"github.com/uproxy/uproxy/socket/handover"
	"github.com/uproxy/uproxy/syncloop"
)

// A uproxy that starts while another of the same --chain-prefix runs takes
// over from it (--take-over). The running one accepts on its rules lock
// (ruleslock.go); the successor dials it:
//
//	successor                          running uproxy
//	take over: what it is       ->
//	                            <-     refused: what differs (the successor exits 1)
//	                            <-     accepted: what it is
//	                            <-     its HTTP listeners, proxy sockets, NodePort sockets; end
//	(first sync: proxy sockets adopted and served, no rule written)
//	serving                     ->
//	                                   (stops syncing)
//	                            <-     the rules lock itself
//	(writes the rules: what they already are)
//	                                   (closes its copies of the proxy sockets)
//	                            <-     sessions: up to 64 established TCP connections
//	(resumes them)
//	ack: resumed, reset         ->
//	                                   (closes its copies of them; the next batch...)
//	                            <-     sessions end
//	                                   (drains the rest - connections still dialing,
//	                                    UDP clients - within --shutdown-grace, exits 0)
//
// Nothing is closed before "serving": a successor that dies before it leaves
// the running uproxy serving as if nothing had happened. Both processes accept
// on the shared sockets in between; whichever accepts a connection serves it.

// Message kinds: the first byte of an item's metadata.
const (
	msgTakeOver    byte = 1 + iota // successor: its identity
	msgRefused                     // the reason, one line
	msgAccepted                    // the running uproxy's identity
	msgHTTP                        // descriptor: an HTTP listener; its kind (metrics, healthz) and flag value
	msgProxy                       // descriptor: a proxy socket; its Service port, protocol, route, proxy port
	msgNodePort                    // descriptor: a NodePort held; network, address
	msgEnd                         // the sockets are all sent
	msgServing                     // successor: it serves on them
	msgLock                        // descriptor: the rules lock
	msgSessions                    // a route (Service port, class), then its connections' items (socket.SessionItems)
	msgSessionsAck                 // successor: connections resumed, reset
	msgSessionsEnd                 // no connection left to hand
	msgUDPClients                  // a route (as msgSessions), then its UDP clients' items (socket.UDPClientItems)
	msgMemory                      // what balancers learnt: JSON of []proxier.RouteMemory
	msgRelay                       // descriptor: a loopback NodePort of the nftables mode's relay; protocol, IPv6, NodePort
)

// sessionBatch is the most connections detached and sent at once: one batch
// is in flight at a time.
const sessionBatch = 64

// helloTimeout bounds each exchange before the successor's first sync.
const helloTimeout = 10 * time.Second

// lockTimeout bounds the successor's wait for the lock once it serves: the
// running uproxy finishes a sync in flight first.
const lockTimeout = 2 * time.Minute

// identity is what a uproxy is, as far as a takeover goes.
type identity struct {
	version, mode, prefix, backend string
	// portRange and bindAddress decide the proxy ports: a successor whose
	// differ adopts no proxy socket (it opens its own).
	portRange, bindAddress string
}

func (s *server) identity() identity {
	return identityOf(s.o, s.cfg, s.modeName)
}

func identityOf(o *options, cfg *config, mode string) identity {
	id := identity{version: version, mode: mode, portRange: cfg.specific.Userspace.PortRange.String()}
	if o != nil {
		id.prefix = o.chainPrefix
	}
	if mode == proxymode.Userspace {
		id.backend = string(cfg.specific.Userspace.Rules)
	}
	if b := cfg.specific.Userspace.BindAddress; b.IsValid() {
		id.bindAddress = b.String()
	}
	return id
}

// refuses names what of successor differs from id so that id cannot hand
// over to it, or "".
func (id identity) refuses(successor identity) string {
	var diffs []string
	if id.mode != successor.mode {
		diffs = append(diffs, fmt.Sprintf("its --proxy-mode is %s, the running uproxy's %s", successor.mode, id.mode))
	}
	if id.prefix != successor.prefix {
		diffs = append(diffs, fmt.Sprintf("its --chain-prefix is %s, the running uproxy's %s", successor.prefix, id.prefix))
	}
	if id.backend != successor.backend {
		diffs = append(diffs, fmt.Sprintf("its --rules is %s, the running uproxy's %s", successor.backend, id.backend))
	}
	return strings.Join(diffs, "; ")
}

func (id identity) encode(kind byte) []byte {
	b := []byte{kind}
	for _, s := range []string{id.version, id.mode, id.prefix, id.backend, id.portRange, id.bindAddress} {
		b = appendString(b, s)
	}
	return b
}

func decodeIdentity(meta []byte) (identity, error) {
	d := decoder{b: meta[1:]}
	id := identity{version: d.str(), mode: d.str(), prefix: d.str(), backend: d.str(), portRange: d.str(), bindAddress: d.str()}
	return id, d.err
}

func appendString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

// decoder reads what appendString and binary.AppendUvarint wrote; its first
// error sticks.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) uint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.err = errors.New("takeover: a message ends early")
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *decoder) str() string {
	n := d.uint()
	if d.err != nil {
		return ""
	}
	if uint64(len(d.b)) < n {
		d.err = errors.New("takeover: a message ends early")
		return ""
	}
	s := string(d.b[:n])
	d.b = d.b[n:]
	return s
}

// kindOf is an item's message kind (0 for none).
func kindOf(it handover.Item) byte {
	if len(it.Meta) == 0 {
		return 0
	}
	return it.Meta[0]
}

func closeItems(items []handover.Item) {
	for _, it := range items {
		if it.FD >= 0 {
			syscall.Close(it.FD)
		}
	}
}

// --- the successor's side ---

// predecessor is the running uproxy a starting one takes over from.
type predecessor struct {
	c     *handover.Conn
	pid   int32
	start time.Time
	id    identity // its identity, once it accepted
	// inUse are the errors of the HTTP addresses this process found in use
	// (by kind), to be taken from the predecessor instead.
	inUse map[string]error
	// http are the HTTP listeners handed, by kind, with their flag values.
	http     map[string]net.Listener
	httpAddr map[string]string
	proxy    []proxier.HandedSocket
	// relay are the loopback NodePort sockets of the nftables mode's relay.
	relay []localnodeports.HandedSocket
	// memory is what the predecessor's balancers had learnt when it handed
	// its sockets (recalled at the first sync).
	memory []proxier.RouteMemory
	// udpResumed counts the UDP client entries resumed (receiveSessions),
	// recalled the balancer memories taken after them.
	udpResumed, recalled int
	// nodePorts counts the NodePort sockets handed (to s.nodePorts).
	nodePorts int
}

// dialPredecessor connects to the uproxy holding the rules lock of prefix, if
// one does and is root; nil otherwise (lockRules then says why the lock is not
// to be had, as before).
func dialPredecessor(prefix string) *predecessor {
	uc, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: lockName(prefix), Net: "unix"})
	if err != nil {
		return nil // nobody holds the lock
	}
	uc.SetDeadline(time.Now().Add(helloTimeout))
	c, err := handover.NewConn(uc)
	if err != nil {
		klog.V(1).InfoS("The rules lock's holder is no uproxy to take over from", "err", err)
		return nil
	}
	return &predecessor{c: c, pid: c.Peer().Pid, start: time.Now(), inUse: map[string]error{}}
}

// close lets go of the predecessor and of whatever it handed that was not
// taken; the predecessor carries on serving.
func (p *predecessor) close() {
	if p == nil {
		return
	}
	p.c.Close()
	for _, ln := range p.http {
		ln.Close()
	}
	p.http = nil
	proxier.CloseHanded(p.proxy)
	p.proxy = nil
	localnodeports.CloseHanded(p.relay)
	p.relay = nil
}

// takeOver asks the predecessor to hand over to id and receives its sockets:
// the NodePort ones go to nodePorts. A refusal comes back as an error of one
// line, naming what differs.
func (p *predecessor) takeOver(id identity, nodePorts *nodePortSockets) error {
	p.c.UnixConn().SetDeadline(time.Now().Add(helloTimeout))
	if err := p.c.Send([]handover.Item{{FD: -1, Meta: id.encode(msgTakeOver)}}); err != nil {
		return fmt.Errorf("take over from uproxy process %d: %w", p.pid, err)
	}
	items, err := p.c.Receive()
	if err != nil {
		return fmt.Errorf("take over from uproxy process %d: %w", p.pid, err)
	}
	switch kindOf(items[0]) {
	case msgRefused:
		closeItems(items)
		observe.HandoverRefused("to", "another_uproxy")
		return fmt.Errorf("another uproxy (process %d) programs this node's rules with --chain-prefix %s, and refused to hand over to this one: %s",
			p.pid, id.prefix, items[0].Meta[1:])
	case msgAccepted:
	default:
		closeItems(items)
		return fmt.Errorf("take over from uproxy process %d: an unexpected answer (kind %d)", p.pid, kindOf(items[0]))
	}
	if p.id, err = decodeIdentity(items[0].Meta); err != nil {
		closeItems(items)
		return err
	}
	p.http, p.httpAddr = map[string]net.Listener{}, map[string]string{}
	for done := false; !done; {
		for i, it := range items[1:] {
			if err := p.receive(it, nodePorts); err != nil {
				closeItems(items[i+2:])
				return fmt.Errorf("take over from uproxy process %d: %w", p.pid, err)
			}
			done = done || kindOf(it) == msgEnd
		}
		if done {
			break
		}
		if items, err = p.c.Receive(); err != nil {
			return fmt.Errorf("take over from uproxy process %d: %w", p.pid, err)
		}
		items = append([]handover.Item{{FD: -1}}, items...) // items[1:] are the batch's
	}
	p.c.UnixConn().SetDeadline(time.Time{})
	return nil
}

// receive takes one handed item.
func (p *predecessor) receive(it handover.Item, nodePorts *nodePortSockets) error {
	kind := kindOf(it)
	if (kind == msgHTTP || kind == msgProxy || kind == msgNodePort || kind == msgRelay) != (it.FD >= 0) {
		if it.FD >= 0 {
			syscall.Close(it.FD)
		}
		return fmt.Errorf("a message of kind %d with a descriptor: %v", kind, it.FD >= 0)
	}
	d := decoder{b: it.Meta[min(1, len(it.Meta)):]}
	switch kind {
	case msgEnd:
	case msgHTTP:
		what, addr := d.str(), d.str()
		f := os.NewFile(uintptr(it.FD), what)
		ln, err := net.FileListener(f)
		f.Close()
		if err == nil && d.err == nil {
			p.http[what], p.httpAddr[what] = ln, addr
		}
	case msgProxy:
		h := decodeProxySocket(&d, it.FD)
		if d.err != nil {
			syscall.Close(it.FD)
			break
		}
		p.proxy = append(p.proxy, h)
	case msgRelay:
		h := localnodeports.HandedSocket{Protocol: service.Protocol(d.str()), IPv6: d.uint() == 1, NodePort: int(d.uint()), FD: it.FD}
		if d.err != nil {
			syscall.Close(it.FD)
			break
		}
		p.relay = append(p.relay, h)
	case msgMemory:
		var ms []proxier.RouteMemory
		if err := json.Unmarshal(it.Meta[1:], &ms); err != nil {
			return fmt.Errorf("what the balancers learnt: %w", err)
		}
		p.memory = append(p.memory, ms...)
	case msgNodePort:
		network, address := d.str(), d.str()
		if d.err != nil {
			syscall.Close(it.FD)
			break
		}
		nodePorts.hand(network, address, it.FD)
		p.nodePorts++
	default:
		return fmt.Errorf("an unexpected message (kind %d)", kind)
	}
	return d.err
}

// listener returns the HTTP listener of kind (metrics, healthz) for flag
// value addr: the predecessor's, when this process found addr in use and the
// predecessor served the same; the bind error otherwise.
func (p *predecessor) listener(kind, addr string) (net.Listener, error) {
	err := p.inUse[kind]
	if err == nil {
		return nil, nil
	}
	ln := p.http[kind]
	if ln == nil || p.httpAddr[kind] != addr {
		return nil, err
	}
	delete(p.http, kind)
	return ln, nil
}

// bindHTTPBeside binds the HTTP addresses as bindHTTP does; an address in use
// while a predecessor runs is left to be taken from it (pred.listener).
func bindHTTPBeside(cfg *config, pred *predecessor) (metrics, healthz net.Listener, err error) {
	if pred == nil {
		return bindHTTP(cfg)
	}
	bind := func(kind, flag, addr string) (net.Listener, error) {
		if addr == "" {
			return nil, nil
		}
		ln, err := net.Listen("tcp", addr)
		if err == nil {
			return ln, nil
		}
		err = fmt.Errorf("%s %s: %w", flag, addr, err)
		if errors.Is(err, syscall.EADDRINUSE) {
			pred.inUse[kind] = err
			return nil, nil
		}
		return nil, err
	}
	if metrics, err = bind("metrics", "--metrics-bind-address", cfg.metricsAddr); err != nil {
		return nil, nil, err
	}
	if healthz, err = bind("healthz", "--healthz-bind-address", cfg.healthzAddr); err != nil {
		if metrics != nil {
			metrics.Close()
		}
		return nil, nil, err
	}
	return metrics, healthz, nil
}

// mayTouchRules reports whether the flags may ask for a mode that writes the
// node's rules, and so holds the rules lock a predecessor is found by: all but
// the userspace mode with --rules none, which runs beside any uproxy.
func mayTouchRules(o *options, cfg *config) bool {
	return o.proxyMode != proxymode.Userspace || cfg.specific.Userspace.Rules != rules.BackendNone
}

// takeListeners gives srv the HTTP listeners this process found in use and
// pred handed (binding them anew when pred is nil: a predecessor that went
// away before it was asked), and the mode the proxy sockets pred handed.
func takeListeners(pred *predecessor, srv *observe.Server, cfg *config, mode any) (taken int, err error) {
	for _, h := range []struct {
		kind, flag, addr string
		ln               *net.Listener
	}{{"metrics", "--metrics-bind-address", cfg.metricsAddr, &srv.MetricsListener}, {"healthz", "--healthz-bind-address", cfg.healthzAddr, &srv.HealthzListener}} {
		if *h.ln != nil || h.addr == "" {
			continue
		}
		if pred == nil {
			if *h.ln, err = net.Listen("tcp", h.addr); err != nil {
				return taken, fmt.Errorf("%s %s: %w", h.flag, h.addr, err)
			}
			continue
		}
		if *h.ln, err = pred.listener(h.kind, h.addr); err != nil {
			return taken, err
		}
		taken++
	}
	if pred == nil {
		return taken, nil
	}
	observe.HandoverSockets.WithLabelValues("to", "http").Add(float64(taken))
	a, ok := mode.(interface{ Adopt([]proxier.HandedSocket) })
	switch own := identityOf(nil, cfg, ""); {
	case !ok:
	case pred.id.portRange != own.portRange || pred.id.bindAddress != own.bindAddress:
		klog.InfoS("Opening proxy ports of its own: the uproxy taken over from has another --proxy-port-range or --bind-address",
			"predecessor", pred.pid, "proxyPortRange", pred.id.portRange, "bindAddress", pred.id.bindAddress)
	default:
		a.Adopt(pred.proxy)
		pred.proxy = nil
	}
	if r, ok := mode.(interface{ RecallAtSync([]proxier.RouteMemory) }); ok && len(pred.memory) > 0 {
		r.RecallAtSync(pred.memory)
	}
	if r, ok := mode.(interface {
		AdoptRelay([]localnodeports.HandedSocket)
	}); ok && len(pred.relay) > 0 {
		r.AdoptRelay(pred.relay)
		pred.relay = nil
	}
	return taken, nil
}

// completeTakeOver finishes a takeover once the first sync has run (proxy
// sockets adopted, no rule written): it says "serving", takes the rules lock,
// lets the mode write its rules, and from then on accepts successors itself.
func (s *server) completeTakeOver(ctx context.Context, p *predecessor, synced <-chan struct{}, runner *syncloop.Runner, successors chan<- *successor) error {
	defer p.close()
	select {
	case <-synced:
	case <-ctx.Done():
		return nil
	}
	adopted, unadopted := 0, 0
	if m, ok := s.mode.(interface{ EndAdoption() (int, int) }); ok {
		adopted, unadopted = m.EndAdoption()
	}
	if m, ok := s.mode.(interface{ EndRecall() }); ok {
		m.EndRecall()
	}
	p.c.UnixConn().SetDeadline(time.Now().Add(lockTimeout))
	err := p.c.Send([]handover.Item{{FD: -1, Meta: []byte{msgServing}}})
	var lock *rulesLock
	if err == nil {
		lock, err = p.receiveLock()
	}
	if err != nil {
		// The predecessor died after it was told: its lock is free.
		klog.ErrorS(err, "The rules lock did not come from the uproxy taken over; taking it", "predecessor", p.pid)
		if lock, err = lockRules(s.o.chainPrefix); err != nil {
			observe.HandoverTotal.WithLabelValues("to", "abandoned").Inc()
			s.events.AddHandover(observe.HandoverAbandonedOutcome, fmt.Sprintf("from process %d: the rules lock neither came nor was free: %v", p.pid, err), time.Since(p.start))
			return fmt.Errorf("take over from uproxy process %d: %w", p.pid, err)
		}
	} else {
		observe.HandoverSockets.WithLabelValues("to", "lock").Inc()
	}
	s.setLock(lock)
	s.gate.release()
	runner.Resync()
	go s.serveSuccessors(ctx, lock, successors)
	var resumed, reset int
	if err == nil {
		resumed, reset = p.receiveSessions(s.mode)
	}
	// The NodePorts are held by the portals' writes, which began now.
	select {
	case <-synced:
	case <-ctx.Done():
	}
	heldNodePorts := p.nodePorts - s.nodePorts.endAdoption()
	took := time.Since(p.start)
	observe.HandoverDone("to", took)
	s.events.AddHandover(observe.HandoverDoneOutcome, fmt.Sprintf("took over from process %d (version %s): %d HTTP listeners, %d proxy sockets (%d closed), %d NodePorts, %d connections resumed, %d reset",
		p.pid, p.id.version, s.takenHTTP, adopted, unadopted, heldNodePorts, resumed, reset), took)
	observe.HandoverSockets.WithLabelValues("to", "proxy").Add(float64(adopted))
	observe.HandoverSockets.WithLabelValues("to", "nodeport").Add(float64(heldNodePorts))
	klog.InfoS("Took over from the uproxy that ran: its listeners serve here, no port changed",
		"predecessor", p.pid, "predecessorVersion", p.id.version, "httpListeners", s.takenHTTP,
		"proxySockets", adopted, "proxySocketsClosed", unadopted, "nodePorts", heldNodePorts, "balancerMemories", len(p.memory), "took", took.Round(time.Millisecond))
	return nil
}

// sessionResumer is the mode that resumes handed connections (the userspace
// mode).
type sessionResumer interface {
	ResumeSessions(proxier.RouteKey, []socket.SessionState) (int, error)
	ResumeUDPClients(proxier.RouteKey, []socket.UDPClientState) (int, error)
}

// resumeUDPClients resumes one batch of UDP client entries (msgUDPClients);
// none is acknowledged: the predecessor reads its UDP sockets no more, and
// closes its copies once sent.
func (p *predecessor) resumeUDPClients(rs sessionResumer, items []handover.Item) (resumed, dropped int) {
	key, err := decodeRouteKey(items[0].Meta)
	if err != nil || items[0].FD >= 0 {
		closeItems(items)
		klog.ErrorS(err, "A batch of UDP clients handed over with a malformed route; dropped", "clients", len(items)-1)
		return 0, len(items) - 1
	}
	states, err := socket.UDPClientStates(items[1:]) // closes them on error
	if err != nil {
		klog.ErrorS(err, "UDP clients handed over could not be read; dropped", "service", key.Service, "clients", len(items)-1)
		return 0, len(items) - 1
	}
	if rs == nil {
		for i := range states {
			states[i].Close()
		}
		return 0, len(states)
	}
	dropped, err = rs.ResumeUDPClients(key, states)
	if err != nil {
		klog.ErrorS(err, "UDP clients handed over were dropped: their next datagrams make new entries", "service", key.Service, "clients", dropped)
	}
	return len(states) - dropped, dropped
}

// receiveSessions resumes the established connections the predecessor hands
// after the lock, batch by batch, acknowledging each once its connections
// are registered here (or reset: their route is gone, or they could not be
// resumed), until the predecessor says there are no more. Should the
// predecessor go away first, what it did not hand it still holds and serves.
func (p *predecessor) receiveSessions(mode any) (resumed, reset int) {
	start := time.Now()
	rs, _ := mode.(sessionResumer)
	var inFlight int
	var err error
	defer func() {
		observe.HandoverConnections.WithLabelValues("to", "resumed").Add(float64(resumed))
		observe.HandoverConnections.WithLabelValues("to", "reset").Add(float64(reset))
		observe.HandoverBytesInFlight.WithLabelValues("to").Add(float64(inFlight))
		if err != nil {
			klog.ErrorS(err, "Receiving the established connections of the uproxy taken over failed; it serves the rest itself",
				"predecessor", p.pid, "resumed", resumed, "reset", reset)
			return
		}
		klog.InfoS("Resumed the established connections of the uproxy taken over", "predecessor", p.pid,
			"resumed", resumed, "reset", reset, "udpClients", p.udpResumed, "balancerMemories", p.recalled, "bytesInFlight", inFlight, "took", time.Since(start).Round(time.Millisecond))
	}()
	for {
		p.c.UnixConn().SetDeadline(time.Now().Add(helloTimeout))
		var items []handover.Item
		if items, err = p.c.Receive(); err != nil {
			return
		}
		switch kindOf(items[0]) {
		case msgSessionsEnd:
			closeItems(items)
			return resumed, reset
		case msgMemory:
			var ms []proxier.RouteMemory
			if derr := json.Unmarshal(items[0].Meta[1:], &ms); derr != nil {
				klog.ErrorS(derr, "What the balancers of the uproxy taken over learnt could not be read; left out")
			} else if r, ok := rs.(interface {
				Recall([]proxier.RouteMemory) int
			}); ok {
				p.recalled += r.Recall(ms)
			}
			closeItems(items)
			continue
		case msgUDPClients:
			udpResumed, udpDropped := p.resumeUDPClients(rs, items)
			observe.HandoverConnections.WithLabelValues("to", "udp_resumed").Add(float64(udpResumed))
			observe.HandoverConnections.WithLabelValues("to", "udp_dropped").Add(float64(udpDropped))
			p.udpResumed += udpResumed
			continue
		case msgSessions:
		default:
			closeItems(items)
			err = fmt.Errorf("an unexpected message (kind %d) instead of connections", kindOf(items[0]))
			return
		}
		key, derr := decodeRouteKey(items[0].Meta)
		var states []socket.SessionState
		if derr == nil && items[0].FD < 0 {
			states, derr = socket.SessionStates(items[1:]) // closes them on error
		} else if derr == nil {
			closeItems(items)
			derr = errors.New("a route with a descriptor")
		}
		if derr != nil {
			// The predecessor keeps these: no ack, and it resumes them.
			err = fmt.Errorf("decode handed connections: %w", derr)
			return
		}
		// The acknowledgement comes first: from it on these connections
		// are this process's, and until it the predecessor's. One that
		// cannot be sent leaves them there (the predecessor resumes them
		// when the connection fails): this process closes its copies and
		// serves none of them, so no connection is ever served twice.
		n := len(states)
		ack := binary.AppendUvarint([]byte{msgSessionsAck}, uint64(n))
		if err = p.c.Send([]handover.Item{{FD: -1, Meta: ack}}); err != nil {
			for i := range states {
				states[i].Close()
			}
			return
		}
		for i := range states {
			inFlight += states[i].InFlight()
		}
		r := n
		if rs != nil {
			r, derr = rs.ResumeSessions(key, states)
		} else {
			for i := range states {
				states[i].Reset()
			}
		}
		if derr != nil {
			klog.ErrorS(derr, "Connections handed over were reset", "service", key.Service, "external", key.External, "connections", r)
		}
		resumed, reset = resumed+n-r, reset+r
	}
}

func encodeRouteKey(k proxier.RouteKey) []byte { return encodeRouteKeyAs(msgSessions, k) }

// encodeRouteKeyAs is a route's metadata in a message of kind.
func encodeRouteKeyAs(kind byte, k proxier.RouteKey) []byte {
	meta := []byte{kind}
	for _, str := range []string{k.Service.Namespace, k.Service.Name, k.Service.Port} {
		meta = appendString(meta, str)
	}
	ext := uint64(0)
	if k.External {
		ext = 1
	}
	return binary.AppendUvarint(meta, ext)
}

func decodeRouteKey(meta []byte) (proxier.RouteKey, error) {
	d := decoder{b: meta[1:]}
	k := proxier.RouteKey{Service: service.PortName{Namespace: d.str(), Name: d.str(), Port: d.str()}}
	k.External = d.uint() == 1
	return k, d.err
}

func (p *predecessor) receiveLock() (*rulesLock, error) {
	items, err := p.c.Receive()
	if err != nil {
		return nil, err
	}
	if len(items) != 1 || kindOf(items[0]) != msgLock || items[0].FD < 0 {
		closeItems(items)
		return nil, errors.New("an unexpected message instead of the rules lock")
	}
	f := os.NewFile(uintptr(items[0].FD), "rules lock")
	defer f.Close()
	ln, err := handover.FileListener(f)
	if err != nil {
		return nil, err
	}
	return &rulesLock{ln: ln}, nil
}

// --- the running uproxy's side ---

// successor is a uproxy that took over and serves: Run hands it the lock
// once this process has stopped syncing.
type successor struct {
	c       *handover.Conn
	pid     int32
	start   time.Time
	sockets int // handed before the lock
	// handed ends the handover in progress (beginHanding), once Run can
	// take the successor.
	handed func()
}

// serveSuccessors accepts successors on the rules lock until it is closed or
// handed, handing over to the first that asks and serves; successors gets it.
func (s *server) serveSuccessors(ctx context.Context, lock *rulesLock, successors chan<- *successor) {
	for {
		c, err := lock.ln.Accept()
		switch {
		case errors.Is(err, net.ErrClosed):
			return
		case errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE):
			// A look at the lock's holder (rules.SocketHolder), not a successor.
			continue
		case errors.Is(err, handover.ErrPeerNotRoot):
			klog.InfoS("Refused to hand over to a process that is not root", "err", err)
			s.handoverRefused("not_root", err.Error())
			continue
		case err != nil:
			var ve *handover.VersionError
			if errors.As(err, &ve) {
				klog.InfoS("Refused to hand over to a uproxy of another handover protocol version", "err", err)
				s.handoverRefused("protocol_version", err.Error())
				continue
			}
			klog.ErrorS(err, "Accepting on the rules lock")
			select {
			case <-ctx.Done():
				return
			case <-time.After(100 * time.Millisecond):
			}
			continue
		}
		if succ := s.handOver(ctx, c); succ != nil {
			successors <- succ
			succ.handed()
			return
		}
	}
}

// handOver serves one connection to the lock: a successor of the same mode,
// prefix and backend gets the listening sockets; once it says it serves, the
// successor is returned, and the rest is Run's. nil: nothing was taken and
// this process carries on.
func (s *server) handOver(ctx context.Context, c *handover.Conn) *successor {
	pid := c.Peer().Pid
	start := time.Now()
	c.UnixConn().SetDeadline(start.Add(helloTimeout))
	items, err := c.Receive()
	if err != nil || len(items) == 0 || kindOf(items[0]) != msgTakeOver {
		closeItems(items)
		if err == nil {
			c.Send([]handover.Item{{FD: -1, Meta: append([]byte{msgRefused}, "the first message was no take-over request"...)}})
			klog.InfoS("Refused a connection to the rules lock: its first message was no take-over request", "peer", pid)
			s.handoverRefused("not_a_request", fmt.Sprintf("process %d: its first message was no take-over request", pid))
		}
		c.Close()
		return nil
	}
	succ, err := decodeIdentity(items[0].Meta)
	closeItems(items)
	own := s.identity()
	if err != nil {
		c.Close()
		klog.InfoS("Refused a connection to the rules lock: a malformed take-over request", "peer", pid, "err", err)
		s.handoverRefused("not_a_request", fmt.Sprintf("process %d: a malformed take-over request: %v", pid, err))
		return nil
	}
	if diff := own.refuses(succ); diff != "" {
		c.Send([]handover.Item{{FD: -1, Meta: append([]byte{msgRefused}, diff...)}})
		c.Close()
		klog.InfoS("Refused a successor: it is another uproxy; serving on", "successor", pid, "differs", diff)
		s.handoverRefused("another_uproxy", fmt.Sprintf("process %d: %s", pid, diff))
		return nil
	}
	items, closers, err := s.handedItems()
	defer func() {
		for _, f := range closers {
			f()
		}
	}()
	if err != nil {
		c.Send([]handover.Item{{FD: -1, Meta: append([]byte{msgRefused}, err.Error()...)}})
		c.Close()
		klog.ErrorS(err, "Could not hand over; serving on", "successor", pid)
		s.handoverRefused("cannot_hand", fmt.Sprintf("process %d: %v", pid, err))
		return nil
	}
	items = append([]handover.Item{{FD: -1, Meta: own.encode(msgAccepted)}}, items...)
	sent := len(items) - 1
	err = sendBatches(c, items)
	if err == nil {
		var n int
		n, err = s.sendProxySockets(c)
		sent += n
	}
	if err == nil {
		err = s.sendMemory(c)
	}
	if err == nil {
		err = c.Send([]handover.Item{{FD: -1, Meta: []byte{msgEnd}}})
	}
	if err != nil {
		c.Close()
		klog.ErrorS(err, "Handing sockets to a successor failed; serving on", "successor", pid)
		s.handoverAbandoned(fmt.Sprintf("handing the sockets to process %d: %v", pid, err), time.Since(start))
		return nil
	}
	klog.InfoS("Handed the listening sockets to a successor; serving on until it serves", "successor", pid, "version", succ.version, "sockets", sent)
	// The handover ends once the successor is Run's (serveSuccessors), or
	// here when it went away.
	done := s.beginHanding()
	served := false
	defer func() {
		if !served {
			done()
		}
	}()
	// No deadline: the successor's first sync takes what it takes. This
	// process goes on serving meanwhile. A SIGTERM (a DaemonSet deletes the
	// old pod once the new one runs, maybe before it serves) gives the
	// successor sigtermHandoverWait more to serve, and Run waits for it, so
	// that its connections go to the successor rather than to the grace.
	c.UnixConn().SetDeadline(time.Time{})
	stop := context.AfterFunc(ctx, func() { c.UnixConn().SetDeadline(time.Now().Add(sigtermHandoverWait)) })
	defer stop()
	got, err := c.Receive()
	if err != nil || len(got) != 1 || kindOf(got[0]) != msgServing {
		closeItems(got)
		c.Close()
		if ctx.Err() == nil {
			klog.InfoS("The successor went away before it served; serving on as before", "successor", pid, "err", err)
		} else {
			klog.InfoS("The successor did not serve before the end of this process; draining as without one", "successor", pid, "err", err)
		}
		s.handoverAbandoned(fmt.Sprintf("process %d went away before it served: %v", pid, err), time.Since(start))
		return nil
	}
	served = true
	return &successor{c: c, pid: pid, start: start, sockets: sent, handed: done}
}

// sigtermHandoverWait is how long a SIGTERM leaves a successor that has the
// sockets to say it serves (its first sync; about 1.5 s at 10,000 Service
// ports).
const sigtermHandoverWait = 30 * time.Second

// handoverRefused counts a successor refused for reason (a label of
// uproxy_handover_refusals_total) and records it in /debug/events.
func (s *server) handoverRefused(reason, what string) {
	observe.HandoverRefused("from", reason)
	s.events.AddHandover(observe.HandoverRefusedOutcome, reason+": "+what, 0)
}

// handoverAbandoned counts a handover whose successor went away, after d.
func (s *server) handoverAbandoned(what string, d time.Duration) {
	observe.HandoverTotal.WithLabelValues("from", "abandoned").Inc()
	s.events.AddHandover(observe.HandoverAbandonedOutcome, what, d)
}

// beginHanding marks a handover in progress until the returned func is called.
func (s *server) beginHanding() func() {
	ch := make(chan struct{})
	s.handingMu.Lock()
	s.handing = ch
	s.handingMu.Unlock()
	return func() {
		s.handingMu.Lock()
		s.handing = nil
		s.handingMu.Unlock()
		close(ch)
	}
}

// awaitHandover is Run's answer to a SIGTERM: with a handover in progress
// it waits for its successor to serve and returns it (nil: it went away),
// so the connections go on in the successor; with none it returns nil at
// once.
func (s *server) awaitHandover(successors <-chan *successor) *successor {
	s.handingMu.Lock()
	ch := s.handing
	s.handingMu.Unlock()
	select {
	case succ := <-successors:
		return succ
	default:
	}
	if ch == nil {
		return nil
	}
	klog.InfoS("Terminating during a handover: waiting for the successor to serve first", "wait", sigtermHandoverWait)
	select {
	case succ := <-successors:
		return succ
	case <-ch:
		select {
		case succ := <-successors:
			return succ
		default:
			return nil
		}
	}
}

// handedItems are the sockets a successor takes first: the HTTP listeners
// and the NodePort sockets, each a duplicate that closers close once sent.
// The proxy sockets follow (sendProxySockets).
func (s *server) handedItems() (items []handover.Item, closers []func(), err error) {
	fail := func(e error) ([]handover.Item, []func(), error) {
		for _, f := range closers {
			f()
		}
		return nil, nil, e
	}
	for _, h := range []struct {
		kind, addr string
		ln         net.Listener
	}{{"metrics", s.cfg.metricsAddr, s.http.MetricsListener}, {"healthz", s.cfg.healthzAddr, s.http.HealthzListener}} {
		tl, ok := h.ln.(*net.TCPListener)
		if !ok {
			continue
		}
		f, err := tl.File()
		if err != nil {
			return fail(fmt.Errorf("duplicate the %s listener: %w", h.kind, err))
		}
		closers = append(closers, func() { f.Close() })
		items = append(items, handover.Item{FD: int(f.Fd()), Meta: appendString(appendString([]byte{msgHTTP}, h.kind), h.addr)})
	}
	if m, ok := s.mode.(interface {
		HandOverRelay() ([]localnodeports.HandedSocket, error)
	}); ok {
		socks, err := m.HandOverRelay()
		if err != nil {
			return fail(err)
		}
		closers = append(closers, func() { localnodeports.CloseHanded(socks) })
		for _, h := range socks {
			v6 := uint64(0)
			if h.IPv6 {
				v6 = 1
			}
			meta := appendString([]byte{msgRelay}, string(h.Protocol))
			meta = binary.AppendUvarint(binary.AppendUvarint(meta, v6), uint64(h.NodePort))
			items = append(items, handover.Item{FD: h.FD, Meta: meta})
		}
	}
	held, err := s.nodePorts.dup()
	if err != nil {
		return fail(err)
	}
	for _, h := range held {
		closers = append(closers, func() { syscall.Close(h.fd) })
		items = append(items, handover.Item{FD: h.fd, Meta: appendString(appendString([]byte{msgNodePort}, h.network), h.address)})
	}
	return items, closers, nil
}

// sendProxySockets sends the mode's proxy sockets, a batch of at most
// handover.MaxFDs at a time, each batch's duplicates closed once sent: the
// process never holds a second descriptor for every proxy socket at once.
func (s *server) sendProxySockets(c *handover.Conn) (sent int, err error) {
	m, ok := s.mode.(interface {
		HandOverEach(func([]proxier.HandedSocket) error) error
	})
	if !ok {
		return 0, nil
	}
	var pending []proxier.HandedSocket
	flush := func() error {
		items := make([]handover.Item, len(pending))
		for i, h := range pending {
			items[i] = handover.Item{FD: h.FD, Meta: encodeProxySocket(msgProxy, h)}
		}
		err := c.Send(items)
		proxier.CloseHanded(pending)
		if err == nil {
			sent += len(pending)
		}
		pending = pending[:0]
		return err
	}
	err = m.HandOverEach(func(socks []proxier.HandedSocket) error {
		if len(pending)+len(socks) > handover.MaxFDs {
			if err := flush(); err != nil {
				proxier.CloseHanded(socks)
				return err
			}
		}
		pending = append(pending, socks...)
		return nil
	})
	if err == nil && len(pending) > 0 {
		err = flush()
	}
	proxier.CloseHanded(pending)
	if err != nil {
		return sent, fmt.Errorf("hand the proxy sockets: %w", err)
	}
	return sent, nil
}

// memoryChunk bounds the metadata of one msgMemory item (handover.MaxMeta
// bounds a batch).
const memoryChunk = 1 << 20

// sendMemory sends c what the mode's balancers have learnt (affinity
// entries, outlier state, rotations), in items of at most memoryChunk bytes
// or one route's memory, each its own batch.
func (s *server) sendMemory(c *handover.Conn) error {
	m, ok := s.mode.(interface{ Remember() []proxier.RouteMemory })
	if !ok {
		return nil
	}
	var chunk []json.RawMessage
	size := 0
	flush := func() error {
		if len(chunk) == 0 {
			return nil
		}
		b, err := json.Marshal(chunk)
		if err != nil {
			return err
		}
		chunk, size = chunk[:0], 0
		return c.Send([]handover.Item{{FD: -1, Meta: append([]byte{msgMemory}, b...)}})
	}
	for _, rm := range m.Remember() {
		b, err := json.Marshal(rm)
		if err != nil {
			return err
		}
		if size+len(b) > memoryChunk {
			if err := flush(); err != nil {
				return err
			}
		}
		chunk, size = append(chunk, b), size+len(b)
	}
	return flush()
}

// sendBatches sends items in batches of at most handover.MaxFDs descriptors.
func sendBatches(c *handover.Conn, items []handover.Item) error {
	for len(items) > 0 {
		n, fds := 0, 0
		for n < len(items) && (items[n].FD < 0 || fds < handover.MaxFDs) {
			if items[n].FD >= 0 {
				fds++
			}
			n++
		}
		if err := c.Send(items[:n]); err != nil {
			return err
		}
		items = items[n:]
	}
	return nil
}

// encodeProxySocket is the metadata of a proxy socket's item of kind:
// its Service port, protocol, route and proxy port.
func encodeProxySocket(kind byte, h proxier.HandedSocket) []byte {
	meta := []byte{kind}
	for _, str := range []string{h.Service.Namespace, h.Service.Name, h.Service.Port, string(h.Protocol)} {
		meta = appendString(meta, str)
	}
	ext := uint64(0)
	if h.External {
		ext = 1
	}
	meta = binary.AppendUvarint(meta, ext)
	return binary.AppendUvarint(meta, uint64(h.ProxyPort))
}

// decodeProxySocket reads encodeProxySocket's metadata (after its kind);
// d.err says whether it could.
func decodeProxySocket(d *decoder, fd int) proxier.HandedSocket {
	return proxier.HandedSocket{
		Service:  service.PortName{Namespace: d.str(), Name: d.str(), Port: d.str()},
		Protocol: service.Protocol(d.str()), External: d.uint() == 1, ProxyPort: int(d.uint()), FD: fd}
}

// handOff ends this process's part once succ serves: the sync loop has
// stopped (syncDone), so the successor alone writes the rules from the
// moment it has the lock. It reports whether the successor got the lock
// (and the connection to it stays open for handSessions).
func (s *server) handOff(succ *successor) bool {
	lock := s.takeLock()
	var err error
	if r, ok := s.portals.(interface{ ReleaseReplyRoute() }); ok && lock != nil {
		// The successor says it uses the reply route at its first write,
		// which comes once it has the lock.
		r.ReleaseReplyRoute()
	}
	if lock != nil {
		var f *os.File
		if f, err = lock.ln.File(); err == nil {
			err = succ.c.Send([]handover.Item{{FD: int(f.Fd()), Meta: []byte{msgLock}}})
			f.Close()
		}
		lock.Close()
	}
	if err != nil {
		succ.c.Close()
		// The successor has gone after it served: the lock, closed here, is
		// free for it to take.
		klog.ErrorS(err, "Handing the rules lock to the successor failed; it is released", "successor", succ.pid)
	}
	observe.HandoverSockets.WithLabelValues("from", "lock").Inc()
	return err == nil
}

// sessionHander is the mode whose established connections go to a successor
// (the userspace mode).
type sessionHander interface {
	sessionResumer
	StopAccepting() error
	DetachSessions(max int) ([]proxier.RouteSessions, error)
	DetachUDPClients() ([]proxier.RouteUDPClients, error)
}

// handSessions hands succ this process's established TCP connections, once
// the lock is the successor's (handOff). It comes after the lock, not right
// after "serving", so that no sync of this process changes its routes while
// they are detached, and the successor's first sync has opened the routes
// they go to. Exactly one process serves each connection at any time: this
// one stops accepting first (the successor accepts on its own copies of the
// proxy sockets), then takes each batch off its event loops (Detach: from
// then on no one reads or writes the connection, its bytes wait in the
// kernel and in the state), the successor acknowledges the batch and only
// then registers it on its own loops (Resume), and this process closes its
// copies of the batch's descriptors on the acknowledgement, which sends
// nothing to either peer. A batch not acknowledged (the successor went away
// or refused it) is resumed here, as is every one after it, and drained with
// the rest (sendSessions says why that never serves one twice). Connections still dialing, and UDP
// clients, stay and are drained. The connection to succ is closed on return.
func (s *server) handSessions(succ *successor) (handed, kept int) {
	defer succ.c.Close()
	start := time.Now()
	m, ok := s.mode.(sessionHander)
	var inFlight, udpHanded int
	// longest is the longest a batch was away from every loop: from its
	// detach here to the successor's acknowledgement (its resume there
	// follows at once).
	var longest time.Duration
	var err error
	defer func() {
		observe.HandoverConnections.WithLabelValues("from", "handed").Add(float64(handed))
		observe.HandoverConnections.WithLabelValues("from", "kept").Add(float64(kept))
		observe.HandoverBytesInFlight.WithLabelValues("from").Add(float64(inFlight))
		if err != nil {
			klog.ErrorS(err, "Handing established connections to the successor failed; the rest are served and drained here",
				"successor", succ.pid, "handed", handed, "keptHere", kept)
			return
		}
		klog.InfoS("Handed the established connections to the successor", "successor", succ.pid,
			"handed", handed, "udpClients", udpHanded, "bytesInFlight", inFlight, "longestPause", longest.Round(100*time.Microsecond),
			"took", time.Since(start).Round(time.Millisecond))
	}()
	if ok {
		if serr := m.StopAccepting(); serr != nil {
			klog.ErrorS(serr, "Closing this process's copies of the proxy sockets")
		}
		for err == nil {
			var batch []proxier.RouteSessions
			detached := time.Now()
			batch, err = m.DetachSessions(sessionBatch)
			if len(batch) == 0 {
				break
			}
			for i := range batch {
				rs := batch[i]
				if err != nil {
					kept += s.keepSessions(m, rs)
					continue
				}
				var acked int
				acked, err = sendSessions(succ.c, rs)
				longest = max(longest, time.Since(detached))
				for j := range rs.States[:acked] {
					inFlight += rs.States[j].InFlight()
					rs.States[j].Close()
				}
				handed += acked
				if err != nil {
					rs.States = rs.States[acked:]
					kept += s.keepSessions(m, rs)
				}
			}
		}
		if err != nil {
			return
		}
		udp, uerr := s.handUDPClients(m, succ)
		udpHanded = udp
		if uerr != nil {
			err = uerr
			return
		}
		// What the balancers learnt since the sockets went, a client's
		// newer entry in the successor winning.
		succ.c.UnixConn().SetDeadline(time.Now().Add(helloTimeout))
		if err = s.sendMemory(succ.c); err != nil {
			return
		}
	}
	succ.c.UnixConn().SetDeadline(time.Now().Add(helloTimeout))
	err = succ.c.Send([]handover.Item{{FD: -1, Meta: []byte{msgSessionsEnd}}})
	return
}

// handUDPClients stops this process's reading of the UDP proxy sockets and
// sends succ every UDP client entry: each keeps its endpoint and its socket
// to it, and the replies on their way are read in succ. It returns how many
// were sent; those that could not be are closed (their clients' next
// datagrams make new entries in succ).
func (s *server) handUDPClients(m sessionHander, succ *successor) (handed int, err error) {
	routes, derr := m.DetachUDPClients()
	if derr != nil {
		klog.ErrorS(derr, "Detaching UDP clients for the successor")
	}
	for _, rc := range routes {
		for _, batch := range socket.UDPClientItems(rc.Clients) {
			if err == nil {
				succ.c.UnixConn().SetDeadline(time.Now().Add(helloTimeout))
				if err = succ.c.Send(append([]handover.Item{{FD: -1, Meta: encodeRouteKeyAs(msgUDPClients, rc.Route)}}, batch...)); err == nil {
					handed += len(batch)
				}
			}
		}
		for i := range rc.Clients {
			rc.Clients[i].Close()
		}
	}
	observe.HandoverConnections.WithLabelValues("from", "udp_handed").Add(float64(handed))
	return handed, err
}

// keepSessions resumes rs here, the successor not having taken them.
func (s *server) keepSessions(m sessionHander, rs proxier.RouteSessions) int {
	r, err := m.ResumeSessions(rs.Route, rs.States)
	if err != nil {
		klog.ErrorS(err, "Connections kept could not be resumed here, and were reset", "service", rs.Route.Service, "connections", r)
	}
	return len(rs.States) - r
}

// sendSessions sends one route's connections, in as many messages as their
// descriptors need, each acknowledged before the next. It returns how many
// were acknowledged, a prefix of rs.States (the successor's now: their
// copies here are to be closed); the rest are still this process's.
//
// The successor acknowledges a message before it resumes anything of it, and
// resumes nothing whose acknowledgement it could not send. So a connection
// that fails (the successor died, or refused the message) before the
// acknowledgement leaves the message's connections to this process. A
// successor that does not answer in time, or answers for another number of
// connections, is another matter: it may yet acknowledge and serve them, so
// they are counted as its (returned as acknowledged, their copies here to be
// closed), never served here as well. If it never does, they close with its
// copies: lost, but no connection is ever served by two processes.
func sendSessions(c *handover.Conn, rs proxier.RouteSessions) (acked int, err error) {
	batches, err := socket.SessionItems(rs.States)
	if err != nil {
		return 0, err
	}
	for _, items := range batches {
		// A connection's first item carries its state, the others none.
		n := 0
		for _, it := range items {
			if len(it.Meta) > 0 {
				n++
			}
		}
		c.UnixConn().SetDeadline(time.Now().Add(helloTimeout))
		if err := c.Send(append([]handover.Item{{FD: -1, Meta: encodeRouteKey(rs.Route)}}, items...)); err != nil {
			return acked, err
		}
		got, err := c.Receive()
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return acked + n, fmt.Errorf("no acknowledgement within %v: %d connections left to the successor", helloTimeout, n)
		}
		if err != nil {
			return acked, err
		}
		if len(got) != 1 || kindOf(got[0]) != msgSessionsAck {
			closeItems(got)
			return acked + n, fmt.Errorf("an unexpected answer (kind %d) instead of an acknowledgement: %d connections left to the successor", kindOf(got[0]), n)
		}
		d := decoder{b: got[0].Meta[1:]}
		if m := int(d.uint()); d.err != nil || m != n {
			return acked + n, fmt.Errorf("an acknowledgement of %d connections for %d sent (%v): they are left to the successor", m, n, d.err)
		}
		acked += n
	}
	return acked, nil
}

// setLock and takeLock guard s.lock, which a takeover sets while Run runs.
func (s *server) setLock(l *rulesLock) {
	s.lockMu.Lock()
	defer s.lockMu.Unlock()
	s.lock = l
}

func (s *server) currentLock() *rulesLock {
	s.lockMu.Lock()
	defer s.lockMu.Unlock()
	return s.lock
}

func (s *server) takeLock() *rulesLock {
	s.lockMu.Lock()
	defer s.lockMu.Unlock()
	l := s.lock
	s.lock = nil
	return l
}

// --- holding writes back ---

// syncGate holds the rules' writes back while a successor waits for its
// predecessor's lock: the syncs it gates succeed without writing.
type syncGate struct{ held atomic.Bool }

func heldGate() *syncGate {
	g := &syncGate{}
	g.held.Store(true)
	return g
}

func (g *syncGate) release() {
	if g != nil {
		g.held.Store(false)
	}
}

func (g *syncGate) holds() bool { return g != nil && g.held.Load() }

// gatedPortals are the userspace mode's portals behind a gate: its proxy
// sockets open and serve while no rule is written.
type gatedPortals struct {
	rules.Portals
	g *syncGate
}

func (p gatedPortals) Sync(portals []rules.Portal) error {
	if p.g.holds() {
		return nil
	}
	return p.Portals.Sync(portals)
}

// Intact is true while the gate holds: nothing written is nothing missing.
func (p gatedPortals) Intact() bool { return p.g.holds() || p.Portals.Intact() }

// gatedMode is a kernel mode behind a gate.
type gatedMode struct {
	syncloop.Mode
	g *syncGate
}

func (m gatedMode) Sync(snap *service.Snapshot) error {
	if m.g.holds() {
		return nil
	}
	return m.Mode.Sync(snap)
}

// --- NodePort sockets ---

// nodePortSockets opens the sockets that hold NodePorts (rules.Config.Listen),
// keeping track of the open ones to hand them to a successor, and adopts
// those a predecessor handed.
type nodePortSockets struct {
	mu     sync.Mutex
	open   map[nodePortKey]*heldNodePort
	handed map[nodePortKey]int // descriptors handed, not yet adopted
}

type nodePortKey struct{ network, address string }

type heldNodePort struct {
	io.Closer
	fd      func() (int, error) // a duplicate
	network string
	address string
	owner   *nodePortSockets
}

func (h *heldNodePort) Close() error {
	h.owner.mu.Lock()
	if h.owner.open[nodePortKey{h.network, h.address}] == h {
		delete(h.owner.open, nodePortKey{h.network, h.address})
	}
	h.owner.mu.Unlock()
	return h.Closer.Close()
}

func (n *nodePortSockets) hand(network, address string, fd int) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.handed == nil {
		n.handed = map[nodePortKey]int{}
	}
	if old, ok := n.handed[nodePortKey{network, address}]; ok {
		syscall.Close(old)
	}
	n.handed[nodePortKey{network, address}] = fd
}

// endAdoption closes the handed sockets not adopted and returns how many.
func (n *nodePortSockets) endAdoption() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	closed := len(n.handed)
	for _, fd := range n.handed {
		syscall.Close(fd)
	}
	n.handed = nil
	return closed
}

func (n *nodePortSockets) listen(network, address string) (io.Closer, error) {
	k := nodePortKey{network, address}
	n.mu.Lock()
	fd, handed := n.handed[k]
	delete(n.handed, k)
	n.mu.Unlock()
	var c io.Closer
	var err error
	if handed {
		f := os.NewFile(uintptr(fd), address)
		if strings.HasPrefix(network, "udp") {
			c, err = net.FilePacketConn(f)
		} else {
			c, err = net.FileListener(f)
		}
		f.Close()
		if err != nil {
			klog.ErrorS(err, "Could not adopt a handed NodePort socket; binding it anew", "network", network, "address", address)
			handed = false
		}
	}
	if !handed {
		if strings.HasPrefix(network, "udp") {
			c, err = net.ListenPacket(network, address)
		} else {
			c, err = net.Listen(network, address)
		}
		if err != nil {
			return nil, err
		}
	}
	h := &heldNodePort{Closer: c, network: network, address: address, owner: n}
	if fc, ok := c.(interface{ File() (*os.File, error) }); ok {
		h.fd = func() (int, error) {
			f, err := fc.File()
			if err != nil {
				return -1, err
			}
			// The duplicate outlives f: f's close would close it.
			fd, err := syscall.Dup(int(f.Fd()))
			f.Close()
			if err == nil {
				syscall.CloseOnExec(fd)
			}
			return fd, err
		}
	}
	n.mu.Lock()
	if n.open == nil {
		n.open = map[nodePortKey]*heldNodePort{}
	}
	n.open[k] = h
	n.mu.Unlock()
	return h, nil
}

type handedNodePort struct {
	network, address string
	fd               int
}

// dup returns a duplicate of every NodePort socket held.
func (n *nodePortSockets) dup() ([]handedNodePort, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	var out []handedNodePort
	for k, h := range n.open {
		if h.fd == nil {
			continue
		}
		fd, err := h.fd()
		if err != nil {
			for _, o := range out {
				syscall.Close(o.fd)
			}
			return nil, fmt.Errorf("duplicate the NodePort socket %s %s: %w", k.network, k.address, err)
		}
		out = append(out, handedNodePort{k.network, k.address, fd})
	}
	return out, nil
}
