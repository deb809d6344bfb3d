package explain

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/observe"
)

// ruleTable is one table of iptables-save output, as the trace walks it.
type ruleTable struct {
	t *iptables.Table // nil when the output has no such table
}

// parseNAT reads the nat table of iptables-save output.
func parseNAT(save []byte) ruleTable { return ruleTable{iptables.Parse(save).Table("nat")} }

// parseFilter reads the filter table of iptables-save output.
func parseFilter(save []byte) ruleTable { return ruleTable{iptables.Parse(save).Table("filter")} }

// packet is what the trace knows of the connection's first packet.
type packet struct {
	dst    netip.AddrPort
	proto  string // tcp, udp
	client netip.Addr
	local  map[netip.Addr]bool
	// recent reports whether the kernel's recent list holds ip; nil, or an
	// error, leaves a recent match undecided.
	recent func(list string, ip netip.Addr) (bool, error)
}

type tri int

const (
	no tri = iota
	maybe
	yes
)

func and(a, b tri) tri { return min(a, b) }

// match evaluates a rule's matches for p coming through hook; note says why a
// maybe is a maybe. prob is the chance a maybe matches when only a random
// choice (-m statistic) makes it one, else -1.
func (p packet) match(args []string, hook string) (m tri, note string, prob float64) {
	m, prob = yes, 1
	var notes []string
	neg := false
	for i := 0; i < len(args); i++ {
		a := args[i]
		next := func() string {
			if i+1 < len(args) {
				i++
				return args[i]
			}
			return ""
		}
		r := yes
		switch a {
		case "!":
			neg = true
			continue
		case "-j", "-g":
			i = len(args) // the target: matches are done
			continue
		case "-p":
			r = boolTri(strings.EqualFold(next(), p.proto))
		case "-d":
			r = prefixMatch(next(), p.dst.Addr())
		case "-s":
			v := next()
			if hook != "OUTPUT" && p.client.IsValid() {
				r = prefixMatch(v, p.client)
			} else {
				r = maybe
				notes = append(notes, "source "+v)
			}
		case "--dport", "--destination-port":
			r = portMatch(next(), p.dst.Port())
		case "--dports":
			r = no
			for _, s := range strings.Split(next(), ",") {
				if portMatch(s, p.dst.Port()) == yes {
					r = yes
				}
			}
		case "--dst-type":
			r = p.addrType(next(), p.local[p.dst.Addr()] || p.dst.Addr().IsLoopback())
		case "--src-type":
			r = p.addrType(next(), hook == "OUTPUT" || (p.client.IsValid() && p.local[p.client]))
		case "--probability":
			r = maybe
			v := next()
			notes = append(notes, "taken with probability "+v)
			if f, err := strconv.ParseFloat(v, 64); err == nil && prob >= 0 && !neg {
				prob *= f
			} else {
				prob = -1
			}
		case "--rcheck", "--update":
			r = maybe
			list := optionValue(args, "--name")
			if in, err := p.inRecent(list, hook); err == nil {
				r = boolTri(in)
				if in {
					notes = append(notes, fmt.Sprintf("client %s is in the recent list %s (ClientIP affinity, kept while it connects within --seconds)", p.client, list))
				}
			} else {
				notes = append(notes, "only for clients the recent list holds (ClientIP affinity)")
			}
		case "--ctstate":
			// The trace follows a connection's first packet: NEW, and no
			// other state it can know.
			if v := next(); v == "NEW" {
				r = yes
			} else {
				r = maybe
				notes = append(notes, a+" "+v)
			}
		case "--mark", "--sport", "--source-port", "-i", "-o", "--in-interface", "--out-interface":
			r = maybe
			notes = append(notes, a+" "+next())
		case "--every", "--packet":
			r = maybe
			notes = append(notes, "every "+next()+"th packet")
		case "-m", "--comment", "--mode", "--name", "--mask", "--seconds", "--hitcount":
			next() // a module name, or an option that decides nothing here
			continue
		case "--rsource", "--rdest", "--reap", "--set":
			continue
		default:
			continue
		}
		if neg {
			r = yes - r // yes<->no, maybe stays
			neg = false
		}
		if r == maybe && a != "--probability" {
			prob = -1
		}
		m = and(m, r)
		if m == no {
			return no, "", 0
		}
	}
	if m == yes {
		prob = 1
	}
	return m, strings.Join(notes, "; "), prob
}

