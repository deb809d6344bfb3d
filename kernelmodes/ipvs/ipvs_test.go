package ipvs

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moby/ipvs"

	"github.com/uproxy/uproxy/netfilter/iptables/iptablestest"
	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/service/servicetest"
)

// fakeKernel models IPVS and the dummy link as the kernel keeps them; IPVS
// cannot run where the tests do (no CONFIG_IP_VS, no CONFIG_DUMMY).
type fakeKernel struct {
	services map[vsKey]*ipvs.Service
	dests    map[vsKey]map[netip.AddrPort]*ipvs.Destination
	link     bool
	addrs    map[netip.Addr]bool
	ops      []string
	sysctls  int
}

func newFakeKernel() *fakeKernel {
	return &fakeKernel{services: map[vsKey]*ipvs.Service{}, dests: map[vsKey]map[netip.AddrPort]*ipvs.Destination{}, addrs: map[netip.Addr]bool{}}
}

func (k *fakeKernel) op(format string, args ...any) {
	k.ops = append(k.ops, fmt.Sprintf(format, args...))
}

func (k *fakeKernel) Services() ([]*ipvs.Service, error) {
	var out []*ipvs.Service
	for _, s := range k.services {
		c := *s
		out = append(out, &c)
	}
	return out, nil
}

func (k *fakeKernel) AddService(s *ipvs.Service) error {
	key := keyOf(s)
	if _, ok := k.services[key]; ok {
		return syscall.EEXIST
	}
	c := *s
	c.Flags |= 0x2 // IP_VS_SVC_F_HASHED, which the kernel adds
	k.services[key] = &c
	k.dests[key] = map[netip.AddrPort]*ipvs.Destination{}
	k.op("add service %s %s flags=%d timeout=%d", key, s.SchedName, s.Flags, s.Timeout)
	return nil
}

func (k *fakeKernel) UpdateService(s *ipvs.Service) error {
	key := keyOf(s)
	if _, ok := k.services[key]; !ok {
		return syscall.ENOENT
	}
	c := *s
	k.services[key] = &c
	k.op("update service %s %s flags=%d timeout=%d", key, s.SchedName, s.Flags, s.Timeout)
	return nil
}

func (k *fakeKernel) DeleteService(s *ipvs.Service) error {
	key := keyOf(s)
	if _, ok := k.services[key]; !ok {
		return syscall.ENOENT
	}
	delete(k.services, key)
	delete(k.dests, key)
	k.op("delete service %s", key)
	return nil
}

func (k *fakeKernel) Destinations(s *ipvs.Service) ([]*ipvs.Destination, error) {
	ds, ok := k.dests[keyOf(s)]
	if !ok {
		return nil, syscall.ENOENT
	}
	var out []*ipvs.Destination
	for _, d := range ds {
		c := *d
		out = append(out, &c)
	}
	return out, nil
}

func (k *fakeKernel) AddDestination(s *ipvs.Service, d *ipvs.Destination) error {
	ds, ok := k.dests[keyOf(s)]
	if !ok {
		return syscall.ENOENT
	}
	if _, ok := ds[destKey(d)]; ok {
		return syscall.EEXIST
	}
	c := *d
	ds[destKey(d)] = &c
	k.op("add real server %s -> %s weight=%d", keyOf(s), destKey(d), d.Weight)
	return nil
}

func (k *fakeKernel) UpdateDestination(s *ipvs.Service, d *ipvs.Destination) error {
	ds := k.dests[keyOf(s)]
	cur, ok := ds[destKey(d)]
	if !ok {
		return syscall.ENOENT
	}
	cur.Weight = d.Weight
	k.op("update real server %s -> %s weight=%d", keyOf(s), destKey(d), d.Weight)
	return nil
}

func (k *fakeKernel) DeleteDestination(s *ipvs.Service, d *ipvs.Destination) error {
	ds := k.dests[keyOf(s)]
	if _, ok := ds[destKey(d)]; !ok {
		return syscall.ENOENT
	}
	delete(ds, destKey(d))
	k.op("delete real server %s -> %s", keyOf(s), destKey(d))
	return nil
}

func (k *fakeKernel) EnsureDummy(name string) error {
	if name != DummyName {
		return fmt.Errorf("fake: unexpected link %s", name)
	}
	k.link = true
	return nil
}

