// Package iptablestest is an in-memory iptables for the unit tests of code that
// programs it through iptables.Kernel.
//
// Fake keeps both families' tables, applies restore input as iptables-restore
// --noflush does and answers iptables-save and the per-rule calls from that
// state, refusing what the kernel refuses (a jump to a chain that does not
// exist, deleting a chain that is not empty or still jumped to, deleting a rule
// that is not there). Tests read what was written (Restores, Calls), the state
// (State), and act as another program would (Apply, Flush).
package iptablestest

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/uproxy/uproxy/netfilter/iptables"
)

// Fake is an iptables.Kernel in memory. It starts as a fresh network namespace
// does: the filter and nat tables with their built-in chains, no rules. Its
// methods may be called from any goroutine.
type Fake struct {
	// mu guards fams and everything they hold.
	mu   sync.Mutex
	fams [2]*family
}

// family is the state of one address family.
type family struct {
	tables      []*table
	restores    []string
	calls       []string
	failRestore error // returned by the next Restore, which then changes nothing
	saveErr     error // returned by every Save while set
}

type table struct {
	name   string
	chains []*chain // built-in chains first, in their kernel order
}

type chain struct {
	name    string
	policy  string // ACCEPT for built-in chains, "-" for user chains
	builtin bool
	rules   []rule
}

type rule struct {
	spec string   // as written: what Save prints after "-A chain "
	args []string // spec's words, which identify the rule
}

// builtins are the built-in chains of each table, in the kernel's order.
var builtins = map[string][]string{
	"filter": {"INPUT", "FORWARD", "OUTPUT"},
	"nat":    {"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"},
	"mangle": {"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"},
	"raw":    {"PREROUTING", "OUTPUT"},
}

// targets are the targets a rule may name besides a chain of its table.
var targets = []string{"ACCEPT", "DROP", "RETURN", "QUEUE", "REJECT", "DNAT", "SNAT", "MASQUERADE",
	"REDIRECT", "MARK", "CONNMARK", "LOG", "NFLOG", "CT", "NOTRACK", "TPROXY", "TRACE"}

// New returns a Fake with empty filter and nat tables in both families.
func New() *Fake {
	f := &Fake{}
	for i := range f.fams {
		f.fams[i] = &family{}
		for _, name := range []string{"filter", "nat"} {
			f.fams[i].tables = append(f.fams[i].tables, newTable(name))
		}
	}
	return f
}

func newTable(name string) *table {
	t := &table{name: name}
	for _, c := range builtins[name] {
		t.chains = append(t.chains, &chain{name: c, policy: "ACCEPT", builtin: true})
	}
	return t
}

func (f *Fake) fam(v6 bool) *family {
	if v6 {
		return f.fams[1]
	}
	return f.fams[0]
}

// Restore implements iptables.Kernel. Input that iptables-restore would refuse
// is an error and changes nothing in the table it failed in.
func (f *Fake) Restore(v6 bool, input []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	fam := f.fam(v6)
	fam.calls = append(fam.calls, "restore")
	if err := fam.failRestore; err != nil {
		fam.failRestore = nil
		return err
	}
	if err := fam.apply(string(input)); err != nil {
		return fmt.Errorf("%s: %w", command(v6, "-restore"), err)
	}
	fam.restores = append(fam.restores, string(input))
	return nil
}

// Save implements iptables.Kernel.
func (f *Fake) Save(v6 bool) ([]byte, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fam := f.fam(v6)
	fam.calls = append(fam.calls, "save")
	if fam.saveErr != nil {
		return nil, fam.saveErr
	}
	return []byte(fam.save("", false)), nil
}

// SaveCounters implements iptables.Kernel: every counter is zero.
func (f *Fake) SaveCounters(v6 bool, table string) ([]byte, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fam := f.fam(v6)
	fam.calls = append(fam.calls, "save -c -t "+table)
	if fam.saveErr != nil {
		return nil, fam.saveErr
	}
	return []byte(fam.save(table, true)), nil
}

