package iptables

import (
	"errors"
	"fmt"
	"testing"

	"github.com/uproxy/uproxy/netfilter/conntrack/conntracktest"
	"github.com/uproxy/uproxy/netfilter/iptables/iptablestest"
	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/service"
)

// countersKernel is the fake iptables with the counters a test chooses.
type countersKernel struct {
	*iptablestest.Fake
	save func(v6 bool, table string) ([]byte, error)
}

func (k countersKernel) SaveCounters(v6 bool, table string) ([]byte, error) { return k.save(v6, table) }

// DebugServices reports each endpoint's DNAT counters as iptables-save -c shows
// them, summed over the families, and leaves them zero when they cannot be read.
func TestDebugServicesCounters(t *testing.T) {
	t.Parallel()
	web := svcPort("shop", "web", "http", service.TCP, 80)
	web.ClusterIPs = addrs("10.96.0.10", "fd00:96::10")
	web.Endpoints = eps("10.244.1.2:8080", "10.244.2.3:8080", "[fd00:244::2]:8080")
	dns := svcPort("kube-system", "dns", "dns", service.UDP, 53)
	dns.ClusterIPs = addrs("10.96.0.53")
	dns.Endpoints = eps("10.244.1.2:53")

	for _, tc := range []struct {
		name string
		fail bool
		want map[string][2]uint64 // service endpoint -> packets, bytes
	}{
		{name: "counted", want: map[string][2]uint64{
			"shop/web:http 10.244.1.2:8080":     {7, 420},
			"shop/web:http 10.244.2.3:8080":     {0, 0},
			"shop/web:http [fd00:244::2]:8080":  {3, 240},
			"kube-system/dns:dns 10.244.1.2:53": {11, 682},
		}},
		{name: "iptables-save fails", fail: true, want: map[string][2]uint64{
			"shop/web:http 10.244.1.2:8080":     {0, 0},
			"shop/web:http 10.244.2.3:8080":     {0, 0},
			"shop/web:http [fd00:244::2]:8080":  {0, 0},
			"kube-system/dns:dns 10.244.1.2:53": {0, 0},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var p *Proxier
			sep := func(port *service.Port, ep string) string {
				return p.n.portChain("SEP", port.Name, port.Protocol, ep)
			}
			calls := 0
			save := func(v6 bool, table string) ([]byte, error) {
				calls++
				if table != "nat" {
					t.Errorf("iptables-save -c -t %s, want -t nat", table)
				}
				if tc.fail {
					return nil, errors.New("iptables-save: not found")
				}
				if v6 {
					return fmt.Appendf(nil, "*nat\n[1:80] -A %[1]s -s fd00:244::2/128 -j UPROXY-MARK-MASQ\n[3:240] -A %[1]s -p tcp -m tcp -j DNAT --to-destination [fd00:244::2]:8080\nCOMMIT\n",
						sep(web, "[fd00:244::2]:8080")), nil
				}
				return fmt.Appendf(nil, "*nat\n[2:120] -A %[1]s -s 10.244.1.2/32 -j UPROXY-MARK-MASQ\n[7:420] -A %[1]s -p tcp -m tcp -j DNAT --to-destination 10.244.1.2:8080\n[0:0] -A %[2]s -p tcp -m tcp -j DNAT --to-destination 10.244.2.3:8080\n[11:682] -A %[3]s -p udp -m udp -j DNAT --to-destination 10.244.1.2:53\nCOMMIT\n",
					sep(web, "10.244.1.2:8080"), sep(web, "10.244.2.3:8080"), sep(dns, "10.244.1.2:53")), nil
			}
			var err error
			p, err = New(Config{Common: proxymode.Common{IPv6: true}, IPTables: countersKernel{iptablestest.New(), save}, Conntrack: &conntracktest.Recorder{}})
			if err != nil {
				t.Fatal(err)
			}
			if err := p.Sync(snapshot(web, dns)); err != nil {
				t.Fatal(err)
			}
			got := map[string][2]uint64{}
			for _, st := range p.DebugServices() {
				for _, e := range st.Endpoints {
					got[st.Name+" "+e.Address] = [2]uint64{e.Packets, e.Bytes}
				}
			}
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Errorf("counters: got %v, want %v", got, tc.want)
			}
			if calls != 2 {
				t.Errorf("iptables-save -c calls for one DebugServices: got %d, want 2 (one per family)", calls)
			}
		})
	}
}
