// Package nftablestest is an in-memory nftables table for the unit tests of
// code that programs it through nftables.Kernel: knftables' own fake, plus the
// rule handles nftables.Kernel reads and a record of every transaction run.
//
// knftables' fake accepts what the kernel accepts in most respects; where it
// is more lenient (it lets "add element" replace the value of an existing key,
// which the kernel refuses), tests of the real kernel in a network namespace
// cover the difference.
package nftablestest

import (
	"context"

	"sigs.k8s.io/knftables"

	"github.com/uproxy/uproxy/netfilter/nftables"
)

// Fake is an nftables.Kernel in memory for one table.
type Fake struct {
	*knftables.Fake
	// Transactions holds the nft input of every Run that succeeded, in order,
	// and that of the same changes for every WriteElements that succeeded.
	Transactions []string
	// ElementWrites counts the WriteElements that succeeded.
	ElementWrites int
	// failNext is returned by the next Run, which then changes nothing.
	failNext error
	id       nftables.Table
}

var _ nftables.Kernel = (*Fake)(nil)

// New returns a Fake of table t, which does not exist yet.
func New(t nftables.Table) *Fake { return &Fake{Fake: knftables.NewFake(t.Family, t.Name), id: t} }

// Run implements knftables.Interface, recording what succeeded.
func (f *Fake) Run(ctx context.Context, tx *knftables.Transaction) error {
	if err := f.failNext; err != nil {
		f.failNext = nil
		return err
	}
	if err := f.Fake.Run(ctx, tx); err != nil {
		return err
	}
	f.Transactions = append(f.Transactions, tx.String())
	return nil
}

// WriteElements implements nftables.Kernel: the changes as one Run would
// make them, once they pass the real kernel's check of their keys and values.
func (f *Fake) WriteElements(ctx context.Context, changes nftables.ElementChanges) error {
	if err := changes.Check(); err != nil {
		return err
	}
	if len(changes) == 0 {
		return nil
	}
	tx := f.NewTransaction()
	changes.Transaction(tx)
	if err := f.Run(ctx, tx); err != nil {
		return err
	}
	f.ElementWrites++
	return nil
}

// FailNextRun makes the next Run (or WriteElements) return err without
// changing anything.
func (f *Fake) FailNextRun(err error) { f.failNext = err }

// RuleHandles implements nftables.Kernel.
func (f *Fake) RuleHandles(_ context.Context, chain string) ([]int, error) {
	f.RLock()
	defer f.RUnlock()
	if f.Table == nil || f.Table.Chains[chain] == nil {
		return nil, nil
	}
	var handles []int
	for _, r := range f.Table.Chains[chain].Rules {
		handles = append(handles, *r.Handle)
	}
	return handles, nil
}

// FlushChains empties every chain of the table, as `nft flush table` by
// another program does (the real command keeps sets and maps, unlike
// knftables' fake flush of a table).
func (f *Fake) FlushChains() error {
	f.RLock()
	var names []string
	if f.Table != nil {
		for name := range f.Table.Chains {
			names = append(names, name)
		}
	}
	f.RUnlock()
	tx := f.NewTransaction()
	for _, name := range names {
		tx.Flush(&knftables.Chain{Name: name})
	}
	return f.Fake.Run(context.Background(), tx)
}

// DeleteTable deletes the table, as `nft delete table` or `nft flush ruleset` by
// another program does.
func (f *Fake) DeleteTable() error {
	tx := f.NewTransaction()
	tx.Add(&knftables.Table{})
	tx.Delete(&knftables.Table{})
	return f.Fake.Run(context.Background(), tx)
}

// TableID implements nftables.Kernel.
func (f *Fake) TableID() nftables.Table { return f.id }

// TableComment implements nftables.Kernel: the comment the table was last
// written with.
func (f *Fake) TableComment(context.Context) (string, bool, error) {
	f.RLock()
	defer f.RUnlock()
	if f.Table == nil {
		return "", false, nil
	}
	if f.Table.Comment == nil {
		return "", true, nil
	}
	return *f.Table.Comment, true, nil
}
