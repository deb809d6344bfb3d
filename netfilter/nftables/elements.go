package nftables

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	gnftables "github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
	"sigs.k8s.io/knftables"
)

// Field is the type of one field of a set's key or a map's value, as nft
// names it; a key or value of several fields is their concatenation.
type Field int

const (
	IPv4Addr    Field = iota + 1 // ipv4_addr
	IPv6Addr                     // ipv6_addr
	InetProto                    // inet_proto: tcp, udp, sctp or a number
	InetService                  // inet_service: a port
	// Integer is a 32-bit integer in host byte order, such as the slot a
	// "numgen random mod N" expression gives.
	Integer
	// Verdict is the whole value of a verdict map: accept, drop, return,
	// "jump CHAIN" or "goto CHAIN".
	Verdict
)

// ElementType is the type of the keys of a set and, for a map, of its values.
type ElementType struct {
	Key   []Field
	Value []Field // empty for a set
}

// ElementChange adds or deletes one element of a set or map of the table.
type ElementChange struct {
	Delete bool
	Set    string // the set's or map's name
	Type   ElementType
	// Key and Value are written as nft writes them, fields joined by " . "
	// ("10.96.0.10 . tcp . 80"). Value is "" in a set and for a deletion.
	Key, Value string
	// Comment is an added element's comment, if any.
	Comment string
}

// MaxElementChanges bounds the changes of one WriteElements: they go to the
// kernel in one netlink message per run of changes to a set, which must fit
// the socket's send buffer. More changes go through Run (nft sizes its buffer
// for its batch).
const MaxElementChanges = 512

// element returns c as knftables writes it.
func (c ElementChange) element() *knftables.Element {
	e := &knftables.Element{Key: []string{c.Key}}
	if len(c.Type.Value) > 0 {
		e.Map = c.Set
		if !c.Delete {
			e.Value = []string{c.Value}
		}
	} else {
		e.Set = c.Set
	}
	if !c.Delete && c.Comment != "" {
		e.Comment = knftables.PtrTo(c.Comment)
	}
	return e
}

// Transaction adds changes to tx, as Run would make them.
func (changes ElementChanges) Transaction(tx *knftables.Transaction) {
	for _, c := range changes {
		if c.Delete {
			tx.Delete(c.element())
		} else {
			tx.Add(c.element())
		}
	}
}

// ElementChanges are the changes of one WriteElements, in order.
type ElementChanges []ElementChange

// Check reports the first change whose key or value does not parse as its
// type, or that there are more than MaxElementChanges.
func (changes ElementChanges) Check() error {
	if len(changes) > MaxElementChanges {
		return fmt.Errorf("%d element changes: at most %d go through netlink", len(changes), MaxElementChanges)
	}
	for _, c := range changes {
		if _, err := c.encode(); err != nil {
			return err
		}
	}
	return nil
}

// encode returns c as the kernel takes it.
func (c ElementChange) encode() (gnftables.SetElement, error) {
	var e gnftables.SetElement
	var err error
	if e.Key, err = encodeFields(c.Type.Key, c.Key); err != nil {
		return e, fmt.Errorf("element %q of %s: key: %w", c.Key, c.Set, err)
	}
	if c.Delete {
		return e, nil
	}
	if len(c.Type.Value) == 1 && c.Type.Value[0] == Verdict {
		if e.VerdictData, err = parseVerdict(c.Value); err != nil {
			return e, fmt.Errorf("element %q of %s: value %q: %w", c.Key, c.Set, c.Value, err)
		}
	} else if len(c.Type.Value) > 0 {
		if e.Val, err = encodeFields(c.Type.Value, c.Value); err != nil {
			return e, fmt.Errorf("element %q of %s: value %q: %w", c.Key, c.Set, c.Value, err)
		}
	} else if c.Value != "" {
		return e, fmt.Errorf("element %q of set %s: a value (%q) in a set", c.Key, c.Set, c.Value)
	}
	e.Comment = c.Comment
	return e, nil
}

