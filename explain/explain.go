// Package explain narrates what happens to a connection to a Service address,
// for `uproxy explain`: which nat rule catches it from pods and from the node,
// which Service port it is and what serves it (a userspace proxy port or the
// kernel), the endpoints and their state, the next choice for a client, and the
// recent connections that were retried or failed.
//
//	err := explain.Run(os.Stdout, "10.96.0.10:80/tcp", explain.Options{Client: "10.244.1.7"})
//
// It reads the running uproxy's metrics address (client.go) and the kernel's
// nat rules through netfilter/iptables' parser, follows the rules for the
// connection's first packet (trace.go) and writes the result as text (text.go)
// or JSON. Where no nat rule rewrites the packet, it follows the filter table
// too, where the portals refuse a Service port without endpoints; what the
// running uproxy refuses, and why, comes from /debug/services, which reports
// the Refusal the portals were given (rules.RefusalOf).
package explain

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"time"

	knft "github.com/uproxy/uproxy/kernelmodes/nftables"
	"github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/nodeaddr"
	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/rules"
	"sigs.k8s.io/knftables"
)

// DefaultMetricsAddress is uproxy's default --metrics-bind-address.
const DefaultMetricsAddress = "127.0.0.1:10249"

// Options are what `uproxy explain` takes besides the destination. The zero
// value asks the proxy at DefaultMetricsAddress, runs iptables-save, writes
// text and lists no recent failures.
type Options struct {
	// Client is the client IP to explain the choice for; "" for any client,
	// and then the rules from both pods and the node are shown.
	Client string
	// MetricsAddress is HOST:PORT of the running uproxy's metrics address;
	// DefaultMetricsAddress when empty.
	MetricsAddress string
	// Output is "text" or "json"; "" is text.
	Output string
	// IPTablesSave is a file holding iptables-save output to read the rules
	// from; "" runs iptables-save, "-" reads Stdin.
	IPTablesSave string
	// Stdin is what IPTablesSave "-" reads; nil is os.Stdin.
	Stdin io.Reader
	// Events is how many recent retried or failed connections to show (the
	// command's default is 10).
	Events int
	// RecentDir holds the kernel's xt_recent lists (ClientIP affinity of the
	// iptables mode); "" is /proc/net/xt_recent.
	RecentDir string
	// ChainPrefix is the running uproxy's --chain-prefix, which names its
	// nftables portals' table; "" is the default.
	ChainPrefix string
	// NFT reads the nftables portals; nil runs nft on the table ChainPrefix
	// names (and, without nft, shows no nftables portals).
	NFT knftables.Interface
	// NFTKernel reads the nftables kernel mode's table; nil runs nft on the
	// table ChainPrefix names.
	NFTKernel knftables.Interface
}

func (o *Options) metricsAddress() string {
	if o.MetricsAddress == "" {
		return DefaultMetricsAddress
	}
	return o.MetricsAddress
}

// explanation is the -o json form of `uproxy explain`.
type explanation struct {
	Destination    string         `json:"destination"`
	Protocol       string         `json:"protocol"`
	Client         string         `json:"client,omitempty"`
	Mode           string         `json:"mode"`
	MetricsAddress string         `json:"metricsAddress"`
	Services       []serviceMatch `json:"services"`
	Rules          []rulePath     `json:"rules"`
	// FilterRules are the ways through the filter table of the packets the
	// nat table leaves to their destination, where they decide something
	// (the portals' REJECT of a Service port without endpoints, a firewall).
	FilterRules []rulePath `json:"filterRules,omitempty"`
	RulesError  string     `json:"rulesError,omitempty"`
	// NFTPortals are the elements of the userspace mode's nftables portals that
	// catch the destination (--rules nftables).
	NFTPortals      []rules.NFTPortal `json:"nftPortals,omitempty"`
	NFTPortalsTable string            `json:"nftPortalsTable,omitempty"`
	// NFTKernel are the elements of the nftables kernel mode's table that
	// concern the destination (--proxy-mode nftables).
	NFTKernel      []knft.Element  `json:"nftKernel,omitempty"`
	NFTKernelTable string          `json:"nftKernelTable,omitempty"`
	RecentFailures []observe.Event `json:"recentFailures"`
	// Conflicts are the Service ports left out because another one serves the
	// destination.
	Conflicts []observe.ConflictState `json:"conflicts,omitempty"`
	Notes     []string                `json:"notes,omitempty"`
}

