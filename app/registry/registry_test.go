package registry

import (
	"testing"

	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/rules"
)

// Every mode name has a constructor, and nothing else does.
func TestConstructors(t *testing.T) {
	for _, name := range proxymode.Names {
		if constructors[name] == nil {
			t.Errorf("mode %s: no constructor", name)
		}
	}
	if len(constructors) != len(proxymode.Names) {
		t.Errorf("constructors: got %d, want one per mode (%d)", len(constructors), len(proxymode.Names))
	}
	for _, name := range []string{proxymode.Auto, "kernelspace", ""} {
		if m, err := New(name, proxymode.Common{}, Specific{}); err == nil {
			t.Errorf("New(%q): got %T, want an error", name, m)
		}
	}
}

// Only the userspace mode without portals leaves the node's rules alone.
func TestTouchesRules(t *testing.T) {
	for _, tt := range []struct {
		name    string
		portals rules.Backend
		want    bool
	}{
		{proxymode.Userspace, rules.BackendNone, false},
		{proxymode.Userspace, rules.BackendIPTables, true},
		{proxymode.Userspace, rules.BackendNFTables, true},
		{proxymode.IPTables, rules.BackendNone, true},
		{proxymode.NFTables, rules.BackendNone, true},
		{proxymode.IPVS, rules.BackendNone, true},
	} {
		s := &Specific{Userspace: Userspace{Rules: tt.portals}}
		if got := TouchesRules(tt.name, s); got != tt.want {
			t.Errorf("TouchesRules(%s, --rules %s): got %v, want %v", tt.name, tt.portals, got, tt.want)
		}
	}
}

// The userspace mode refuses the schedulers only IPVS has; the IPVS mode takes them.
func TestCheckScheduler(t *testing.T) {
	if err := CheckScheduler(proxymode.Userspace, "wlc"); err == nil {
		t.Errorf("userspace with wlc: got no error, want one")
	}
	for _, tt := range []struct{ mode, scheduler string }{{proxymode.Userspace, "rr"}, {proxymode.Userspace, ""}, {proxymode.IPVS, "wlc"}} {
		if err := CheckScheduler(tt.mode, tt.scheduler); err != nil {
			t.Errorf("%s with %q: got %v, want nil", tt.mode, tt.scheduler, err)
		}
	}
}
