package proxier

import (
	"fmt"
	"net"
	"net/netip"
	"testing"

	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/test/testbed/logs"
)

// Every proxy port opened is logged once at the default verbosity, with its
// Service port, protocol and the addresses it serves: with --rules none that
// line is how a user finds a Service's proxy port.
func TestOpenedProxyPortLogged(t *testing.T) {
	w := newWorld(t)
	a := w.tcpBackend("a", "127.0.0.2")
	u := w.udpBackend("u", "127.0.0.2")
	web := port("web", service.TCP, a)
	web.ClusterIPs = append(web.ClusterIPs, netip.MustParseAddr("fd00::1"))
	web.NodePort = 30080
	dns := port("dns", service.UDP, u)
	log := logs.Capture(t)
	p := newProxier(t, Config{})

	mustSync(t, p, snapshot(dns, web))
	webPort := p.ProxyPort(web.Name)
	dnsPort := p.ProxyPort(dns.Name)
	logs.Check(t, "first sync", log.Since(), [][]string{
		{"I", `"Opened proxy port"`, `service="default/dns:p"`, `protocol="UDP"`, fmt.Sprintf("proxyPort=%d", dnsPort), `serves="10.96.0.1:80/UDP"`},
		{"I", `"Opened proxy port"`, `service="default/web:p"`, `protocol="TCP"`, fmt.Sprintf("proxyPort=%d", webPort),
			`serves="10.96.0.1:80/TCP [fd00::1]:80/TCP nodePort 30080/TCP"`},
	})

	// Endpoints change under open ports: nothing is opened, nothing logged.
	mustSync(t, p, snapshot(port("dns", service.UDP), port("web", service.TCP)))
	logs.Check(t, "endpoint change", log.Since(), nil)
}

// A Service port left out of a sync is logged when the problem appears, not at
// every sync that retries it, and once more when it is gone.
func TestLeftOutPortLoggedOnce(t *testing.T) {
	w := newWorld(t)
	a := w.tcpBackend("a", "127.0.0.2")
	// The whole proxy port range is one port, taken by someone else at first.
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	pn := taken.Addr().(*net.TCPAddr).Port
	log := logs.Capture(t)
	p := newProxier(t, Config{PortRange: PortRange{First: pn, Last: pn}})
	web := snapshot(port("web", service.TCP, a))
	mustSync(t, p, web)
	logs.Check(t, "first sync", log.Since(), [][]string{
		{"E", `"Service port left out of the sync, whole or in part; retried at every sync, logged again when it is gone"`, "default/web:p", "address already in use"},
	})
	mustSync(t, p, web)
	mustSync(t, p, web)
	logs.Check(t, "the same problem at the next syncs", log.Since(), nil)
	taken.Close()
	mustSync(t, p, web)
	logs.Check(t, "once the port is free", log.Since(), [][]string{
		{"I", `"Opened proxy port"`, `service="default/web:p"`},
		{"I", `"Service port problem gone"`, "default/web:p"},
	})
}