func (k *fakeKernel) DeleteDummy(name string) error {
	k.link = false
	k.addrs = map[netip.Addr]bool{}
	return nil
}

func (k *fakeKernel) DummyAddrs(name string) ([]netip.Addr, error) {
	var out []netip.Addr
	for a := range k.addrs {
		out = append(out, a)
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return out, nil
}

func (k *fakeKernel) AddAddr(name string, a netip.Addr) error {
	if !k.link {
		return errors.New("fake: no link")
	}
	k.addrs[a] = true
	return nil
}

func (k *fakeKernel) DeleteAddr(name string, a netip.Addr) error {
	delete(k.addrs, a)
	return nil
}

func (k *fakeKernel) SetSysctls() error { k.sysctls++; return nil }

// servers lists the virtual servers as "addr:port/PROTO sched [persistent T]: dest=weight ...".
func (k *fakeKernel) servers() []string {
	var out []string
	for key, s := range k.services {
		line := key.String() + " " + s.SchedName
		if s.Flags&flagPersistent != 0 {
			line += fmt.Sprintf(" persistent %ds", s.Timeout)
		}
		line += ":"
		var ds []string
		for ep, d := range k.dests[key] {
			ds = append(ds, fmt.Sprintf(" %s=%d", ep, d.Weight))
		}
		sort.Strings(ds)
		out = append(out, line+strings.Join(ds, ""))
	}
	sort.Strings(out)
	return out
}

// port is a Service port of namespace shop with one ClusterIP and its endpoints.
func port(name string, proto service.Protocol, p int, cluster string, eps ...string) *service.Port {
	sp := servicetest.Port("shop", name, "", proto, p)
	sp.ClusterIPs = servicetest.Addrs(cluster)
	sp.Endpoints = servicetest.Endpoints(eps...)
	return sp
}

var snap = servicetest.Snapshot

func newProxier(t *testing.T, cfg Config) (*Proxier, *fakeKernel, *iptablestest.Fake) {
	t.Helper()
	k, r := newFakeKernel(), iptablestest.New()
	cfg.Kernel, cfg.IPTables = k, r
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return p, k, r
}

func syncOK(t *testing.T, p *Proxier, s *service.Snapshot) {
	t.Helper()
	if err := p.Sync(s); err != nil {
		t.Fatalf("Sync: %v", err)
	}
}

func equal(t *testing.T, what string, got, want []string) {
	t.Helper()
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("%s:\ngot:\n  %s\nwant:\n  %s", what, strings.Join(got, "\n  "), strings.Join(want, "\n  "))
	}
}

