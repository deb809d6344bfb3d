package app

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"runtime/debug"
	"sync"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/nodeaddr"
	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/proxier"
	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/rules"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/socket"
	"github.com/uproxy/uproxy/source/file"
	"github.com/uproxy/uproxy/source/kube"
	"github.com/uproxy/uproxy/syncloop"
)

// running is what runProxy tells its synced hook of the proxy it runs.
type running struct {
	name  string         // the proxy mode's name, resolved (auto is never one)
	rules rules.Backend  // the userspace mode's portals, resolved: nftables, iptables or none
	mode  proxymode.Mode // the mode
}

// runProxy runs the proxy in the mode of o until SIGINT/SIGTERM: it builds
// the server (newServer), then runs it (server.Run). synced, if not nil, is
// called after every sync (the demo uses it to print its Services).
func runProxy(ctx context.Context, o *options, synced func(running, *service.Snapshot)) error {
	if o.crashHolder && os.Getenv(holderFDEnv) == "" && synced == nil {
		// This process holds; a child of it serves (holder.go).
		return runHolder()
	}
	s, err := newServer(ctx, o)
	if err != nil {
		return err
	}
	return s.Run(synced)
}

// server is the proxy built from the flags and not yet running, as kube-proxy
// builds a ProxyServer before it runs it: its HTTP addresses are bound, its
// source and its mode made (the node's rules lock held, the conntrack sysctls
// set, other modes' leftovers removed), but nothing is served and no sync has
// run. Run runs it; Close releases a server that is never run.
type server struct {
	o   *options
	cfg *config
	// ctx is the run's context: the caller's, ended by SIGINT or SIGTERM,
	// which are caught from before the build touches the node (the source,
	// the mode) so that a signal never cuts a start in half; stop releases
	// the signals.
	ctx  context.Context
	stop context.CancelFunc

	http        *observe.Server
	healthConns *observe.ConnLimit
	health      *observe.Health
	src         syncloop.Source
	srcName     string
	events      *observe.Events
	modeName    string
	mode        proxymode.Mode
	// lockMu guards lock, which a takeover sets while Run runs (takeover.go).
	lockMu sync.Mutex
	lock   *rulesLock

	// pred is the uproxy this one takes over from (nil: none); gate holds
	// back the rules' writes until it has handed the lock over; takenHTTP
	// counts the HTTP listeners it handed. nodePorts are the NodePort
	// sockets, which a successor takes in turn.
	pred      *predecessor
	gate      *syncGate
	takenHTTP int
	nodePorts *nodePortSockets
	portals   rules.Portals
	// held is the crash holder (nil: none); heldAdopting: the mode adopts
	// the sockets it kept, until the first sync (EndAdoption).
	held         *heldBy
	heldAdopting bool

	// handing is the handover in progress, from the moment a successor has
	// this process's sockets until it serves or goes away (nil: none); its
	// channel is closed then. A SIGTERM meanwhile waits for it (awaitHandover).
	handingMu sync.Mutex
	handing   chan struct{}
}

