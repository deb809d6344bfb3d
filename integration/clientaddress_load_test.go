package integration

import (
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/uproxy/uproxy/test/testbed"
)

// TestKeptClientAddressUnderLoad: every connection and flow whose dial keeps
// the client's address keeps it, under load, while the Services around it
// change, on a node where other programs' rules stand beside uproxy's.
//
// Clients at once: a pod on the node to a ClusterIP (TCP and UDP, endpoints on
// both nodes), and a host outside, the second node itself and a pod on the
// second node to an externalTrafficPolicy Local NodePort (TCP and UDP). Each
// client checks the address its endpoint saw on every connection and
// datagram. Meanwhile Services come and go (new external routes, syncs the
// long way) and the loaded Services' endpoints change (the short way).
//
// The node holds what a CNI plugin chain leaves on a node that runs a pod with
// a hostPort (the portmap plugin, chained behind ptp or bridge in most
// clusters): its nat chains, whose masquerade matches packet mark 0x2000, the
// plugin's default bit 13. That was uproxy's dial mark too, so the node
// masqueraded every transparent dial from the first hostPort pod on: a
// NetworkPolicy admitting the client saw the node instead, on some nodes and
// not others. And a masquerade of the pod network's egress, as ip-masq-agent
// writes it, which no dial matches.
//
// At the end no dial went from the node or fell back: uproxy_dial_sources_total
// counts client dials only.
func TestKeptClientAddressUnderLoad(t *testing.T) {
	for _, c := range []struct {
		rules string
		v6    bool
	}{{"nftables", false}, {"iptables", false}, {"nftables", true}} {
		family := "IPv4"
		if c.v6 {
			family = "IPv6"
		}
		t.Run(c.rules+"/"+family, func(t *testing.T) {
			if c.rules == "nftables" {
				testbed.Needs(t, testbed.NFTables)
			}
			testKeptUnderLoad(t, c.rules, c.v6)
		})
	}
}

// loadDuration is how long the clients of TestKeptClientAddressUnderLoad run.
const loadDuration = 6 * time.Second

