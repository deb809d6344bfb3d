package nftables

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"strings"
	"testing"

	"sigs.k8s.io/knftables"
)

func TestEncodeFields(t *testing.T) {
	slot := binary.NativeEndian.AppendUint32(nil, 2)
	tests := []struct {
		name    string
		fields  []Field
		text    string
		want    []byte
		wantErr string
	}{
		{"count map key: each field padded to 4 bytes, the slot in host order",
			[]Field{IPv4Addr, InetProto, InetService, Integer}, "10.96.0.10 . tcp . 80 . 2",
			append([]byte{10, 96, 0, 10, 6, 0, 0, 0, 0, 80, 0, 0}, slot...), ""},
		{"count map value", []Field{IPv4Addr, InetService}, "10.244.0.1 . 8080", []byte{10, 244, 0, 1, 0x1f, 0x90, 0, 0}, ""},
		{"NodePort key, protocol by number", []Field{InetProto, InetService}, "132 . 30000", []byte{132, 0, 0, 0, 0x75, 0x30, 0, 0}, ""},
		{"IPv6 hairpin pair", []Field{IPv6Addr, IPv6Addr}, "fd00::1 . fd00::1",
			[]byte{0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1}, ""},
		{"one field: no padding", []Field{InetService}, "53", []byte{0, 53}, ""},
		{"too few fields", []Field{IPv4Addr, InetProto, InetService}, "10.96.0.10 . tcp", nil, "2 fields, want 3"},
		{"IPv6 address in an IPv4 field", []Field{IPv4Addr, IPv4Addr}, "fd00::1 . 10.0.0.1", nil, "not an IPv4 address"},
		{"IPv4 address in an IPv6 field", []Field{IPv6Addr, IPv6Addr}, "10.0.0.1 . fd00::1", nil, "not an IPv6 address"},
		{"unknown protocol", []Field{InetProto, InetService}, "icmp . 1", nil, `"icmp" is not a protocol`},
		{"port out of range", []Field{InetProto, InetService}, "tcp . 65536", nil, `"65536" is not a port`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := encodeFields(tt.fields, tt.text)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("got %x, %v; want an error with %q", got, err, tt.wantErr)
				}
				return
			}
			if err != nil || !bytes.Equal(got, tt.want) {
				t.Errorf("got %x, %v; want %x", got, err, tt.want)
			}
		})
	}
}

// The changes WriteElements sends over netlink are those Transaction writes
// for nft: a map's element deleted by its key alone, a set's without value,
// comments on additions only.
func TestElementChangesTransaction(t *testing.T) {
	countMap := ElementType{Key: []Field{IPv4Addr, InetProto, InetService, Integer}, Value: []Field{IPv4Addr, InetService}}
	set := ElementType{Key: []Field{IPv4Addr, IPv4Addr}}
	changes := ElementChanges{
		{Delete: true, Set: "backends4-2", Type: countMap, Key: "10.96.0.10 . tcp . 80 . 1"},
		{Delete: true, Set: "hairpin4", Type: set, Key: "10.1.0.2 . 10.1.0.2"},
		{Set: "backends4-2", Type: countMap, Key: "10.96.0.10 . tcp . 80 . 1", Value: "10.1.0.3 . 8080", Comment: "ns/web:http"},
		{Set: "hairpin4", Type: set, Key: "10.1.0.3 . 10.1.0.3"},
	}
	if err := changes.Check(); err != nil {
		t.Fatalf("Check: %v", err)
	}
	nft := knftables.NewFake(knftables.InetFamily, "t")
	tx := nft.NewTransaction()
	changes.Transaction(tx)
	want := `delete element inet t backends4-2 { 10.96.0.10 . tcp . 80 . 1 }
delete element inet t hairpin4 { 10.1.0.2 . 10.1.0.2 }
add element inet t backends4-2 { 10.96.0.10 . tcp . 80 . 1 comment "ns/web:http" : 10.1.0.3 . 8080 }
add element inet t hairpin4 { 10.1.0.3 . 10.1.0.3 }
`
	if got := tx.String(); got != want {
		t.Errorf("got:\n%s\nwant:\n%s", got, want)
	}

	bad := append(ElementChanges{}, changes...)
	bad[2].Value = "10.1.0.3"
	if err := bad.Check(); err == nil || !strings.Contains(err.Error(), `value "10.1.0.3"`) {
		t.Errorf("Check of a value missing its port: got %v", err)
	}
	many := make(ElementChanges, MaxElementChanges+1)
	for i := range many {
		many[i] = changes[1]
	}
	if err := many.Check(); err == nil {
		t.Errorf("Check of %d changes: got nil, want too many", len(many))
	}
}

func TestComment(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, in, want string
	}{
		{"a Service port's name: unchanged", "shop/web:http", "shop/web:http"},
		{"empty", "", ""},
		{"a quote, which ends nft's string", `default/a"b`, "default/a_b"},
		{"a backslash, which knftables doubles", `default/a\b`, "default/a_b"},
		{"control characters", "a\nb\tc\x00", "a_b_c_"},
		{"non-ASCII, each byte", "ns/é", "ns/__"},
		{"too long: cut", strings.Repeat("a", knftables.CommentLengthMax+5), strings.Repeat("a", knftables.CommentLengthMax)},
		{"too long, with a quote beyond the cut", strings.Repeat("a", knftables.CommentLengthMax) + `"`, strings.Repeat("a", knftables.CommentLengthMax)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Comment(tt.in)
			if got != tt.want {
				t.Errorf("Comment(%q): got %q, want %q", tt.in, got, tt.want)
			}
			// What knftables writes is then the comment itself, quoted.
			if q := fmt.Sprintf("%q", got); q != `"`+got+`"` {
				t.Errorf("Comment(%q) = %q is written as %s, with escapes nft does not know", tt.in, got, q)
			}
		})
	}
}
