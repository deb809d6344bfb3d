package app

import (
	"strings"
	"testing"
)

// A successor's identity survives its encoding, and the running uproxy refuses
// one of another mode, prefix or portal backend, naming each difference; the
// proxy port flags and the version refuse nothing.
func TestTakeOverIdentity(t *testing.T) {
	own := identity{version: "v1", mode: "userspace", prefix: "UPROXY", backend: "nftables", portRange: "30000-31000", bindAddress: "0.0.0.0"}
	got, err := decodeIdentity(own.encode(msgTakeOver))
	if err != nil || got != own {
		t.Fatalf("decode(encode(%+v)): got %+v, %v", own, got, err)
	}
	if _, err := decodeIdentity(own.encode(msgTakeOver)[:5]); err == nil {
		t.Errorf("a truncated identity decoded without an error")
	}
	for _, tc := range []struct {
		name      string
		successor func(*identity)
		want      []string
	}{
		{"same", func(*identity) {}, nil},
		{"other version and proxy ports", func(id *identity) { id.version, id.portRange, id.bindAddress = "v2", "", "10.0.0.1" }, nil},
		{"other mode", func(id *identity) { id.mode, id.backend = "iptables", "" },
			[]string{"its --proxy-mode is iptables, the running uproxy's userspace", "its --rules is , the running uproxy's nftables"}},
		{"other backend", func(id *identity) { id.backend = "iptables" }, []string{"its --rules is iptables, the running uproxy's nftables"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			succ := own
			tc.successor(&succ)
			diff := own.refuses(succ)
			if (diff == "") != (tc.want == nil) {
				t.Fatalf("refuses: got %q, want a refusal: %v", diff, tc.want != nil)
			}
			for _, w := range tc.want {
				if !strings.Contains(diff, w) {
					t.Errorf("refuses: got %q, want it to say %q", diff, w)
				}
			}
		})
	}
}