// newServer builds the server of o: flags -> config -> HTTP listeners ->
// source -> mode (from the registry). On error, nothing it took is held.
func newServer(ctx context.Context, o *options) (_ *server, err error) {
	if err := o.applyConfigFile(); err != nil {
		return nil, err
	}
	cfg, err := o.validate()
	if err != nil {
		return nil, o.configFieldError(err)
	}
	// Under a crash holder, the proxy sockets it kept through a crash.
	held, heldSocks, err := dialHolder()
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			proxier.CloseHanded(heldSocks)
		}
	}()
	if held != nil {
		cfg.specific.Userspace.Config.Holding = held
		held.export()
		if held.start > 1 {
			klog.InfoS("Started again by the crash holder after the serving uproxy died", "start", held.start, "heldSockets", len(heldSocks))
		}
	}
	// A uproxy of this --chain-prefix already running is taken over from
	// (takeover.go): its HTTP addresses are in use, and taken from it.
	var pred *predecessor
	if o.takeOver && mayTouchRules(o, cfg) {
		pred = dialPredecessor(o.chainPrefix)
	}
	defer func() {
		if err != nil {
			pred.close()
		}
	}()
	// The HTTP addresses are bound before anything else happens (or is logged),
	// so a port in use is reported as its flag's error at once.
	metricsLn, healthzLn, err := bindHTTPBeside(cfg, pred)
	if err != nil {
		return nil, o.configFieldError(err)
	}
	// The HTTP servers hold at most a quarter of the descriptors the data path
	// leaves to the rest of the process: an eighth for the metrics address,
	// an eighth for /healthz and the health check ports together.
	share := socket.CurrentReserve() / 8
	metricsConns, healthConns := observe.NewConnLimit(share), observe.NewConnLimit(share)
	srv := &observe.Server{MetricsListener: metricsLn, HealthzListener: healthzLn, MetricsAddress: cfg.metricsAddr, HealthzAddress: cfg.healthzAddr,
		MetricsConns: metricsConns, HealthzConns: healthConns}
	defer func() {
		if err != nil {
			srv.Stop(context.Background())
		}
	}()
	// So are the proxy ports' address and the manifests.
	if err := checkBindAddress(cfg.specific.Userspace.BindAddress); err != nil {
		return nil, o.configFieldError(err)
	}
	if err := o.checkServicesPath(); err != nil {
		return nil, err
	}
	o.logConfigNotes()
	raiseFileLimit()
	if ctx == nil {
		ctx = context.Background()
	}
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer func() {
		if err != nil {
			stop()
		}
	}()

	health := &observe.Health{Timeout: 2 * o.syncPeriod}
	// Manifests on disk when --services is given, else the API server.
	// Endpoints on loopback are the demo's: taken when only the node's own
	// processes reach the proxy ports (file.Source.LoopbackEndpoints).
	bind := cfg.specific.Userspace.BindAddress
	fileSrc := &file.Source{Path: o.services, Options: service.BuildOptions{NodeName: cfg.nodeName, Zone: cfg.zone},
		LoopbackEndpoints: bind.IsValid() && bind.Unmap().IsLoopback()}
	var kubeSrc *kube.Source
	var src syncloop.Source = fileSrc
	srcName := o.services
	if o.services == "" {
		if kubeSrc, err = newKubeSource(ctx, o, cfg, health); err != nil {
			return nil, err
		}
		src, srcName = kubeSrc, "kubernetes"
	}

	var events *observe.Events // --events 0: none recorded
	if o.events > 0 {
		events = observe.NewEvents(o.events)
	}
	cfg.specific.Userspace.Events = events
	nodePorts := &nodePortSockets{}
	cfg.specific.Userspace.NodePortListen = nodePorts.listen
	var gate *syncGate
	if pred != nil {
		gate = heldGate()
	}
	// portals are the userspace mode's (nil in the kernel modes); a
	// successor's are behind the gate until it has the lock.
	var portals rules.Portals
	cfg.specific.Userspace.WrapPortals = func(p rules.Portals) rules.Portals {
		portals = p
		if gate == nil {
			return p
		}
		return gatedPortals{p, gate}
	}
	modeName, mode, lock, pred, err := startMode(o, cfg, pred, nodePorts)
	if err != nil {
		return nil, err
	}
	// Adopted before a predecessor's, which replace them (takeListeners).
	heldAdopting := false
	if a, ok := mode.(interface{ Adopt([]proxier.HandedSocket) }); ok && len(heldSocks) > 0 {
		a.Adopt(heldSocks)
		heldAdopting = true
	} else {
		proxier.CloseHanded(heldSocks)
	}
	heldSocks = nil
	if pred == nil {
		// No predecessor, or none any more: this process writes at once.
		gate.release()
		gate = nil
	}
	takenHTTP, err := takeListeners(pred, srv, cfg, mode)
	if err != nil {
		if m, ok := mode.(interface{ Shutdown(context.Context) error }); ok {
			m.Shutdown(context.Background())
		}
		lock.Close()
		return nil, o.configFieldError(err)
	}
	// The Service ports of a protocol the mode cannot serve are reported by
	// the source, as problems of its Snapshots.
	if m, ok := mode.(interface{ Unserved() []service.Unserved }); ok {
		fileSrc.Options.Unserved = m.Unserved()
		if kubeSrc != nil {
			kubeSrc.Unserved = m.Unserved()
		}
	}
	return &server{o: o, cfg: cfg, ctx: ctx, stop: stop, http: srv, healthConns: healthConns, health: health,
		src: src, srcName: srcName, events: events, modeName: modeName, mode: mode, lock: lock,
		pred: pred, gate: gate, takenHTTP: takenHTTP, nodePorts: nodePorts, portals: portals, held: held, heldAdopting: heldAdopting}, nil
}

