package rules

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
	"sigs.k8s.io/knftables"
)

// The replies to a transparent dial (socket.TCPProxy.KeepClientAddress) are
// addressed to the client, not to the node: the node would route them on to the
// client, which never opened that connection, and the proxy's socket would never
// see them. Three things bring them back to it:
//
//   - the connection's conntrack entry gets the client-address mark
//     (Config.ClientAddressMark) when its first packet leaves: a packet of
//     the node's own (output hook) carrying the dial mark, with a source that
//     is not the node's;
//   - every reply of a connection so marked gets the same bit as its packet
//     mark, on the prerouting hook (an endpoint elsewhere, or a pod on this
//     node) and on the output hook (an endpoint listening on the node itself);
//   - a policy routing rule sends packets with that mark to a routing table
//     whose one route delivers everything locally (`local default dev lo`),
//     where the socket, bound to the client's address and connected to the
//     endpoint, takes them.
//
// The dial mark is uproxy's own signal, read on the output hook only (these
// chains, the portals' own-dial returns). So a packet of a dial leaves the node
// without it: a chain on the postrouting hook, before any NAT there, clears
// the bit on every packet that carries it and does not loop back over lo.
// Other programs match packet marks on postrouting with bits of their own:
// the CNI portmap plugin, on every node where a pod has a hostPort,
// masquerades packets with mark 0x2000 (its default bit, 13, which was also
// uproxy's default dial mark), and would give every dial from a client's
// address the node's address, on some nodes and not others. With the bit
// cleared first, nothing after uproxy's output chains can tell a dial from a
// DNATed connection, as behind kube-proxy.
//
// Only the first packet of a connection pays the conntrack marking; a reply
// pays one conntrack mark test in the chains and, when marked, one policy
// rule. Nothing else on the node is touched: a packet without the dial mark
// never gets the conntrack mark, and the routing rule matches only the mark bit
// the proxy owns. The kernel needs conntrack, nftables' ct and fib expressions
// (or iptables' connmark, mark and addrtype matches), policy routing and
// transparent sockets (IP_TRANSPARENT).

// ClientAddressTable is the routing table, and the priority of the policy
// routing rule that leads to it, of the replies to transparent dials: any
// number below the main table's rule (32766) that no other program on the node
// uses.
const ClientAddressTable = 21840

// The nftables chains that mark the replies.
const (
	nftClientOutput      = "client-address-output"
	nftClientPrerouting  = "client-address-prerouting"
	nftClientPostrouting = "client-address-postrouting"
)

// markHex is mark as nft and iptables take it.
func markHex(mark uint32) string { return "0x" + strconv.FormatUint(uint64(mark), 16) }

// clientAddressChains adds the chains that mark transparent connections and
// their replies to tx (none when mark or dialMark is 0).
func clientAddressChains(tx *knftables.Transaction, mark, dialMark uint32) {
	if mark == 0 || dialMark == 0 {
		return
	}
	prio := knftables.ManglePriority
	route, filter := knftables.RouteType, knftables.FilterType
	out, pre := knftables.OutputHook, knftables.PreroutingHook
	tx.Add(&knftables.Chain{Name: nftClientOutput, Type: &route, Hook: &out, Priority: &prio,
		Comment: knftables.PtrTo("uproxy dials from a client's address and their replies from this node")})
	tx.Add(&knftables.Chain{Name: nftClientPrerouting, Type: &filter, Hook: &pre, Priority: &prio,
		Comment: knftables.PtrTo("replies to uproxy's dials from a client's address")})
	m, d := markHex(mark), markHex(dialMark)
	reply := knftables.Concat("ct direction reply ct mark &", m, "==", m, "meta mark set meta mark |", m)
	tx.Add(&knftables.Rule{Chain: nftClientOutput, Comment: knftables.PtrTo("a dial from a client's address"),
		Rule: knftables.Concat("ct state new meta mark &", d, "==", d, "fib saddr type != local ct mark set ct mark |", m)})
	tx.Add(&knftables.Rule{Chain: nftClientOutput, Comment: knftables.PtrTo("its replies from the node itself"), Rule: reply})
	tx.Add(&knftables.Rule{Chain: nftClientPrerouting, Comment: knftables.PtrTo("its replies"), Rule: reply})
	post := knftables.PostroutingHook
	tx.Add(&knftables.Chain{Name: nftClientPostrouting, Type: &filter, Hook: &post, Priority: &prio,
		Comment: knftables.PtrTo("uproxy's dial mark ends with uproxy's rules")})
	tx.Add(&knftables.Rule{Chain: nftClientPostrouting, Comment: knftables.PtrTo("no later rule sees uproxy's dial mark"),
		Rule: knftables.Concat("meta mark &", d, "==", d, `oifname != "lo" meta mark set meta mark &`, markHex(^dialMark))})
}