func TestVirtualServers(t *testing.T) {
	t.Parallel()
	web := port("web", service.TCP, 80, "10.96.0.10", "10.244.1.2:8080", "10.244.2.3:8080", "[fd00::2]:8080")
	web.ClusterIPs = append(web.ClusterIPs, netip.MustParseAddr("fd00:96::10"))
	web.ExternalIPs = []netip.Addr{netip.MustParseAddr("203.0.113.5")}
	web.LoadBalancerIPs = []netip.Addr{netip.MustParseAddr("198.51.100.7")}
	web.NodePort = 30080
	dns := port("dns", service.UDP, 53, "10.96.0.53", "10.244.1.2:5353")
	sticky := port("sticky", service.TCP, 443, "10.96.0.11", "10.244.1.2:8443")
	sticky.AffinityClientIP = true
	sticky.AffinityTimeout = 3 * time.Hour
	local := port("local", service.TCP, 80, "10.96.0.12")
	local.Endpoints = []service.Endpoint{servicetest.Endpoint("10.244.1.2:80", true), servicetest.Endpoint("10.244.2.3:80", false)}
	local.NodePort = 30081
	local.ExternalPolicyLocal = true

	cases := []struct {
		name        string
		cfg         Config
		want, addrs []string
	}{
		{
			name: "IPv4, wlc, NodePorts on the node IPs",
			cfg:  Config{Common: proxymode.Common{NodeIPs: []netip.Addr{netip.MustParseAddr("192.168.50.1")}}, Scheduler: "wlc"},
			want: []string{
				"10.96.0.10:80/TCP wlc: 10.244.1.2:8080=1 10.244.2.3:8080=1",
				"10.96.0.11:443/TCP wlc persistent 10800s: 10.244.1.2:8443=1",
				"10.96.0.12:80/TCP wlc: 10.244.1.2:80=1 10.244.2.3:80=1",
				"10.96.0.53:53/UDP wlc: 10.244.1.2:5353=1",
				"192.168.50.1:30080/TCP wlc: 10.244.1.2:8080=1 10.244.2.3:8080=1",
				"192.168.50.1:30081/TCP wlc: 10.244.1.2:80=1",
				"198.51.100.7:80/TCP wlc: 10.244.1.2:8080=1 10.244.2.3:8080=1",
				"203.0.113.5:80/TCP wlc: 10.244.1.2:8080=1 10.244.2.3:8080=1",
			},
			addrs: []string{"10.96.0.10", "10.96.0.11", "10.96.0.12", "10.96.0.53", "198.51.100.7", "203.0.113.5"},
		},
		{
			name: "dual stack, NodePortAddresses excluding one node IP",
			cfg:  Config{Common: proxymode.Common{IPv6: true, NodeIPs: []netip.Addr{netip.MustParseAddr("192.168.50.1"), netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("fd00:50::1")}, NodePortAddresses: []netip.Prefix{netip.MustParsePrefix("192.168.50.0/24"), netip.MustParsePrefix("fd00:50::/64")}}},
			want: []string{
				"10.96.0.10:80/TCP rr: 10.244.1.2:8080=1 10.244.2.3:8080=1",
				"10.96.0.11:443/TCP rr persistent 10800s: 10.244.1.2:8443=1",
				"10.96.0.12:80/TCP rr: 10.244.1.2:80=1 10.244.2.3:80=1",
				"10.96.0.53:53/UDP rr: 10.244.1.2:5353=1",
				"192.168.50.1:30080/TCP rr: 10.244.1.2:8080=1 10.244.2.3:8080=1",
				"192.168.50.1:30081/TCP rr: 10.244.1.2:80=1",
				"198.51.100.7:80/TCP rr: 10.244.1.2:8080=1 10.244.2.3:8080=1",
				"203.0.113.5:80/TCP rr: 10.244.1.2:8080=1 10.244.2.3:8080=1",
				"[fd00:50::1]:30080/TCP rr: [fd00::2]:8080=1",
				"[fd00:96::10]:80/TCP rr: [fd00::2]:8080=1",
			},
			addrs: []string{"10.96.0.10", "10.96.0.11", "10.96.0.12", "10.96.0.53", "198.51.100.7", "203.0.113.5", "fd00:96::10"},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p, k, _ := newProxier(t, c.cfg)
			syncOK(t, p, snap(web, dns, sticky, local))
			equal(t, "virtual servers", k.servers(), c.want)
			got, _ := k.DummyAddrs(DummyName)
			var gs []string
			for _, a := range got {
				gs = append(gs, a.String())
			}
			equal(t, "addresses on "+DummyName, gs, c.addrs)
			if k.sysctls == 0 {
				t.Errorf("sysctls: got none set, want conntrack and expiry ones")
			}
			n := len(k.ops)
			syncOK(t, p, snap(web, dns, sticky, local))
			if extra := k.ops[n:]; len(extra) != 0 {
				t.Errorf("unchanged sync: got kernel calls %q, want none", extra)
			}
		})
	}
}

