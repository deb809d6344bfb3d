package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/uproxy/uproxy/measure/topology"
)

// KubeProxyLayout names the control-plane row of the reference layout: the
// nftables layout of kube-proxy's nftables mode (a chain per Service port and
// one per endpoint, reached from a verdict map), rendered by this benchmark and
// loaded with nft -f, beside uproxy's own nftables mode in the same table. It
// is measured only when the nftables path runs.
const KubeProxyLayout = "kube-proxy-layout"

// refTable is the reference layout's table; it lives in a namespace of its own.
const refTable = "kube-proxy-ref"

// refService is one Service port of the reference layout: ClusterIP:80/TCP and
// its endpoints.
type refService struct {
	name string
	vip  netip.Addr
	eps  []netip.AddrPort
}

func refServices(n int) []refService {
	out := make([]refService, n)
	for i := range out {
		out[i] = refService{name: fmt.Sprintf("scale-%d", i), vip: scaleVIP(i).Addr(), eps: []netip.AddrPort{
			netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 244, byte(i >> 8), byte(i)}), 8080),
			netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 245, byte(i >> 8), byte(i)}), 8080),
		}}
	}
	return out
}

func (s refService) chain() string { return "svc-" + s.name }

func refEndpointChain(s refService, ep netip.AddrPort) string {
	return fmt.Sprintf("sep-%s-%s-%d", s.name, ep.Addr(), ep.Port())
}

// writeRefTable writes the reference table with the shared chains and no
// Service, replacing an older one.
func writeRefTable(b *bytes.Buffer) {
	fmt.Fprintf(b, `add table ip %[1]s
delete table ip %[1]s
table ip %[1]s {
	map service-ips { type ipv4_addr . inet_proto . inet_service : verdict; }
	chain mark-for-masquerade { meta mark set meta mark | 0x4000; }
	chain masquerading { meta mark & 0x4000 == 0 return; meta mark set meta mark ^ 0x4000; masquerade fully-random; }
	chain services { ip daddr . meta l4proto . th dport vmap @service-ips; }
	chain nat-prerouting { type nat hook prerouting priority dstnat; policy accept; jump services; }
	chain nat-output { type nat hook output priority -100; policy accept; jump services; }
	chain nat-postrouting { type nat hook postrouting priority srcnat; policy accept; jump masquerading; }
}
`, refTable)
}

// writeRefService adds one Service port: its endpoint chains, its chain
// picking one at random, and its verdict-map element.
func writeRefService(b *bytes.Buffer, s refService) {
	for _, ep := range s.eps {
		writeRefEndpoint(b, s, ep)
	}
	fmt.Fprintf(b, "add chain ip %s %s\n", refTable, s.chain())
	writeRefServiceRules(b, s)
	fmt.Fprintf(b, "add element ip %s service-ips { %s . tcp . 80 : goto %s }\n", refTable, s.vip, s.chain())
}

func writeRefEndpoint(b *bytes.Buffer, s refService, ep netip.AddrPort) {
	c := refEndpointChain(s, ep)
	fmt.Fprintf(b, "add chain ip %[1]s %[2]s\nadd rule ip %[1]s %[2]s ip saddr %[3]s jump mark-for-masquerade\nadd rule ip %[1]s %[2]s meta l4proto tcp dnat to %[4]s\n",
		refTable, c, ep.Addr(), ep)
}

func writeRefServiceRules(b *bytes.Buffer, s refService) {
	c := s.chain()
	fmt.Fprintf(b, "add rule ip %s %s ip saddr != 10.244.0.0/16 jump mark-for-masquerade\n", refTable, c)
	fmt.Fprintf(b, "add rule ip %s %s numgen random mod %d vmap {", refTable, c, len(s.eps))
	for i, ep := range s.eps {
		sep := ","
		if i == 0 {
			sep = ""
		}
		fmt.Fprintf(b, "%s %d : goto %s", sep, i, refEndpointChain(s, ep))
	}
	b.WriteString(" }\n")
}

