package explain

import (
	"context"
	"io"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/knftables"

	"github.com/uproxy/uproxy/netfilter/conntrack/conntracktest"
	"github.com/uproxy/uproxy/netfilter/iptables/iptablestest"
	"github.com/uproxy/uproxy/netfilter/nftables"
	"github.com/uproxy/uproxy/netfilter/nftables/nftablestest"
	"github.com/uproxy/uproxy/observe"
	"github.com/uproxy/uproxy/proxier"
	"github.com/uproxy/uproxy/rules"
	"github.com/uproxy/uproxy/service"
)

// TestExplainRefused: a Service port without endpoints, its portals written by
// the rules package for what the proxier decided, is narrated as refused at
// the portal: the served-by line, the reason from /debug/services, the filter
// table's REJECT (iptables) or the no-endpoint map's element (nftables), and
// no claim that the portals are missing. Once it has an endpoint, it is
// narrated as steered to its proxy port again.
func TestExplainRefused(t *testing.T) {
	empty := &service.Port{Name: service.PortName{Namespace: "shop", Name: "empty"}, Protocol: service.TCP, Port: 80,
		ClusterIPs: []netip.Addr{netip.MustParseAddr("10.96.0.12")}}
	withEndpoint := *empty
	withEndpoint.Endpoints = []service.Endpoint{{Addr: netip.MustParseAddrPort("127.0.0.2:8080"), Ready: true, Serving: true}}
	portalsCfg := rules.Config{NodeIPs: []netip.Addr{netip.MustParseAddr("192.0.2.10")}, Conntrack: &conntracktest.Recorder{},
		Listen: func(string, string) (io.Closer, error) { return io.NopCloser(nil), nil }}

	for _, backend := range []rules.Backend{rules.BackendIPTables, rules.BackendNFTables} {
		t.Run(string(backend), func(t *testing.T) {
			ipt := iptablestest.New()
			nftTable, err := rules.NFTPortalTable("")
			if err != nil {
				t.Fatal(err)
			}
			nft := nftablestest.New(nftables.Table{Family: nftTable.Family, Name: nftTable.Name})
			cfg := portalsCfg
			var portals rules.Portals
			if backend == rules.BackendIPTables {
				cfg.IPTables = ipt
				portals, err = rules.NewIPTables(cfg)
			} else {
				cfg.NFTables = nft
				portals, err = rules.NewNFTables(cfg)
			}
			if err != nil {
				t.Fatal(err)
			}
			px, err := proxier.New(proxier.Config{BindAddress: netip.MustParseAddr("127.0.0.1"), Portals: portals})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				defer cancel()
				px.Shutdown(ctx)
				portals.Cleanup()
			})
			srv := httptest.NewServer((&observe.Server{Mode: "userspace", Services: px, Debug: true}).MetricsHandler())
			t.Cleanup(srv.Close)
			addr := strings.TrimPrefix(srv.URL, "http://")
			explain := func(port *service.Port) string {
				t.Helper()
				if err := px.Sync(&service.Snapshot{Ports: []*service.Port{port}, Built: time.Now()}); err != nil {
					t.Fatal(err)
				}
				save, err := ipt.Save(false)
				if err != nil {
					t.Fatal(err)
				}
				return runExplain(t, "10.96.0.12:80", Options{MetricsAddress: addr, IPTablesSave: writeFile(t, string(save)),
					NFT: knftables.Interface(nft)})
			}

			out := explain(empty)
			pp := px.ProxyPort(empty.Name)
			wants := []string{
				"Service port shop/empty (TCP, matched as clusterIP)",
				"Served by nothing: the portal refuses it, no usable endpoint of IPv4: a TCP connect fails at once with connection refused",
				"none: the portals refuse every connection, before any socket",
				"Refused at the portal: its IPv4 ClusterIPs, no usable endpoint of IPv4 (TCP reset, ICMP port unreachable).",
			}
			if backend == rules.BackendIPTables {
				wants = append(wants,
					"Rules (filter table, for the packets the nat table leaves to their destination):",
					"From pods and other hosts (FORWARD):",
					"From this node (OUTPUT):",
					`-A UPROXY-NO-ENDPOINTS -d 10.96.0.12/32 -p tcp -m comment --comment "shop/empty has no endpoints" -m tcp --dport 80 -j REJECT --reject-with tcp-reset`,
					"=> always REJECT: refused with tcp-reset (UPROXY-NO-ENDPOINTS rule 1)")
			} else {
				wants = append(wants,
					"map no-endpoint-service-ips4: 10.96.0.12 . tcp . 80 : goto refuse (shop/empty)",
					"=> refused, its Service port having no endpoints")
			}
			for _, want := range wants {
				if !strings.Contains(out, want) {
					t.Errorf("no endpoints: output lacks %q", want)
				}
			}
			if strings.Contains(out, "no portal rule") {
				t.Errorf("no endpoints: output says the portals are missing")
			}
			if t.Failed() {
				t.Logf("output:\n%s", out)
			}

			out = explain(&withEndpoint)
			if px.ProxyPort(empty.Name) != pp {
				t.Errorf("proxy port: got %d after the endpoint came, want %d", px.ProxyPort(empty.Name), pp)
			}
			for _, notWant := range []string{"refuse", "Refused", "REJECT", "filter table"} {
				if strings.Contains(out, notWant) {
					t.Errorf("with an endpoint: output has %q\n%s", notWant, out)
				}
			}
			if !strings.Contains(out, "Served by uproxy's proxy port") {
				t.Errorf("with an endpoint: output lacks the proxy port\n%s", out)
			}
		})
	}
}