// replyRoute is the policy routing rule and the table of the replies to
// transparent dials, for the families enabled, with mark as the rule's
// selector. Its methods act on the network namespace of the calling thread.
//
// The rule and the table carry no chain prefix: uproxies of several prefixes
// on one node share them (their content is the same; a rule per mark bit).
// So the portals of a prefix say they use them by listening on an abstract
// unix socket of that prefix (replyRouteUser) from before their first write
// until their Cleanup, and no uproxy removes them while a socket of another
// prefix listens. Like the rules lock, the name belongs to the network
// namespace and the kernel frees it when the process dies, however it dies.
type replyRoute struct {
	mark    uint32
	enabled [2]bool
	// prefix is the portals' chain prefix; user, when not nil, is the socket
	// that says they use the route.
	prefix string
	user   net.Listener
}

// replyRouteUser is the abstract socket name that says the portals of a chain
// prefix use the reply route.
const replyRouteUser = "@uproxy-reply-route-"

// use says that these portals use the route, before they write it. A socket
// of the prefix that is taken already (EADDRINUSE) is another Portals of this
// prefix in this process, which says the same; the next sync tries again.
func (r *replyRoute) use() {
	if r.user != nil {
		return
	}
	if ln, err := net.Listen("unix", replyRouteUser+r.prefix); err == nil {
		r.user = ln
	}
}

// release says that these portals no longer use the route.
func (r *replyRoute) release() {
	if r.user != nil {
		r.user.Close()
		r.user = nil
	}
}

// replyRouteUsers returns the chain prefixes, but except, of the portals that
// use the reply route in the calling thread's network namespace, each with the
// process that holds it ("process PID", or "a process" when the pid cannot be
// told). It reads the listening abstract sockets of the namespace.
func replyRouteUsers(except string) ([]routeUser, error) {
	// thread-self: the namespace of this thread, which a test may have moved.
	data, err := os.ReadFile("/proc/thread-self/net/unix")
	if err != nil {
		return nil, fmt.Errorf("list the uproxies that use the policy route of table %d: %w", ClientAddressTable, err)
	}
	var users []routeUser
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		// Num RefCount Protocol Flags Type St Inode Path; a listener's flags
		// are __SO_ACCEPTCON (00010000). The connections queued on it show its
		// name too, with other flags.
		f := strings.Fields(sc.Text())
		if len(f) < 8 || f[3] != "00010000" || !strings.HasPrefix(f[7], replyRouteUser) {
			continue
		}
		prefix := strings.TrimPrefix(f[7], replyRouteUser)
		if prefix == except {
			continue
		}
		u := routeUser{prefix: prefix, holder: "a process"}
		if cred, ok := SocketHolder(f[7]); ok {
			// Any process may bind an abstract name; portals run as root.
			if cred.Uid != 0 && os.Geteuid() == 0 {
				continue
			}
			u.holder = "process " + strconv.Itoa(int(cred.Pid))
		}
		users = append(users, u)
	}
	return users, nil
}

// routeUser is a chain prefix whose portals use the reply route, and the
// process that runs them.
type routeUser struct{ prefix, holder string }

func (u routeUser) String() string { return u.holder + " with --chain-prefix " + u.prefix }

// SocketHolder returns the credentials of the process listening on the unix
// socket name (abstract when it begins with '@'), as the kernel recorded them
// when it listened; ok is false when none listens or they cannot be told.
// Any process may bind an abstract name, root or not: its uid tells uproxy,
// which programs rules as root, from anyone else.
func SocketHolder(name string) (cred unix.Ucred, ok bool) {
	c, err := net.Dial("unix", name)
	if err != nil {
		return cred, false
	}
	defer c.Close()
	raw, err := c.(*net.UnixConn).SyscallConn()
	if err != nil {
		return cred, false
	}
	raw.Control(func(fd uintptr) {
		if uc, err := unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED); err == nil {
			cred, ok = *uc, true
		}
	})
	return cred, ok
}

func (r replyRoute) families() []int {
	var fams []int
	if r.enabled[v4] {
		fams = append(fams, unix.AF_INET)
	}
	if r.enabled[v6] {
		fams = append(fams, unix.AF_INET6)
	}
	return fams
}