// Close releases a server that is never run: the mode's event loops, if it
// has any (it serves nothing yet), and what building s took (release).
func (s *server) Close() {
	if m, ok := s.mode.(interface{ Shutdown(context.Context) error }); ok {
		m.Shutdown(context.Background())
	}
	s.release()
}

// release lets go of what building s took: the rules lock, the signals, the
// HTTP listeners. Run releases s when it returns (its mode shut down by then).
func (s *server) release() {
	s.takeLock().Close()
	s.pred.close()
	s.stop()
	s.http.Stop(context.Background())
}

// Run serves until the context newServer was given ends (or SIGINT/SIGTERM),
// or the source fails: the servers of observe, the sync loop, the source; at
// exit the mode's Shutdown within --shutdown-grace, then its Cleanup with
// --cleanup-on-exit. synced is runProxy's.
func (s *server) Run(synced func(running, *service.Snapshot)) error {
	defer s.release()
	o, cfg, ctx, stop := s.o, s.cfg, s.ctx, s.stop
	srv, healthConns, health, events := s.http, s.healthConns, s.health, s.events
	src, srcName, modeName, mode := s.src, s.srcName, s.modeName, s.mode
	var err error

	// runCtx ends the sync loop and the source: at SIGINT or SIGTERM, or
	// once a successor serves.
	runCtx, cancelRun := context.WithCancel(ctx)
	defer cancelRun()
	// syncedOK has a value after a sync that succeeded (a takeover waits
	// for one); successors gets the successor that serves, takeErr a
	// takeover that failed.
	syncedOK := make(chan struct{}, 1)
	// A successor is sent without waiting: Run takes it even after a
	// SIGTERM (awaitHandover).
	successors := make(chan *successor, 1)
	takeErr := make(chan error, 1)

	changes := &observe.Changes{}
	conflicts := &observe.Conflicts{}
	unserved := &observe.Unserved{}
	problems := &observe.Problems{}
	// healthCheckNodePort servers of externalTrafficPolicy: Local Services.
	hc := &observe.HealthCheckServer{IPs: nodePortIPs(cfg.common.NodePortAddresses), Conns: healthConns, Healthy: func() bool {
		ok, _ := health.Healthy(time.Now())
		return ok
	}}
	defer hc.Close(context.Background())
	runner := &syncloop.Runner{
		Mode:          mode,
		MinSyncPeriod: o.minSyncPeriod,
		SyncPeriod:    o.syncPeriod,
		Hooks: syncloop.Hooks{
			Queued: health.Queued,
			Synced: func(start time.Time, took time.Duration, snap *service.Snapshot, err error) {
				observe.SyncObserved(start, took, err)
				if err == nil {
					select {
					case syncedOK <- struct{}{}:
					default:
					}
					health.Synced(start)
					changes.Synced(snap)
					if herr := hc.Sync(snap); herr != nil {
						klog.ErrorS(herr, "Health check node ports")
					}

				}
				if synced != nil {
					synced(running{name: modeName, rules: cfg.specific.Userspace.Rules, mode: mode}, snap)
				}
			},
		},
	}
	// A mode that counts its localhost NodePort packets in the kernel (the
	// iptables mode) has them exported, as kube-proxy's iptables mode does.
	if m, ok := mode.(interface {
		LocalhostNodePortPackets() (uint64, bool, error)
	}); ok {
		observe.LocalhostNodePortsAccepted.Set(m.LocalhostNodePortPackets)
		defer observe.LocalhostNodePortsAccepted.Set(nil)
	}
	// Modes that can tell cheaply whether their rules are still there (a
	// canary) get them repaired within the check period after a flush.
	if m, ok := mode.(interface{ Intact() bool }); ok {
		runner.Check = m.Intact
	}
	// A successor writes no rule before its predecessor has stopped: the
	// userspace mode's gate is in its portals (it adopts proxy sockets, and
	// must open them in that first sync), a kernel mode's here.
	if _, adopts := mode.(interface{ Adopt([]proxier.HandedSocket) }); s.gate != nil && !adopts {
		runner.Mode = gatedMode{mode, s.gate}
	}
	srv.Mode, srv.Services, srv.Conflicts, srv.Events, srv.Health, srv.Debug, srv.Profiling = modeName, mode, conflicts, events, health, o.debug, o.profiling
	srv.Unserved = unserved
	srv.Problems = problems
	srv.Start()

	start := []any{"version", version, "mode", modeName}
	if usesFlag(modeName, "rules") {
		start = append(start, "rules", cfg.specific.Userspace.Rules)
	}
	start = append(start, "services", srcName)
	if usesFlag(modeName, "scheduler") {
		start = append(start, "scheduler", o.scheduler)
	}
	klog.InfoS("Starting uproxy", start...)
	srcErr := make(chan error, 1)
	// The source's first Snapshot is pending from now: should it never come
	// (manifests on a file system that hangs, an API server that cannot be
	// reached or forbids a list), /healthz fails once it is late, as for any
	// update that is not synced. kube-proxy's /healthz answers 200 until its
	// first sync, however late: a node that proxies nothing would look
	// healthy.
	health.Queued(time.Now())
	go func() {
		// Sources log their problems themselves, once each, when they appear.
		srcErr <- src.Run(runCtx, func(snap *service.Snapshot) {
			changes.Queued(snap)
			conflicts.Update(snap)
			unserved.Update(snap)
			problems.Update(snap)
			runner.Update(snap)
		})
	}()
	syncDone := make(chan struct{})
	health.Started(time.Now())
	go func() {
		defer close(syncDone)
		runner.Run(runCtx)
	}()
	if lock := s.currentLock(); lock != nil {
		go s.serveSuccessors(ctx, lock, successors)
	}
	if s.heldAdopting && s.pred == nil {
		go s.endHeldAdoption(runCtx, syncedOK)
	}
	if s.pred != nil {
		pred := s.pred
		s.pred = nil // completeTakeOver's from now on
		go func() {
			if err := s.completeTakeOver(runCtx, pred, syncedOK, runner, successors); err != nil {
				takeErr <- err
			}
		}()
	}

	srcDone := false
	var succ *successor
	select {
	case <-ctx.Done():
		succ = s.awaitHandover(successors)
	case succ = <-successors:
	case err = <-takeErr:
	case err = <-srcErr:
		srcDone = true
		switch {
		case err != nil && o.services != "":
			err = fmt.Errorf("--services %s: %w", srcName, err)
		case err != nil:
			err = fmt.Errorf("source %s: %w", srcName, err)
		}
	}
	cancelRun()
	if succ == nil {
		// From here a second SIGINT or SIGTERM ends the process at once.
		stop()
	} else {
		// Handed over, it may wait for its SIGTERM (--after-handover).
		defer stop()
	}
	var shutdown func(context.Context) error
	if m, ok := mode.(interface{ Shutdown(context.Context) error }); ok {
		shutdown = m.Shutdown
	}
	if succ != nil {
		// The successor serves: it gets the lock once no sync of this
		// process can write any more, and the rules stay as they are.
		<-syncDone
		handed := 0
		if s.handOff(succ) {
			// Its established TCP connections and UDP clients go too;
			// the connections still dialing drain here.
			handed, _ = s.handSessions(succ)
		}
		observe.HandoverDone("from", time.Since(succ.start))
		s.held.releaseAll()
		srv.Stop(context.Background())
		reset := finish(syncDone, shutdown, o.shutdownGrace, mode, false)
		klog.InfoS("Handed over to the successor and exited: its copies of the listening sockets serve on, no connection was refused",
			"successor", succ.pid, "sockets", succ.sockets+1, "connectionsHanded", handed, "connectionsReset", reset, "took", time.Since(succ.start).Round(time.Millisecond))
		if !srcDone {
			select {
			case <-srcErr:
			case <-time.After(sourceStopWait):
			}
		}
		if cfg.waitAfterHandover {
			// A pod's container that exits is restarted, and the restarted
			// process would take over back from the successor; so this one
			// waits, holding nothing, for the pod's deletion to end it.
			klog.InfoS("Handed over; holding no listening or connected socket and waiting for SIGTERM (--after-handover)", "successor", succ.pid)
			debug.FreeOSMemory()
			<-ctx.Done()
		}
		return nil
	}
	finish(syncDone, shutdown, o.shutdownGrace, mode, o.cleanupOnExit)
	if !srcDone {
		// The source ends with the context (the API source once its
		// informers have); a read of a hung file system may not.
		select {
		case <-srcErr:
		case <-time.After(sourceStopWait):
			klog.InfoS("The source has not stopped; exiting without it", "waited", sourceStopWait)
		}
	}
	return err
}