// inRecent reports whether the client is in the recent list: it fails when the
// trace has no client, or the list cannot be read.
func (p packet) inRecent(list, hook string) (bool, error) {
	if p.recent == nil || list == "" || !p.client.IsValid() {
		return false, errors.New("no client or no recent lists")
	}
	if hook == "OUTPUT" && !p.local[p.client] {
		return false, errors.New("the node's source address is not known")
	}
	return p.recent(list, p.client)
}

// optionValue returns the value that follows option in a rule's words.
func optionValue(args []string, option string) string {
	for i := 0; i+1 < len(args); i++ {
		if args[i] == option {
			return args[i+1]
		}
	}
	return ""
}

// recentLists reads the kernel's xt_recent lists from dir (default
// /proc/net/xt_recent, of the calling process's network namespace): each line
// of a list starts with "src=IP".
func recentLists(dir string) func(list string, ip netip.Addr) (bool, error) {
	if dir == "" {
		dir = "/proc/net/xt_recent"
	}
	return func(list string, ip netip.Addr) (bool, error) {
		if strings.ContainsAny(list, "/.") {
			return false, fmt.Errorf("recent list %q: not a list name", list)
		}
		b, err := os.ReadFile(filepath.Join(dir, list))
		if err != nil {
			return false, fmt.Errorf("read recent list: %w", err)
		}
		for _, line := range strings.Split(string(b), "\n") {
			f, _, _ := strings.Cut(line, " ")
			if a, err := netip.ParseAddr(strings.TrimPrefix(f, "src=")); err == nil && a.Unmap() == ip.Unmap() {
				return true, nil
			}
		}
		return false, nil
	}
}

func boolTri(b bool) tri {
	if b {
		return yes
	}
	return no
}

func (p packet) addrType(want string, isLocal bool) tri {
	switch want {
	case "LOCAL":
		return boolTri(isLocal)
	}
	return maybe
}

func prefixMatch(v string, a netip.Addr) tri {
	if !strings.Contains(v, "/") {
		v += map[bool]string{true: "/32", false: "/128"}[a.Is4()]
	}
	pfx, err := netip.ParsePrefix(v)
	if err != nil {
		return maybe
	}
	return boolTri(pfx.Contains(a))
}

func portMatch(v string, port uint16) tri {
	lo, hi, ok := strings.Cut(v, ":")
	l, err := strconv.Atoi(lo)
	if err != nil {
		return maybe
	}
	h := l
	if ok {
		if h, err = strconv.Atoi(hi); err != nil {
			return maybe
		}
	}
	return boolTri(int(port) >= l && int(port) <= h)
}

// destination returns the address or port a rule rewrites the destination to,
// or the answer a REJECT gives; "" when there is none.
func destination(args []string) string {
	to := ""
	for i := 0; i+1 < len(args); i++ {
		switch args[i] {
		case "--to-destination", "--to-ports", "--to", "--reject-with":
			to = args[i+1]
		}
	}
	return to
}

// trace follows p through the table from hook.
func (t ruleTable) trace(hook string, p packet) rulePath {
	rp := rulePath{Hook: hook, Steps: []ruleStep{}, Verdicts: []verdict{}}
	done, decided := t.walk(&rp, hook, hook, p, true, 1, 0)
	if !done {
		v := verdict{Target: "none", Via: -1, Certain: len(rp.Verdicts) == 0}
		if decided >= 0 {
			v.Chance = 1 - decided
		}
		rp.Verdicts = append(rp.Verdicts, v)
	}
	return rp
}

