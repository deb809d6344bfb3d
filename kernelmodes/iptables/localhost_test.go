package iptables

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/netfilter/conntrack"
	"github.com/uproxy/uproxy/netfilter/nfacct"
	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/service"
)

// fakeAccounting is nfnetlink_acct in memory; ensureErr fails Ensure.
type fakeAccounting struct {
	objects   map[string]uint64
	ensureErr error
}

func (a *fakeAccounting) Ensure(name string) error {
	if a.ensureErr != nil {
		return a.ensureErr
	}
	if _, ok := a.objects[name]; !ok {
		a.objects[name] = 0
	}
	return nil
}

func (a *fakeAccounting) Get(name string) (nfacct.Counter, error) {
	n, ok := a.objects[name]
	if !ok {
		return nfacct.Counter{}, nfacct.ErrNotFound
	}
	return nfacct.Counter{Name: name, Packets: n}, nil
}

func (a *fakeAccounting) Delete(name string) error {
	if _, ok := a.objects[name]; !ok {
		return nfacct.ErrNotFound
	}
	delete(a.objects, name)
	return nil
}

// sysctlRecorder records the sysctls written; err fails every write.
type sysctlRecorder struct {
	writes []string
	err    error
}

func (s *sysctlRecorder) set(key string, value int) (*conntrack.Change, error) {
	if s.err != nil {
		return nil, s.err
	}
	s.writes = append(s.writes, key+"="+string(rune('0'+value)))
	return &conntrack.Change{Key: key, From: "0", To: value}, nil
}

// localhostWorld is a Proxier on the fake kernel with a NodePort Service.
type localhostWorld struct {
	k      *fakeKernel
	acct   *fakeAccounting
	sysctl *sysctlRecorder
	p      *Proxier
	port   *service.Port
}

func newLocalhostWorld(t *testing.T, cfg Config) *localhostWorld {
	t.Helper()
	w := &localhostWorld{k: newFakeKernel(), acct: &fakeAccounting{objects: map[string]uint64{}}, sysctl: &sysctlRecorder{}}
	cfg.IPv6, cfg.IPTables, cfg.Conntrack = true, w.k.Fake, &w.k.ct
	cfg.Accounting, cfg.Sysctl = w.acct, w.sysctl.set
	var err error
	if w.p, err = New(cfg); err != nil {
		t.Fatal(err)
	}
	w.port = svcPort("shop", "web", "http", service.TCP, 80)
	w.port.ClusterIPs = addrs("10.96.0.10", "fd00:96::10")
	w.port.NodePort = 30080
	w.port.Endpoints = eps("10.244.1.2:8080", "[fd00:244::2]:8080")
	return w
}

func (w *localhostWorld) sync(t *testing.T) error {
	t.Helper()
	return w.p.Sync(snapshot(w.port))
}

const (
	guardRule  = `-A UPROXY-BLOCK-LOCALNET ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block incoming localnet connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP`
	allLocal   = `-A UPROXY-SERVICES -m addrtype --dst-type LOCAL -m comment --comment "uproxy service nodeports; NOTE: this must be the last rule in this chain" -j UPROXY-NODEPORTS`
	notLoV4    = `-A UPROXY-SERVICES ! -d 127.0.0.0/8 -m addrtype --dst-type LOCAL -m comment --comment "uproxy service nodeports; NOTE: this must be the last rule in this chain" -j UPROXY-NODEPORTS`
	notLoV6    = `-A UPROXY-SERVICES ! -d ::1/128 -m addrtype --dst-type LOCAL -m comment --comment "uproxy service nodeports; NOTE: this must be the last rule in this chain" -j UPROXY-NODEPORTS`
	inputJump  = `filter -A INPUT -m comment --comment "uproxy localnet guard" -j UPROXY-BLOCK-LOCALNET`
	outputJump = `filter -A OUTPUT -m comment --comment "uproxy localnet guard" -j UPROXY-BLOCK-LOCALNET`
)

func lines(s string) []string { return strings.Split(strings.TrimSuffix(s, "\n"), "\n") }

