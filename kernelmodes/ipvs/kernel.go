package ipvs

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"

	"github.com/moby/ipvs"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Kernel is everything of IPVS and netlink the mode uses: virtual servers, real
// servers, and the dummy interface holding the Service IPs. NetlinkKernel is the
// real one; tests use a fake of exactly this, because IPVS cannot run where they do.
type Kernel interface {
	Services() ([]*ipvs.Service, error)
	AddService(*ipvs.Service) error
	UpdateService(*ipvs.Service) error
	DeleteService(*ipvs.Service) error
	Destinations(*ipvs.Service) ([]*ipvs.Destination, error)
	AddDestination(*ipvs.Service, *ipvs.Destination) error
	UpdateDestination(*ipvs.Service, *ipvs.Destination) error
	DeleteDestination(*ipvs.Service, *ipvs.Destination) error

	// EnsureDummy creates the dummy link name if missing and sets it up.
	EnsureDummy(name string) error
	// DeleteDummy deletes the link; a missing link is not an error.
	DeleteDummy(name string) error
	// DummyAddrs lists the link's addresses (nil, nil when the link is missing).
	DummyAddrs(name string) ([]netip.Addr, error)
	AddAddr(name string, a netip.Addr) error
	DeleteAddr(name string, a netip.Addr) error

	// SetSysctls sets the IPVS sysctls the mode relies on (see vsSysctls).
	SetSysctls() error
}

// vsSysctls are set on every sync: conntrack lets iptables masquerade what IPVS
// forwards; expire_nodest_conn drops connections to a deleted real server at
// once instead of black-holing them; expire_quiescent_template ends ClientIP
// persistence to a real server whose weight went to 0, so terminating
// endpoints really stop receiving new clients.
var vsSysctls = map[string]string{
	"net/ipv4/vs/conntrack":                 "1",
	"net/ipv4/vs/expire_nodest_conn":        "1",
	"net/ipv4/vs/expire_quiescent_template": "1",
}

// NetlinkKernel is Kernel over moby/ipvs and vishvananda/netlink, in the
// network namespace of the thread that created it.
type NetlinkKernel struct {
	h *ipvs.Handle
}

// NewNetlinkKernel opens the IPVS netlink socket.
func NewNetlinkKernel() (*NetlinkKernel, error) {
	h, err := ipvs.New("")
	if err != nil {
		return nil, fmt.Errorf("open IPVS netlink socket: %w", err)
	}
	return &NetlinkKernel{h: h}, nil
}

// Close releases the netlink socket.
func (k *NetlinkKernel) Close() { k.h.Close() }

func (k *NetlinkKernel) Services() ([]*ipvs.Service, error) { return k.h.GetServices() }
func (k *NetlinkKernel) AddService(s *ipvs.Service) error   { return k.h.NewService(s) }
func (k *NetlinkKernel) UpdateService(s *ipvs.Service) error {
	return k.h.UpdateService(s)
}
func (k *NetlinkKernel) DeleteService(s *ipvs.Service) error { return k.h.DelService(s) }
func (k *NetlinkKernel) Destinations(s *ipvs.Service) ([]*ipvs.Destination, error) {
	return k.h.GetDestinations(s)
}
func (k *NetlinkKernel) AddDestination(s *ipvs.Service, d *ipvs.Destination) error {
	return k.h.NewDestination(s, d)
}
func (k *NetlinkKernel) UpdateDestination(s *ipvs.Service, d *ipvs.Destination) error {
	return k.h.UpdateDestination(s, d)
}
func (k *NetlinkKernel) DeleteDestination(s *ipvs.Service, d *ipvs.Destination) error {
	return k.h.DelDestination(s, d)
}

func (k *NetlinkKernel) SetSysctls() error {
	for name, v := range vsSysctls {
		path := "/proc/sys/" + name
		if cur, err := os.ReadFile(path); err == nil && strings.TrimSpace(string(cur)) == v {
			continue
		}
		if err := os.WriteFile(path, []byte(v), 0o644); err != nil {
			return fmt.Errorf("set sysctl %s=%s: %w", strings.ReplaceAll(name, "/", "."), v, err)
		}
	}
	return nil
}

func (k *NetlinkKernel) EnsureDummy(name string) error { return ensureDummy(name) }
func (k *NetlinkKernel) DeleteDummy(name string) error { return deleteDummy(name) }

func (k *NetlinkKernel) DummyAddrs(name string) ([]netip.Addr, error) {
	link, err := netlink.LinkByName(name)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return nil, nil
		}
		return nil, fmt.Errorf("find link %s: %w", name, err)
	}
	list, err := netlink.AddrList(link, netlink.FAMILY_ALL)
	if err != nil {
		return nil, fmt.Errorf("list addresses of %s: %w", name, err)
	}
	var out []netip.Addr
	for _, a := range list {
		if ip, ok := netip.AddrFromSlice(a.IP); ok && !ip.Unmap().IsLinkLocalUnicast() {
			out = append(out, ip.Unmap())
		}
	}
	return out, nil
}

func (k *NetlinkKernel) AddAddr(name string, a netip.Addr) error {
	return changeAddr(name, a, netlink.AddrAdd)
}

func (k *NetlinkKernel) DeleteAddr(name string, a netip.Addr) error {
	return changeAddr(name, a, netlink.AddrDel)
}

func changeAddr(name string, a netip.Addr, op func(netlink.Link, *netlink.Addr) error) error {
	link, err := netlink.LinkByName(name)
	if err != nil {
		return fmt.Errorf("find link %s: %w", name, err)
	}
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(a.BitLen(), a.BitLen())}}
	if a.Is6() {
		// No duplicate address detection: the address would stay "tentative"
		// and unusable for a second or more, and it lives on a dummy link.
		addr.Flags = unix.IFA_F_NODAD
	}
	if err := op(link, addr); err != nil {
		return fmt.Errorf("%s on %s: %w", a, name, err)
	}
	return nil
}

// ensureDummy creates the dummy link when missing. Without CONFIG_DUMMY the
// kernel answers EOPNOTSUPP, which the caller can test with errors.Is.
func ensureDummy(name string) error {
	link, err := netlink.LinkByName(name)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if !errors.As(err, &nf) {
			return fmt.Errorf("find link %s: %w", name, err)
		}
		link = &netlink.Dummy{LinkAttrs: netlink.LinkAttrs{Name: name}}
		if err := netlink.LinkAdd(link); err != nil {
			return fmt.Errorf("create dummy link %s: %w", name, err)
		}
	}
	if err := netlink.LinkSetUp(link); err != nil {
		return fmt.Errorf("set %s up: %w", name, err)
	}
	return nil
}

func deleteDummy(name string) error {
	link, err := netlink.LinkByName(name)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return nil
		}
		return fmt.Errorf("find link %s: %w", name, err)
	}
	if err := netlink.LinkDel(link); err != nil {
		return fmt.Errorf("delete link %s: %w", name, err)
	}
	return nil
}
