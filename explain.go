package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/observe"
)

// explainOptions are the flags of `uproxy explain`.
type explainOptions struct {
	client       string
	metricsAddr  string
	output       string
	iptablesSave string // file with iptables-save output; "" runs the command
	events       int
	// recentDir holds the kernel's xt_recent lists (ClientIP affinity of the
	// iptables mode); "" is /proc/net/xt_recent.
	recentDir string
}

func newExplainCommand() *cobra.Command {
	o := &explainOptions{metricsAddr: "127.0.0.1:10249", output: "text", events: 10}
	cmd := &cobra.Command{
		Use:   "explain IP:PORT[/tcp|udp]",
		Short: "Explain what happens to a connection to IP:PORT: rules, proxy port, endpoints, next choice, recent failures",
		Long: `explain asks the running uproxy (its metrics address: /proxyMode, /debug/services,
/debug/events) and the kernel's nat rules (iptables-save) what happens to a
connection to IP:PORT:

  - which rule catches the destination: the chain and rule number, from PREROUTING
    (traffic from pods and other hosts) and from OUTPUT (traffic from this node);
  - which Service port it is, and what serves it: a userspace proxy port, or the
    kernel's DNAT rules;
  - the endpoints with their state (ready, ejected, active connections, failures);
  - which endpoint the client given by --client would get next, and why;
  - the recent connections of that Service port that were retried or failed.`,
		Example: `  uproxy explain 10.96.0.10:80
  uproxy explain 10.96.0.10:53/udp --client 10.244.1.7
  uproxy explain 10.96.0.10:80 -o json | jq .services[0].endpoints`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runExplain(cmd.OutOrStdout(), args[0], o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.client, "client", o.client, "client IP to explain the choice for (default: any client; the rules from both pods and the node are shown)")
	f.StringVar(&o.metricsAddr, "metrics-address", o.metricsAddr, "HOST:PORT of the running uproxy's metrics address (--metrics-bind-address)")
	f.StringVarP(&o.output, "output", "o", o.output, "output format: text or json")
	f.StringVar(&o.iptablesSave, "iptables-save-file", o.iptablesSave, "read the rules from this iptables-save output instead of running iptables-save (- for stdin)")
	f.IntVar(&o.events, "events", o.events, "how many recent retried or failed connections to show")
	return cmd
}

// explanation is the -o json form of `uproxy explain`.
type explanation struct {
	Destination    string          `json:"destination"`
	Protocol       string          `json:"protocol"`
	Client         string          `json:"client,omitempty"`
	Mode           string          `json:"mode"`
	MetricsAddress string          `json:"metricsAddress"`
	Services       []serviceMatch  `json:"services"`
	Rules          []rulePath      `json:"rules"`
	RulesError     string          `json:"rulesError,omitempty"`
	RecentFailures []observe.Event `json:"recentFailures"`
	Notes          []string        `json:"notes,omitempty"`
}

// serviceMatch is one Service port that has the destination.
type serviceMatch struct {
	// MatchedAs says how the destination belongs to the Service port: clusterIP,
	// externalIP, loadBalancerIP, nodePort or proxyPort.
	MatchedAs string `json:"matchedAs"`
	// ServedBy says what carries the connection: the proxy port or the kernel.
	ServedBy string               `json:"servedBy"`
	Service  observe.ServiceState `json:"service"`
}

// rulePath is the way through the nat table from one hook.
type rulePath struct {
	// Hook is PREROUTING (from pods and other hosts) or OUTPUT (from this node).
	Hook  string     `json:"hook"`
	Steps []ruleStep `json:"steps"`
	// Verdicts are where the packet may end up: one when the path is certain, one
	// per branch where the rules choose at random (kernel modes) or by state the
	// rules alone do not show (affinity, marks).
	Verdicts []verdict `json:"verdicts"`
}

type ruleStep struct {
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

func runExplain(w io.Writer, arg string, o *explainOptions) error {
	dst, proto, err := parseDestination(arg)
	if err != nil {
		return err
	}
	var client netip.Addr
	if o.client != "" {
		if client, err = netip.ParseAddr(o.client); err != nil {
			return fmt.Errorf("--client %q: not an IP address", o.client)
		}
	}
	if o.output != "text" && o.output != "json" {
		return fmt.Errorf("-o %q: want text or json", o.output)
	}
	x := &explanation{Destination: dst.String(), Protocol: proto, MetricsAddress: o.metricsAddr, Services: []serviceMatch{}, Rules: []rulePath{}, RecentFailures: []observe.Event{}}
	if client.IsValid() {
		x.Client = client.String()
	}

	api := &proxyAPI{base: "http://" + o.metricsAddr, client: &http.Client{Timeout: 5 * time.Second}}
	mode, err := api.mode()
	if err != nil {
		return fmt.Errorf("ask the running uproxy at %s (--metrics-address): %w", o.metricsAddr, err)
	}
	x.Mode = mode
	states, err := api.services(client)
	if err != nil {
		return err
	}
	local := localAddrs()
	for _, st := range states {
		if m := matchService(st, dst, proto, local); m != "" {
			served := "the kernel (" + mode + " mode): the rules below rewrite the destination to an endpoint; no proxy process sees the connection"
			if st.ProxyPort != 0 {
				served = fmt.Sprintf("uproxy's proxy port %d (%s mode): uproxy accepts, picks an endpoint, dials it and retries another if the dial fails", st.ProxyPort, mode)
			}
			x.Services = append(x.Services, serviceMatch{MatchedAs: m, ServedBy: served, Service: st})
		}
	}
	for _, sm := range x.Services {
		evs, err := api.failures(sm.Service.Name, o.events)
		if err != nil {
			return err
		}
		x.RecentFailures = append(x.RecentFailures, evs...)
	}
	if len(x.Services) == 0 {
		x.Notes = append(x.Notes, fmt.Sprintf("no Service port of the running proxy has %s/%s (as a ClusterIP, ExternalIP, LoadBalancer IP, NodePort or proxy port)", dst, proto))
	}

	save, err := readRules(o.iptablesSave, dst.Addr().Is6())
	if err != nil {
		x.RulesError = err.Error()
	} else {
		t := parseNAT(save)
		pkt := packet{dst: dst, proto: strings.ToLower(proto), client: client, local: local, recent: recentLists(o.recentDir)}
		hooks := []string{"PREROUTING", "OUTPUT"}
		if client.IsValid() {
			// A client on this node goes through OUTPUT, any other through PREROUTING.
			hooks = hooks[:1]
			if local[client.Unmap()] {
				hooks = []string{"OUTPUT"}
			}
		}
		for _, h := range hooks {
			x.Rules = append(x.Rules, t.trace(h, pkt))
		}
		if client.IsValid() {
			x.kernelChoices()
		}
	}
	if len(x.Services) > 0 && x.Mode != "userspace" {
		x.Notes = append(x.Notes, fmt.Sprintf("in the %s mode the kernel forwards each connection itself: uproxy never sees it, so it cannot retry a failed dial and records no connection events; only the connection's client sees a failure", x.Mode))
	}

	if o.output == "json" {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(x)
	}
	return x.writeText(w)
}

// parseDestination parses IP:PORT[/tcp|udp] (protocol default tcp).
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
			return netip.AddrPort{}, "", fmt.Errorf("%q: protocol %q: want tcp or udp", arg, arg[i+1:])
		}
		arg = arg[:i]
	}
	ap, err := netip.ParseAddrPort(arg)
	if err != nil {
		return netip.AddrPort{}, "", fmt.Errorf("%q: want IP:PORT[/tcp|udp] ([IPv6]:PORT for IPv6)", arg)
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
	case st.NodePort != 0 && port == st.NodePort && (local[dst.Addr()] || dst.Addr().IsLoopback()):
		return "nodePort"
	case st.ProxyPort != 0 && port == st.ProxyPort && (local[dst.Addr()] || dst.Addr().IsLoopback()):
		return "proxyPort"
	}
	return ""
}

