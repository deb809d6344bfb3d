package ipvs

import (
	"bytes"
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/service"
)

// names are the IPVS mode's iptables chains. They differ from the iptables
// mode's and the portals', so cleaning one mode never touches another.
type names struct {
	services, postrouting       string // nat
	filter, firewall, nodePorts string // filter
	canary                      iptables.Canary
}

func namesOf(prefix string) names {
	return names{
		services:    prefix + "-IPVS-SERVICES",
		postrouting: prefix + "-IPVS-POSTROUTING",
		canary:      iptables.Canary{Chain: prefix + "-IPVS-CANARY", Tables: []string{"nat"}},
		filter:      prefix + "-IPVS-FILTER",
		firewall:    prefix + "-IPVS-FIREWALL",
		nodePorts:   prefix + "-IPVS-NODEPORTS",
	}
}

func (n names) nat() []string          { return []string{n.services, n.postrouting, n.canary.Chain} }
func (n names) filterChains() []string { return []string{n.filter, n.firewall, n.nodePorts} }

// ours is the mode's chains, for cleanup and the check that none is another
// program's (iptables.Claim).
func (n names) ours() iptables.Ours {
	return iptables.Ours{Chains: iptables.ChainSet{"nat": n.nat(), "filter": n.filterChains()}.Has}
}

// jumps lists the rules in built-in chains, each inserted first when missing.
// Each comment begins with iptables.CommentPrefix, which tells the mode's
// chains from another program's of the same name.
func (n names) jumps() []iptables.Jump {
	newOnly := []string{"-m", "conntrack", "--ctstate", "NEW"}
	jump := func(table, chain string, match []string, text, target string) iptables.Jump {
		return iptables.Jump{Table: table, Chain: chain, Spec: iptables.JumpSpec(match, text, target)}
	}
	return []iptables.Jump{
		jump("nat", "PREROUTING", nil, "ipvs service portals", n.services),
		jump("nat", "OUTPUT", nil, "ipvs service portals", n.services),
		jump("nat", "POSTROUTING", nil, "ipvs postrouting rules", n.postrouting),
		jump("filter", "INPUT", newOnly, "ipvs load balancer firewall", n.firewall),
		jump("filter", "INPUT", newOnly, "ipvs service IPs", n.filter),
		jump("filter", "INPUT", nil, "ipvs NodePorts", n.nodePorts),
	}
}

func protoName(p service.Protocol) string { return strings.ToLower(string(p)) }