// serviceMatch is one Service port that has the destination.
type serviceMatch struct {
	// MatchedAs says how the destination belongs to the Service port: clusterIP,
	// externalIP, loadBalancerIP, nodePort, proxyPort or externalProxyPort.
	MatchedAs string `json:"matchedAs"`
	// ServedBy says what carries the connection: the proxy port or the kernel.
	ServedBy string               `json:"servedBy"`
	Service  observe.ServiceState `json:"service"`
}

// rulePath is the way through the nat or the filter table from one hook.
type rulePath struct {
	// Hook is PREROUTING (nat), INPUT or FORWARD (filter) for pods and other
	// hosts, or OUTPUT for this node.
	Hook  string     `json:"hook"`
	Steps []ruleStep `json:"steps"`
	// Verdicts are where the packet may end up: one when the path is certain, one
	// per branch where the rules choose at random (kernel modes) or by state the
	// rules alone do not show (affinity, marks).
	Verdicts []verdict `json:"verdicts"`
}

type ruleStep struct {
	// Table is set for an element of an nftables table ("inet uproxy"):
	// Chain is then its map and Text the element; Rule and Line are 0.
	Table string `json:"table,omitempty"`
	Chain string `json:"chain"`
	// Rule is the rule's number in its chain (as `iptables -t nat -L CHAIN
	// --line-numbers` counts); Line its line in the iptables-save output.
	Rule int    `json:"rule"`
	Line int    `json:"line"`
	Text string `json:"text"`
	// Maybe is true when the rule matches only sometimes (statistic, recent, mark...).
	Maybe bool   `json:"maybe,omitempty"`
	Note  string `json:"note,omitempty"`
}

type verdict struct {
	Target string `json:"target"` // DNAT, REDIRECT, ACCEPT, DROP, REJECT, or "none"
	To     string `json:"to,omitempty"`
	// Via is the index in Steps of the rule that decided.
	Via     int  `json:"via"`
	Certain bool `json:"certain"`
	// Chance is the share of connections that get this verdict, when the only
	// uncertainty on the way is a random choice (-m statistic); 0 when other
	// state (marks, sources the trace does not know) decides too.
	Chance float64 `json:"chance,omitempty"`
}

