package iptables

import (
	"bytes"
	"strconv"
	"strings"
)

// Ruleset is iptables-save output, parsed: the tables in the order printed.
type Ruleset struct {
	Tables []*Table
}

// Table is one "*name" section of iptables-save output.
type Table struct {
	Name string
	// Chains in the order declared. A chain that rules name but no line
	// declares (iptables-save never prints one) follows, in order of first use.
	Chains []*Chain
	byName map[string]*Chain
}

// Chain is one chain and its rules in order.
type Chain struct {
	Name string
	// Policy is a built-in chain's policy (ACCEPT, DROP); "-" for a user chain,
	// "" for a chain only rules name.
	Policy string
	Rules  []*Rule
}

// Rule is one "-A CHAIN ..." line.
type Rule struct {
	Chain string
	// Spec is the rule after "-A CHAIN ", as printed: a "-D CHAIN Spec" names
	// the same rule to iptables-restore.
	Spec string
	// Text is the line as printed, counters left out.
	Text string
	// Line is the line's number in the save output, from 1; Index the rule's
	// position in its chain, from 1, as `iptables -L --line-numbers` counts.
	Line, Index int
	// Packets and Bytes are what iptables-save -c prints before the rule; zero
	// without -c.
	Packets, Bytes uint64
}

// Parse reads iptables-save output (with or without -c). It never fails:
// lines it does not know (comments, anything outside a table) are skipped, so
// that whatever iptables prints around the rules is not an error.
func Parse(saved []byte) *Ruleset {
	rs := &Ruleset{}
	var cur *Table
	n := 0
	for raw := range bytes.Lines(saved) {
		n++
		line := strings.TrimSuffix(strings.TrimSuffix(string(raw), "\n"), "\r")
		switch {
		case strings.HasPrefix(line, "*"):
			cur = rs.table(line[1:])
		case cur == nil:
		case line == "COMMIT":
			cur = nil
		case strings.HasPrefix(line, ":"):
			name, rest, _ := strings.Cut(line[1:], " ")
			if name == "" {
				continue
			}
			policy, _, _ := strings.Cut(rest, " ")
			c := cur.chain(name)
			if c.Policy == "" {
				c.Policy = policy
			}
		default:
			var packets, bytes uint64
			if strings.HasPrefix(line, "[") {
				counters, rule, ok := strings.Cut(line[1:], "] ")
				if !ok {
					continue
				}
				p, b, _ := strings.Cut(counters, ":")
				packets, _ = strconv.ParseUint(p, 10, 64)
				bytes, _ = strconv.ParseUint(b, 10, 64)
				line = rule
			}
			rest, ok := strings.CutPrefix(line, "-A ")
			if !ok {
				continue
			}
			name, spec, _ := strings.Cut(rest, " ")
			if name == "" {
				continue
			}
			c := cur.chain(name)
			c.Rules = append(c.Rules, &Rule{Chain: name, Spec: spec, Text: line, Line: n, Index: len(c.Rules) + 1, Packets: packets, Bytes: bytes})
		}
	}
	return rs
}

// table returns the table called name, added when new: a second "*nat" adds
// to the first.
func (rs *Ruleset) table(name string) *Table {
	if t := rs.Table(name); t != nil {
		return t
	}
	t := &Table{Name: name, byName: map[string]*Chain{}}
	rs.Tables = append(rs.Tables, t)
	return t
}

func (t *Table) chain(name string) *Chain {
	if c := t.byName[name]; c != nil {
		return c
	}
	c := &Chain{Name: name}
	t.byName[name] = c
	t.Chains = append(t.Chains, c)
	return c
}

// Table returns the table called name, nil when the output has none.
func (rs *Ruleset) Table(name string) *Table {
	for _, t := range rs.Tables {
		if t.Name == name {
			return t
		}
	}
	return nil
}

// Chains returns the chains of the table called table, none when the output has
// no such table.
func (rs *Ruleset) Chains(table string) []*Chain {
	if t := rs.Table(table); t != nil {
		return t.Chains
	}
	return nil
}

// Chain returns the chain called name, nil when t (which may be nil) has none.
func (t *Table) Chain(name string) *Chain {
	if t == nil {
		return nil
	}
	return t.byName[name]
}

// Args returns the rule's words after the chain name, quotes removed.
func (r *Rule) Args() []string { return Fields(r.Spec) }

// Target returns what the rule jumps (-j) or goes (-g) to: a chain, or a
// target such as ACCEPT or DNAT; "" when it has none.
func (r *Rule) Target() string {
	target := ""
	args := r.Args()
	for i := 0; i+1 < len(args); i++ {
		if args[i] == "-j" || args[i] == "-g" {
			target = args[i+1]
		}
	}
	return target
}

// Fields splits a rule into words as iptables-restore does: a double-quoted
// string is one word, and inside quotes a backslash escapes the next
// character. Quote is its inverse.
func Fields(s string) []string {
	var out []string
	var cur strings.Builder
	inQuote, escaped, have := false, false, false
	for _, r := range s {
		switch {
		case escaped:
			cur.WriteRune(r)
			escaped = false
		case r == '\\' && inQuote:
			escaped = true
		case r == '"':
			inQuote, have = !inQuote, true
		case r == ' ' && !inQuote:
			if have {
				out = append(out, cur.String())
				cur.Reset()
				have = false
			}
		default:
			cur.WriteRune(r)
			have = true
		}
	}
	if have {
		out = append(out, cur.String())
	}
	return out
}

// Quote double-quotes s as one word of restore input, escaping what Fields
// would otherwise take as the end of the word.
func Quote(s string) string {
	if !strings.ContainsAny(s, `"\`) {
		return `"` + s + `"`
	}
	return `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(s) + `"`
}

// rules returns the chain's rules; none for a nil chain.
func (c *Chain) rules() []*Rule {
	if c == nil {
		return nil
	}
	return c.Rules
}