func TestGracefulTermination(t *testing.T) {
	t.Parallel()
	p, k, _ := newProxier(t, Config{})
	web := port("web", service.TCP, 80, "10.96.0.10", "10.244.1.2:8080", "10.244.2.3:8080")
	dns := port("dns", service.UDP, 53, "10.96.0.53", "10.244.1.2:5353", "10.244.2.3:5353")
	syncOK(t, p, snap(web, dns))
	webKey := vsKey{netip.MustParseAddr("10.96.0.10"), syscall.IPPROTO_TCP, 80}
	leaving := netip.MustParseAddrPort("10.244.2.3:8080")
	k.dests[webKey][leaving].ActiveConnections = 2
	k.dests[webKey][leaving].InactiveConnections = 1

	web1 := port("web", service.TCP, 80, "10.96.0.10", "10.244.1.2:8080")
	dns1 := port("dns", service.UDP, 53, "10.96.0.53", "10.244.1.2:5353")
	steps := []struct {
		name   string
		before func()
		s      *service.Snapshot
		want   []string
	}{
		{"endpoint removed with connections: weight 0, UDP deleted at once", func() {}, snap(web1, dns1), []string{
			"10.96.0.10:80/TCP rr: 10.244.1.2:8080=1 10.244.2.3:8080=0",
			"10.96.0.53:53/UDP rr: 10.244.1.2:5353=1",
		}},
		{"active connections gone, inactive remain: kept", func() { k.dests[webKey][leaving].ActiveConnections = 0 }, snap(web1, dns1), []string{
			"10.96.0.10:80/TCP rr: 10.244.1.2:8080=1 10.244.2.3:8080=0",
			"10.96.0.53:53/UDP rr: 10.244.1.2:5353=1",
		}},
		{"drained: deleted on the next sync", func() { k.dests[webKey][leaving].InactiveConnections = 0 }, snap(web1, dns1), []string{
			"10.96.0.10:80/TCP rr: 10.244.1.2:8080=1",
			"10.96.0.53:53/UDP rr: 10.244.1.2:5353=1",
		}},
	}
	for _, st := range steps {
		st.before()
		syncOK(t, p, st.s)
		equal(t, st.name, k.servers(), st.want)
	}

	t.Run("a terminating endpoint that comes back gets its weight back", func(t *testing.T) {
		syncOK(t, p, snap(web, dns))
		k.dests[webKey][leaving].ActiveConnections = 1
		syncOK(t, p, snap(web1, dns))
		syncOK(t, p, snap(web, dns))
		equal(t, "servers", k.servers(), []string{
			"10.96.0.10:80/TCP rr: 10.244.1.2:8080=1 10.244.2.3:8080=1",
			"10.96.0.53:53/UDP rr: 10.244.1.2:5353=1 10.244.2.3:5353=1",
		})
	})
}

func TestServiceChangesAndRemoval(t *testing.T) {
	t.Parallel()
	p, k, _ := newProxier(t, Config{})
	web := port("web", service.TCP, 80, "10.96.0.10", "10.244.1.2:8080")
	api := port("api", service.TCP, 443, "10.96.0.11", "10.244.1.3:8443")
	// Not ours: another virtual server on an address outside the dummy link.
	other := &ipvs.Service{Address: netip.MustParseAddr("172.16.0.1").AsSlice(), Protocol: syscall.IPPROTO_TCP, Port: 80, SchedName: "rr", AddressFamily: syscall.AF_INET}
	k.AddService(other)
	// A previous run's leftover on the dummy link.
	k.link = true
	k.addrs[netip.MustParseAddr("10.96.0.99")] = true
	k.AddService(&ipvs.Service{Address: netip.MustParseAddr("10.96.0.99").AsSlice(), Protocol: syscall.IPPROTO_TCP, Port: 80, SchedName: "rr", AddressFamily: syscall.AF_INET})

	syncOK(t, p, snap(web, api))
	equal(t, "first sync adopts the leftover and deletes it, leaves the foreign one", k.servers(), []string{
		"10.96.0.10:80/TCP rr: 10.244.1.2:8080=1",
		"10.96.0.11:443/TCP rr: 10.244.1.3:8443=1",
		"172.16.0.1:80/TCP rr:",
	})
	if k.addrs[netip.MustParseAddr("10.96.0.99")] {
		t.Errorf("leftover address 10.96.0.99 still on %s", DummyName)
	}

	sticky := *web
	sticky.AffinityClientIP, sticky.AffinityTimeout = true, time.Minute
	syncOK(t, p, snap(&sticky))
	equal(t, "affinity turned on, api removed", k.servers(), []string{
		"10.96.0.10:80/TCP rr persistent 60s: 10.244.1.2:8080=1",
		"172.16.0.1:80/TCP rr:",
	})
	if k.addrs[netip.MustParseAddr("10.96.0.11")] || !k.addrs[netip.MustParseAddr("10.96.0.10")] {
		t.Errorf("dummy addresses after removing api: got %v, want only 10.96.0.10", k.addrs)
	}

	if err := p.Cleanup(); err != nil {
		t.Fatalf("Cleanup: %v", err)
	}
	equal(t, "after Cleanup", k.servers(), []string{"172.16.0.1:80/TCP rr:"})
	if k.link {
		t.Errorf("dummy link still present after Cleanup")
	}
}