// Run explains a connection to destination, IP:PORT[/tcp|udp|sctp] (the protocol
// defaults to tcp), writing the explanation to w.
func Run(w io.Writer, destination string, o Options) error {
	dst, proto, err := parseDestination(destination)
	if err != nil {
		return err
	}
	if o.Events < 0 {
		return fmt.Errorf("--events %d: want 0 or more", o.Events)
	}
	if o.IPTablesSave != "" && o.IPTablesSave != "-" {
		if _, err := os.Stat(o.IPTablesSave); err != nil {
			return fmt.Errorf("--iptables-save-file: %w", err)
		}
	}
	var client netip.Addr
	if o.Client != "" {
		if client, err = netip.ParseAddr(o.Client); err != nil {
			return fmt.Errorf("--client %q: not an IP address", o.Client)
		}
	}
	output := o.Output
	if output == "" {
		output = "text"
	}
	if output != "text" && output != "json" {
		return fmt.Errorf("-o %q: want text or json", o.Output)
	}
	metrics := o.metricsAddress()
	x := &explanation{Destination: dst.String(), Protocol: proto, MetricsAddress: metrics, Services: []serviceMatch{}, Rules: []rulePath{}, RecentFailures: []observe.Event{}}
	if client.IsValid() {
		x.Client = client.String()
	}

	api := &proxyAPI{base: "http://" + metrics, client: &http.Client{Timeout: 5 * time.Second}}
	mode, err := api.mode()
	if err != nil {
		return fmt.Errorf("ask the running uproxy at %s (--metrics-address): %w", metrics, err)
	}
	x.Mode = mode
	view, err := api.services(client)
	if err != nil {
		return err
	}
	states, conflicts := view.Services, view.Conflicts
	local := localAddrs()
	for _, c := range conflicts {
		if matchConflict(c, dst, proto, local) {
			x.Conflicts = append(x.Conflicts, c)
			x.Notes = append(x.Notes, fmt.Sprintf("%s is claimed by two Service ports: %s serves it; %s is left out (not served at all) until the address is free",
				c.Address, c.ServedBy, c.LeftOut))
		}
	}
	for _, st := range states {
		if m := matchService(st, dst, proto, local); m != "" {
			served := "the kernel (" + mode + " mode): the rules below rewrite the destination to an endpoint; no proxy process sees the connection"
			switch {
			case st.NotServed != "":
				served = "nothing: " + st.NotServed
			case st.ProxyPort != 0:
				served = servedByProxy(st, m, mode)
				if r := refusedAs(st, m, dst.Addr().Is6()); r != nil {
					served = refusedByPortal(st, m, *r)
				}
			}
			if external(m) && st.NextForClientExternal != nil {
				// The destination's own proxy port, balancers and
				// client-address rule answer for it.
				st.NextForClient = st.NextForClientExternal
			}
			x.Services = append(x.Services, serviceMatch{MatchedAs: m, ServedBy: served, Service: st})
		}
	}
	for _, sm := range x.Services {
		evs, err := api.failures(sm.Service.Name, o.Events)
		if err != nil {
			return err
		}
		x.RecentFailures = append(x.RecentFailures, evs...)
	}
	if len(x.Services) == 0 {
		x.Notes = append(x.Notes, fmt.Sprintf("no Service port of the running proxy has %s/%s (as a ClusterIP, ExternalIP, LoadBalancer IP, NodePort or proxy port)", dst, proto))
	}
	x.Notes = append(x.Notes, sourceNotes(view, x.Services)...)

	if x.Mode == "userspace" {
		if err := x.findNFTPortals(o, dst, proto, local[dst.Addr()] || dst.Addr().IsLoopback()); err != nil {
			x.Notes = append(x.Notes, "nftables portals unreadable: "+err.Error())
		}
	}
	if x.Mode == "nftables" {
		if err := x.findNFTKernel(o, dst, proto, local[dst.Addr()] || dst.Addr().IsLoopback()); err != nil {
			x.Notes = append(x.Notes, "nftables kernel mode's table unreadable: "+err.Error())
		}
	}
	hooks := []string{"PREROUTING", "OUTPUT"}
	if client.IsValid() {
		// A client on this node goes through OUTPUT, any other through PREROUTING.
		hooks = hooks[:1]
		if local[client.Unmap()] {
			hooks = []string{"OUTPUT"}
		}
	}
	pkt := packet{dst: dst, proto: strings.ToLower(proto), client: client, local: local, recent: recentLists(o.RecentDir)}
	save, err := o.readRules(dst.Addr().Is6())
	if err != nil {
		x.RulesError = err.Error()
	} else {
		t := parseNAT(save)
		for _, h := range hooks {
			x.Rules = append(x.Rules, t.trace(h, pkt))
		}
	}
	// The nftables elements decide beside the iptables rules: on the same
	// paths, before the filter trace and the kernel's choice read them.
	x.nftPaths(hooks)
	if err == nil {
		filter := parseFilter(save)
		for _, rp := range x.Rules {
			if rewritesSurely(rp) {
				continue // the filter table sees another destination
			}
			fh := rp.Hook // OUTPUT: the node's own packet
			if fh == "PREROUTING" {
				fh = "FORWARD"
				if onNode(dst, local) {
					fh = "INPUT"
				}
			}
			if fp := filter.trace(fh, pkt); decides(fp) {
				x.FilterRules = append(x.FilterRules, fp)
			}
		}
	}
	if client.IsValid() {
		x.kernelChoices()
	}
	if (err == nil || len(x.NFTPortals) > 0) && x.Mode == "userspace" && !x.anyRewrite() {
		for _, sm := range x.Services {
			if sm.Service.NotServed == "" && sm.MatchedAs != "proxyPort" && sm.MatchedAs != "externalProxyPort" && refusedAs(sm.Service, sm.MatchedAs, dst.Addr().Is6()) == nil {
				x.Notes = append(x.Notes, fmt.Sprintf("no portal rule sends %s/%s to the proxy (uproxy runs with --rules none, or its rules were removed): connect to %s's proxy port %d on this node instead",
					dst, proto, sm.Service.Name, proxyPortOf(sm.Service, sm.MatchedAs)))
			}
		}
	}
	if len(x.Services) > 0 && x.Mode != "userspace" {
		x.Notes = append(x.Notes, fmt.Sprintf("in the %s mode the kernel forwards each connection itself: uproxy never sees it, so it cannot retry a failed dial and records no connection events; only the connection's client sees a failure", x.Mode))
	}

	if output == "json" {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(x)
	}
	return x.writeText(w)
}

