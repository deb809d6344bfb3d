// Package kernelmodes is what the kernel offers the kernel modes: it probes
// the running kernel (IPVS, dummy links, nftables, iptables), picks a mode for
// --proxy-mode auto, and refuses an explicit mode the kernel cannot run with
// one message naming what is missing. The modes themselves are its
// subpackages iptables, nftables and ipvs.
//
//	mode, reason, err := kernelmodes.Choose(requested, scheduler)
//	if err != nil { exit non-zero with err }
package kernelmodes

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/kernelmodes/nftables"
	"github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/proxymode"
)

// probeLink is the dummy link the probe creates and deletes at once.
const probeLink = "uproxy-probe0"

// Verdict is what the kernel offers the kernel modes. Each Missing list names
// the absent features as a user should read them, with the kernel option.
type Verdict struct {
	// IPVSMissing is empty when the IPVS mode can run.
	IPVSMissing []string
	// NFTablesMissing is empty when the nftables mode can run.
	NFTablesMissing []string
	// IPTablesMissing is empty when the iptables mode can run.
	IPTablesMissing []string
	// Notes are findings that do not block a mode (e.g. an unverifiable
	// scheduler module).
	Notes []string
}

// IPVS reports whether the IPVS mode can run.
func (v Verdict) IPVS() bool { return len(v.IPVSMissing) == 0 }

// NFTables reports whether the nftables mode can run.
func (v Verdict) NFTables() bool { return len(v.NFTablesMissing) == 0 }

// IPTables reports whether the iptables mode can run.
func (v Verdict) IPTables() bool { return len(v.IPTablesMissing) == 0 }

// IPVSError is nil when the IPVS mode can run, else the one message to show:
// what is missing and what to use instead.
func (v Verdict) IPVSError() error {
	if v.IPVS() {
		return nil
	}
	return fmt.Errorf("ipvs mode unavailable on this kernel: %s; %s", strings.Join(v.IPVSMissing, ", "), v.alternatives(v.NFTables(), v.IPTables()))
}

// alternatives names the modes to use instead of one the kernel cannot run.
func (v Verdict) alternatives(nft, ipt bool) string {
	var alts []string
	if nft {
		alts = append(alts, "--proxy-mode nftables")
	}
	if ipt {
		alts = append(alts, "--proxy-mode iptables")
	}
	return "use " + strings.Join(append(alts, "--proxy-mode userspace"), " or ")
}

// NFTablesError is nil when the nftables mode can run, else the one message
// to show: what is missing and what to use instead.
func (v Verdict) NFTablesError() error {
	if v.NFTables() {
		return nil
	}
	return fmt.Errorf("nftables mode unavailable: %s; %s", strings.Join(v.NFTablesMissing, ", "), v.alternatives(false, v.IPTables()))
}

// IPTablesError is nil when the iptables mode can run.
func (v Verdict) IPTablesError() error {
	if v.IPTables() {
		return nil
	}
	return fmt.Errorf("iptables mode unavailable: %s; use --proxy-mode userspace", strings.Join(v.IPTablesMissing, ", "))
}

// Probe examines the kernel of the calling thread's network namespace. It
// changes nothing that outlives it: the only thing it creates is a dummy link
// it deletes at once. schedulers are the IPVS schedulers to check ("rr" when none).
func Probe(schedulers ...string) Verdict {
	var v Verdict
	if len(schedulers) == 0 {
		schedulers = []string{"rr"}
	}
	hasIPVS := true
	if _, err := netlink.GenlFamilyGet("IPVS"); err != nil {
		hasIPVS = false
		v.IPVSMissing = append(v.IPVSMissing, "no IPVS netlink family (CONFIG_IP_VS)")
	}
	if err := probeDummy(); err != nil {
		v.IPVSMissing = append(v.IPVSMissing, err.Error())
	}
	if hasIPVS {
		for _, s := range schedulers {
			ok, known := schedulerAvailable(s)
			switch {
			case !known:
				v.Notes = append(v.Notes, fmt.Sprintf("cannot verify the IPVS scheduler module ip_vs_%s (no /lib/modules for this kernel)", s))
			case !ok:
				v.IPVSMissing = append(v.IPVSMissing, fmt.Sprintf("no IPVS scheduler %s (CONFIG_IP_VS_%s)", s, strings.ToUpper(s)))
			}
		}
	}
	if err := nftables.Probe(); err != nil {
		v.NFTablesMissing = append(v.NFTablesMissing, err.Error())
	}
	v.IPTablesMissing = probeIPTables()
	return v
}