func TestLocalhostNodePorts(t *testing.T) {
	t.Parallel()
	w := newLocalhostWorld(t, Config{LocalhostNodePorts: true})
	if err := w.sync(t); err != nil {
		t.Fatal(err)
	}
	v4, v6 := w.k.last(0), w.k.last(1)
	ext := w.p.n.portChain("EXT", w.port.Name, w.port.Protocol, "")
	counted := `-A UPROXY-NODEPORTS -d 127.0.0.0/8 -p tcp -m comment --comment "shop/web:http" -m tcp --dport 30080 -m nfacct --nfacct-name  uproxy_localhost_nps_pkts -j ` + ext
	plain := `-A UPROXY-NODEPORTS -p tcp -m comment --comment "shop/web:http" -m tcp --dport 30080 -j ` + ext
	got := lines(v4)
	at := slices.Index(got, counted)
	if at < 0 || at+1 >= len(got) || got[at+1] != plain {
		t.Errorf("IPv4 NodePort rules: want the counting rule %q right before %q, got:\n%s", counted, plain, v4)
	}
	for _, want := range []string{guardRule, allLocal} {
		if !slices.Contains(got, want) {
			t.Errorf("IPv4: want %q, got:\n%s", want, v4)
		}
	}
	if slices.Contains(got, notLoV4) {
		t.Errorf("IPv4: NodePorts still exclude loopback:\n%s", v4)
	}
	// IPv6 has no route_localnet: as before, and nothing of the IPv4 guard.
	if g6 := lines(v6); !slices.Contains(g6, notLoV6) || strings.Contains(v6, "nfacct") || strings.Contains(v6, "-A UPROXY-BLOCK-LOCALNET") {
		t.Errorf("IPv6: want NodePorts off ::1 and no localhost rules, got:\n%s", v6)
	}
	for _, j := range []string{inputJump, outputJump} {
		if !slices.Contains(w.k.jumps(0), j) {
			t.Errorf("IPv4 jumps: want %q, got %q", j, w.k.jumps(0))
		}
		if slices.Contains(w.k.jumps(1), j) {
			t.Errorf("IPv6 jumps: got %q, want none to the IPv4 guard", j)
		}
	}
	if want := []string{"net.ipv4.conf.all.route_localnet=1"}; !slices.Equal(w.sysctl.writes, want) {
		t.Errorf("sysctls written: got %q, want %q", w.sysctl.writes, want)
	}
	if _, ok := w.acct.objects["uproxy_localhost_nps_pkts"]; !ok {
		t.Errorf("nfacct objects: got %v, want uproxy_localhost_nps_pkts", w.acct.objects)
	}

	w.acct.objects["uproxy_localhost_nps_pkts"] = 10
	if n, counting, err := w.p.LocalhostNodePortPackets(); n != 10 || !counting || err != nil {
		t.Errorf("LocalhostNodePortPackets: got %d, %v, %v; want 10, true, nil", n, counting, err)
	}

	t.Run("a later sync leaves route_localnet alone", func(t *testing.T) {
		w.port.Endpoints = eps("10.244.1.3:8080")
		if err := w.sync(t); err != nil {
			t.Fatal(err)
		}
		if len(w.sysctl.writes) != 1 {
			t.Errorf("sysctls written after two syncs: got %q, want one", w.sysctl.writes)
		}
	})

	t.Run("Cleanup removes the guard, its jumps and the counter", func(t *testing.T) {
		if err := w.p.Cleanup(); err != nil {
			t.Fatal(err)
		}
		if len(w.acct.objects) != 0 {
			t.Errorf("nfacct objects after Cleanup: got %v, want none", w.acct.objects)
		}
		if j := w.k.jumps(0); len(j) != 0 {
			t.Errorf("IPv4 jumps after Cleanup: got %q, want none", j)
		}
		if _, counting, _ := w.p.LocalhostNodePortPackets(); counting {
			t.Errorf("LocalhostNodePortPackets after Cleanup: counting, want not")
		}
	})
}

// Without nfnetlink_acct localhost NodePorts still answer, uncounted.
func TestLocalhostNodePortsWithoutAccounting(t *testing.T) {
	t.Parallel()
	w := newLocalhostWorld(t, Config{LocalhostNodePorts: true})
	w.acct.ensureErr = errors.New("nfacct unavailable")
	if err := w.sync(t); err != nil {
		t.Fatalf("Sync without nfacct: %v, want no error (the packets are served, not counted)", err)
	}
	v4 := w.k.last(0)
	if strings.Contains(v4, "nfacct") || !slices.Contains(lines(v4), allLocal) {
		t.Errorf("IPv4 without nfacct: want NodePorts on loopback and no counting rule, got:\n%s", v4)
	}
	if _, counting, _ := w.p.LocalhostNodePortPackets(); counting {
		t.Errorf("LocalhostNodePortPackets without nfacct: counting, want not")
	}
	// Once nfacct answers, a whole sync starts counting.
	w.acct.ensureErr = nil
	w.p.fams[0].written = nil
	if err := w.sync(t); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(w.k.last(0), "-m nfacct --nfacct-name  uproxy_localhost_nps_pkts") {
		t.Errorf("IPv4 once nfacct answers: want the counting rule, got:\n%s", w.k.last(0))
	}
}

