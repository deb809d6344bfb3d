package explain

import (
	"fmt"
	"io"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/uproxy/uproxy/observe"
)

// describe words a verdict, naming the Service port whose proxy port it reaches.
func (x *explanation) describe(v verdict) string {
	var d string
	switch v.Target {
	case "REDIRECT":
		d = "REDIRECT to local port " + v.To
	case "DNAT":
		d = "DNAT to " + v.To
	case "REJECT":
		d = "REJECT: refused"
		if v.To != "" {
			d += " with " + v.To
		}
		return d
	default:
		return v.Target + " " + v.To
	}
	port := v.To
	if ap, err := netip.ParseAddrPort(v.To); err == nil {
		port = strconv.Itoa(int(ap.Port()))
	} else if i := strings.LastIndexByte(v.To, ':'); i >= 0 {
		port = v.To[i+1:] // "this node's address:PORT" (nftables portals)
	}
	for _, sm := range x.Services {
		if pp := sm.Service.ProxyPort; pp != 0 && strconv.Itoa(pp) == port {
			d += ", the proxy port of " + sm.Service.Name
		}
		if pp := sm.Service.ExternalProxyPort; pp != 0 && strconv.Itoa(pp) == port {
			d += ", the external traffic's proxy port of " + sm.Service.Name
		}
	}
	return d
}

func (x *explanation) writeText(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	p := func(format string, a ...any) { fmt.Fprintf(tw, format, a...) }
	p("Destination %s/%s", x.Destination, x.Protocol)
	if x.Client != "" {
		p(" from client %s", x.Client)
	}
	p("\nProxy mode: %s (asked %s)\n", x.Mode, x.MetricsAddress)
	for _, n := range x.Notes {
		p("Note: %s\n", n)
	}
	for _, sm := range x.Services {
		st := sm.Service
		p("\nService port %s (%s, matched as %s)\n", st.Name, st.Protocol, sm.MatchedAs)
		p("  Served by %s.\n", sm.ServedBy)
		if st.NotServed != "" {
			continue // no scheduler, endpoints or rules to show
		}
		p("  Scheduler %s, session affinity %s", st.Scheduler, st.SessionAffinity)
		if st.AffinityTimeout > 0 {
			p(" (%ds)", st.AffinityTimeout)
		}
		if st.Ejection != "" {
			p(", outlier ejection %s", st.Ejection)
		}
		p(".\n")
		if pol := st.Policy; pol != nil {
			p("  Retry policy: dial timeouts %s; hedge %s; retry budget %s", pol.DialTimeouts, pol.DialHedge, pol.RetryBudget)
			if pol.RetryTokens != nil {
				p(", %.1f retries left in it", *pol.RetryTokens)
			}
			p("; scheduler %s.\n", pol.Scheduler)
		}
		p("  Endpoints:\n")
		switch {
		case len(st.Endpoints) == 0 && len(st.Refused) > 0:
			p("    none: the portals refuse every connection, before any socket\n")
		case len(st.Endpoints) == 0:
			p("    none: every connection fails (reset)\n")
		}
		for _, e := range st.Endpoints {
			var state []string
			switch {
			case e.Ejected:
				state = append(state, "EJECTED"+ejectedFor(e.EjectedUntil))
			case !e.Usable:
				state = append(state, "not used")
			default:
				state = append(state, "in use")
			}
			switch {
			case e.Ready:
				state = append(state, "ready")
			case e.Serving:
				state = append(state, "serving")
			default:
				state = append(state, "not ready")
			}
			if e.Terminating {
				state = append(state, "terminating")
			}
			if st.ProxyPort == 0 && x.Mode == "iptables" {
				// The kernel keeps no per-endpoint state but its rule counters.
				p("    %s\t%s\tconnections sent %d (DNAT rule counter)\n", e.Address, strings.Join(state, ", "), e.Packets)
				continue
			}
			p("    %s\t%s\tactive %d\tconsecutive failures %d\n", e.Address, strings.Join(state, ", "), e.ActiveConnections, e.ConsecutiveFailures)
		}
		for _, r := range st.Refused {
			which := "ClusterIPs"
			if r.Addresses == "external" {
				which = "NodePort, ExternalIPs and LoadBalancer IPs"
			}
			p("  Refused at the portal: its %s %s, %s (TCP reset, ICMP port unreachable).\n", r.Family, which, r.Reason)
		}
		switch {
		case st.NextForClient != nil:
			c := st.NextForClient
			if c.Endpoint == "" && st.ProxyPort == 0 {
				p("  Next for client %s: %s.\n", c.Client, c.Reason)
			} else if c.Endpoint == "" {
				p("  Next for client %s: none (%s).\n", c.Client, c.Reason)
			} else {
				p("  Next for client %s: %s, because %s.\n", c.Client, c.Endpoint, c.Reason)
			}
			switch c.Source {
			case "client":
				p("  Its dial goes from the client's address, %s: %s.\n", c.Client, c.SourceReason)
			case "node", "hairpin":
				p("  Its dial goes from the node's address: %s.\n", c.SourceReason)
			}
		case st.NextEndpoint != "":
			because := ""
			if st.NextReason != "" {
				because = ", because " + st.NextReason
			}
			p("  Next new client: %s%s (give --client IP for a given client's choice).\n", st.NextEndpoint, because)
		case st.ProxyPort != 0 && st.Scheduler == "sh" && len(st.Endpoints) > 0:
			p("  Next new client: hangs on its address (scheduler sh); give --client IP for its choice.\n")
		}
		if st.AffinityCounters != nil && st.SessionAffinity == "ClientIP" {
			c := st.AffinityCounters
			entries := max(st.AffinityEntries, len(st.Affinity)) // a uproxy before the count gave the whole table
			p("  Affinity: %d entries, %d hits, %d misses, %d resets after failed dials, %d expired, %d evicted.\n", entries, c.Hits, c.Misses, c.Resets, c.Expired, c.Evicted)
		}
	}
	tw.Flush()

	if len(x.NFTPortals) > 0 {
		p("\nnftables portals (table %s):\n", x.NFTPortalsTable)
		for _, np := range x.NFTPortals {
			if np.Refused {
				p("  map %s: %s : goto refuse (%s)\n", np.Map, np.Key, np.Service)
				p("    => refused, its Service port having no endpoints: from pods, other hosts and this node (filter input, forward, output), a TCP reset or ICMP port unreachable, before any socket\n")
				continue
			}
			p("  map %s: %s : %d (%s)\n", np.Map, np.Key, np.ProxyPort, np.Service)
			p("    => from pods and other hosts (prerouting): to the proxy port %d on this node\n", np.ProxyPort)
			p("    => from this node (output): DNAT to node IP:%d, unless the connection is uproxy's own dial\n", np.ProxyPort)
		}
	}
	if len(x.NFTKernel) > 0 {
		p("\nnftables kernel mode (table %s):\n", x.NFTKernelTable)
		for _, e := range x.NFTKernel {
			v := ""
			if e.Value != "" {
				v = " : " + e.Value
			}
			p("  %s: %s%s (%s)\n    => %s\n", e.Set, e.Key, v, e.Service, e.Meaning)
		}
	}
	p("\nRules (nat table%s):\n", x.natSources())
	if x.RulesError != "" {
		p("  unavailable: %s\n", x.RulesError)
	}
	x.writePaths(p, x.Rules, false)
	if len(x.FilterRules) > 0 {
		p("\nRules (filter table, for the packets the nat table leaves to their destination):\n")
		x.writePaths(p, x.FilterRules, true)
	}
	tw.Flush()

	p("\nRecent retried or failed connections, newest first:\n")
	switch {
	case len(x.RecentFailures) > 0:
	case x.Mode != "userspace" && len(x.Services) > 0:
		p("  none recorded: in the %s mode uproxy does not see connections\n", x.Mode)
	default:
		p("  none\n")
	}
	for _, ev := range x.RecentFailures {
		t := ev.Time.Local().Format("15:04:05.000")
		if ev.Kind != observe.KindConnection {
			p("  %s  %s %s: %s\n", t, ev.Kind, ev.Endpoint, ev.Reason)
			continue
		}
		var as []string
		for _, a := range ev.Attempts {
			as = append(as, fmt.Sprintf("%s %s after %s", a.Endpoint, a.Result, a.Duration))
		}
		p("  %s  %s from %s: %s", t, ev.Outcome, ev.Client, strings.Join(as, ", "))
		if ev.Error != "" {
			p(" (%s)", ev.Error)
		}
		p("\n")
	}
	return tw.Flush()
}

