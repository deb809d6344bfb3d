package rules

import (
	"bufio"
	"bytes"
	"fmt"
	"slices"
	"strings"

	"github.com/hashicorp/go-multierror"
)

// Cleanup removes every chain and jump rule the portals with this chain prefix
// install, in both families, through the real iptables commands. What is already
// gone, including a missing ip6tables, is not an error. It is `uproxy cleanup`.
func Cleanup(prefix string) error {
	prefix, err := ChainPrefix(prefix)
	if err != nil {
		return err
	}
	return cleanup(nil, chainNames(prefix))
}

func cleanup(k *Kernel, c chains) error {
	nat, filter := c.nat(), c.filter()
	return RemoveChains(k, func(table, chain string) bool {
		switch table {
		case "nat":
			return slices.Contains(nat, chain)
		case "filter":
			return slices.Contains(filter, chain)
		}
		return false
	})
}

// RemoveChains deletes, in both families, the chains ours accepts and every rule
// elsewhere that jumps to them. Each family's tables are read once and changed in
// one restore. What is already gone, including a missing ip6tables, is not an
// error; the families' errors are collected. Every mode's cleanup uses it.
func RemoveChains(k *Kernel, ours func(table, chain string) bool) error {
	var errs []error
	for f := v4; f <= v6; f++ {
		saved, err := k.save(f == v6)
		if err != nil {
			if missingCommand(err) {
				continue
			}
			errs = append(errs, fmt.Errorf("read rules for cleanup: %w", err))
			continue
		}
		input := RemovalInput(saved, ours)
		if len(input) == 0 {
			continue
		}
		if err := k.restore(f == v6, input); err != nil {
			errs = append(errs, fmt.Errorf("cleanup: %w", err))
		}
	}
	return multierror.Append(nil, errs...).ErrorOrNil()
}

// RemovalInput returns the restore input that deletes, from the iptables-save
// output saved, the chains ours accepts and the rules elsewhere that jump to
// them; nothing when none is there. Only what exists is named: a -D or -X of
// something absent would fail the whole restore, and declaring a chain in a
// table that does not exist would create the table.
func RemovalInput(saved []byte, ours func(table, chain string) bool) []byte {
	type tableState struct {
		name    string
		present []string // our chains declared in the table
		jumps   []string // "-D ..." lines for rules elsewhere that jump to them
	}
	var tables []*tableState
	var cur *tableState
	sc := bufio.NewScanner(bytes.NewReader(saved))
	sc.Buffer(make([]byte, 0, 64*1024), 16*1024*1024)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "*"):
			cur = &tableState{name: line[1:]}
			tables = append(tables, cur)
		case cur == nil:
		case strings.HasPrefix(line, ":"):
			name, _, _ := strings.Cut(line[1:], " ")
			if ours(cur.name, name) {
				cur.present = append(cur.present, name)
			}
		case strings.HasPrefix(line, "-A "):
			chain, rest, _ := strings.Cut(line[3:], " ")
			if ours(cur.name, chain) || !jumpsTo(rest, func(c string) bool { return ours(cur.name, c) }) {
				continue
			}
			cur.jumps = append(cur.jumps, "-D "+chain+" "+rest)
		}
	}
	var b strings.Builder
	for _, t := range tables {
		if len(t.present) == 0 && len(t.jumps) == 0 {
			continue
		}
		b.WriteString("*" + t.name + "\n")
		// Declaring a chain flushes it, so -X finds it empty.
		for _, c := range t.present {
			b.WriteString(":" + c + " - [0:0]\n")
		}
		for _, j := range t.jumps {
			b.WriteString(j + "\n")
		}
		for _, c := range t.present {
			b.WriteString("-X " + c + "\n")
		}
		b.WriteString("COMMIT\n")
	}
	return []byte(b.String())
}

// jumpsTo reports whether the rule text targets (-j or -g) a chain ours accepts.
func jumpsTo(rule string, ours func(string) bool) bool {
	fields := strings.Fields(rule)
	for i := 0; i+1 < len(fields); i++ {
		if (fields[i] == "-j" || fields[i] == "-g") && ours(fields[i+1]) {
			return true
		}
	}
	return false
}
