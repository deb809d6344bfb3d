package app

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/nodeaddr"
	"github.com/uproxy/uproxy/observe"
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

// runProxy runs the proxy in the mode of o until SIGINT/SIGTERM: flags ->
// config -> HTTP listeners -> source -> mode (from the registry) -> sync loop.
// synced, if not nil, is called after every sync (the demo uses it to print
// its Services).
func runProxy(ctx context.Context, o *options, synced func(running, *service.Snapshot)) error {
	if err := o.applyConfigFile(); err != nil {
		return err
	}
	cfg, err := o.validate()
	if err != nil {
		return o.configFieldError(err)
	}
	// The HTTP addresses are bound before anything else happens (or is logged),
	// so a port in use is reported as its flag's error at once.
	metricsLn, healthzLn, err := bindHTTP(cfg)
	if err != nil {
		return o.configFieldError(err)
	}
	// The HTTP servers hold at most a quarter of the descriptors the data path
	// leaves to the rest of the process: an eighth for the metrics address,
	// an eighth for /healthz and the health check ports together.
	share := socket.CurrentReserve() / 8
	metricsConns, healthConns := observe.NewConnLimit(share), observe.NewConnLimit(share)
	srv := &observe.Server{MetricsListener: metricsLn, HealthzListener: healthzLn, MetricsAddress: cfg.metricsAddr, HealthzAddress: cfg.healthzAddr,
		MetricsConns: metricsConns, HealthzConns: healthConns}
	defer srv.Stop(context.Background())
	// So are the proxy ports' address and the manifests.
	if err := checkBindAddress(cfg.specific.Userspace.BindAddress); err != nil {
		return o.configFieldError(err)
	}
	if err := o.checkServicesPath(); err != nil {
		return err
	}
	o.logConfigNotes()
	raiseFileLimit()
	if ctx == nil {
		ctx = context.Background()
	}
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()

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
			return err
		}
		src, srcName = kubeSrc, "kubernetes"
	}

	var events *observe.Events // --events 0: none recorded
	if o.events > 0 {
		events = observe.NewEvents(o.events)
	}
	cfg.specific.Userspace.Events = events
	modeName, mode, lock, err := startMode(o, cfg)
	if err != nil {
		return err
	}
	defer lock.Close()
	// The Service ports of a protocol the mode cannot serve are reported by
	// the source, as problems of its Snapshots.
	if m, ok := mode.(interface{ Unserved() []service.Unserved }); ok {
		fileSrc.Options.Unserved = m.Unserved()
		if kubeSrc != nil {
			kubeSrc.Unserved = m.Unserved()
		}
	}

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
			Synced: func(start time.Time, took time.Duration, s *service.Snapshot, err error) {
				observe.SyncObserved(start, took, err)
				if err == nil {
					health.Synced(start)
					changes.Synced(s)
					if herr := hc.Sync(s); herr != nil {
						klog.ErrorS(herr, "Health check node ports")
					}

				}
				if synced != nil {
					synced(running{name: modeName, rules: cfg.specific.Userspace.Rules, mode: mode}, s)
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
		srcErr <- src.Run(ctx, func(s *service.Snapshot) {
			changes.Queued(s)
			conflicts.Update(s)
			unserved.Update(s)
			problems.Update(s)
			runner.Update(s)
		})
	}()
	syncDone := make(chan struct{})
	health.Started(time.Now())
	go func() {
		defer close(syncDone)
		runner.Run(ctx)
	}()

	srcDone := false
	select {
	case <-ctx.Done():
	case err = <-srcErr:
		srcDone = true
		switch {
		case err != nil && o.services != "":
			err = fmt.Errorf("--services %s: %w", srcName, err)
		case err != nil:
			err = fmt.Errorf("source %s: %w", srcName, err)
		}
	}
	stop()
	var shutdown func(context.Context) error
	if m, ok := mode.(interface{ Shutdown(context.Context) error }); ok {
		shutdown = m.Shutdown
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
func finish(syncDone <-chan struct{}, shutdown func(context.Context) error, grace time.Duration, mode interface{ Cleanup() error }, cleanupOnExit bool) {
	<-syncDone
	if shutdown != nil {
		klog.InfoS("Shutting down", "grace", grace)
		ctx, cancel := context.WithTimeout(context.Background(), grace)
		defer cancel()
		err := shutdown(ctx)
		if se, ok := err.(*socket.ShutdownExpiredError); ok {
			// The grace period's end, as --shutdown-grace asks: not a failure.
			klog.InfoS("Shutdown grace period over: the connections still open were reset", "grace", grace, "connections", se.Reset)
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