// proxyAPI reads the running proxy's metrics address.
type proxyAPI struct {
	base   string
	client *http.Client
}

func (a *proxyAPI) get(path string) ([]byte, error) {
	resp, err := a.client.Get(a.base + path)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", path, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s: %s", path, resp.Status, bytes.TrimSpace(b))
	}
	return b, nil
}

func (a *proxyAPI) mode() (string, error) {
	b, err := a.get("/proxyMode")
	return strings.TrimSpace(string(b)), err
}

func (a *proxyAPI) services(client netip.Addr) ([]observe.ServiceState, error) {
	path := "/debug/services"
	if client.IsValid() {
		path += "?client=" + url.QueryEscape(client.String())
	}
	b, err := a.get(path)
	if err != nil {
		return nil, fmt.Errorf("%w (is uproxy running with --debug-handlers?)", err)
	}
	var body struct{ Services []observe.ServiceState }
	if err := json.Unmarshal(b, &body); err != nil {
		return nil, fmt.Errorf("GET %s: %w", path, err)
	}
	return body.Services, nil
}

// failures returns up to n recent events of service that are not plain
// successes: retried and failed connections, ejections and re-admissions.
func (a *proxyAPI) failures(service string, n int) ([]observe.Event, error) {
	path := "/debug/events?limit=1000&service=" + url.QueryEscape(service)
	b, err := a.get(path)
	if err != nil {
		return nil, err
	}
	var body struct{ Events []observe.Event }
	if err := json.Unmarshal(b, &body); err != nil {
		return nil, fmt.Errorf("GET %s: %w", path, err)
	}
	var out []observe.Event
	for _, ev := range body.Events {
		if len(out) == n {
			break
		}
		if ev.Kind != observe.KindConnection || ev.Outcome != observe.OutcomeSuccess {
			out = append(out, ev)
		}
	}
	return out, nil
}