// Tables implements iptables.Kernel.
func (f *Fake) Tables(v6 bool) (iptables.Tables, error) { return &tables{f: f, v6: v6}, nil }

// Restores returns the restore inputs of the family that succeeded, in order.
func (f *Fake) Restores(v6 bool) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.fam(v6).restores)
}

// Calls returns every call the family got, in order: "restore", "save",
// "save -c -t TABLE", and "list", "exists", "insert" (with its position) and
// "append" followed by table, chain and rule.
func (f *Fake) Calls(v6 bool) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.fam(v6).calls)
}

// FailNextRestore makes the family's next Restore return err and change nothing.
func (f *Fake) FailNextRestore(v6 bool, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fam(v6).failRestore = err
}

// FailSave makes every Save of the family return err; nil ends it.
func (f *Fake) FailSave(v6 bool, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fam(v6).saveErr = err
}

// Apply changes the state as restore input would, as another program does: it
// is not recorded in Restores or Calls.
func (f *Fake) Apply(v6 bool, input string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.fam(v6).apply(input)
}

// Flush empties every chain of the table, as `iptables -t TABLE -F` does.
func (f *Fake) Flush(v6 bool, table string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if t := f.fam(v6).table(table); t != nil {
		for _, c := range t.chains {
			c.rules = nil
		}
	}
}

// State returns the family's tables as Save prints them, parsed, without
// counting as a call.
func (f *Fake) State(v6 bool) *iptables.Ruleset {
	f.mu.Lock()
	defer f.mu.Unlock()
	return iptables.Parse([]byte(f.fam(v6).save("", false)))
}

func (fam *family) table(name string) *table {
	return find(fam.tables, func(t *table) bool { return t.name == name })
}

// find returns the first of items that is wanted, nil when none is.
func find[T any](items []*T, wanted func(*T) bool) *T {
	if i := slices.IndexFunc(items, wanted); i >= 0 {
		return items[i]
	}
	return nil
}

// save prints one table ("" for all) as iptables-save does: declarations, then
// rules, chain by chain.
func (fam *family) save(only string, counters bool) string {
	var b strings.Builder
	prefix := ""
	if counters {
		prefix = "[0:0] "
	}
	for _, t := range fam.tables {
		if only != "" && t.name != only {
			continue
		}
		b.WriteString("*" + t.name + "\n")
		for _, c := range t.chains {
			b.WriteString(":" + c.name + " " + c.policy + " [0:0]\n")
		}
		for _, c := range t.chains {
			for _, r := range c.rules {
				b.WriteString(prefix + "-A " + c.name + " " + r.spec + "\n")
			}
		}
		b.WriteString("COMMIT\n")
	}
	return b.String()
}

// apply runs restore input with --noflush semantics. Each table's lines apply
// to a copy that replaces the table at its COMMIT, so a failing line leaves
// that table as it was (tables committed before it stay changed, as with
// iptables-restore).
func (fam *family) apply(input string) error {
	var cur *table
	for n, line := range strings.Split(input, "\n") {
		n++
		line = strings.TrimSpace(line)
		fail := func(err error) error { return fmt.Errorf("line %d failed: %q: %w", n, line, err) }
		switch {
		case line == "" || strings.HasPrefix(line, "#"):
		case strings.HasPrefix(line, "*"):
			if cur != nil {
				return fail(errors.New("COMMIT expected"))
			}
			if old := fam.table(line[1:]); old != nil {
				cur = old.clone()
			} else {
				cur = newTable(line[1:])
			}
		case cur == nil:
			return fail(errors.New("not in a table"))
		case line == "COMMIT":
			fam.commit(cur)
			cur = nil
		case strings.HasPrefix(line, ":"):
			if err := cur.declare(line[1:]); err != nil {
				return fail(err)
			}
		default:
			if err := cur.command(line); err != nil {
				return fail(err)
			}
		}
	}
	if cur != nil {
		return errors.New("COMMIT expected at the end")
	}
	return nil
}

