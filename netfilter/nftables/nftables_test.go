package nftables_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/knftables"

	"github.com/uproxy/uproxy/netfilter/nftables"
	"github.com/uproxy/uproxy/netfilter/nftables/nftablestest"
	"github.com/uproxy/uproxy/test/testbed"
)

func TestTableName(t *testing.T) {
	tests := []struct {
		prefix, want, wantErr string
	}{
		{"UPROXY", "uproxy", ""},
		{"UPX_2-a", "upx_2-a", ""},
		{"9UP", "", `nftables table name "9up" (from chain prefix "9UP"): want a letter`},
		{"-UP", "", "want a letter"},
		{"", "", "want a letter"},
		{"KUBE-PROXY", "", "kube* tables belong to kube-proxy"},
		{"kube", "", "kube* tables belong to kube-proxy"},
	}
	for _, tt := range tests {
		got, err := nftables.TableName(tt.prefix)
		if got != tt.want || (err == nil) != (tt.wantErr == "") || err != nil && !strings.Contains(err.Error(), tt.wantErr) {
			t.Errorf("TableName(%q): got %q, %v; want %q, error containing %q", tt.prefix, got, err, tt.want, tt.wantErr)
		}
	}
}

func TestDeleteTableIgnoresAbsentTable(t *testing.T) {
	k := nftablestest.New(nftables.Table{Family: knftables.InetFamily, Name: "upx"})
	ctx := context.Background()
	if err := nftables.DeleteTable(ctx, k); err != nil {
		t.Fatalf("DeleteTable of an absent table: %v", err)
	}
	tx := k.NewTransaction()
	tx.Add(&knftables.Table{Comment: knftables.PtrTo(nftables.CommentPrefix + "test")})
	tx.Add(&knftables.Chain{Name: "c"})
	if err := k.Run(ctx, tx); err != nil {
		t.Fatal(err)
	}
	if err := nftables.DeleteTable(ctx, k); err != nil {
		t.Fatalf("DeleteTable: %v", err)
	}
	if k.Table != nil {
		t.Errorf("table left after DeleteTable:\n%s", k.Dump())
	}
}

// A table of uproxy's name without uproxy's comment is another program's:
// DeleteTable leaves it, and the error names it and what its comment is.
func TestDeleteTableLeavesAnotherProgramsTable(t *testing.T) {
	ctx := context.Background()
	for _, comment := range []*string{nil, knftables.PtrTo("host firewall"), knftables.PtrTo("uproxy")} {
		k := nftablestest.New(nftables.Table{Family: knftables.InetFamily, Name: "filter"})
		tx := k.NewTransaction()
		tx.Add(&knftables.Table{Comment: comment})
		tx.Add(&knftables.Chain{Name: "input"})
		if err := k.Run(ctx, tx); err != nil {
			t.Fatal(err)
		}
		err := nftables.DeleteTable(ctx, k)
		notOurs, ok := errors.AsType[*nftables.NotOursError](err)
		if !ok || !strings.Contains(err.Error(), "inet filter is not uproxy's") || !strings.Contains(err.Error(), "--chain-prefix") {
			t.Errorf("comment %q: DeleteTable: got %v, want a *NotOursError naming inet filter and --chain-prefix", ptrOr(comment), err)
		} else if want := ptrOr(comment); notOurs.Comment != want {
			t.Errorf("comment %q: the error's comment is %q, want %q", want, notOurs.Comment, want)
		}
		if k.Table == nil || k.Table.Chains["input"] == nil {
			t.Errorf("comment %q: DeleteTable changed another program's table", ptrOr(comment))
		}
	}
}