// sourceStopWait bounds how long a run that ends waits for its source.
const sourceStopWait = 5 * time.Second

// finish ends a run whose context is done: it waits for the sync loop to return
// (a sync in flight completes first), so that no sync can rewrite what the
// cleanup below removes; then it shuts the mode down (shutdown: the userspace
// mode's connections, the nftables mode's loopback relay; nil for a mode
// with nothing to drain) within grace, and removes the mode's rules if cleanupOnExit.
// It returns how many connections were reset at the grace period's end.
func finish(syncDone <-chan struct{}, shutdown func(context.Context) error, grace time.Duration, mode interface{ Cleanup() error }, cleanupOnExit bool) (reset int) {
	<-syncDone
	if shutdown != nil {
		klog.InfoS("Shutting down", "grace", grace)
		ctx, cancel := context.WithTimeout(context.Background(), grace)
		defer cancel()
		err := shutdown(ctx)
		if se, ok := err.(*socket.ShutdownExpiredError); ok {
			// The grace period's end, as --shutdown-grace asks: not a failure.
			klog.InfoS("Shutdown grace period over: the connections still open were reset", "grace", grace, "connections", se.Reset)
			reset = se.Reset
		} else if err != nil {
			klog.ErrorS(err, "Shutdown")
		}
	}
	// Kernel modes keep serving from the kernel after exit unless asked not to.
	if cleanupOnExit {
		if cerr := mode.Cleanup(); cerr != nil {
			klog.ErrorS(cerr, "Removing the mode's rules on exit")
		} else {
			klog.InfoS("Removed the mode's rules on exit")
		}
	}
	return reset
}

