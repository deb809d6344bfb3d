package kube

import (
	"errors"
	"fmt"
	"net/http"

	v1 "k8s.io/api/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// Defaults of the client connection, as kube-proxy's.
const (
	DefaultQPS         = 5
	DefaultBurst       = 10
	DefaultContentType = "application/vnd.kubernetes.protobuf"
)

// ClientOptions say how to reach the API server.
type ClientOptions struct {
	// Kubeconfig is a kubeconfig file; Master overrides its server address. With
	// neither, the in-cluster configuration (the Pod's ServiceAccount) is used.
	Kubeconfig string
	Master     string
	// QPS and Burst limit the client's request rate; if zero, DefaultQPS and
	// DefaultBurst.
	QPS   float32
	Burst int
	// ContentType is the encoding of requests and preferred for responses; if
	// empty, DefaultContentType. AcceptContentTypes, if set, replaces the Accept
	// header.
	ContentType        string
	AcceptContentTypes string
	// UserAgent, if set, names the client in the API server's logs and audit.
	UserAgent string
}

// ErrNoConfig is returned by ClientConfig when no way to reach an API server is
// given and the process does not run in a cluster.
var ErrNoConfig = errors.New("no API server: give --kubeconfig or --master, or run in a cluster")

// ClientConfig builds the client configuration that opts describe. Its
// clients log failed requests at the default verbosity, rate-limited, apart
// for the server and for each resource (failureLog); a Source's informers
// leave those failures to them.
func ClientConfig(opts ClientOptions) (*rest.Config, error) {
	var cfg *rest.Config
	var err error
	if opts.Kubeconfig == "" && opts.Master == "" {
		cfg, err = rest.InClusterConfig()
		if errors.Is(err, rest.ErrNotInCluster) {
			return nil, ErrNoConfig
		}
		if err != nil {
			return nil, fmt.Errorf("in-cluster config: %w", err)
		}
	} else {
		cfg, err = clientcmd.BuildConfigFromFlags(opts.Master, opts.Kubeconfig)
		if err != nil {
			return nil, fmt.Errorf("kubeconfig %q, master %q: %w", opts.Kubeconfig, opts.Master, err)
		}
	}
	cfg.QPS, cfg.Burst = opts.QPS, opts.Burst
	if cfg.QPS == 0 {
		cfg.QPS = DefaultQPS
	}
	if cfg.Burst == 0 {
		cfg.Burst = DefaultBurst
	}
	cfg.ContentType = opts.ContentType
	if cfg.ContentType == "" {
		cfg.ContentType = DefaultContentType
	}
	cfg.AcceptContentTypes = opts.AcceptContentTypes
	if opts.UserAgent != "" {
		cfg.UserAgent = opts.UserAgent
	}
	host := cfg.Host
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper { return newFailureLog(host, rt) })
	return cfg, nil
}

// LabelZone is the Node label that names its topology zone.
const LabelZone = v1.LabelTopologyZone

// ToBeDeletedTaint is the taint the cluster autoscaler puts on a Node it is about
// to remove.
const ToBeDeletedTaint = "ToBeDeletedByClusterAutoscaler"

// NodeEligible reports whether load balancers should keep sending traffic to node,
// as kube-proxy's /healthz reports it: not when the Node is being deleted or is
// tainted for removal, nor when it is unknown (nil: not listed yet, absent or
// deleted), as kube-proxy v1.36 answers without a Node.
func NodeEligible(node *v1.Node) bool {
	if node == nil {
		return false
	}
	if node.DeletionTimestamp != nil {
		return false
	}
	for _, t := range node.Spec.Taints {
		if t.Key == ToBeDeletedTaint {
			return false
		}
	}
	return true
}