func ptrOr(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// Without an nft command there is no table to delete, and nothing to probe.
func TestWithoutNFT(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	tab := nftables.Table{Family: knftables.InetFamily, Name: "upx"}
	if err := nftables.Delete(tab); err != nil {
		t.Errorf("Delete: got %v, want nil", err)
	}
	if err := nftables.Probe(tab, func(*knftables.Transaction) {}); err == nil || !strings.Contains(err.Error(), "nftables binary") {
		t.Errorf("Probe: got %v, want an error naming the missing nft", err)
	}
	if _, err := nftables.New(tab); err == nil {
		t.Error("New: got nil error, want the missing nft")
	}
}

// TestRealKernel runs the real nft and netlink in a test namespace.
func TestRealKernel(t *testing.T) {
	testbed.Needs(t, testbed.NFTables)
	tp := testbed.New(t)
	tab := nftables.Table{Family: knftables.InetFamily, Name: "upx"}
	layout := func(tx *knftables.Transaction) {
		tx.Add(&knftables.Table{Comment: knftables.PtrTo(nftables.CommentPrefix + "test table")})
		tx.Add(&knftables.Map{Name: "ports", Type: "ipv4_addr . inet_proto . inet_service : inet_service"})
		tx.Add(&knftables.Chain{Name: "pre", Type: knftables.PtrTo(knftables.NATType),
			Hook: knftables.PtrTo(knftables.PreroutingHook), Priority: knftables.PtrTo(knftables.DNATPriority)})
		tx.Add(&knftables.Rule{Chain: "pre", Rule: "meta l4proto { tcp, udp } redirect to : ip daddr . meta l4proto . th dport map @ports"})
		tx.Add(&knftables.Rule{Chain: "pre", Rule: "fib daddr type local counter"})
	}
	ctx := context.Background()
	err := tp.Run(testbed.Node, func() error {
		if err := nftables.Probe(tab, layout); err != nil {
			t.Errorf("Probe of a valid layout: %v", err)
		}
		bad := func(tx *knftables.Transaction) {
			layout(tx)
			tx.Add(&knftables.Rule{Chain: "pre", Rule: "ip daddr @nosuchset accept"})
		}
		if err := nftables.Probe(tab, bad); err == nil || !strings.Contains(err.Error(), "refuses the layout") {
			t.Errorf("Probe of a layout naming a missing set: got %v, want refused", err)
		}
		k, err := nftables.New(tab)
		if err != nil {
			return err
		}
		handles := func(what string, want int) []int {
			t.Helper()
			h, err := k.RuleHandles(ctx, "pre")
			if err != nil || len(h) != want {
				t.Errorf("%s: RuleHandles: got %v, %v; want %d handles", what, h, err, want)
			}
			return h
		}
		handles("no table yet", 0)
		if ruleset, _ := tp.Exec(testbed.Node, "nft", "list", "ruleset"); len(ruleset) != 0 {
			t.Errorf("Probe changed the ruleset:\n%s", ruleset)
		}
		tx := k.NewTransaction()
		layout(tx)
		if err := k.Run(ctx, tx); err != nil {
			return err
		}
		first := handles("written", 2)
		if _, err := tp.Exec(testbed.Node, "nft", "flush", "chain", "inet", "upx", "pre"); err != nil {
			return err
		}
		handles("flushed", 0)
		tx = k.NewTransaction()
		layout(tx)
		if err := k.Run(ctx, tx); err != nil {
			return err
		}
		if again := handles("written again", 2); slices.Equal(again, first) {
			t.Errorf("handles after a rewrite: got %v again, want new ones", again)
		}
		if c, ok, err := k.TableComment(ctx); c != nftables.CommentPrefix+"test table" || !ok || err != nil {
			t.Errorf("TableComment: got %q, %v, %v; want the comment written", c, ok, err)
		}
		for i := range 2 { // the second finds nothing to delete
			if err := nftables.Delete(tab); err != nil {
				t.Errorf("Delete %d: %v", i, err)
			}
		}
		handles("deleted", 0)
		if c, ok, err := k.TableComment(ctx); c != "" || ok || err != nil {
			t.Errorf("TableComment of a deleted table: got %q, %v, %v; want none", c, ok, err)
		}
		// Other programs' tables: one with a comment of its own, one with none.
		for name, comment := range map[string]string{"fw": "host firewall", "bare": ""} {
			add := "add table inet " + name
			if comment != "" {
				add += ` { comment "` + comment + `"; }`
			}
			if out, err := tp.Exec(testbed.Node, "sh", "-c", "nft '"+add+"' && nft add chain inet "+name+" input"); err != nil {
				return fmt.Errorf("%s: %v: %s", add, err, out)
			}
			err := nftables.Delete(nftables.Table{Family: knftables.InetFamily, Name: name})
			if e, ok := errors.AsType[*nftables.NotOursError](err); !ok || e.Comment != comment {
				t.Errorf("Delete of table %s (comment %q): got %v, want a *NotOursError with its comment", name, comment, err)
			}
			if out, err := tp.Exec(testbed.Node, "nft", "list", "chain", "inet", name, "input"); err != nil {
				t.Errorf("table %s after Delete: %v: %s", name, err, out)
			}
			if out, err := tp.Exec(testbed.Node, "nft", "delete", "table", "inet", name); err != nil {
				return fmt.Errorf("delete table %s: %v: %s", name, err, out)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if ruleset, err := tp.Exec(testbed.Node, "nft", "list", "ruleset"); err != nil || len(ruleset) != 0 {
		t.Errorf("ruleset after Delete: got %q (%v), want empty", ruleset, err)
	}
}

// WriteElements writes a verdict map's elements over netlink as nft would
// write them: nft lists what it wrote, and the deletion takes it away.
func TestWriteElementsVerdictMap(t *testing.T) {
	testbed.Needs(t, testbed.NFTables)
	tp := testbed.New(t)
	tab := nftables.Table{Family: knftables.InetFamily, Name: "upx"}
	vmap := nftables.ElementType{Key: []nftables.Field{nftables.IPv4Addr, nftables.InetProto, nftables.InetService}, Value: []nftables.Field{nftables.Verdict}}
	ctx := context.Background()
	err := tp.Run(testbed.Node, func() error {
		k, err := nftables.New(tab)
		if err != nil {
			return err
		}
		tx := k.NewTransaction()
		tx.Add(&knftables.Table{Comment: knftables.PtrTo(nftables.CommentPrefix + "test table")})
		tx.Add(&knftables.Chain{Name: "refuse"})
		tx.Add(&knftables.Chain{Name: "other"})
		tx.Add(&knftables.Map{Name: "noendpoints", Type: "ipv4_addr . inet_proto . inet_service : verdict"})
		if err := k.Run(ctx, tx); err != nil {
			return err
		}
		adds := nftables.ElementChanges{
			{Set: "noendpoints", Type: vmap, Key: "10.96.0.10 . tcp . 80", Value: "goto refuse", Comment: "ns/web:http"},
			{Set: "noendpoints", Type: vmap, Key: "10.96.0.11 . udp . 53", Value: "jump other"},
			{Set: "noendpoints", Type: vmap, Key: "10.96.0.12 . tcp . 443", Value: "drop"},
		}
		if err := k.WriteElements(ctx, adds); err != nil {
			t.Fatalf("WriteElements of verdicts: %v", err)
		}
		listed, err := tp.Exec(testbed.Node, "nft", "list", "map", "inet", "upx", "noendpoints")
		if err != nil {
			return fmt.Errorf("nft list map: %v: %s", err, listed)
		}
		for _, want := range []string{`10.96.0.10 . tcp . 80 comment "ns/web:http" : goto refuse`, "10.96.0.11 . udp . 53 : jump other", "10.96.0.12 . tcp . 443 : drop"} {
			if !strings.Contains(string(listed), want) {
				t.Errorf("the map after WriteElements lacks %q:\n%s", want, listed)
			}
		}
		dels := nftables.ElementChanges{{Delete: true, Set: "noendpoints", Type: vmap, Key: "10.96.0.10 . tcp . 80"}}
		if err := k.WriteElements(ctx, dels); err != nil {
			t.Fatalf("WriteElements deleting a verdict element: %v", err)
		}
		listed, _ = tp.Exec(testbed.Node, "nft", "list", "map", "inet", "upx", "noendpoints")
		if strings.Contains(string(listed), "10.96.0.10") || !strings.Contains(string(listed), "10.96.0.11") {
			t.Errorf("the map after deleting one element:\n%s", listed)
		}
		bad := nftables.ElementChanges{{Set: "noendpoints", Type: vmap, Key: "10.96.0.13 . tcp . 80", Value: "goto"}}
		if err := k.WriteElements(ctx, bad); err == nil || !strings.Contains(err.Error(), "not a verdict") {
			t.Errorf("WriteElements of verdict %q: got %v, want it refused as not a verdict", "goto", err)
		}
		return nftables.Delete(tab)
	})
	if err != nil {
		t.Fatal(err)
	}
}