func testKeptUnderLoad(t *testing.T, rules string, v6 bool) {
	w := newTwoNodes(t, v6)
	tp, ip, vip, family, cidr := w.tp, w.ip, w.vip, w.family, w.cidr
	otherRules(t, tp, v6, ip(testbed.Pod2), cidr)

	local := startWhoSaw(t, tp, testbed.Pod2, ip(testbed.Pod2))
	local2 := startWhoSaw(t, tp, testbed.Pod2, ip(testbed.Pod2))
	remote := startWhoSaw(t, tp, testbed.RemotePod, ip(testbed.RemotePod))

	svc := func(name string, n int, proto string, nodePort int) string {
		doc := fmt.Sprintf("apiVersion: v1\nkind: Service\nmetadata: {name: %s, namespace: it}\nspec:\n  clusterIP: %s\n  clusterIPs: [%s]\n  ipFamilies: [%s]\n", name, vip(n), vip(n), family)
		if nodePort != 0 {
			doc += "  type: NodePort\n  externalTrafficPolicy: Local\n"
		}
		doc += fmt.Sprintf("  ports:\n  - {name: p, protocol: %s, port: 80", proto)
		if nodePort != 0 {
			doc += fmt.Sprintf(", nodePort: %d", nodePort)
		}
		return doc + "}\n"
	}
	endpoints := func(name, proto string, eps ...whoSaw) string {
		var docs []string
		for i, e := range eps {
			port, node := e.tcp, "it-node"
			if proto == "UDP" {
				port = e.udp
			}
			if e.role == testbed.RemotePod {
				node = "node-b"
			}
			docs = append(docs, slice(fmt.Sprintf("%s-%d", name, i), name, family, proto, ep{addr: e.addr, port: port, node: node}))
		}
		return join(docs...)
	}
	// loaded are the Services the clients use; with more, their endpoints
	// change (a second local endpoint comes and goes).
	loaded := func(more bool) string {
		extra := func(eps ...whoSaw) []whoSaw {
			if more {
				return append(eps, local2)
			}
			return eps
		}
		return join(
			svc("cip", 10, "TCP", 0), endpoints("cip", "TCP", extra(local, remote)...),
			svc("cip-udp", 11, "UDP", 0), endpoints("cip-udp", "UDP", extra(local, remote)...),
			svc("local", 12, "TCP", 30012), endpoints("local", "TCP", extra(local)...),
			svc("local-udp", 13, "UDP", 30013), endpoints("local-udp", "UDP", extra(local)...),
		)
	}
	// churn are Services without traffic that come and go: each set opens
	// proxy ports and external routes in a sync that takes the long way.
	churn := func(round int) string {
		var docs []string
		for i := range 8 {
			n := 100 + (round%2)*20 + i
			docs = append(docs, svc(fmt.Sprintf("churn-%d", n), n, []string{"TCP", "UDP"}[i%2], 31000+n), endpoints(fmt.Sprintf("churn-%d", n), []string{"TCP", "UDP"}[i%2], local))
		}
		return join(docs...)
	}

	px := runUproxy(t, tp, loaded(false), launch{want: 4, flags: []string{"--rules", rules, "--hostname-override", "it-node",
		"--cluster-cidr", cidr, "--shutdown-grace", "1s"}})
	px.write("churn.yaml", churn(0))

	hostPort := func(a netip.Addr, port int) string { return net.JoinHostPort(a.String(), fmt.Sprint(port)) }
	nodeIP := ip(testbed.Node)
	clients := []struct {
		name, role, proto, addr string
		want                    netip.Addr
	}{
		{"pod to ClusterIP", testbed.Pod, "TCP", net.JoinHostPort(vip(10), "80"), ip(testbed.Pod)},
		{"pod to ClusterIP", testbed.Pod, "UDP", net.JoinHostPort(vip(11), "80"), ip(testbed.Pod)},
		{"outside host to Local NodePort", testbed.External, "TCP", hostPort(nodeIP, 30012), ip(testbed.External)},
		{"outside host to Local NodePort", testbed.External, "UDP", hostPort(nodeIP, 30013), ip(testbed.External)},
		{"other node to Local NodePort", testbed.NodeB, "TCP", hostPort(nodeIP, 30012), ip(testbed.NodeB)},
		{"other node's pod to Local NodePort", testbed.RemotePod, "TCP", hostPort(nodeIP, 30012), ip(testbed.RemotePod)},
		{"other node's pod to Local NodePort", testbed.RemotePod, "UDP", hostPort(nodeIP, 30013), ip(testbed.RemotePod)},
	}

	stop := make(chan struct{})
	var changes atomic.Int64
	var churnWG sync.WaitGroup
	churnWG.Add(1)
	go func() {
		defer churnWG.Done()
		for round := 1; ; round++ {
			select {
			case <-stop:
				return
			case <-time.After(150 * time.Millisecond):
			}
			if round%2 == 1 {
				px.write("churn.yaml", churn(round))
			} else {
				px.write("services.yaml", loaded(round%4 == 0))
			}
			changes.Add(1)
		}
	}()

	// A UDP exchange whose endpoint is removed while its reply is on the way
	// loses the reply (the client entry ends, as kube-proxy deletes the
	// flow's conntrack entry): it is asked again once, as a UDP client
	// retries, and counted.
	type tally struct {
		ok, failed, retried int
		wrong               map[netip.Addr]int
		lastErr             error
	}
	tallies := make([]tally, len(clients))
	var wg sync.WaitGroup
	var mu sync.Mutex
	const perClient = 3
	for i, c := range clients {
		for range perClient {
			wg.Add(1)
			go func() {
				defer wg.Done()
				deadline := time.Now().Add(loadDuration)
				for time.Now().Before(deadline) {
					_, saw, err := askWho(tp, c.proto, c.role, c.addr)
					retried := false
					if err != nil && c.proto == "UDP" {
						retried = true
						_, saw, err = askWho(tp, c.proto, c.role, c.addr)
					}
					mu.Lock()
					tl := &tallies[i]
					if retried {
						tl.retried++
					}
					switch {
					case err != nil:
						tl.failed++
						tl.lastErr = err
					case saw.Addr().Unmap() != c.want:
						if tl.wrong == nil {
							tl.wrong = map[netip.Addr]int{}
						}
						tl.wrong[saw.Addr().Unmap()]++
					default:
						tl.ok++
					}
					mu.Unlock()
				}
			}()
		}
	}
	wg.Wait()
	close(stop)
	churnWG.Wait()

	total := 0
	for i, c := range clients {
		tl := tallies[i]
		asked := tl.ok + tl.failed
		for _, n := range tl.wrong {
			asked += n
		}
		total += asked
		for saw, n := range tl.wrong {
			t.Errorf("%s (%s, %s): %d of %d answers saw the client as %v; want %v", c.name, c.proto, c.role, n, asked, saw, c.want)
		}
		if tl.failed > 0 {
			t.Errorf("%s (%s, %s): %d failed, the last: %v", c.name, c.proto, c.role, tl.failed, tl.lastErr)
		}
		if tl.retried > 0 {
			t.Logf("%s (%s, %s): %d of %d exchanges asked twice", c.name, c.proto, c.role, tl.retried, asked)
		}
		if tl.ok == 0 {
			t.Errorf("%s (%s, %s): no answer at all", c.name, c.proto, c.role)
		}
	}
	t.Logf("%d connections and datagram exchanges, %d manifest changes meanwhile", total, changes.Load())
	if changes.Load() < 10 {
		t.Errorf("only %d manifest changes during the load; want at least 10", changes.Load())
	}

	m, err := px.get("/metrics")
	if err != nil {
		t.Fatal(err)
	}
	for _, src := range []string{"node", "fallback", "hairpin"} {
		if v := metricValue(m, `uproxy_dial_sources_total{source="`+src+`"}`); v != 0 {
			t.Errorf("uproxy_dial_sources_total{source=%q} = %v; want 0: every dial of this test keeps the client's address", src, v)
		}
	}
	if v := metricValue(m, `uproxy_dial_sources_total{source="client"}`); v == 0 {
		t.Errorf(`uproxy_dial_sources_total{source="client"} = 0; want every dial`)
	}
}