func (r replyRoute) rule(family int) *netlink.Rule {
	rule := netlink.NewRule()
	rule.Family = family
	rule.Mark = r.mark
	rule.Mask = &r.mark
	rule.Table = ClientAddressTable
	rule.Priority = ClientAddressTable
	return rule
}

func localDefault(family, lo int) *netlink.Route {
	dst := &net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)}
	if family == unix.AF_INET6 {
		dst = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
	}
	return &netlink.Route{Family: family, Dst: dst, Type: unix.RTN_LOCAL, Table: ClientAddressTable,
		Scope: netlink.SCOPE_HOST, LinkIndex: lo}
}

// ensure adds the rule and the route where they are missing (or replaces a
// route someone changed); it is cheap enough for every sync: a dump of the
// rules of one table and one route replacement per family.
func (r *replyRoute) ensure() error {
	if r.mark == 0 {
		return nil
	}
	r.use()
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("client-address replies: loopback: %w", err)
	}
	var errs []error
	for _, fam := range r.families() {
		want := r.rule(fam)
		have, err := netlink.RuleListFiltered(fam, want, netlink.RT_FILTER_TABLE|netlink.RT_FILTER_MARK|netlink.RT_FILTER_MASK|netlink.RT_FILTER_PRIORITY)
		if err == nil && len(have) == 0 {
			err = netlink.RuleAdd(want)
		}
		if err == nil {
			err = netlink.RouteReplace(localDefault(fam, lo.Attrs().Index))
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("client-address replies: %s policy route (ip rule fwmark %s lookup %d): %w",
				familyName(familyIndex(fam)), markHex(r.mark), ClientAddressTable, err))
		}
	}
	return errors.Join(errs...)
}

// present reports whether the rule and the route of every enabled family are in
// place: Intact asks it between syncs, so a rule or route someone deleted is
// put back promptly.
func (r replyRoute) present() bool {
	for _, fam := range r.families() {
		rules, err := netlink.RuleListFiltered(fam, r.rule(fam), netlink.RT_FILTER_TABLE|netlink.RT_FILTER_MARK)
		if err != nil || len(rules) == 0 {
			return false
		}
		routes, err := netlink.RouteListFiltered(fam, &netlink.Route{Table: ClientAddressTable}, netlink.RT_FILTER_TABLE)
		if err != nil || len(routes) == 0 {
			return false
		}
	}
	return true
}

// removeReplyRoutes deletes the rules and the table of the replies to
// transparent dials, whatever their mark, in both families, for the chain
// prefix prefix: unless the portals of another prefix use them (replyRoute),
// which it then says, naming them. What is gone already is not an error.
func removeReplyRoutes(prefix string) error {
	users, err := replyRouteUsers(prefix)
	if err != nil {
		return err
	}
	if len(users) > 0 {
		names := make([]string, len(users))
		for i, u := range users {
			names[i] = u.String()
		}
		klog.InfoS("Left the policy route of the replies to dials from a client's address: another uproxy uses it",
			"rule", fmt.Sprintf("priority %d, table %d", ClientAddressTable, ClientAddressTable), "prefix", prefix, "usedBy", names)
		return nil
	}
	var errs []error
	for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
		filter := &netlink.Rule{Table: ClientAddressTable, Priority: ClientAddressTable}
		rules, err := netlink.RuleListFiltered(fam, filter, netlink.RT_FILTER_TABLE|netlink.RT_FILTER_PRIORITY)
		if err != nil {
			errs = append(errs, fmt.Errorf("list %s policy routing rules: %w", familyName(familyIndex(fam)), err))
			continue
		}
		for i := range rules {
			if err := netlink.RuleDel(&rules[i]); err != nil && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("delete %s policy routing rule of table %d: %w", familyName(familyIndex(fam)), ClientAddressTable, err))
			}
		}
		routes, err := netlink.RouteListFiltered(fam, &netlink.Route{Table: ClientAddressTable}, netlink.RT_FILTER_TABLE)
		if err != nil {
			errs = append(errs, fmt.Errorf("list %s routes of table %d: %w", familyName(familyIndex(fam)), ClientAddressTable, err))
			continue
		}
		for i := range routes {
			if err := netlink.RouteDel(&routes[i]); err != nil && !errors.Is(err, unix.ESRCH) {
				errs = append(errs, fmt.Errorf("delete %s route of table %d: %w", familyName(familyIndex(fam)), ClientAddressTable, err))
			}
		}
	}
	return errors.Join(errs...)
}

func familyIndex(fam int) int {
	if fam == unix.AF_INET6 {
		return v6
	}
	return v4
}