// walk evaluates chain's rules in order for the packets that reach it (a share
// reach of all, -1 when not known). It returns done when a certain terminating
// verdict ended the traversal, and the share of all packets that a verdict in
// the chain (or below) took (-1 when not known).
func (t ruleTable) walk(rp *rulePath, chain, hook string, p packet, certain bool, reach float64, depth int) (done bool, decided float64) {
	if depth > 16 {
		return false, -1
	}
	// took adds to decided a share of packets a verdict took.
	took := func(share float64) {
		if share < 0 || decided < 0 {
			decided, reach = -1, -1
			return
		}
		decided += share
		reach -= share
	}
	c := t.t.Chain(chain)
	if c == nil {
		return false, decided
	}
	for _, r := range c.Rules {
		args := r.Args()
		m, note, prob := p.match(args, hook)
		if m == no {
			continue
		}
		share := -1.0
		if reach >= 0 && prob >= 0 {
			share = reach * prob
		}
		name, to := r.Target(), destination(args)
		sure := certain && m == yes
		step := ruleStep{Chain: chain, Rule: r.Index, Line: r.Line, Text: r.Text, Maybe: m == maybe, Note: note}
		switch name {
		case "DNAT", "REDIRECT", "ACCEPT", "DROP", "REJECT":
			rp.Steps = append(rp.Steps, step)
			v := verdict{Target: name, To: to, Via: len(rp.Steps) - 1, Certain: sure}
			if share >= 0 {
				v.Chance = share
			}
			rp.Verdicts = append(rp.Verdicts, v)
			if sure {
				return true, decided + share
			}
			took(share)
		case "RETURN":
			if m == yes {
				return false, decided
			}
			// A RETURN taken at random hands those packets back unexamined; the
			// trace does not follow them, so the shares below are unknown.
			reach = -1
		default:
			if t.t.Chain(name) == nil {
				continue // MARK, MASQUERADE, LOG...: the packet goes on
			}
			rp.Steps = append(rp.Steps, step)
			mark, vmark := len(rp.Steps), len(rp.Verdicts)
			done, sub := t.walk(rp, name, hook, p, sure, share, depth+1)
			if done {
				return true, -1 // only reached on a certain path: no share to report
			}
			took(sub)
			// A chain that only marked (KUBE-MARK-MASQ style) or returned:
			// drop its entry step unless something under it decided.
			if len(rp.Steps) == mark && len(rp.Verdicts) == vmark {
				rp.Steps = rp.Steps[:mark-1]
			}
		}
	}
	return false, decided
}

// kernelChoices sets, for each Service port the kernel serves, the choice the
// client gets from the traced rules: the endpoint its affinity entry (recent
// list) pins it to, or the random split among the endpoints' DNAT rules.
func (x *explanation) kernelChoices() {
	for i := range x.Services {
		st := &x.Services[i].Service
		if st.ProxyPort != 0 || st.NextForClient != nil {
			continue
		}
		eps := map[string]bool{}
		for _, e := range st.Endpoints {
			eps[e.Address] = true
		}
		c := &observe.Choice{Client: x.Client}
		var split []string
		for _, rp := range x.Rules {
			for _, v := range rp.Verdicts {
				if v.Target != "DNAT" || !eps[v.To] {
					continue
				}
				if v.Certain && len(split) == 0 {
					c.Endpoint = v.To
					c.Reason = fmt.Sprintf("%s rule %d sends every new connection there", rp.Steps[v.Via].Chain, rp.Steps[v.Via].Rule)
					if s := rp.Steps[v.Via]; s.Table != "" {
						c.Reason = fmt.Sprintf("the element of nftables %s, %s sends every new connection there", s.Table, s.Chain)
					}
					for _, s := range rp.Steps[:v.Via+1] {
						if list := optionValue(iptables.Fields(s.Text), "--name"); list != "" && !s.Maybe && strings.Contains(s.Text, "--rcheck") {
							c.Sticky = true
							c.Reason = fmt.Sprintf("ClientIP affinity: the kernel's recent list %s holds the client (%s rule %d)", list, s.Chain, s.Rule)
						}
					}
					break
				}
				share := "a share the rules alone do not tell"
				if v.Chance > 0 {
					share = fmt.Sprintf("%.0f%%", 100*v.Chance)
				}
				split = append(split, v.To+" "+share)
			}
		}
		switch {
		case c.Endpoint != "":
		case len(split) > 0:
			how := "-m statistic"
			if x.Mode == "nftables" {
				how = "numgen random, one slot per endpoint"
			}
			c.Reason = "the kernel picks at random for each new connection (" + how + "): " + strings.Join(split, ", ")
			if nftAffinity(x.Rules) {
				c.Reason = "ClientIP affinity: a client the Service port's chain has seen within the timeout goes back to its endpoint; a new one: " + c.Reason
			}
		case x.Mode == "ipvs":
			c.Reason = fmt.Sprintf("the kernel's IPVS scheduler %s picks for each new connection", st.Scheduler)
		default:
			c.Reason = "no rule sends it to an endpoint"
		}
		st.NextForClient = c
	}
}

// nftAffinity reports whether a path passes an nftables affinity element.
func nftAffinity(paths []rulePath) bool {
	for _, rp := range paths {
		for _, s := range rp.Steps {
			if s.Table != "" && s.Maybe && strings.HasPrefix(s.Note, "ClientIP affinity") {
				return true
			}
		}
	}
	return false
}
