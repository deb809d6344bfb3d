// Package kube follows Services and EndpointSlices in a Kubernetes API server with
// client-go informers, selecting them as kube-proxy does, and hands every change on
// as a service.Snapshot.
//
//	cfg, err := kube.ClientConfig(kube.ClientOptions{Kubeconfig: path})
//	client, err := kubernetes.NewForConfig(cfg)
//	src := &kube.Source{Client: client, NodeName: node, ServiceProxyName: "uproxy"}
//	err = src.Run(ctx, func(s *service.Snapshot) { runner.Update(s) })
//
// Selection follows kube-proxy's label selectors, which is what lets uproxy and
// kube-proxy share a node without touching each other's Services: by default every
// Service without the service.kubernetes.io/service-proxy-name label; with
// ServiceProxyName only the Services carrying that label with that value.
// EndpointSlices labelled service.kubernetes.io/headless are never listed, and a
// slice only counts when its kubernetes.io/service-name names a selected Service.
package kube

import (
	"context"
	"fmt"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/client-go/informers"
	coreinformers "k8s.io/client-go/informers/core/v1"
	discoveryinformers "k8s.io/client-go/informers/discovery/v1"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	discoverylisters "k8s.io/client-go/listers/discovery/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/service"
)

// Labels that select what a service proxy handles, as kube-proxy reads them.
const (
	// LabelServiceProxyName on a Service names the proxy that handles it; a proxy
	// without a name of its own leaves such Services alone.
	LabelServiceProxyName = "service.kubernetes.io/service-proxy-name"
	// LabelHeadless marks the EndpointSlices of headless Services, which no proxy
	// programs.
	LabelHeadless = v1.IsHeadlessService
)

// Source follows the Services and EndpointSlices of an API server. The zero value
// is not usable: set Client.
type Source struct {
	// Client reaches the API server. Built from ClientConfig, it logs the
	// failed requests; the informers log them only at -v=2.
	Client kubernetes.Interface
	// NodeName is this node's name: endpoints on it are Local, and the Node object
	// of that name is watched for its zone (topology.kubernetes.io/zone, which
	// the Snapshots carry as Zone and follow live) and for NodeChanged. If
	// empty, nothing is Local and no Node is watched.
	NodeName string
	// ServiceProxyName, if set, selects only the Services labelled
	// service.kubernetes.io/service-proxy-name=ServiceProxyName; if empty, only
	// those without that label.
	ServiceProxyName string
	// ResyncPeriod is how often the informers replay their caches (kube-proxy's
	// configSyncPeriod); if zero, never. Replays change nothing unless something
	// was missed, so the source then sends nothing.
	ResyncPeriod time.Duration
	// NodeChanged, if set, is called from the informer with this node's Node
	// whenever it is added or changes, and with nil when it is deleted.
	NodeChanged func(*v1.Node)
	// Unserved are the protocols the proxy mode cannot serve: their Service
	// ports are reported in Snapshot.Errors (service.BuildOptions.Unserved).
	Unserved []service.Unserved
}

// ServiceSelector returns the label selector for the Services a proxy named name
// handles ("" for the unnamed default proxy).
func ServiceSelector(name string) labels.Selector {
	var req *labels.Requirement
	var err error
	if name == "" {
		req, err = labels.NewRequirement(LabelServiceProxyName, selection.DoesNotExist, nil)
	} else {
		req, err = labels.NewRequirement(LabelServiceProxyName, selection.Equals, []string{name})
	}
	if err != nil {
		// Only an invalid label value can fail here; Validate reports it first.
		panic(fmt.Sprintf("service selector for proxy name %q: %v", name, err))
	}
	return labels.NewSelector().Add(*req)
}

// sliceSelector leaves out the EndpointSlices of headless Services.
func sliceSelector() labels.Selector {
	req, err := labels.NewRequirement(LabelHeadless, selection.DoesNotExist, nil)
	if err != nil {
		panic(err) // a constant key and operator: cannot fail
	}
	return labels.NewSelector().Add(*req)
}