func (fam *family) commit(t *table) {
	if i := slices.IndexFunc(fam.tables, func(old *table) bool { return old.name == t.name }); i >= 0 {
		fam.tables[i] = t
		return
	}
	fam.tables = append(fam.tables, t)
}

func (t *table) clone() *table {
	c := &table{name: t.name}
	for _, ch := range t.chains {
		cc := *ch
		cc.rules = slices.Clone(ch.rules)
		c.chains = append(c.chains, &cc)
	}
	return c
}

func (t *table) chain(name string) *chain {
	return find(t.chains, func(c *chain) bool { return c.name == name })
}

// declare handles ":NAME POLICY [counters]": a user chain is created, or
// flushed when it exists (--noflush); a built-in chain gets the policy.
func (t *table) declare(decl string) error {
	f := strings.Fields(decl)
	if len(f) < 2 {
		return errors.New("bad chain declaration")
	}
	name, policy := f[0], f[1]
	c := t.chain(name)
	switch {
	case c != nil && c.builtin:
		if policy != "-" {
			c.policy = policy
		}
	case c != nil:
		c.rules = nil
	case policy != "-":
		return errors.New("no built-in chain of that name")
	default:
		t.addChain(name)
	}
	return nil
}

// addChain adds a user chain. User chains are kept sorted after the built-in
// ones, as iptables-save prints them.
func (t *table) addChain(name string) {
	c := &chain{name: name, policy: "-"}
	i := len(t.chains)
	for i > 0 && !t.chains[i-1].builtin && t.chains[i-1].name > name {
		i--
	}
	t.chains = slices.Insert(t.chains, i, c)
}

// command handles -A, -I, -D, -N, -X and -F lines.
func (t *table) command(line string) error {
	words := iptables.Fields(line)
	if len(words) == 1 && words[0] == "-F" {
		for _, c := range t.chains {
			c.rules = nil
		}
		return nil
	}
	if len(words) < 2 {
		return errors.New("missing chain")
	}
	op, name := words[0], words[1]
	// spec is the rest of the line as written, for Save to print.
	_, spec, _ := strings.Cut(strings.TrimPrefix(line, op+" "), " ")
	c := t.chain(name)
	if c == nil && op != "-N" {
		return fmt.Errorf("no chain %s", name)
	}
	switch op {
	case "-A":
		return t.insert(c, len(c.rules), spec, words[2:])
	case "-I":
		pos, args := 1, words[2:]
		if len(args) > 0 {
			if p, err := strconv.Atoi(args[0]); err == nil {
				pos, args = p, args[1:]
				_, spec, _ = strings.Cut(spec, " ")
			}
		}
		return t.insert(c, pos-1, spec, args)
	case "-D":
		return c.delete(words[2:])
	case "-N":
		if c != nil {
			return errors.New("chain already exists")
		}
		t.addChain(name)
	case "-X":
		return t.deleteChain(c)
	case "-F":
		c.rules = nil
	default:
		return fmt.Errorf("unsupported command %s", op)
	}
	return nil
}

// insert puts a rule at index i of c, after checking its target exists.
func (t *table) insert(c *chain, i int, spec string, args []string) error {
	if i < 0 || i > len(c.rules) {
		return errors.New("index of insertion too big")
	}
	if target := targetOf(args); target != "" && t.chain(target) == nil && !slices.Contains(targets, target) {
		return fmt.Errorf("couldn't load target %q: no chain or target of that name", target)
	}
	c.rules = slices.Insert(c.rules, i, rule{spec: spec, args: args})
	return nil
}

// delete removes the first rule with args.
func (c *chain) delete(args []string) error {
	for i, r := range c.rules {
		if slices.Equal(r.args, args) {
			c.rules = slices.Delete(c.rules, i, i+1)
			return nil
		}
	}
	return errors.New("bad rule (does a matching rule exist in that chain?)")
}

