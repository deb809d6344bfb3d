package rules

import (
	"strconv"
	"strings"
	"testing"
)

// TestExternalProxyPort: with Portal.ExternalProxyPort set, the ClusterIPs lead
// to ProxyPort and the NodePort, ExternalIPs and LoadBalancer IPs to the
// external proxy port, in both backends and for both the node's own
// connections and everyone else's; the NodePort accept rule names the
// external proxy port.
func TestExternalProxyPort(t *testing.T) {
	t.Parallel()
	np := freePort(t, "tcp4")
	NP := strconv.Itoa(np)
	portals := []Portal{{Port: webPort(np), ProxyPort: 40001, ExternalProxyPort: 40009}}

	t.Run("iptables", func(t *testing.T) {
		k := newFakeKernel()
		if err := newTestIPTables(t, k, Config{}).Sync(portals); err != nil {
			t.Fatalf("Sync: %v", err)
		}
		got := k.restores(v4)[0]
		for _, want := range []string{
			`-A UPROXY-NODEPORT-NON-LOCAL -p tcp -m comment --comment "shop/web:http" -m tcp --dport 40009 -m conntrack --ctstate DNAT --ctorigdstport ` + NP + ` -j ACCEPT`,
			`-A UPROXY-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "shop/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 40001`,
			`-A UPROXY-PORTALS-CONTAINER -d 10.251.0.7/32 -p tcp -m comment --comment "shop/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 40009`,
			`-A UPROXY-PORTALS-CONTAINER -d 10.250.0.5/32 -p tcp -m comment --comment "shop/web:http" -m tcp --dport 80 -m addrtype ! --src-type LOCAL -j REDIRECT --to-ports 40009`,
			`-A UPROXY-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "shop/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.1:40001`,
			`-A UPROXY-PORTALS-HOST -d 10.251.0.7/32 -p tcp -m comment --comment "shop/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.1:40009`,
			`-A UPROXY-PORTALS-HOST -d 10.250.0.5/32 -p tcp -m comment --comment "shop/web:http" -m tcp --dport 80 -m addrtype --dst-type LOCAL -j DNAT --to-destination 10.0.0.1:40009`,
			`-A UPROXY-NODEPORT-CONTAINER -p tcp -m comment --comment "shop/web:http" -m tcp --dport ` + NP + ` -j REDIRECT --to-ports 40009`,
			`-A UPROXY-NODEPORT-HOST -p tcp -m comment --comment "shop/web:http" -m tcp --dport ` + NP + ` -j DNAT --to-destination 10.0.0.1:40009`,
		} {
			if !strings.Contains(got, want+"\n") {
				t.Errorf("restore input lacks\n%s\ngot:\n%s", want, got)
			}
		}
	})

	t.Run("nftables", func(t *testing.T) {
		p, k := newTestNFTables(t, Config{})
		if err := p.Sync(portals); err != nil {
			t.Fatalf("Sync: %v", err)
		}
		got := writes(k, 0)
		for _, want := range []string{
			`add element inet uproxy service-ips4 { 10.96.0.10 . tcp . 80 comment "shop/web:http" : 40001 }`,
			`add element inet uproxy service-ips4 { 10.251.0.7 . tcp . 80 comment "shop/web:http" : 40009 }`,
			`add element inet uproxy external-ips4 { 10.250.0.5 . tcp . 80 comment "shop/web:http" : 40009 }`,
			`add element inet uproxy nodeports4 { tcp . ` + NP + ` comment "shop/web:http" : 40009 }`,
		} {
			if !strings.Contains(got, want+"\n") {
				t.Errorf("transaction lacks\n%s\ngot:\n%s", want, got)
			}
		}
		// Moving only the external proxy port rewrites only its elements.
		portals[0].ExternalProxyPort = 40010
		if err := p.Sync(portals); err != nil {
			t.Fatalf("second Sync: %v", err)
		}
		if got := writes(k, 1); strings.Contains(got, "10.96.0.10") || !strings.Contains(got, ": 40010 }") {
			t.Errorf("second transaction: got\n%s\nwant the external elements moved to 40010 and the ClusterIP's untouched", got)
		}
	})
}