// proxyPortOf is the proxy port that serves st's address matched as m: the
// external traffic's own port (a Service port whose traffic policies differ)
// for its NodePort, ExternalIPs and LoadBalancer IPs, else its proxy port.
func proxyPortOf(st observe.ServiceState, m string) int {
	switch m {
	case "externalIP", "loadBalancerIP", "nodePort", "externalProxyPort":
		if st.ExternalProxyPort != 0 {
			return st.ExternalProxyPort
		}
	}
	return st.ProxyPort
}

// servedByProxy says what the userspace mode does with a connection (TCP) or
// datagrams (UDP) of st's address matched as m.
func servedByProxy(st observe.ServiceState, m, mode string) string {
	pp := proxyPortOf(st, m)
	which := fmt.Sprintf("uproxy's proxy port %d", pp)
	if pp != st.ProxyPort {
		which += " for external traffic (it picks from the external endpoints, per externalTrafficPolicy)"
	}
	if strings.EqualFold(st.Protocol, "UDP") {
		return fmt.Sprintf("%s (%s mode): uproxy gives each client address an endpoint and forwards its datagrams there, and the replies back; a UDP send cannot fail, so nothing is retried (an endpoint that answers with ICMP port unreachable counts as a failed one)", which, mode)
	}
	return fmt.Sprintf("%s (%s mode): uproxy accepts, picks an endpoint, dials it and retries another if the dial fails", which, mode)
}

// refusedAs returns what st's Refused says of its addresses matched as m in
// the family of v6: nil when the portals steer them (or m is a proxy port,
// which no portal stands in front of).
func refusedAs(st observe.ServiceState, m string, v6 bool) *observe.Refused {
	addresses := "external"
	switch m {
	case "clusterIP":
		addresses = "clusterIPs"
	case "proxyPort", "externalProxyPort":
		return nil
	}
	family := "IPv4"
	if v6 {
		family = "IPv6"
	}
	for i, r := range st.Refused {
		if r.Addresses == addresses && r.Family == family {
			return &st.Refused[i]
		}
	}
	return nil
}

// refusedByPortal says what happens to a connection (TCP) or datagrams (UDP)
// of st's address matched as m, which the portals refuse for r's reason.
func refusedByPortal(st observe.ServiceState, m string, r observe.Refused) string {
	what := "a TCP connect fails at once with connection refused (a TCP reset from the portal), never accepted"
	if strings.EqualFold(st.Protocol, "UDP") {
		what = "every datagram is answered with ICMP port unreachable (a connected socket reads connection refused)"
	}
	return fmt.Sprintf("nothing: the portal refuses it, %s: %s. uproxy's proxy port %d stays open, and the portal steers to it again from the sync that brings an endpoint",
		r.Reason, what, proxyPortOf(st, m))
}