// A route_localnet that cannot be set fails the sync, naming it, yet every
// rule is written, and the next sync tries again.
func TestLocalhostNodePortsSysctlFailure(t *testing.T) {
	t.Parallel()
	w := newLocalhostWorld(t, Config{LocalhostNodePorts: true})
	w.sysctl.err = errors.New("set net.ipv4.conf.all.route_localnet to 1: read-only file system")
	err := w.sync(t)
	if err == nil || !strings.Contains(err.Error(), "route_localnet") {
		t.Errorf("Sync with route_localnet read-only: got %v, want an error naming it", err)
	}
	if !strings.Contains(w.k.last(0), "-A UPROXY-NODEPORTS -p tcp") {
		t.Errorf("rules not written after the sysctl failed:\n%s", w.k.last(0))
	}
	w.sysctl.err = nil
	if err := w.sync(t); err != nil || len(w.sysctl.writes) != 1 {
		t.Errorf("next sync: got %v, sysctls %q; want route_localnet set", err, w.sysctl.writes)
	}
}

func TestLocalhostNodePortsOff(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		cfg  Config
		// jump is the IPv4 NodePort jump wanted, and gone one that must be absent.
		jump, gone string
	}{
		{"--iptables-localhost-nodeports=false", Config{}, notLoV4, allLocal},
		{"NodePortAddresses without loopback", Config{Common: proxymode.Common{NodePortAddresses: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}, LocalhostNodePorts: true},
			`-A UPROXY-SERVICES -d 10.0.0.0/8 -m comment --comment "uproxy service nodeports; NOTE: this must be the last rule in this chain" -j UPROXY-NODEPORTS`, allLocal},
		{"a loopback NodePortAddress without localhost NodePorts serves nothing", Config{Common: proxymode.Common{NodePortAddresses: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("10.0.0.0/8")}}},
			`-A UPROXY-SERVICES -d 10.0.0.0/8 -m comment --comment "uproxy service nodeports; NOTE: this must be the last rule in this chain" -j UPROXY-NODEPORTS`,
			`-A UPROXY-SERVICES -d 127.0.0.0/8 -m comment --comment "uproxy service nodeports; NOTE: this must be the last rule in this chain" -j UPROXY-NODEPORTS`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newLocalhostWorld(t, tc.cfg)
			if err := w.sync(t); err != nil {
				t.Fatal(err)
			}
			v4 := w.k.last(0)
			if got := lines(v4); !slices.Contains(got, tc.jump) || slices.Contains(got, tc.gone) {
				t.Errorf("IPv4: want %q and not %q, got:\n%s", tc.jump, tc.gone, v4)
			}
			if strings.Contains(v4, "nfacct") || strings.Contains(v4, "-A UPROXY-BLOCK-LOCALNET") {
				t.Errorf("IPv4: got localhost rules, want none:\n%s", v4)
			}
			if len(w.sysctl.writes) != 0 || len(w.acct.objects) != 0 {
				t.Errorf("got sysctls %q and nfacct objects %v, want neither touched", w.sysctl.writes, w.acct.objects)
			}
			if slices.Contains(w.k.jumps(0), inputJump) {
				t.Errorf("IPv4 jumps: got %q, want no guard", w.k.jumps(0))
			}
		})
	}
	t.Run("a loopback NodePortAddress with localhost NodePorts", func(t *testing.T) {
		w := newLocalhostWorld(t, Config{Common: proxymode.Common{NodePortAddresses: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}}, LocalhostNodePorts: true})
		if err := w.sync(t); err != nil {
			t.Fatal(err)
		}
		jump := `-A UPROXY-SERVICES -d 127.0.0.1/32 -m comment --comment "uproxy service nodeports; NOTE: this must be the last rule in this chain" -j UPROXY-NODEPORTS`
		if v4 := w.k.last(0); !slices.Contains(lines(v4), jump) || !slices.Contains(lines(v4), guardRule) || len(w.sysctl.writes) != 1 {
			t.Errorf("IPv4: want %q, the guard and route_localnet, got sysctls %q and:\n%s", jump, w.sysctl.writes, v4)
		}
	})
}
