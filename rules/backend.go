package rules

import (
	"errors"
	"fmt"
	"net/netip"

	"k8s.io/klog/v2"
)

// A Backend is what carries the portals, as --rules names it.
type Backend string

// The backends. BackendAuto is a request, resolved by ChooseBackend.
const (
	BackendNFTables Backend = "nftables"
	BackendIPTables Backend = "iptables"
	BackendNone     Backend = "none"
	BackendAuto     Backend = "auto"
)

// ParseBackend reads --rules: a backend's name or auto ("" is auto).
func ParseBackend(s string) (Backend, error) {
	switch b := Backend(s); b {
	case BackendNFTables, BackendIPTables, BackendNone, BackendAuto:
		return b, nil
	case "":
		return BackendAuto, nil
	}
	return "", fmt.Errorf("--rules %q: want nftables, iptables, none or auto", s)
}

// ChooseBackend resolves BackendAuto (any other backend is kept): nftables
// where nft and the kernel take the portals' whole layout of chain prefix
// prefix, else iptables; none when the node has no IPv4 address for the
// portals of its own connections (ips: the node IPs). It logs the choice and
// why. Auto is only asked for as root: without root there are no portals to
// choose.
func ChooseBackend(requested Backend, prefix string, ips []netip.Addr) Backend {
	if requested != BackendAuto {
		return requested
	}
	if err := CheckNodeIPs(ips); err != nil {
		klog.InfoS("Portal rules", "rules", BackendNone, "reason", "auto: "+err.Error()+"; clients reach Services on their proxy ports")
		return BackendNone
	}
	if err := ProbeNFTables(prefix); err != nil {
		klog.InfoS("Portal rules", "rules", BackendIPTables, "reason", "auto: "+err.Error())
		return BackendIPTables
	}
	klog.InfoS("Portal rules", "rules", BackendNFTables, "reason", "auto: nft and the kernel support the nftables portals")
	return BackendNFTables
}

// New builds the portals of backend b (resolved: not auto); BackendNone is
// None, which programs nothing. No backend touches the kernel before its
// first Sync. An error names the flag.
func New(b Backend, cfg Config) (Portals, error) {
	var p Portals
	var err error
	switch b {
	case BackendNone:
		return None{}, nil
	case BackendNFTables:
		p, err = NewNFTables(cfg)
	case BackendIPTables:
		p, err = NewIPTables(cfg)
	default:
		return nil, fmt.Errorf("--rules %q: want nftables, iptables or none", b)
	}
	flag := "--rules " + string(b)
	if cfg.Chosen {
		flag = "--rules auto, which chose " + string(b)
	}
	if _, ok := errors.AsType[*NoNodeIPError](err); ok {
		return nil, fmt.Errorf("%s: %w (give an interface an address, set --bind-address to the node IP, or run with --rules none)", flag, err)
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w", flag, err)
	}
	return p, nil
}