// encodeFields turns text, fields as nft writes them joined by " . ", into
// the kernel's bytes: each field in its own byte order and, in a
// concatenation, padded to a multiple of four bytes (nft's register size).
func encodeFields(fields []Field, text string) ([]byte, error) {
	parts := strings.Split(text, " . ")
	if len(parts) != len(fields) || len(fields) == 0 {
		return nil, fmt.Errorf("%d fields, want %d", len(parts), len(fields))
	}
	var b []byte
	for i, f := range fields {
		start := len(b)
		p := parts[i]
		switch f {
		case IPv4Addr, IPv6Addr:
			a, err := netip.ParseAddr(p)
			if err != nil || a.Zone() != "" || a.Is4() != (f == IPv4Addr) {
				return nil, fmt.Errorf("field %d: %q is not an %s address", i+1, p, map[Field]string{IPv4Addr: "IPv4", IPv6Addr: "IPv6"}[f])
			}
			b = append(b, a.AsSlice()...)
		case InetProto:
			n, ok := protocolNumbers[p]
			if !ok {
				v, err := strconv.ParseUint(p, 10, 8)
				if err != nil {
					return nil, fmt.Errorf("field %d: %q is not a protocol", i+1, p)
				}
				n = byte(v)
			}
			b = append(b, n)
		case InetService:
			v, err := strconv.ParseUint(p, 10, 16)
			if err != nil {
				return nil, fmt.Errorf("field %d: %q is not a port", i+1, p)
			}
			b = binary.BigEndian.AppendUint16(b, uint16(v))
		case Integer:
			v, err := strconv.ParseUint(p, 10, 32)
			if err != nil {
				return nil, fmt.Errorf("field %d: %q is not a 32-bit integer", i+1, p)
			}
			b = binary.NativeEndian.AppendUint32(b, uint32(v))
		case Verdict:
			return nil, fmt.Errorf("field %d: a verdict is a map's whole value", i+1)
		default:
			return nil, fmt.Errorf("field %d: unknown type %d", i+1, f)
		}
		if len(fields) > 1 {
			for (len(b)-start)%4 != 0 {
				b = append(b, 0)
			}
		}
	}
	return b, nil
}

// parseVerdict returns verdict text as nft writes it as the kernel takes it.
func parseVerdict(text string) (*expr.Verdict, error) {
	switch text {
	case "accept":
		return &expr.Verdict{Kind: expr.VerdictAccept}, nil
	case "drop":
		return &expr.Verdict{Kind: expr.VerdictDrop}, nil
	case "return":
		return &expr.Verdict{Kind: expr.VerdictReturn}, nil
	}
	kind, chain, _ := strings.Cut(text, " ")
	if chain == "" || strings.ContainsAny(chain, " \t\"") || len(chain) > unix.NFT_CHAIN_MAXNAMELEN-1 {
		return nil, fmt.Errorf("not a verdict (accept, drop, return, jump CHAIN or goto CHAIN)")
	}
	switch kind {
	case "jump":
		return &expr.Verdict{Kind: expr.VerdictJump, Chain: chain}, nil
	case "goto":
		return &expr.Verdict{Kind: expr.VerdictGoto, Chain: chain}, nil
	}
	return nil, fmt.Errorf("not a verdict (accept, drop, return, jump CHAIN or goto CHAIN)")
}

// protocolNumbers are the protocols nft writes by name.
var protocolNumbers = map[string]byte{"tcp": 6, "udp": 17, "sctp": 132}

// Comment returns s as a comment nft takes whatever s holds: printable ASCII
// but for '"' and '\', each other byte replaced by '_', and cut to
// knftables.CommentLengthMax. knftables quotes a comment the way Go does
// (%q), with escapes that nft does not know: a '"' ends the string early
// and fails the whole transaction, and an escape makes the comment longer
// than the text it came from, maybe too long for nft. Services and
// endpoints from the API server have names that need none of this; one
// from a manifest may not, and one object must not stop every sync.
func Comment(s string) string {
	clean := true
	for i := 0; i < len(s); i++ {
		if !commentByte(s[i]) {
			clean = false
			break
		}
	}
	if clean {
		return s[:min(len(s), knftables.CommentLengthMax)]
	}
	b := []byte(s[:min(len(s), knftables.CommentLengthMax)])
	for i, c := range b {
		if !commentByte(c) {
			b[i] = '_'
		}
	}
	return string(b)
}

func commentByte(c byte) bool {
	return c >= ' ' && c <= '~' && c != '"' && c != '\\'
}
