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
	if prefix == "" {
		prefix = DefaultChainPrefix
	}
	if err := checkPrefix(prefix); err != nil {
		return err
	}
	return cleanup(nil, chainNames(prefix))
}

func cleanup(k *Kernel, c chains) error {
	var errs []error
	for f := v4; f <= v6; f++ {
		if err := cleanupFamily(k, c, f == v6); err != nil {
			errs = append(errs, err)
		}
	}
	return multierror.Append(nil, errs...).ErrorOrNil()
}

// cleanupFamily reads the family's tables once and, in one restore, deletes the
// rules that jump to our chains and then the chains. Only what exists is named:
// a -D or -X of something absent would fail the whole restore, and declaring a
// chain in a table that does not exist would create the table.
func cleanupFamily(k *Kernel, c chains, v6 bool) error {
	saved, err := k.save(v6)
	if err != nil {
		if missingCommand(err) {
			return nil
		}
		return fmt.Errorf("read rules for cleanup: %w", err)
	}
	input := cleanupInput(saved, map[string][]string{"nat": c.nat(), "filter": c.filter()})
	if len(input) == 0 {
		return nil
	}
	if err := k.restore(v6, input); err != nil {
		return fmt.Errorf("cleanup: %w", err)
	}
	return nil
}

// cleanupInput returns the restore input removing ours[table] chains from the
// iptables-save output saved, or nothing when none of them is there.
func cleanupInput(saved []byte, ours map[string][]string) []byte {
	type tableState struct {
		present []string // our chains declared in the table
		jumps   []string // "-D ..." lines for rules elsewhere that jump to them
	}
	var order []string
	tables := map[string]*tableState{}
	var cur *tableState
	var curOurs []string
	sc := bufio.NewScanner(bytes.NewReader(saved))
	sc.Buffer(make([]byte, 0, 64*1024), 16*1024*1024)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "*"):
			name := line[1:]
			curOurs = ours[name]
			cur = nil
			if curOurs != nil {
				cur = &tableState{}
				tables[name] = cur
				order = append(order, name)
			}
		case cur == nil:
		case strings.HasPrefix(line, ":"):
			name, _, _ := strings.Cut(line[1:], " ")
			if slices.Contains(curOurs, name) {
				cur.present = append(cur.present, name)
			}
		case strings.HasPrefix(line, "-A "):
			chain, rest, _ := strings.Cut(line[3:], " ")
			if slices.Contains(curOurs, chain) || !jumpsTo(rest, curOurs) {
				continue
			}
			cur.jumps = append(cur.jumps, "-D "+chain+" "+rest)
		}
	}

	var b strings.Builder
	for _, name := range order {
		t := tables[name]
		if len(t.present) == 0 && len(t.jumps) == 0 {
			continue
		}
		b.WriteString("*" + name + "\n")
		// Declaring a chain flushes it, so -X finds it empty.
		for _, ch := range t.present {
			b.WriteString(":" + ch + " - [0:0]\n")
		}
		for _, j := range t.jumps {
			b.WriteString(j + "\n")
		}
		for _, ch := range t.present {
			b.WriteString("-X " + ch + "\n")
		}
		b.WriteString("COMMIT\n")
	}
	return []byte(b.String())
}

// jumpsTo reports whether the rule text targets (-j or -g) one of chains.
func jumpsTo(rule string, chains []string) bool {
	fields := strings.Fields(rule)
	for i := 0; i+1 < len(fields); i++ {
		if (fields[i] == "-j" || fields[i] == "-g") && slices.Contains(chains, fields[i+1]) {
			return true
		}
	}
	return false
}