func TestRules(t *testing.T) {
	t.Parallel()
	p, _, r := newProxier(t, Config{Common: proxymode.Common{NodeIPs: []netip.Addr{netip.MustParseAddr("192.168.50.1")}, ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}}})
	web := port("web", service.TCP, 80, "10.96.0.10", "10.244.1.2:8080")
	web.NodePort = 30080
	web.LoadBalancerIPs = []netip.Addr{netip.MustParseAddr("198.51.100.7")}
	web.LoadBalancerSourceRanges = []netip.Prefix{netip.MustParsePrefix("203.0.113.0/24")}
	syncOK(t, p, snap(web))
	in := r.Restores(false)[0]
	for _, want := range []string{
		`-A UPROXY-IPVS-SERVICES ! -s 10.244.0.0/16 -d 10.96.0.10/32 -p tcp -m comment --comment "shop/web cluster IP" -m tcp --dport 80 -j MARK --or-mark 0x4000`,
		`-A UPROXY-IPVS-SERVICES -d 198.51.100.7/32 -p tcp -m comment --comment "shop/web loadbalancer IP" -m tcp --dport 80 -j MARK --or-mark 0x4000`,
		`-A UPROXY-IPVS-SERVICES -d 192.168.50.1/32 -p tcp -m comment --comment "shop/web nodePort" -m tcp --dport 30080 -j MARK --or-mark 0x4000`,
		`-A UPROXY-IPVS-NODEPORTS -d 192.168.50.1/32 -p tcp -m comment --comment "shop/web nodePort" -m tcp --dport 30080 -j ACCEPT`,
		`-A UPROXY-IPVS-FIREWALL -s 203.0.113.0/24 -d 198.51.100.7/32 -p tcp -m comment --comment "shop/web allowed source" -m tcp --dport 80 -j RETURN`,
		`-A UPROXY-IPVS-FIREWALL -d 198.51.100.7/32 -p tcp -m comment --comment "shop/web source not allowed" -m tcp --dport 80 -j DROP`,
		`-A UPROXY-IPVS-FILTER -d 10.96.0.10/32 -p tcp -m comment --comment "shop/web service port" -m tcp --dport 80 -j RETURN`,
		`-A UPROXY-IPVS-FILTER -d 10.96.0.10/32 -m comment --comment "uproxy ipvs: no such service port" -j REJECT`,
		`-A UPROXY-IPVS-POSTROUTING -s 10.244.1.2/32 -d 10.244.1.2/32 -p tcp -m comment --comment "shop/web hairpin" -m tcp --dport 8080 -j MASQUERADE`,
		`-A UPROXY-IPVS-POSTROUTING -m comment --comment "uproxy ipvs traffic requiring SNAT" -j MASQUERADE --random-fully`,
	} {
		if !strings.Contains(in, want+"\n") {
			t.Errorf("restore input lacks\n  %s\ngot:\n%s", want, in)
		}
	}
	jumps := 0
	for _, c := range r.Calls(false) {
		if strings.HasPrefix(c, "insert ") {
			jumps++
		}
	}
	if jumps != len(p.n.jumps()) {
		t.Errorf("jumps: got %d, want %d", jumps, len(p.n.jumps()))
	}
	syncOK(t, p, snap(web))
	if got := len(r.Restores(false)); got != 1 {
		t.Errorf("restores after an unchanged sync: got %d, want 1", got)
	}
	r.Flush(false, "nat")
	syncOK(t, p, snap(web))
	if got := len(r.Restores(false)); got != 2 {
		t.Errorf("restores after a flush: got %d, want 2", got)
	}
}

func TestNewRejectsUnknownScheduler(t *testing.T) {
	t.Parallel()
	for _, s := range Schedulers {
		if _, err := New(Config{Scheduler: s, Kernel: newFakeKernel()}); err != nil {
			t.Errorf("scheduler %s: got %v, want nil", s, err)
		}
	}
	if _, err := New(Config{Scheduler: "maglev", Kernel: newFakeKernel()}); err == nil {
		t.Errorf("scheduler maglev: got nil error, want one")
	}
}

