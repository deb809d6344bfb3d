package ipvs

import (
	"errors"
	"fmt"
	"net/netip"

	"github.com/hashicorp/go-multierror"
	"github.com/moby/ipvs"
	"github.com/vishvananda/netlink"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/netfilter/iptables"
)

// Cleanup removes the virtual servers this proxier owns (and any on the dummy
// link's addresses), the dummy link and the iptables chains.
func (p *Proxier) Cleanup() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var errs []error
	if current, err := p.k.Services(); err == nil {
		for _, vs := range current {
			if p.owned[keyOf(vs)] {
				if err := p.k.DeleteService(vs); err != nil {
					errs = append(errs, fmt.Errorf("delete IPVS service %s: %w", keyOf(vs), err))
				}
			}
		}
	}
	p.owned, p.written, p.last, p.byPort = nil, [2][]byte{}, nil, nil
	if err := cleanup(p.k, p.cfg.IPTables, p.n); err != nil {
		errs = append(errs, err)
	}
	return multierror.Append(nil, errs...).ErrorOrNil()
}

// Cleanup removes what the IPVS mode with this chain prefix leaves in the
// calling thread's namespace: its iptables chains always; when IPVS exists,
// the virtual servers on the dummy link's addresses; the dummy link. A kernel
// without IPVS or dummy links has nothing of it, which is not an error.
func Cleanup(prefix string) error {
	prefix, err := iptables.ChainPrefix(prefix)
	if err != nil {
		return err
	}
	var k Kernel
	// Looking the family up first keeps moby/ipvs from trying modprobe and
	// logging errors on kernels without IPVS, where only the link can be left.
	if _, err := netlink.GenlFamilyGet("IPVS"); err == nil {
		if nk, err := NewNetlinkKernel(); err == nil {
			defer nk.Close()
			k = nk
		}
	}
	return cleanup(k, iptables.Commands{}, namesOf(prefix))
}

// Chains returns what the IPVS mode owns of a family's iptables tables with
// this chain prefix ("" for the default), for a check that none of it is
// another program's before anything is written (iptables.Claim).
func Chains(prefix string) (iptables.Ours, error) {
	prefix, err := iptables.ChainPrefix(prefix)
	if err != nil {
		return iptables.Ours{}, err
	}
	return namesOf(prefix).ours(), nil
}

// cleanup removes the IPVS mode's state; k may be nil (no IPVS socket), and a
// k whose Services fails (no IPVS family) still gets its dummy link removed.
func cleanup(k Kernel, rk iptables.Kernel, n names) error {
	var errs []error
	if err := cleanupRules(rk, n); err != nil {
		errs = append(errs, err)
	}
	if k == nil {
		k = &linkOnly{}
	}
	addrs, err := k.DummyAddrs(DummyName)
	if err != nil {
		errs = append(errs, err)
	}
	on := map[netip.Addr]bool{}
	for _, a := range addrs {
		on[a] = true
	}
	if len(on) > 0 {
		if current, err := k.Services(); err == nil {
			for _, vs := range current {
				if on[keyOf(vs).addr] {
					if err := k.DeleteService(vs); err != nil {
						errs = append(errs, fmt.Errorf("delete IPVS service %s: %w", keyOf(vs), err))
					}
				}
			}
		} else if !errors.Is(err, errNoIPVS) {
			klog.V(2).InfoS("Listing IPVS services for cleanup", "err", err)
		}
	}
	if err := k.DeleteDummy(DummyName); err != nil {
		errs = append(errs, err)
	}
	return multierror.Append(nil, errs...).ErrorOrNil()
}

var errNoIPVS = errors.New("no IPVS netlink socket")

// linkOnly is the Kernel of a cleanup without IPVS: the dummy link can still be
// found and deleted; there are no virtual servers.
type linkOnly struct{ NetlinkKernel }

func (*linkOnly) Services() ([]*ipvs.Service, error) { return nil, errNoIPVS }
