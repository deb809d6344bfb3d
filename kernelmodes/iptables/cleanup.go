package iptables

import (
	"bufio"
	"bytes"
	"fmt"
	"slices"
	"strings"

	"github.com/hashicorp/go-multierror"

	"github.com/uproxy/uproxy/rules"
)

// Cleanup removes every chain and jump rule the iptables mode installs with
// this chain prefix ("" for the default), in both families, through the real
// iptables commands of the calling thread's namespace. What is already gone,
// including a missing ip6tables, is not an error. The userspace mode's portal
// chains share the prefix but not the names, and are left alone.
func Cleanup(prefix string) error {
	if prefix == "" {
		prefix = rules.DefaultChainPrefix
	}
	if err := rules.CheckChainPrefix(prefix); err != nil {
		return err
	}
	return cleanup(nil, namesOf(prefix))
}

func cleanup(k *rules.Kernel, n names) error {
	var errs []error
	for _, v6 := range []bool{false, true} {
		saved, err := k.RunSave(v6)
		if err != nil {
			if rules.IsMissingCommand(err) {
				continue
			}
			errs = append(errs, fmt.Errorf("read %s rules for cleanup: %w", familyName(v6), err))
			continue
		}
		input := cleanupInput(saved, func(table, chain string) bool {
			switch table {
			case "nat":
				return slices.Contains(n.natChains(), chain) || n.isPortChain(chain)
			case "filter":
				return slices.Contains(n.filterChains(), chain)
			}
			return false
		})
		if len(input) == 0 {
			continue
		}
		if err := k.RunRestore(v6, input); err != nil {
			errs = append(errs, fmt.Errorf("clean up %s iptables-mode rules: %w", familyName(v6), err))
		}
	}
	return multierror.Append(nil, errs...).ErrorOrNil()
}

// cleanupInput returns the restore input deleting the chains ours accepts, and
// every rule elsewhere that jumps to them, from iptables-save output; nothing
// when none is there. Only what exists is named: deleting something absent
// would fail the whole restore.
func cleanupInput(saved []byte, ours func(table, chain string) bool) []byte {
	type tableState struct {
		name    string
		present []string
		jumps   []string
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
