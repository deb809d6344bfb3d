package main

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

	"github.com/uproxy/uproxy/localnodeports"
	"github.com/uproxy/uproxy/nodeaddr"
	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/proxier"
	"github.com/uproxy/uproxy/rules"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/socket"
	"github.com/uproxy/uproxy/source/file"
	"github.com/uproxy/uproxy/source/kube"
	"github.com/uproxy/uproxy/syncloop"
)

// running is what runProxy tells its synced hook of the proxy it runs.
type running struct {
	mode  string           // the proxy mode, resolved (auto is never one)
	rules string           // the userspace mode's portals, resolved: nftables, iptables or none
	px    *proxier.Proxier // the userspace mode's proxier; nil in a kernel mode
}

// runProxy runs the proxy in the mode of o until SIGINT/SIGTERM. synced, if not
// nil, is called after every sync (the demo uses it to print its Services).
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
	srv := &observe.Server{MetricsListener: metricsLn, HealthzListener: healthzLn, MetricsAddress: cfg.metricsAddr, HealthzAddress: cfg.healthzAddr}
	defer srv.Stop(context.Background())
	// So are the proxy ports' address and the manifests.
	if err := checkBindAddress(cfg.proxier.BindAddress); err != nil {
		return o.configFieldError(err)
	}
	if err := o.checkServicesPath(); err != nil {
		return err
	}
	raiseFileLimit()
	if ctx == nil {
		ctx = context.Background()
	}
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()

	health := &observe.Health{Timeout: 2 * o.syncPeriod}
	// Manifests on disk when --services is given, else the API server.
	fileSrc := &file.Source{Path: o.services, Options: service.BuildOptions{NodeName: cfg.nodeName, Zone: cfg.zone}}
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
	modeName, mode, px, lock, err := newProxyMode(o, cfg, events)
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

	// The nftables mode's loopback NodePorts are served from user space.
	var relay *localnodeports.Relay
	if cfg.localhostRelay[0] || cfg.localhostRelay[1] {
		if relay, err = localnodeports.New(localnodeports.Config{IPv4: cfg.localhostRelay[0], IPv6: cfg.localhostRelay[1]}); err != nil {
			return err
		}
		klog.InfoS("NodePorts answer on loopback through a relay to the ClusterIP", "mode", modeName, "ipv4", cfg.localhostRelay[0], "ipv6", cfg.localhostRelay[1])
		defer func() {
			ctx, cancel := context.WithTimeout(context.Background(), o.shutdownGrace)
			defer cancel()
			if err := relay.Close(ctx); err != nil {
				klog.ErrorS(err, "Closing the localhost NodePorts")
			}
		}()
	}

	changes := &observe.Changes{}
	conflicts := &observe.Conflicts{}
	unserved := &observe.Unserved{}
	// healthCheckNodePort servers of externalTrafficPolicy: Local Services.
	hc := &kube.HealthCheckServer{IPs: nodePortIPs(cfg.prefixes), Healthy: func() bool {
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
				// Before the sync is reported done: a client that waits for
				// that finds the loopback NodePorts listening too.
				if err == nil && relay != nil {
					if rerr := relay.Sync(s); rerr != nil {
						klog.ErrorS(rerr, "Localhost NodePorts")
					}
				}
				observe.SyncObserved(start, took, err)
				if err == nil {
					health.Synced(start)
					changes.Synced(s)
					if herr := hc.Sync(s); herr != nil {
						klog.ErrorS(herr, "Health check node ports")
					}

				}
				if synced != nil {
					synced(running{mode: modeName, rules: cfg.rules, px: px}, s)
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
	srv.Start()

	start := []any{"version", version, "mode", modeName}
	if usesFlag(modeName, "rules") {
		start = append(start, "rules", cfg.rules)
	}
	start = append(start, "services", srcName)
	if usesFlag(modeName, "scheduler") {
		start = append(start, "scheduler", cfg.proxier.Scheduler)
	}
	klog.InfoS("Starting uproxy", start...)
	srcErr := make(chan error, 1)
	go func() {
		// Sources log their problems themselves, once each, when they appear.
		srcErr <- src.Run(ctx, func(s *service.Snapshot) {
			changes.Queued(s)
			conflicts.Update(s)
			unserved.Update(s)
			runner.Update(s)
		})
	}()
	syncDone := make(chan struct{})
	health.Started(time.Now())
	go func() {
		defer close(syncDone)
		runner.Run(ctx)
	}()

	select {
	case <-ctx.Done():
	case err = <-srcErr:
		switch {
		case err != nil && o.services != "":
			err = fmt.Errorf("--services %s: %w", srcName, err)
		case err != nil:
			err = fmt.Errorf("source %s: %w", srcName, err)
		}
	}
	stop()
	var shutdown func(context.Context) error
	if px != nil {
		shutdown = px.Shutdown
	}
	finish(syncDone, shutdown, o.shutdownGrace, mode, o.cleanupOnExit)
	return err
}

// finish ends a run whose context is done: it waits for the sync loop to return
// (a sync in flight completes first), so that no sync can rewrite what the
// cleanup below removes; then it shuts the userspace proxier down (shutdown, nil
// for a kernel mode) within grace, and removes the mode's rules if cleanupOnExit.
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

// chooseRules resolves --rules auto (as root): nftables where nft and the
// kernel take the portals' whole layout, else iptables; none when the node has
// no IPv4 address for the portals of its own connections (ips: nodeIPs). It logs
// the choice and why.
func chooseRules(requested, prefix string, ips []netip.Addr) string {
	if requested != "auto" {
		return requested
	}
	if err := rules.CheckNodeIPs(ips); err != nil {
		klog.InfoS("Portal rules", "rules", "none", "reason", "auto: "+err.Error()+"; clients reach Services on their proxy ports")
		return "none"
	}
	if err := rules.ProbeNFTables(prefix); err != nil {
		klog.InfoS("Portal rules", "rules", rules.BackendIPTables, "reason", "auto: "+err.Error())
		return rules.BackendIPTables
	}
	klog.InfoS("Portal rules", "rules", rules.BackendNFTables, "reason", "auto: nft and the kernel support the nftables portals")
	return rules.BackendNFTables
}

// newPortals builds the portals of cfg.rules, resolved by chooseRules.
func newPortals(cfg *config, prefix string, ips []netip.Addr) (rules.Portals, error) {
	if cfg.rules == "none" {
		return rules.None{}, nil
	}
	mark := cfg.dialMark
	if err := socket.SetDialMark(mark); err != nil {
		// Connections still work; each of the proxy's own pays for the portal lookups.
		klog.ErrorS(err, "Proxy connections to endpoints go through the portals", "flag", "--dial-mark-bit")
		mark = 0
	}
	bind := cfg.proxier.BindAddress
	rc := rules.Config{
		ChainPrefix:        prefix,
		NodeIPs:            ips,
		NodePortAddresses:  cfg.prefixes,
		IPv6:               hasIPv6(ips),
		DialMark:           mark,
		ClientAddressMark:  keepClientAddress(cfg, mark),
		ProxyPortsOnNodeIP: bind.IsValid() && !bind.IsUnspecified(),
	}
	if rc.ProxyPortsOnNodeIP {
		other := "IPv6"
		if bind.Is6() {
			other = "IPv4"
		}
		klog.InfoS("Proxy ports listen on --bind-address only: the portals DNAT to it, and Service addresses of the other family get none",
			"bindAddress", bind, "withoutPortals", other)
	}
	var p rules.Portals
	var err error
	if cfg.rules == rules.BackendNFTables {
		p, err = rules.NewNFTables(rc)
	} else {
		p, err = rules.NewIPTables(rc)
	}
	if _, ok := errors.AsType[*rules.NoNodeIPError](err); ok {
		return nil, fmt.Errorf("--rules %s: %w (give an interface an address, set --bind-address to the node IP, or run with --rules none)", cfg.rules, err)
	}
	if err != nil {
		return nil, fmt.Errorf("--rules %s: %w", cfg.rules, err)
	}
	return p, nil
}

// keepClientAddress returns the mark of the portals' rules for the replies to
// dials from a client's address, 0 (and cfg.clientMark cleared, with the
// reason logged) when client addresses cannot be kept: no dial mark for the
// rules to tell the proxy's own connections by, or a kernel or a process
// that refuses transparent sockets.
func keepClientAddress(cfg *config, dialMark uint32) uint32 {
	if cfg.clientMark == 0 {
		return 0
	}
	var why string
	if dialMark == 0 {
		why = "the rules tell uproxy's own connections by the dial mark, and there is none (--dial-mark-bit)"
	} else if err := socket.CheckTransparent(); err != nil {
		why = err.Error()
	}
	if why != "" {
		klog.InfoS("Endpoints see the node's address, not the client's, on every connection", "flag", "--preserve-client-address", "reason", why)
		cfg.clientMark = 0
		return 0
	}
	klog.InfoS("Endpoints see the client's address where kube-proxy would keep it", "flag", "--preserve-client-address",
		"mark", fmt.Sprintf("%#x", cfg.clientMark), "routeTable", rules.ClientAddressTable)
	return cfg.clientMark
}

func hasIPv6(ips []netip.Addr) bool {
	for _, ip := range ips {
		if ip.Is6() {
			return true
		}
	}
	return false
}

// nodeIPs returns the addresses the HOST portals DNAT to: the bind address when
// one is given, else the first global unicast address of each family.
func nodeIPs(bind netip.Addr) []netip.Addr {
	if bind.IsValid() && !bind.IsUnspecified() {
		return []netip.Addr{bind}
	}
	addrs, err := nodeaddr.List()
	if err != nil {
		klog.ErrorS(err, "Listing node addresses")
		return nil
	}
	return nodeaddr.Primary(addrs)
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