// rewritesSurely reports whether the nat path certainly rewrites the
// destination.
func rewritesSurely(rp rulePath) bool {
	for _, v := range rp.Verdicts {
		if v.Certain && (v.Target == "DNAT" || v.Target == "REDIRECT") {
			return true
		}
	}
	return false
}

// decides reports whether a filter path ends anywhere but in "no rule".
func decides(rp rulePath) bool {
	for _, v := range rp.Verdicts {
		if v.Target != "none" {
			return true
		}
	}
	return false
}

// findNFTPortals looks dst up in the nftables portals, if they are there.
func (x *explanation) findNFTPortals(o Options, dst netip.AddrPort, proto string, local bool) error {
	table, err := rules.NFTPortalTable(cmp.Or(o.ChainPrefix, iptables.DefaultChainPrefix))
	if err != nil {
		return err
	}
	nft := o.NFT
	if nft == nil {
		if nft, err = knftables.New(table.Family, table.Name); err != nil {
			return nil // no nft here: no nftables portals either
		}
	}
	found, err := rules.FindNFTPortals(context.Background(), nft, dst, proto, local)
	if errors.Is(err, rules.ErrNoNFTPortals) {
		return nil
	}
	if err != nil {
		return err
	}
	x.NFTPortals, x.NFTPortalsTable = found, table.String()
	return nil
}

// findNFTKernel looks dst up in the nftables kernel mode's table.
func (x *explanation) findNFTKernel(o Options, dst netip.AddrPort, proto string, local bool) error {
	table, err := knft.TableName(o.ChainPrefix)
	if err != nil {
		return err
	}
	nft := o.NFTKernel
	if nft == nil {
		if nft, err = knftables.New(table.Family, table.Name); err != nil {
			return err
		}
	}
	found, err := knft.Find(context.Background(), nft, dst, proto, local)
	if err != nil {
		return err
	}
	x.NFTKernel, x.NFTKernelTable = found, table.String()
	if len(found) == 0 {
		x.Notes = append(x.Notes, fmt.Sprintf("no element of table %s concerns %s/%s: the kernel leaves it alone", table, dst, proto))
	}
	return nil
}

// anyRewrite reports whether a traced rule may send the packet somewhere else.
func (x *explanation) anyRewrite() bool {
	if len(x.NFTPortals) > 0 {
		return true
	}
	for _, rp := range x.Rules {
		for _, v := range rp.Verdicts {
			if v.Target == "DNAT" || v.Target == "REDIRECT" {
				return true
			}
		}
	}
	return false
}

// maxSourceNotes bounds the problems and left-out Service ports a note lists.
const maxSourceNotes = 5

// sourceNotes says what of the source's problems and of the Service ports
// the last sync left out concerns the destination: those naming a Service
// port of matched, or, when nothing matched, all of them (the destination's
// Service may be the one with a problem), at most maxSourceNotes of each.
func sourceNotes(view *servicesView, matched []serviceMatch) []string {
	concerns := func(msg string) bool {
		if len(matched) == 0 {
			return true
		}
		for _, m := range matched {
			// "ns/name:port" in a left-out port's error; "Kind ns/name:" in a problem.
			name := m.Service.Name
			if svc, _, ok := strings.Cut(name, ":"); ok && (strings.Contains(msg, name) || strings.Contains(msg, "Service "+svc+":") || strings.Contains(msg, "EndpointSlice "+svc)) {
				return true
			}
		}
		return false
	}
	var notes []string
	listed := 0
	for _, p := range view.Problems {
		if concerns(p) && listed < maxSourceNotes {
			notes = append(notes, "problem of the Service source (the object is left out, or kept at its last good version): "+p)
			listed++
		}
	}
	if len(matched) == 0 && view.ProblemCount > listed {
		notes = append(notes, fmt.Sprintf("the Service source has %d problems in all: /debug/services lists them", view.ProblemCount))
	}
	listed = 0
	for _, l := range view.LeftOut {
		if concerns(l) && listed < maxSourceNotes {
			notes = append(notes, "left out of the last sync: "+l)
			listed++
		}
	}
	return notes
}