// readRules returns iptables-save output: from file ("-": stdin) or the command.
func readRules(file string, v6 bool) ([]byte, error) {
	switch file {
	case "":
		b, err := iptables.Commands{}.Save(v6)
		if err != nil {
			return nil, fmt.Errorf("read the rules: %w", err)
		}
		return b, nil
	case "-":
		return io.ReadAll(os.Stdin)
	}
	return os.ReadFile(file)
}

func localAddrs() map[netip.Addr]bool {
	out := map[netip.Addr]bool{}
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return out
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP); ok {
				out[ip.Unmap()] = true
			}
		}
	}
	return out
}

// natTable is the nat table of an iptables-save output.
type natTable struct {
	chains map[string][]natRule
}

type natRule struct {
	line  int
	text  string
	args  []string
	index int // 1-based position in its chain
}

// parseNAT reads the *nat section of iptables-save output.
func parseNAT(save []byte) *natTable {
	t := &natTable{chains: map[string][]natRule{}}
	sc := bufio.NewScanner(bytes.NewReader(save))
	sc.Buffer(make([]byte, 1<<16), 1<<24)
	inNAT := false
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "*"):
			inNAT = line == "*nat"
		case !inNAT:
		case strings.HasPrefix(line, ":"):
			if f := strings.Fields(line[1:]); len(f) > 0 {
				if _, ok := t.chains[f[0]]; !ok {
					t.chains[f[0]] = nil
				}
			}
		case strings.HasPrefix(line, "-A "):
			args := splitRule(line)
			if len(args) < 2 {
				continue
			}
			chain := args[1]
			t.chains[chain] = append(t.chains[chain], natRule{line: n, text: line, args: args[2:], index: len(t.chains[chain]) + 1})
		}
	}
	return t
}

