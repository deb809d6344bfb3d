package explain

import (
	"fmt"
	"strconv"
	"strings"
)

// The nftables tables (the portals of --rules nftables, the nftables kernel
// mode) decide in one map lookup what the iptables nat rules would decide in
// a chain walk: the element found for the destination is the data path's
// decision. nftPaths puts those decisions on the traced ways through nat, so
// that the verdicts, the note on missing portals, the filter trace and the
// kernel's next choice read one account of where the packet goes.

// nftPaths adds the verdicts of the nftables elements found for the
// destination to the nat paths of hooks (creating a path where iptables-save
// gave none), in place of "no rule rewrites it".
func (x *explanation) nftPaths(hooks []string) {
	for _, h := range hooks {
		steps, verdicts := x.nftVerdicts(h)
		if len(verdicts) == 0 {
			continue
		}
		i := -1
		for j := range x.Rules {
			if x.Rules[j].Hook == h {
				i = j
			}
		}
		if i < 0 {
			x.Rules = append(x.Rules, rulePath{Hook: h})
			i = len(x.Rules) - 1
		}
		rp := &x.Rules[i]
		kept := rp.Verdicts[:0]
		for _, v := range rp.Verdicts {
			if v.Target != "none" {
				kept = append(kept, v)
			}
		}
		rp.Verdicts = kept
		base := len(rp.Steps)
		rp.Steps = append(rp.Steps, steps...)
		for _, v := range verdicts {
			v.Via += base
			rp.Verdicts = append(rp.Verdicts, v)
		}
	}
}

// nftVerdicts returns the steps and verdicts of the nftables elements for
// the nat hook h (PREROUTING or OUTPUT); Via counts from the first step.
func (x *explanation) nftVerdicts(h string) ([]ruleStep, []verdict) {
	var steps []ruleStep
	var verdicts []verdict
	for _, np := range x.NFTPortals {
		if np.Refused {
			continue // no nat element: the filter hooks refuse it
		}
		step := ruleStep{Table: x.NFTPortalsTable, Chain: np.Map, Text: fmt.Sprintf("%s : %d (%s)", np.Key, np.ProxyPort, np.Service)}
		external := strings.HasPrefix(np.Map, "external-ips")
		// The portals' rules (rules.nftLayout): prerouting steers to the
		// proxy port, output DNATs to the node's address and the proxy
		// port; ExternalIPs only from outside the node, or from the node
		// when it owns them.
		v := verdict{Target: "REDIRECT", To: strconv.Itoa(np.ProxyPort), Certain: !external, Via: len(steps)}
		if h == "OUTPUT" {
			v.Target, v.To = "DNAT", "this node's address:"+strconv.Itoa(np.ProxyPort)
		}
		if external {
			step.Maybe, step.Note = true, "ExternalIPs: from outside the node, or from the node when it owns the address"
		}
		steps = append(steps, step)
		verdicts = append(verdicts, v)
	}
	affinity := -1
	for _, e := range x.NFTKernel {
		switch {
		case e.Affinity && !e.Local:
			affinity = len(steps)
			steps = append(steps, ruleStep{Table: x.NFTKernelTable, Chain: e.Set, Text: e.Key + " : " + e.Value + " (" + e.Service + ")",
				Maybe: true, Note: "ClientIP affinity: a client seen within the timeout goes back to its endpoint"})
		case e.Endpoint != "":
			step := ruleStep{Table: x.NFTKernelTable, Chain: e.Set, Text: e.Key + " : " + e.Value + " (" + e.Service + ")"}
			v := verdict{Target: "DNAT", To: e.Endpoint, Via: len(steps), Chance: e.Share, Certain: e.Share == 1 && affinity < 0}
			if e.Local {
				// Only traffic from outside to an externalTrafficPolicy
				// Local port picks here: its share is of that traffic.
				step.Maybe, step.Note = true, "externalTrafficPolicy Local, traffic from outside"
				v.Certain, v.Chance = false, 0
			}
			if affinity >= 0 {
				v.Chance = 0 // a new client's share; a known one goes back
			}
			steps = append(steps, step)
			verdicts = append(verdicts, v)
		}
	}
	return steps, verdicts
}