// otherRules writes, in the node's namespace, the rules other programs of a
// node leave beside uproxy's: the CNI portmap plugin's chains of a pod with a
// hostPort (DNAT of the host port to the pod, a mark 0x2000 for hairpin
// traffic and a masquerade of packets carrying it), and a masquerade of the
// pod network's traffic to destinations outside it.
func otherRules(t *testing.T, tp *testbed.Topology, v6 bool, hostPortPod netip.Addr, podCIDR string) {
	t.Helper()
	cmd := "iptables"
	if v6 {
		cmd = "ip6tables"
	}
	pod := hostPortPod.String()
	if v6 {
		pod = "[" + pod + "]"
	}
	for _, r := range [][]string{
		{"-t", "nat", "-N", "CNI-HOSTPORT-SETMARK"},
		{"-t", "nat", "-A", "CNI-HOSTPORT-SETMARK", "-m", "comment", "--comment", "CNI portfwd masquerade mark", "-j", "MARK", "--set-xmark", "0x2000/0x2000"},
		{"-t", "nat", "-N", "CNI-HOSTPORT-MASQ"},
		{"-t", "nat", "-A", "CNI-HOSTPORT-MASQ", "-m", "mark", "--mark", "0x2000/0x2000", "-j", "MASQUERADE"},
		{"-t", "nat", "-A", "POSTROUTING", "-m", "comment", "--comment", "CNI portfwd requiring masquerade", "-j", "CNI-HOSTPORT-MASQ"},
		{"-t", "nat", "-N", "CNI-HOSTPORT-DNAT"},
		{"-t", "nat", "-N", "CNI-DN-it"},
		{"-t", "nat", "-A", "CNI-DN-it", "-s", hostPortPod.String(), "-p", "tcp", "--dport", "8080", "-j", "CNI-HOSTPORT-SETMARK"},
		{"-t", "nat", "-A", "CNI-DN-it", "-p", "tcp", "--dport", "8080", "-j", "DNAT", "--to-destination", pod + ":80"},
		{"-t", "nat", "-A", "CNI-HOSTPORT-DNAT", "-p", "tcp", "-m", "multiport", "--destination-ports", "8080", "-j", "CNI-DN-it"},
		{"-t", "nat", "-A", "PREROUTING", "-m", "addrtype", "--dst-type", "LOCAL", "-j", "CNI-HOSTPORT-DNAT"},
		{"-t", "nat", "-A", "OUTPUT", "-m", "addrtype", "--dst-type", "LOCAL", "-j", "CNI-HOSTPORT-DNAT"},
		{"-t", "nat", "-A", "POSTROUTING", "-s", podCIDR, "!", "-d", podCIDR, "-m", "comment", "--comment", "pod network egress", "-j", "MASQUERADE"},
	} {
		tp.MustExec(t, testbed.Node, append([]string{cmd, "-w"}, r...)...)
	}
}
