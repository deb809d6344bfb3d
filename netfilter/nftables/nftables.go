// Package nftables is uproxy's one access to nftables, shared by every mode and
// tool: a table's kernel boundary (Kernel: knftables for transactions, plus a
// cheap read of the table's rules), the probe that says whether nft and the
// kernel run a layout (Probe), the deletion of a table (Delete), the name of
// uproxy's tables (TableName), and comments that nft takes whatever text they
// come from (Comment).
//
// A mode builds its own objects with knftables and writes them in one
// transaction; this package never decides what a table holds:
//
//	t := nftables.Table{Family: knftables.InetFamily, Name: "uproxy"}
//	if err := nftables.Probe(t, layout); err != nil { ... } // layout adds the objects to a transaction
//	k, err := nftables.New(t)
//	tx := k.NewTransaction()
//	...
//	err = k.Run(ctx, tx) // nft -f -
//	handles, err := k.RuleHandles(ctx, "prerouting") // netlink; after a flush, not the ones written
//	err = nftables.Delete(t)
//
// It is the nftables backend beside netfilter/iptables; the UDP conntrack
// cleanup both need lives in netfilter/conntrack.
package nftables

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"regexp"
	"strings"
	"sync"

	gnftables "github.com/google/nftables"
	"golang.org/x/sys/unix"
	"sigs.k8s.io/knftables"
)

// Table names one nftables table.
type Table struct {
	Family knftables.Family
	Name   string
}

func (t Table) String() string { return string(t.Family) + " " + t.Name }

// Kernel is one table in the nftables of a network namespace. The knftables
// part writes it and lists it through nft; New returns the real one and
// nftablestest.Fake stands in for it in unit tests.
type Kernel interface {
	knftables.Interface
	// RuleHandles returns the handles of the rules in one of the table's chains,
	// in order; none when the table or the chain does not exist. A table written
	// again gets new handles, so comparing them with the ones read after a write
	// tells whether anyone flushed, deleted or edited the chain since.
	RuleHandles(ctx context.Context, chain string) ([]int, error)
	// WriteElements makes changes, in order, in one transaction the kernel
	// applies whole or not at all, as Run would with the same elements, but
	// over netlink: no nft to start, and no wait for the kernel to free
	// deleted elements. Every set and map they name must exist, and changes
	// must pass ElementChanges.Check.
	WriteElements(ctx context.Context, changes ElementChanges) error
	// TableID names the table.
	TableID() Table
	// TableComment returns the table's comment ("" for none) and whether the
	// table exists; Claim reads it before the table is rewritten or deleted.
	TableComment(ctx context.Context) (comment string, exists bool, err error)
}

// New returns the Kernel of table t in the network namespace of the calling
// thread at each call. It fails, saying why, when nft is missing, older than
// knftables supports, or refused (no CAP_NET_ADMIN, no nf_tables).
func New(t Table) (Kernel, error) {
	nft, err := knftables.New(t.Family, t.Name)
	if err != nil {
		return nil, fmt.Errorf("nftables table %s: %w", t, err)
	}
	fam, ok := netlinkFamilies[t.Family]
	if !ok {
		return nil, fmt.Errorf("nftables table %s: family not supported", t)
	}
	return &kernel{Interface: nft, id: t, table: &gnftables.Table{Name: t.Name, Family: fam}}, nil
}

var netlinkFamilies = map[knftables.Family]gnftables.TableFamily{
	knftables.IPv4Family: gnftables.TableFamilyIPv4,
	knftables.IPv6Family: gnftables.TableFamilyIPv6,
	knftables.InetFamily: gnftables.TableFamilyINet,
}

type kernel struct {
	knftables.Interface
	id    Table
	table *gnftables.Table

	// mu guards conn, a netlink connection kept open in the network
	// namespace whose inode is netns. Closing a netfilter netlink socket
	// makes the kernel finish freeing what earlier transactions deleted
	// first (it waits for an RCU grace period, milliseconds on a busy node,
	// holding the lock every transaction takes; docs/decisions has the
	// measurement, 2026-11-27-control-plane-at-scale): nft pays that at its
	// exit after every transaction that deletes something, which is most of
	// what moving one endpoint cost through it. A connection kept open pays
	// it never.
	mu    sync.Mutex
	conn  *gnftables.Conn
	netns uint64
}

// connection returns the netlink connection to the namespace of the calling
// thread, opened on first use there; k.mu must be held.
func (k *kernel) connection() (*gnftables.Conn, error) {
	var st unix.Stat_t
	if err := unix.Stat("/proc/thread-self/ns/net", &st); err != nil {
		st.Ino = 0 // unknown: a new connection every time
	}
	if k.conn != nil && st.Ino != 0 && st.Ino == k.netns {
		return k.conn, nil
	}
	k.drop()
	conn, err := gnftables.New(gnftables.AsLasting())
	if err != nil {
		return nil, fmt.Errorf("nftables table %s: netlink: %w", k.table.Name, err)
	}
	k.conn, k.netns = conn, st.Ino
	return conn, nil
}

// drop forgets the connection, closing it in the background (see kernel);
// k.mu must be held. A connection that failed is dropped: the next use opens
// a new one.
func (k *kernel) drop() {
	if k.conn != nil {
		go k.conn.CloseLasting()
		k.conn = nil
	}
}