// writeRefEndpointChange replaces the second endpoint of s with ep, as a sync
// of that one Service would: the new endpoint's chain, the Service chain
// rewritten, the old endpoint's chain deleted.
func writeRefEndpointChange(b *bytes.Buffer, s refService, ep netip.AddrPort) refService {
	old := s.eps[1]
	s.eps = []netip.AddrPort{s.eps[0], ep}
	writeRefEndpoint(b, s, ep)
	fmt.Fprintf(b, "flush chain ip %s %s\n", refTable, s.chain())
	writeRefServiceRules(b, s)
	fmt.Fprintf(b, "delete chain ip %s %s\n", refTable, refEndpointChain(s, old))
	return s
}

// runKubeProxyLayout measures the reference layout at each size: the whole
// table loaded with n Service ports of two endpoints, one Service port added,
// one endpoint changed. Each is one nft -f in a namespace of its own, nft's
// start and parse included; a load that outlasts limit (plus 1 ms per Service
// port) ends the measurement with the sizes done so far.
func runKubeProxyLayout(ctx context.Context, sizes []int, limit time.Duration, dir string) (*ControlResult, error) {
	tp, err := topology.Build()
	if err != nil {
		return nil, err
	}
	defer tp.Close()
	res := &ControlResult{}
	load := func(b *bytes.Buffer, name string, n int) (float64, error) {
		return loadRef(ctx, tp, b, filepath.Join(dir, name+".nft"), limit+time.Duration(n)*time.Millisecond)
	}
	for _, n := range sizes {
		svcs := refServices(n + 1)
		var b bytes.Buffer
		b.Grow(n * 600)
		writeRefTable(&b)
		for _, s := range svcs[:n] {
			writeRefService(&b, s)
		}
		full, err := load(&b, "kube-proxy-layout-full", n)
		if err != nil {
			return res, fmt.Errorf("%d Service ports: %w", n, err)
		}
		sr := SyncResult{Ports: n, SyncSeconds: full, Syncs: 1}
		b.Reset()
		writeRefService(&b, svcs[n])
		one, err := load(&b, "kube-proxy-layout-add", n)
		if err != nil {
			res.Syncs = append(res.Syncs, sr)
			return res, fmt.Errorf("one more at %d: %w", n, err)
		}
		sr.AddOneSyncSeconds = ptr(one)
		b.Reset()
		writeRefEndpointChange(&b, svcs[n/2], netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 246, 0, 1}), 8080))
		ep, err := load(&b, "kube-proxy-layout-endpoint", n)
		if err != nil {
			res.Syncs = append(res.Syncs, sr)
			return res, fmt.Errorf("endpoint change at %d: %w", n, err)
		}
		sr.EndpointSyncSeconds = ptr(ep)
		res.Syncs = append(res.Syncs, sr)
		if ctx.Err() != nil {
			return res, ctx.Err()
		}
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, "delete table ip %s\n", refTable)
	if _, err := load(&b, "kube-proxy-layout-delete", 0); err != nil && !errors.Is(err, context.Canceled) {
		return res, err
	}
	return res, nil
}

// loadRef writes b to file and loads it with nft -f in tp's node namespace,
// returning how long nft took; a load that outlasts limit is stopped.
func loadRef(ctx context.Context, tp *topology.Topology, b *bytes.Buffer, file string, limit time.Duration) (float64, error) {
	if err := os.WriteFile(file, b.Bytes(), 0o644); err != nil {
		return 0, err
	}
	lctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	var took time.Duration
	err := tp.Run(topology.Node, func() error {
		start := time.Now()
		out, err := exec.CommandContext(lctx, "nft", "-f", file).CombinedOutput()
		took = time.Since(start)
		if lctx.Err() != nil && ctx.Err() == nil {
			return fmt.Errorf("nft -f did not finish within %v", limit)
		}
		if err != nil {
			return fmt.Errorf("nft -f %s: %w: %s", file, err, bytes.TrimSpace(out))
		}
		return nil
	})
	return took.Seconds(), err
}