// parseDestination parses IP:PORT[/tcp|udp|sctp] (protocol default tcp).
func parseDestination(arg string) (netip.AddrPort, string, error) {
	proto := "TCP"
	if i := strings.LastIndexByte(arg, '/'); i >= 0 {
		switch strings.ToLower(arg[i+1:]) {
		case "tcp":
		case "udp":
			proto = "UDP"
		case "sctp":
			proto = "SCTP"
		default:
			return netip.AddrPort{}, "", fmt.Errorf("%q: protocol %q: want tcp, udp or sctp", arg, arg[i+1:])
		}
		arg = arg[:i]
	}
	ap, err := netip.ParseAddrPort(arg)
	if err != nil {
		return netip.AddrPort{}, "", fmt.Errorf("%q: want IP:PORT[/tcp|udp|sctp] ([IPv6]:PORT for IPv6)", arg)
	}
	if ap.Port() == 0 {
		return netip.AddrPort{}, "", fmt.Errorf("%q: port 0: no Service port is 0", arg)
	}
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), proto, nil
}

// matchService says how dst belongs to st ("" when it does not).
func matchService(st observe.ServiceState, dst netip.AddrPort, proto string, local map[netip.Addr]bool) string {
	if !strings.EqualFold(st.Protocol, proto) {
		return ""
	}
	ip, port := dst.Addr().String(), int(dst.Port())
	has := func(ips []string) bool {
		for _, s := range ips {
			if a, err := netip.ParseAddr(s); err == nil && a.Unmap().String() == ip {
				return true
			}
		}
		return false
	}
	switch {
	case port == st.Port && has(st.ClusterIPs):
		return "clusterIP"
	case port == st.Port && has(st.ExternalIPs):
		return "externalIP"
	case port == st.Port && has(st.LoadBalancerIPs):
		return "loadBalancerIP"
	case st.NodePort != 0 && port == st.NodePort && onNode(dst, local):
		return "nodePort"
	case st.ProxyPort != 0 && port == st.ProxyPort && onNode(dst, local):
		return "proxyPort"
	case st.ExternalProxyPort != 0 && port == st.ExternalProxyPort && onNode(dst, local):
		return "externalProxyPort"
	}
	return ""
}

// external reports whether a destination matched as m (matchService) is one
// of the addresses a Service port's external proxy port serves.
func external(m string) bool {
	switch m {
	case "externalIP", "loadBalancerIP", "nodePort", "externalProxyPort":
		return true
	}
	return false
}

// matchConflict reports whether dst is the address that c is about.
func matchConflict(c observe.ConflictState, dst netip.AddrPort, proto string, local map[netip.Addr]bool) bool {
	if !strings.EqualFold(c.Protocol, proto) || c.Port != int(dst.Port()) {
		return false
	}
	if c.NodePort {
		return onNode(dst, local)
	}
	ip, err := netip.ParseAddr(c.IP)
	return err == nil && ip.Unmap() == dst.Addr()
}

// onNode reports whether dst is an address of this node, where NodePorts and
// proxy ports are reached.
func onNode(dst netip.AddrPort, local map[netip.Addr]bool) bool {
	return local[dst.Addr()] || dst.Addr().IsLoopback()
}

// readRules returns iptables-save output: from the file, from Stdin ("-") or
// from the command.
func (o *Options) readRules(v6 bool) ([]byte, error) {
	switch o.IPTablesSave {
	case "":
		b, err := iptables.Commands{}.Save(v6)
		if err != nil {
			return nil, fmt.Errorf("read the rules: %w", err)
		}
		return b, nil
	case "-":
		if o.Stdin == nil {
			return io.ReadAll(os.Stdin)
		}
		return io.ReadAll(o.Stdin)
	}
	return os.ReadFile(o.IPTablesSave)
}

// localAddrs returns the node's addresses as a set; none when they cannot be
// listed, which only makes fewer destinations count as local.
func localAddrs() map[netip.Addr]bool {
	out := map[netip.Addr]bool{}
	addrs, _ := nodeaddr.List()
	for _, a := range addrs {
		out[a] = true
	}
	return out
}