// RuleHandles implements Kernel over netlink rather than nft: nft loads every
// set and map of the table with its elements before it lists a single rule (half
// a second with 50k elements), while a rule dump of one chain costs well under
// a millisecond whatever the maps hold.
func (k *kernel) RuleHandles(_ context.Context, chain string) ([]int, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	conn, err := k.connection()
	if err != nil {
		return nil, err
	}
	rules, err := conn.GetRules(k.table, &gnftables.Chain{Name: chain})
	if err != nil {
		k.drop()
		return nil, fmt.Errorf("list the rules of chain %s in table %s: %w", chain, k.table.Name, err)
	}
	handles := make([]int, len(rules))
	for i, r := range rules {
		handles[i] = int(r.Handle)
	}
	return handles, nil
}

// WriteElements implements Kernel: one netlink batch with a message per run
// of changes to one set.
func (k *kernel) WriteElements(_ context.Context, changes ElementChanges) error {
	if err := changes.Check(); err != nil {
		return fmt.Errorf("write elements of nftables table %s: %w", k.table.Name, err)
	}
	if len(changes) == 0 {
		return nil
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	conn, err := k.connection()
	if err != nil {
		return err
	}
	for i := 0; i < len(changes); {
		j := i + 1
		for j < len(changes) && changes[j].Set == changes[i].Set && changes[j].Delete == changes[i].Delete {
			j++
		}
		elems := make([]gnftables.SetElement, 0, j-i)
		for _, c := range changes[i:j] {
			e, _ := c.encode() // Check encoded every one
			elems = append(elems, e)
		}
		set := &gnftables.Set{Table: k.table, Name: changes[i].Set, IsMap: len(changes[i].Type.Value) > 0}
		if changes[i].Delete {
			err = conn.SetDeleteElements(set, elems)
		} else {
			err = conn.SetAddElements(set, elems)
		}
		if err != nil {
			return fmt.Errorf("write elements of nftables table %s: %w", k.table.Name, err)
		}
		i = j
	}
	if err := conn.Flush(); err != nil {
		k.drop()
		return fmt.Errorf("write elements of nftables table %s: %w", k.table.Name, err)
	}
	return nil
}

// Probe reports why the nftables of the calling thread's namespace cannot hold
// table t as objects lay it out (nil when it can): no nft command, one too old,
// no permission, or a kernel without what the objects use (NAT, fib,
// concatenated map keys, ...). It runs nft --check on a transaction that adds
// table t and the objects: the kernel validates the batch and discards it, so
// nothing changes.
func Probe(t Table, objects func(tx *knftables.Transaction)) error {
	nft, err := knftables.New(t.Family, t.Name)
	if err != nil {
		return fmt.Errorf("nftables: %w", err)
	}
	tx := nft.NewTransaction()
	tx.Add(&knftables.Table{})
	objects(tx)
	if err := nft.Check(context.Background(), tx); err != nil {
		return fmt.Errorf("nftables table %s: the kernel or nft refuses the layout: %s", t, strings.TrimSpace(err.Error()))
	}
	return nil
}

// DeleteTable deletes k's table with everything in it, when it is uproxy's
// (Claim): another program's table of the same name is left as it is and
// reported as a *NotOursError. A table that does not exist is not an error:
// the transaction adds it first, so the deletion always finds it (nft's own
// "destroy" needs Linux 6.3 and nft 1.0.8).
func DeleteTable(ctx context.Context, k Kernel) error {
	if err := Claim(ctx, k); err != nil {
		return err
	}
	tx := k.NewTransaction()
	tx.Add(&knftables.Table{})
	tx.Delete(&knftables.Table{})
	return k.Run(ctx, tx)
}

// Delete deletes table t in the calling thread's namespace through nft, as
// DeleteTable. No nft command means no table to delete; any other failure is
// an error naming t.
func Delete(t Table) error {
	k, err := New(t)
	if errors.Is(err, exec.ErrNotFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("delete nftables table %s: %w", t, err)
	}
	if err := DeleteTable(context.Background(), k); err != nil {
		if _, ok := errors.AsType[*NotOursError](err); ok {
			return err
		}
		return fmt.Errorf("delete nftables table %s: %w", t, err)
	}
	return nil
}

// tableNameRE is what nft takes as a bare table name: a letter, then letters,
// digits, '_' or '-' (knftables writes names unquoted).
var tableNameRE = regexp.MustCompile(`^[a-z][a-z0-9_-]*$`)

// TableName returns the name of uproxy's table for a chain prefix: the prefix
// lower-cased, so the default UPROXY gives "uproxy". A name nft would not take,
// or one starting with "kube" (kube-proxy's table is "kube-proxy"), is an error.
func TableName(prefix string) (string, error) {
	name := strings.ToLower(prefix)
	if !tableNameRE.MatchString(name) {
		return "", fmt.Errorf("nftables table name %q (from chain prefix %q): want a letter, then letters, digits, '_' or '-'", name, prefix)
	}
	if strings.HasPrefix(name, "kube") {
		return "", fmt.Errorf("nftables table name %q (from chain prefix %q): kube* tables belong to kube-proxy", name, prefix)
	}
	return name, nil
}