// deleteChain removes a user chain that is empty and that no rule targets.
func (t *table) deleteChain(c *chain) error {
	switch {
	case c.builtin:
		return errors.New("cannot delete a built-in chain")
	case len(c.rules) > 0:
		return fmt.Errorf("chain %s is not empty", c.name)
	}
	for _, o := range t.chains {
		for _, r := range o.rules {
			if targetOf(r.args) == c.name {
				return fmt.Errorf("chain %s is still jumped to from %s", c.name, o.name)
			}
		}
	}
	t.chains = slices.DeleteFunc(t.chains, func(o *chain) bool { return o == c })
	return nil
}

func targetOf(args []string) string {
	r := iptables.Rule{Spec: specOf(args)}
	return r.Target()
}

// specOf writes args as one line, quoting the words that need it, as iptables
// -S prints a rule.
func specOf(args []string) string {
	words := make([]string, len(args))
	for i, a := range args {
		words[i] = a
		if a == "" || strings.ContainsAny(a, " \"\\") {
			words[i] = iptables.Quote(a)
		}
	}
	return strings.Join(words, " ")
}

func command(v6 bool, suffix string) string {
	if v6 {
		return "ip6tables" + suffix
	}
	return "iptables" + suffix
}

// tables is the per-rule API of one family.
type tables struct {
	f  *Fake
	v6 bool
}

// call records a per-rule call and finds the chain it names: nil when the
// table or the chain does not exist. f.mu must be held.
func (t *tables) call(op, table, name string, spec []string) (*table, *chain) {
	fam := t.f.fam(t.v6)
	c := op + " " + table + " " + name
	if len(spec) > 0 {
		c += " " + specOf(spec)
	}
	fam.calls = append(fam.calls, c)
	if tb := fam.table(table); tb != nil {
		return tb, tb.chain(name)
	}
	return nil, nil
}

func (t *tables) missing(op, table, chain string) error {
	return fmt.Errorf("%s -t %s %s %s: no chain/target/match by that name", command(t.v6, ""), table, op, chain)
}

func (t *tables) Exists(table, chain string, spec ...string) (bool, error) {
	t.f.mu.Lock()
	defer t.f.mu.Unlock()
	_, c := t.call("exists", table, chain, spec)
	// iptables -C of a missing chain exits 1 like a missing rule, which
	// go-iptables reports as (false, nil).
	return c != nil && slices.ContainsFunc(c.rules, func(r rule) bool { return slices.Equal(r.args, spec) }), nil
}

func (t *tables) Insert(table, chain string, pos int, spec ...string) error {
	t.f.mu.Lock()
	defer t.f.mu.Unlock()
	tb, c := t.call("insert", table, chain, append([]string{strconv.Itoa(pos)}, spec...))
	if c == nil {
		return t.missing("-I", table, chain)
	}
	return tb.insert(c, pos-1, specOf(spec), slices.Clone(spec))
}

func (t *tables) Append(table, chain string, spec ...string) error {
	t.f.mu.Lock()
	defer t.f.mu.Unlock()
	tb, c := t.call("append", table, chain, spec)
	if c == nil {
		return t.missing("-A", table, chain)
	}
	return tb.insert(c, len(c.rules), specOf(spec), slices.Clone(spec))
}

func (t *tables) List(table, chain string) ([]string, error) {
	t.f.mu.Lock()
	defer t.f.mu.Unlock()
	_, c := t.call("list", table, chain, nil)
	if c == nil {
		return nil, t.missing("-S", table, chain)
	}
	out := []string{"-N " + chain}
	if c.builtin {
		out[0] = "-P " + chain + " " + c.policy
	}
	for _, r := range c.rules {
		out = append(out, "-A "+chain+" "+r.spec)
	}
	return out, nil
}