func TestCleanupRules(t *testing.T) {
	t.Parallel()
	r := iptablestest.New()
	err := r.Apply(false, "*nat\n:PREROUTING ACCEPT [0:0]\n:UPROXY-IPVS-SERVICES - [0:0]\n:UPROXY-IPVS-CANARY - [0:0]\n"+
		"-A PREROUTING -m comment --comment \"uproxy ipvs service portals\" -j UPROXY-IPVS-SERVICES\nCOMMIT\n"+
		"*filter\n:INPUT ACCEPT [0:0]\n:KUBE-FIREWALL - [0:0]\n-A INPUT -j KUBE-FIREWALL\nCOMMIT\n")
	if err != nil {
		t.Fatal(err)
	}
	k := newFakeKernel()
	k.link = true
	if err := cleanup(k, r, namesOf("UPROXY")); err != nil {
		t.Fatal(err)
	}
	want := "*nat\n:UPROXY-IPVS-CANARY - [0:0]\n:UPROXY-IPVS-SERVICES - [0:0]\n" +
		"-D PREROUTING -m comment --comment \"uproxy ipvs service portals\" -j UPROXY-IPVS-SERVICES\n" +
		"-X UPROXY-IPVS-CANARY\n-X UPROXY-IPVS-SERVICES\nCOMMIT\n"
	if got := r.Restores(false); len(got) != 1 || got[0] != want {
		t.Errorf("cleanup restore:\ngot  %q\nwant %q", got, want)
	}
	if got := r.Restores(true); len(got) != 0 {
		t.Errorf("IPv6 with nothing to clean: got restores %q, want none", got)
	}
	if k.link {
		t.Errorf("dummy link not deleted")
	}
}

func TestDebugServices(t *testing.T) {
	t.Parallel()
	p, k, _ := newProxier(t, Config{})
	web := port("web", service.TCP, 80, "10.96.0.10", "10.244.1.2:8080", "10.244.2.3:8080")
	syncOK(t, p, snap(web))
	k.dests[vsKey{netip.MustParseAddr("10.96.0.10"), syscall.IPPROTO_TCP, 80}][netip.MustParseAddrPort("10.244.1.2:8080")].ActiveConnections = 3
	st := p.DebugServices()
	if len(st) != 1 || len(st[0].Endpoints) != 2 {
		t.Fatalf("DebugServices: got %+v, want one Service with 2 endpoints", st)
	}
	if got := st[0].Endpoints[0]; got.Address != "10.244.1.2:8080" || got.ActiveConnections != 3 || !got.Usable {
		t.Errorf("endpoint 0: got %+v, want 10.244.1.2:8080 usable with 3 active connections", got)
	}
	if st[0].Scheduler != "rr" {
		t.Errorf("scheduler: got %q, want rr", st[0].Scheduler)
	}
}

// A Service's uproxy.io/scheduler annotation sets its virtual servers'
// scheduler; a change of it updates them in place.
func TestServiceSchedulerAnnotation(t *testing.T) {
	t.Parallel()
	p, k, _ := newProxier(t, Config{Scheduler: "wlc"})
	web := port("web", service.TCP, 80, "10.96.0.10", "10.244.1.2:8080")
	web.Policy.Scheduler = "sh"
	other := port("other", service.TCP, 80, "10.96.0.11", "10.244.1.2:8081")
	syncOK(t, p, snap(web, other))
	equal(t, "virtual servers", k.servers(), []string{
		"10.96.0.10:80/TCP sh: 10.244.1.2:8080=1",
		"10.96.0.11:80/TCP wlc: 10.244.1.2:8081=1",
	})
	changed := *web
	changed.Policy.Scheduler = "lc"
	n := len(k.ops)
	syncOK(t, p, snap(&changed, other))
	equal(t, "virtual servers after the annotation changed", k.servers(), []string{
		"10.96.0.10:80/TCP lc: 10.244.1.2:8080=1",
		"10.96.0.11:80/TCP wlc: 10.244.1.2:8081=1",
	})
	equal(t, "kernel calls", k.ops[n:], []string{"update service 10.96.0.10:80/TCP lc flags=0 timeout=0"})
	for _, st := range p.DebugServices() {
		if want := map[string]string{"shop/web": "lc", "shop/other": "wlc"}[st.Name]; st.Scheduler != want {
			t.Errorf("DebugServices %s: got scheduler %q, want %q", st.Name, st.Scheduler, want)
		}
	}
}