// renderRules writes the family's iptables input: masquerade marks (IPVS
// forwards in NAT mode, so replies return through the node only when the
// source is the node's or the client is on the way back anyway), hairpin
// masquerade, the Service-IP filter, the source-range firewall and the NodePort
// accept rules.
func (p *Proxier) renderRules(s *service.Snapshot, v6 bool) []byte {
	n := p.n
	fam := func(a netip.Addr) bool { return a.Is6() == v6 }
	var clusterCIDRs []netip.Prefix
	for _, c := range p.cfg.ClusterCIDRs {
		if fam(c.Addr()) {
			clusterCIDRs = append(clusterCIDRs, c.Masked())
		}
	}
	var nat, filter, firewall, nodePorts, hairpin []byte
	masq := " -j MARK --or-mark " + p.mark + "\n"
	vips := map[netip.Addr]bool{}
	var vipOrder []netip.Addr
	seenHairpin := map[string]bool{}
	for _, sp := range s.Ports {
		proto := protoName(sp.Protocol)
		if protoNumber(sp.Protocol) == 0 {
			continue
		}
		name := sp.Name.String()
		match := func(ip netip.Addr, port int, comment string) string {
			return " -d " + ipNet(ip) + " -p " + proto + " -m comment --comment " + iptables.Quote(name+" "+comment) + " -m " + proto + " --dport " + strconv.Itoa(port)
		}
		addVIP := func(ip netip.Addr) {
			if !vips[ip] {
				vips[ip] = true
				vipOrder = append(vipOrder, ip)
			}
			filter = append(filter, "-A "+n.filter+match(ip, sp.Port, "service port")+" -j RETURN\n"...)
		}
		for _, ip := range cleanAddrs(sp.ClusterIPs) {
			if !fam(ip) {
				continue
			}
			addVIP(ip)
			switch {
			case p.cfg.MasqueradeAll:
				nat = append(nat, "-A "+n.services+match(ip, sp.Port, "cluster IP")+masq...)
			case len(clusterCIDRs) > 0 && !sp.InternalPolicyLocal:
				for _, c := range clusterCIDRs {
					nat = append(nat, "-A "+n.services+" ! -s "+c.String()+match(ip, sp.Port, "cluster IP")+masq...)
				}
			}
		}
		// External traffic is masqueraded unless externalTrafficPolicy Local
		// asks to keep the client address (the node's own traffic still is).
		srcLocal := ""
		if sp.ExternalPolicyLocal {
			srcLocal = " -m addrtype --src-type LOCAL"
		}
		for kind, ips := range [][]netip.Addr{sp.ExternalIPs, sp.LoadBalancerIPs} {
			comment := "external IP"
			if kind == 1 {
				comment = "loadbalancer IP"
			}
			for _, ip := range cleanAddrs(ips) {
				if !fam(ip) {
					continue
				}
				addVIP(ip)
				nat = append(nat, "-A "+n.services+match(ip, sp.Port, comment)+srcLocal+masq...)
				if kind == 1 && len(sp.LoadBalancerSourceRanges) > 0 {
					for _, r := range sp.LoadBalancerSourceRanges {
						if fam(r.Addr()) {
							firewall = append(firewall, "-A "+n.firewall+" -s "+r.Masked().String()+match(ip, sp.Port, "allowed source")+" -j RETURN\n"...)
						}
					}
					firewall = append(firewall, "-A "+n.firewall+match(ip, sp.Port, "source not allowed")+" -j DROP\n"...)
				}
			}
		}
		if sp.NodePort > 0 && len(p.nodePortIPs()) > 0 {
			fams := familiesOf(sp)
			for _, ip := range p.nodePortIPs() {
				if !fam(ip) || !fams[ip.Is6()] {
					continue
				}
				nat = append(nat, "-A "+n.services+match(ip, sp.NodePort, "nodePort")+srcLocal+masq...)
				nodePorts = append(nodePorts, "-A "+n.nodePorts+match(ip, sp.NodePort, "nodePort")+" -j ACCEPT\n"...)
			}
		}
		// Hairpin: an endpoint reaching itself through the Service would see its
		// own address as the source.
		for _, ep := range epsOfFamily(sp.Endpoints, v6) {
			line := "-A " + n.postrouting + " -s " + ipNet(ep.Addr()) + " -d " + ipNet(ep.Addr()) + " -p " + proto + " -m comment --comment " + iptables.Quote(name+" hairpin") + " -m " + proto + " --dport " + strconv.Itoa(int(ep.Port())) + " -j MASQUERADE\n"
			if !seenHairpin[line] {
				seenHairpin[line] = true
				hairpin = append(hairpin, line...)
			}
		}
	}
	for _, ip := range vipOrder {
		// The Service IPs are local addresses on the dummy link: without this,
		// anything listening on the node (sshd) would answer on them.
		filter = append(filter, "-A "+n.filter+" -d "+ipNet(ip)+` -m comment --comment "uproxy ipvs: no such service port" -j REJECT`+"\n"...)
	}

	var b bytes.Buffer
	b.WriteString("*filter\n")
	for _, c := range n.filterChains() {
		b.WriteString(":" + c + " - [0:0]\n")
	}
	b.Write(firewall)
	b.Write(filter)
	b.Write(nodePorts)
	b.WriteString("COMMIT\n*nat\n")
	for _, c := range n.nat() {
		b.WriteString(":" + c + " - [0:0]\n")
	}
	b.WriteString(n.canary.Rule() + "\n")
	b.Write(nat)
	b.Write(hairpin)
	b.WriteString("-A " + n.postrouting + " -m mark ! --mark " + p.mark + "/" + p.mark + " -j RETURN\n")
	b.WriteString("-A " + n.postrouting + " -j MARK --xor-mark " + p.mark + "\n")
	b.WriteString("-A " + n.postrouting + ` -m comment --comment "uproxy ipvs traffic requiring SNAT" -j MASQUERADE --random-fully` + "\n")
	b.WriteString("COMMIT\n")
	return b.Bytes()
}

// syncRules writes the family's rules when they changed or were flushed.
func (p *Proxier) syncRules(s *service.Snapshot, v6 bool) error {
	f := 0
	if v6 {
		f = 1
	}
	text := p.renderRules(s, v6)
	t, err := p.cfg.IPTables.Tables(v6)
	if err != nil {
		return err
	}
	if p.written[f] != nil {
		if ok, err := p.n.canary.Intact(t); !ok {
			klog.InfoS("IPVS-mode iptables rules were flushed or deleted by someone else; rewriting them", "family", iptables.FamilyName(v6), "err", err)
			p.written[f] = nil
		}
	}
	if p.written[f] != nil && bytes.Equal(p.written[f], text) {
		return nil
	}
	newJumps := p.written[f] == nil
	p.written[f] = nil
	if err := p.cfg.IPTables.Restore(v6, text); err != nil {
		return fmt.Errorf("write %s IPVS-mode iptables rules: %w", iptables.FamilyName(v6), err)
	}
	if newJumps {
		if err := iptables.EnsureJumps(t, v6, p.n.jumps()); err != nil {
			return err
		}
	}
	p.written[f] = text
	return nil
}

// cleanupRules deletes the IPVS mode's chains and the jumps to them in both
// families; another program's chain of the mode's names is left, and named in
// the error.
func cleanupRules(k iptables.Kernel, n names) error {
	if err := iptables.RemoveChains(k, n.ours()); err != nil {
		return fmt.Errorf("clean up IPVS-mode rules: %w", err)
	}
	return nil
}