// splitRule splits a rule into words, keeping "quoted strings" whole.
func splitRule(s string) []string {
	var out []string
	var cur strings.Builder
	inQuote, escaped, have := false, false, false
	for _, r := range s {
		switch {
		case escaped:
			cur.WriteRune(r)
			escaped = false
		case r == '\\' && inQuote:
			escaped = true
		case r == '"':
			inQuote, have = !inQuote, true
		case r == ' ' && !inQuote:
			if have {
				out = append(out, cur.String())
				cur.Reset()
				have = false
			}
		default:
			cur.WriteRune(r)
			have = true
		}
	}
	if have {
		out = append(out, cur.String())
	}
	return out
}

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
			if hook == "PREROUTING" && p.client.IsValid() {
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
		case "--mark", "--ctstate", "--sport", "--source-port", "-i", "-o", "--in-interface", "--out-interface":
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

// target returns a rule's target and its destination argument.
func target(args []string) (name, to string) {
	for i := 0; i < len(args); i++ {
		switch args[i] {
		case "-j", "-g":
			if i+1 < len(args) {
				name = args[i+1]
			}
		case "--to-destination", "--to-ports", "--to":
			if i+1 < len(args) {
				to = args[i+1]
			}
		}
	}
	return name, to
}

// trace follows p through the nat table from hook.
func (t *natTable) trace(hook string, p packet) rulePath {
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
func (t *natTable) walk(rp *rulePath, chain, hook string, p packet, certain bool, reach float64, depth int) (done bool, decided float64) {
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
	for _, r := range t.chains[chain] {
		m, note, prob := p.match(r.args, hook)
		if m == no {
			continue
		}
		share := -1.0
		if reach >= 0 && prob >= 0 {
			share = reach * prob
		}
		name, to := target(r.args)
		sure := certain && m == yes
		step := ruleStep{Chain: chain, Rule: r.index, Line: r.line, Text: r.text, Maybe: m == maybe, Note: note}
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
			if _, ok := t.chains[name]; !ok {
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
					for _, s := range rp.Steps[:v.Via+1] {
						if list := optionValue(splitRule(s.Text), "--name"); list != "" && !s.Maybe && strings.Contains(s.Text, "--rcheck") {
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
			c.Reason = "the kernel picks at random for each new connection (-m statistic): " + strings.Join(split, ", ")
		case x.Mode == "ipvs":
			c.Reason = fmt.Sprintf("the kernel's IPVS scheduler %s picks for each new connection", st.Scheduler)
		default:
			c.Reason = "no rule sends it to an endpoint"
		}
		st.NextForClient = c
	}
}

// describe words a verdict, naming the Service port whose proxy port it reaches.
func (x *explanation) describe(v verdict) string {
	var d string
	switch v.Target {
	case "REDIRECT":
		d = "REDIRECT to local port " + v.To
	case "DNAT":
		d = "DNAT to " + v.To
	default:
		return v.Target + " " + v.To
	}
	port := v.To
	if ap, err := netip.ParseAddrPort(v.To); err == nil {
		port = strconv.Itoa(int(ap.Port()))
	}
	for _, sm := range x.Services {
		if pp := sm.Service.ProxyPort; pp != 0 && strconv.Itoa(pp) == port {
			d += ", the proxy port of " + sm.Service.Name
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
		p("  Scheduler %s, session affinity %s", st.Scheduler, st.SessionAffinity)
		if st.AffinityTimeout > 0 {
			p(" (%ds)", st.AffinityTimeout)
		}
		if st.Ejection != "" {
			p(", outlier ejection %s", st.Ejection)
		}
		p(".\n  Endpoints:\n")
		if len(st.Endpoints) == 0 {
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
		case st.NextEndpoint != "":
			p("  Next new client: %s (the scheduler's rotation; give --client IP for a given client's choice).\n", st.NextEndpoint)
		}
		if st.AffinityCounters != nil && st.SessionAffinity == "ClientIP" {
			c := st.AffinityCounters
			p("  Affinity: %d entries, %d hits, %d misses, %d resets after failed dials, %d expired.\n", len(st.Affinity), c.Hits, c.Misses, c.Resets, c.Expired)
		}
	}
	tw.Flush()

	p("\nRules (nat table):\n")
	if x.RulesError != "" {
		p("  unavailable: %s\n", x.RulesError)
	}
	for _, rp := range x.Rules {
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
			p("    %s rule %d (line %d)%s:\n      %s\n", s.Chain, s.Rule, s.Line, mark, s.Text)
		}
		for i, v := range rp.Verdicts {
			switch {
			case v.Target == "none" && v.Certain:
				p("    => no rule rewrites it: the packet goes to %s itself\n", x.Destination)
			case v.Target == "none":
				p("    => otherwise: no rule rewrites it\n")
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
				p("    => %s %s (%s rule %d%s)\n", how, x.describe(v), rp.Steps[v.Via].Chain, rp.Steps[v.Via].Rule, share)
			}
		}
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

// ejectedFor words the rest of an ejection: " for another 1.2s (until 15:04:05)".
func ejectedFor(until string) string {
	t, err := time.Parse(time.RFC3339Nano, until)
	if err != nil {
		return " until " + until
	}
	return fmt.Sprintf(" for another %s (until %s)", time.Until(t).Round(100*time.Millisecond), t.Local().Format("15:04:05"))
}