// ValidateProxyName reports whether name can be used as ServiceProxyName (a label
// value).
func ValidateProxyName(name string) error {
	if name == "" {
		return nil
	}
	if _, err := labels.NewRequirement(LabelServiceProxyName, selection.Equals, []string{name}); err != nil {
		return fmt.Errorf("service proxy name %q: %w", name, err)
	}
	return nil
}

// Run starts the informers, waits until Services and EndpointSlices have both been
// listed once, then calls update with a Snapshot of them, and again after every
// change that alters the Snapshot, until ctx is done; it then returns nil.
//
// Watches that end (an API server restart, a network break) are resumed by the
// informers, which relist when needed, so nothing is lost while the server is away:
// the source simply sends the difference when it is back.
func (s *Source) Run(ctx context.Context, update func(*service.Snapshot)) error {
	if s.Client == nil {
		return fmt.Errorf("kube source: no client")
	}
	if err := ValidateProxyName(s.ServiceProxyName); err != nil {
		return fmt.Errorf("kube source: %w", err)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	changed := make(chan struct{}, 1)
	notify := func() {
		select {
		case changed <- struct{}{}:
		default:
		}
	}
	handler := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { notify() },
		UpdateFunc: func(any, any) { notify() },
		DeleteFunc: func(any) { notify() },
	}

	factory := informers.NewSharedInformerFactoryWithOptions(s.Client, s.ResyncPeriod,
		informers.WithTransform(dropManagedFields))
	svcSel, sliceSel := ServiceSelector(s.ServiceProxyName).String(), sliceSelector().String()
	// One factory, a selector per kind: Services by proxy name, slices by headless.
	// Slices are not selected by proxy name because slices made by hand (or by a
	// controller other than Kubernetes') need not copy their Service's labels; they
	// are matched to the selected Services instead.
	svcInformer := factory.InformerFor(&v1.Service{}, func(c kubernetes.Interface, resync time.Duration) cache.SharedIndexInformer {
		return coreinformers.NewFilteredServiceInformer(c, metav1.NamespaceAll, resync,
			cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc},
			func(o *metav1.ListOptions) { o.LabelSelector = svcSel })
	})
	sliceInformer := factory.InformerFor(&discoveryv1.EndpointSlice{}, func(c kubernetes.Interface, resync time.Duration) cache.SharedIndexInformer {
		return discoveryinformers.NewFilteredEndpointSliceInformer(c, metav1.NamespaceAll, resync,
			cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc},
			func(o *metav1.ListOptions) { o.LabelSelector = sliceSel })
	})
	// failureLog (ClientConfig) logs the failed requests, rate-limited; the
	// informers' own lines would repeat each of them.
	for _, inf := range []cache.SharedIndexInformer{svcInformer, sliceInformer} {
		if err := inf.SetWatchErrorHandlerWithContext(watchError); err != nil {
			return fmt.Errorf("kube source: watch error handler: %w", err)
		}
	}
	if _, err := svcInformer.AddEventHandler(handler); err != nil {
		return fmt.Errorf("kube source: service handler: %w", err)
	}
	if _, err := sliceInformer.AddEventHandler(handler); err != nil {
		return fmt.Errorf("kube source: endpointslice handler: %w", err)
	}
	svcLister := corelisters.NewServiceLister(svcInformer.GetIndexer())
	sliceLister := discoverylisters.NewEndpointSliceLister(sliceInformer.GetIndexer())

	// zone is the node's zone as the Node informer last saw it; the build
	// loop reads it, and a change wakes it like any other change.
	var zoneMu sync.Mutex
	zone := ""
	setZone := func(n *v1.Node) {
		z := ""
		if n != nil {
			z = n.Labels[LabelZone]
		}
		zoneMu.Lock()
		changed := z != zone
		was := zone
		zone = z
		zoneMu.Unlock()
		if changed {
			klog.InfoS("This node's zone; topology hints follow it", "node", s.NodeName, "zone", z, "previous", was)
			notify()
		}
	}
	synced := []cache.InformerSynced{svcInformer.HasSynced, sliceInformer.HasSynced}
	var nodeFactory informers.SharedInformerFactory
	var nodeStore cache.Store
	if s.NodeName != "" {
		// The Node is watched by name alone: a node cannot read every other node's
		// changes cheaply, nor needs to.
		nodeFactory = informers.NewSharedInformerFactoryWithOptions(s.Client, s.ResyncPeriod,
			informers.WithTransform(dropManagedFields),
			informers.WithTweakListOptions(func(o *metav1.ListOptions) {
				o.FieldSelector = fields.OneTermEqualSelector(metav1.ObjectNameField, s.NodeName).String()
			}))
		nodeInformer := nodeFactory.Core().V1().Nodes().Informer()
		nodeStore = nodeInformer.GetStore()
		if err := nodeInformer.SetWatchErrorHandlerWithContext(watchError); err != nil {
			return fmt.Errorf("kube source: watch error handler: %w", err)
		}
		if _, err := nodeInformer.AddEventHandler(s.nodeHandler(setZone)); err != nil {
			return fmt.Errorf("kube source: node handler: %w", err)
		}
		// The first Snapshot has the zone of a Node that exists; a node not
		// registered yet lists as none, and its zone comes when it does.
		synced = append(synced, nodeInformer.HasSynced)
		nodeFactory.Start(ctx.Done())
	}
	factory.Start(ctx.Done())
	// Shutdown waits for the informers' goroutines, which end once ctx is done.
	defer func() {
		cancel()
		factory.Shutdown()
		if nodeFactory != nil {
			nodeFactory.Shutdown()
		}
	}()

	klog.InfoS("Waiting for Services and EndpointSlices", "serviceSelector", svcSel, "endpointSliceSelector", sliceSel)
	if !cache.WaitForCacheSync(ctx.Done(), synced...) {
		return nil // ctx is done
	}
	klog.InfoS("Services and EndpointSlices synced")
	if nodeStore != nil {
		if _, ok, _ := nodeStore.GetByKey(s.NodeName); !ok {
			klog.ErrorS(nil, "No Node of this node's name: it is not eligible for load balancers' traffic (/healthz answers 503) until there is one; give its name with --hostname-override", "node", s.NodeName)
		}
	}

	b := newBuilder(s.NodeName)
	b.unserved = s.Unserved
	var last *service.Snapshot
	for {
		zoneMu.Lock()
		b.setZone(zone)
		zoneMu.Unlock()
		svcs, err := svcLister.List(labels.Everything())
		if err != nil {
			return fmt.Errorf("kube source: list services: %w", err)
		}
		slices, err := sliceLister.List(labels.Everything())
		if err != nil {
			return fmt.Errorf("kube source: list endpointslices: %w", err)
		}
		snap := b.build(svcs, slices)
		if last == nil || !last.Equal(snap) {
			klog.V(2).InfoS("Services changed", "ports", len(snap.Ports), "errors", len(snap.Errors))
			last = snap
			update(snap)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-changed:
		}
	}
}

// nodeHandler hands this node's Node to setZone, then to NodeChanged if set.
func (s *Source) nodeHandler(setZone func(*v1.Node)) cache.ResourceEventHandler {
	changed := func(n *v1.Node) {
		setZone(n)
		if s.NodeChanged != nil {
			s.NodeChanged(n)
		}
	}
	return cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			if n, ok := obj.(*v1.Node); ok {
				changed(n)
			}
		},
		UpdateFunc: func(_, obj any) {
			if n, ok := obj.(*v1.Node); ok {
				changed(n)
			}
		},
		// A deleted Node has no zone: hints stay off until it is back.
		DeleteFunc: func(any) { changed(nil) },
	}
}

// dropManagedFields removes what a proxy never reads before objects enter the
// caches: on large clusters managed fields are a good part of every object.
func dropManagedFields(obj any) (any, error) {
	if a, err := meta.Accessor(obj); err == nil {
		a.SetManagedFields(nil)
	}
	return obj, nil
}