// writePaths writes the ways through a table (the filter table when filter),
// one per hook.
func (x *explanation) writePaths(p func(string, ...any), paths []rulePath, filter bool) {
	passes := "no rule rewrites it: the packet goes to " + x.Destination + " itself"
	passesOtherwise := "otherwise: no rule rewrites it"
	if filter {
		passes, passesOtherwise = "no rule stops it", "otherwise: no rule stops it"
	}
	for _, rp := range paths {
		from := "pods and other hosts"
		if rp.Hook == "OUTPUT" {
			from = "this node"
		}
		p("  From %s (%s):\n", from, rp.Hook)
		for _, s := range rp.Steps {
			mark := ""
			if s.Maybe {
				mark = " [sometimes: " + s.Note + "]"
			}
			if s.Table != "" {
				p("    nftables %s, %s element%s:\n      %s\n", s.Table, s.Chain, mark, s.Text)
				continue
			}
			p("    %s rule %d (line %d)%s:\n      %s\n", s.Chain, s.Rule, s.Line, mark, s.Text)
		}
		for i, v := range rp.Verdicts {
			switch {
			case v.Target == "none" && v.Certain:
				p("    => %s\n", passes)
			case v.Target == "none":
				p("    => %s\n", passesOtherwise)
			default:
				how := "always"
				switch {
				case !v.Certain:
					how = "sometimes"
				case i > 0:
					how = "otherwise"
				}
				share := ""
				if v.Chance > 0 && v.Chance < 1 {
					share = fmt.Sprintf(", %.0f%% of new connections", 100*v.Chance)
				}
				if s := rp.Steps[v.Via]; s.Table != "" {
					p("    => %s %s (nftables %s, %s%s)\n", how, x.describe(v), s.Table, s.Chain, share)
					continue
				}
				p("    => %s %s (%s rule %d%s)\n", how, x.describe(v), rp.Steps[v.Via].Chain, rp.Steps[v.Via].Rule, share)
			}
		}
	}
}

// ejectedFor words the rest of an ejection: " for another 1.2s (until 15:04:05)".
func ejectedFor(until string) string {
	t, err := time.Parse(time.RFC3339Nano, until)
	if err != nil {
		return " until " + until
	}
	return fmt.Sprintf(" for another %s (until %s)", time.Until(t).Round(100*time.Millisecond), t.Local().Format("15:04:05"))
}

// natSources names the nftables tables whose elements the nat paths show
// beside iptables' rules.
func (x *explanation) natSources() string {
	var ts []string
	for _, rp := range x.Rules {
		for _, s := range rp.Steps {
			if s.Table != "" && !slices.Contains(ts, s.Table) {
				ts = append(ts, s.Table)
			}
		}
	}
	if len(ts) == 0 {
		return ""
	}
	return " of iptables, and nftables table " + strings.Join(ts, ", ")
}
