package app

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/nodeaddr"
	"github.com/uproxy/uproxy/proxymode"
)

// modeFlag is a flag that only some proxy modes use.
type modeFlag struct {
	name  string
	modes []string
	// warn marks a flag that is warned of, not refused, where it has no use:
	// one standing for a kube-proxy setting, which kube-proxy takes in every
	// mode, or one that does no harm to a mode that has nothing for it to do.
	warn bool
}

var (
	userspaceOnly    = []string{proxymode.Userspace}
	userspaceAndIPVS = []string{proxymode.Userspace, proxymode.IPVS}
	modeFlags        = []modeFlag{
		{name: "rules", modes: userspaceOnly},
		{name: "proxy-port-range", modes: userspaceOnly, warn: true},
		{name: "udp-timeout", modes: userspaceOnly},
		{name: "udp-max-clients", modes: userspaceOnly},
		{name: "dial-timeouts", modes: userspaceOnly},
		{name: "tcp-keepalive", modes: userspaceOnly},
		{name: "tcp-idle-timeout", modes: userspaceOnly},
		{name: "dial-mark-bit", modes: userspaceOnly},
		{name: "preserve-client-address", modes: userspaceOnly},
		{name: "client-address-mark-bit", modes: userspaceOnly},
		{name: "event-loops", modes: userspaceOnly},
		{name: "dial-hedge", modes: userspaceOnly},
		{name: "retry-budget", modes: userspaceOnly},
		{name: "eject-after", modes: userspaceOnly},
		{name: "events", modes: userspaceOnly},
		// The kernel modes have no connections to drain at exit.
		{name: "shutdown-grace", modes: userspaceOnly, warn: true},
		// kube-proxy takes --ipvs-scheduler in every mode.
		{name: "scheduler", modes: userspaceAndIPVS, warn: true},
		// kube-proxy takes it in every mode, and uses it in its iptables mode.
		{name: "iptables-localhost-nodeports", modes: []string{proxymode.IPTables}, warn: true},
	}
)

// usesFlag reports whether mode uses the flag name.
func usesFlag(mode, name string) bool {
	for _, f := range modeFlags {
		if f.name == name {
			return slices.Contains(f.modes, mode)
		}
	}
	return true
}

// unusedModeFlags returns the flags given on the command line that mode does
// not use: those refused, and those only warned of, a flag marked warn
// (kube-proxy takes it in every mode) or any when the mode was chosen by
// --proxy-mode auto rather than by the user. Flags that --config set are its
// fields, which kube-proxy takes in every mode: they are left alone.
func (o *options) unusedModeFlags(mode string) (refused, warned []modeFlag) {
	if o.flags == nil {
		return nil, nil
	}
	auto := o.proxyMode == "" || o.proxyMode == proxymode.Auto
	for _, f := range modeFlags {
		_, fromFile := o.configFields[f.name]
		if !o.flags.Changed(f.name) || fromFile || slices.Contains(f.modes, mode) {
			continue
		}
		if f.warn || auto {
			warned = append(warned, f)
		} else {
			refused = append(refused, f)
		}
	}
	return refused, warned
}

// checkModeFlags refuses the flags given on the command line that mode does
// not use (see unusedModeFlags), so that a flag is never accepted and then
// ignored. It logs nothing: it runs before the start logs anything.
func (o *options) checkModeFlags(mode string) error {
	refused, _ := o.unusedModeFlags(mode)
	if len(refused) == 0 {
		return nil
	}
	msgs := make([]string, len(refused))
	for i, f := range refused {
		msgs[i] = fmt.Sprintf("--%s: the %s mode does not use it (the %s mode does); leave it out", f.name, mode, strings.Join(f.modes, ", "))
	}
	return errors.New(strings.Join(msgs, "; "))
}

// warnModeFlags logs, once each, the flags mode does not use that
// checkModeFlags lets pass.
func (o *options) warnModeFlags(mode string) {
	_, warned := o.unusedModeFlags(mode)
	for _, f := range warned {
		klog.InfoS("Ignoring a flag the proxy mode does not use", "flag", "--"+f.name, "mode", mode, "usedBy", strings.Join(f.modes, ", "))
	}
}

// checkSourceFlags refuses the flags of the API source beside --services,
// whose manifests are the only source then: they would be ignored.
func (o *options) checkSourceFlags() error {
	if o.services == "" {
		return nil
	}
	for _, f := range []struct{ flag, value string }{
		{"--kubeconfig", o.kubeconfig},
		{"--master", o.master},
		{"--service-proxy-name", o.serviceProxyName},
	} {
		if f.value != "" {
			return fmt.Errorf("%s %q: the Services come from --services %s, and only the API server's are selected by it; give one source", f.flag, f.value, o.services)
		}
	}
	return nil
}

// checkServicesPath checks at start that --services names something, so that a
// wrong path fails the start naming the flag, before anything is logged.
func (o *options) checkServicesPath() error {
	if o.services == "" {
		return nil
	}
	if _, err := os.Stat(o.services); err != nil {
		if pe, ok := errors.AsType[*fs.PathError](err); ok {
			err = pe.Err // the path is named once, with the flag
		}
		return fmt.Errorf("--services %s: %w", o.services, err)
	}
	return nil
}

// checkBindAddress checks at start that a specific --bind-address is an
// address of this node, by binding it as the HTTP addresses are bound: the
// proxy ports, opened at every sync, would otherwise fail one by one.
func checkBindAddress(addr netip.Addr) error {
	if !addr.IsValid() || addr.IsUnspecified() {
		return nil
	}
	ln, err := net.Listen("tcp", netip.AddrPortFrom(addr, 0).String())
	if err != nil {
		hint := "not an address of this node"
		if addr.IsLinkLocalUnicast() && addr.Zone() == "" {
			hint = "a link-local address needs its interface, which --bind-address cannot name"
		}
		return fmt.Errorf("--bind-address %s: %s: %w", addr, hint, err)
	}
	ln.Close()
	// The kernel lets a socket bind more than the node's addresses: a
	// subnet's broadcast address, any address with net.ipv4.ip_nonlocal_bind.
	// No client connects to those, so the address must be an interface's
	// (any loopback address reaches lo).
	if !addr.IsLoopback() {
		addrs, err := nodeaddr.List()
		if err == nil && !slices.Contains(addrs, addr.Unmap().WithZone("")) {
			return fmt.Errorf("--bind-address %s: not an address of this node: no interface has it (the kernel lets a broadcast address, or any address with net.ipv4.ip_nonlocal_bind, be bound, but no client connects there)", addr)
		}
	}
	return nil
}

// hasNetAdmin reports whether the process may change the packet filter and
// links (CAP_NET_ADMIN in its effective set).
func hasNetAdmin() bool {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return true // unknown: let the steps say what they can
	}
	return data[unix.CAP_NET_ADMIN/32].Effective&(1<<(unix.CAP_NET_ADMIN%32)) != 0
}
