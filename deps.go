package main
import (
 _ "k8s.io/api/core/v1"
 _ "k8s.io/apimachinery/pkg/runtime"
 _ "k8s.io/client-go/kubernetes"
 _ "github.com/coreos/go-iptables/iptables"
 _ "golang.org/x/sys/unix"
 _ "github.com/vishvananda/netlink"
 _ "github.com/moby/ipvs"
 _ "github.com/hashicorp/go-multierror"
 _ "github.com/prometheus/client_golang/prometheus"
 _ "github.com/spf13/cobra"
 _ "k8s.io/klog/v2"
 _ "github.com/fsnotify/fsnotify"
 _ "sigs.k8s.io/yaml"
)
func main(){}