// bindHTTP binds --metrics-bind-address and --healthz-bind-address (nil for an
// empty one); an error names the flag.
func bindHTTP(cfg *config) (metrics, healthz net.Listener, err error) {
	if cfg.metricsAddr != "" {
		if metrics, err = net.Listen("tcp", cfg.metricsAddr); err != nil {
			return nil, nil, fmt.Errorf("--metrics-bind-address %s: %w", cfg.metricsAddr, err)
		}
	}
	if cfg.healthzAddr != "" {
		if healthz, err = net.Listen("tcp", cfg.healthzAddr); err != nil {
			if metrics != nil {
				metrics.Close()
			}
			return nil, nil, fmt.Errorf("--healthz-bind-address %s: %w", cfg.healthzAddr, err)
		}
	}
	return metrics, healthz, nil
}

// newKubeSource connects to the API server that the flags (or the Pod) name and
// sets this node's topology zone from its Node, when it is known at start.
func newKubeSource(ctx context.Context, o *options, cfg *config, health *observe.Health) (*kube.Source, error) {
	rc, err := kube.ClientConfig(kube.ClientOptions{
		Kubeconfig:  o.kubeconfig,
		Master:      o.master,
		QPS:         o.kubeAPIQPS,
		Burst:       o.kubeAPIBurst,
		ContentType: o.kubeAPIContentType,
		UserAgent:   "uproxy/" + version,
	})
	if errors.Is(err, kube.ErrNoConfig) {
		return nil, errors.New("no source of Services: give --services PATH (manifests on disk), or --kubeconfig/--master, or run in a cluster")
	}
	if err != nil {
		return nil, err
	}
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("API client: %w", err)
	}
	// The source follows this node's zone (its Node's label) into every
	// Snapshot, live. Until its Node is known, the node is not eligible (/healthz
	// answers 503), as kube-proxy's is not without one.
	health.SetNodeEligible(false)
	klog.InfoS("Following the API server", "host", rc.Host, "node", cfg.nodeName, "serviceProxyName", o.serviceProxyName)
	return &kube.Source{
		Client:           client,
		NodeName:         cfg.nodeName,
		ServiceProxyName: o.serviceProxyName,
		ResyncPeriod:     o.configSyncPeriod,
		NodeChanged: func(n *v1.Node) {
			health.SetNodeEligible(kube.NodeEligible(n))
			if n == nil {
				klog.InfoS("This node's Node was deleted", "node", cfg.nodeName)
				return
			}
			klog.V(2).InfoS("Node changed", "node", n.Name, "eligible", kube.NodeEligible(n))
		},
	}, nil
}

// nodePortIPs returns the node addresses inside prefixes (--nodeport-addresses);
// nil, meaning every address, when there are no prefixes.
func nodePortIPs(prefixes []netip.Prefix) []netip.Addr {
	if len(prefixes) == 0 {
		return nil
	}
	addrs, err := nodeaddr.List()
	if err != nil {
		klog.ErrorS(err, "Listing node addresses")
		return nil
	}
	return nodeaddr.In(addrs, prefixes)
}