// probeDummy creates and deletes a dummy link. EOPNOTSUPP (or ENOTSUP) is the
// kernel saying it has no dummy driver.
func probeDummy() error {
	link := &netlink.Dummy{LinkAttrs: netlink.LinkAttrs{Name: probeLink}}
	err := netlink.LinkAdd(link)
	switch {
	case err == nil:
		if err := netlink.LinkDel(link); err != nil {
			return fmt.Errorf("cannot delete the probe dummy link %s: %v", probeLink, err)
		}
		return nil
	case errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOTSUP):
		return errors.New("cannot create dummy links (CONFIG_DUMMY)")
	case errors.Is(err, unix.EEXIST):
		// A previous probe died before deleting it: the driver exists.
		netlink.LinkDel(link)
		return nil
	case errors.Is(err, unix.EPERM):
		return errors.New("cannot create dummy links (no CAP_NET_ADMIN)")
	default:
		return fmt.Errorf("cannot create dummy links: %v", err)
	}
}

// schedulerAvailable looks for the scheduler's module: loaded or built in
// (/sys/module, modules.builtin) or loadable (modules.dep), IPVS loading it on
// demand. known is false when there is nowhere to look.
func schedulerAvailable(s string) (ok, known bool) {
	mod := "ip_vs_" + s
	if _, err := os.Stat("/sys/module/" + mod); err == nil {
		return true, true
	}
	var uts unix.Utsname
	if err := unix.Uname(&uts); err != nil {
		return false, false
	}
	dir := "/lib/modules/" + unix.ByteSliceToString(uts.Release[:])
	for _, f := range []string{"modules.builtin", "modules.dep"} {
		data, err := os.ReadFile(dir + "/" + f)
		if err != nil {
			continue
		}
		known = true
		sc := bufio.NewScanner(strings.NewReader(string(data)))
		for sc.Scan() {
			path, _, _ := strings.Cut(sc.Text(), ":")
			base := path[strings.LastIndex(path, "/")+1:]
			if strings.HasPrefix(base, mod+".ko") {
				return true, true
			}
		}
	}
	return false, known
}

// probeIPTables checks that iptables-restore exists and the nat table answers.
func probeIPTables() []string {
	var missing []string
	for _, c := range []string{"iptables-restore", "iptables-save"} {
		if _, err := exec.LookPath(c); err != nil {
			missing = append(missing, "no "+c+" command")
		}
	}
	if len(missing) > 0 {
		return missing
	}
	t, err := iptables.Commands{}.Tables(false)
	if err == nil {
		_, err = t.List("nat", "OUTPUT")
	}
	if err != nil {
		missing = append(missing, fmt.Sprintf("the iptables nat table is unusable (CONFIG_IP_NF_NAT or CONFIG_NF_TABLES): %v", err))
	}
	return missing
}

// Choose resolves --proxy-mode. "auto" (or "") picks ipvs when the kernel runs
// it, else nftables, else iptables, else userspace, and reason says why. An
// explicit kernel mode the kernel cannot run is an error naming what is missing, for the
// caller to exit non-zero with. scheduler is the IPVS scheduler ("" for rr).
func Choose(requested, scheduler string) (mode, reason string, err error) {
	switch requested {
	case proxymode.Userspace:
		return proxymode.Userspace, "requested", nil
	case "", proxymode.Auto, proxymode.IPVS, proxymode.NFTables, proxymode.IPTables:
	default:
		return "", "", fmt.Errorf("--proxy-mode %q: want auto, userspace, iptables, nftables or ipvs", requested)
	}
	if scheduler == "" {
		scheduler = "rr"
	}
	return choose(requested, Probe(scheduler))
}

// choose decides from a verdict; Choose probes first.
func choose(requested string, v Verdict) (mode, reason string, err error) {
	switch requested {
	case proxymode.IPVS:
		if err := v.IPVSError(); err != nil {
			return "", "", err
		}
		return proxymode.IPVS, "requested", nil
	case proxymode.NFTables:
		if err := v.NFTablesError(); err != nil {
			return "", "", err
		}
		return proxymode.NFTables, "requested", nil
	case proxymode.IPTables:
		if err := v.IPTablesError(); err != nil {
			return "", "", err
		}
		return proxymode.IPTables, "requested", nil
	}
	if v.IPVS() {
		return proxymode.IPVS, "auto: the kernel offers IPVS and dummy links", nil
	}
	why := "auto: " + strings.Join(v.IPVSMissing, ", ")
	if v.NFTables() {
		return proxymode.NFTables, why + "; nftables works", nil
	}
	why += "; " + strings.Join(v.NFTablesMissing, ", ")
	if v.IPTables() {
		return proxymode.IPTables, why + "; iptables works", nil
	}
	return proxymode.Userspace, why + "; " + strings.Join(v.IPTablesMissing, ", "), nil
}
