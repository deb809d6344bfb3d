package nftables

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// Which tables are uproxy's. A table's name comes from --chain-prefix, which
// an operator may set to anything nft takes; "FILTER" names the table a
// distribution's firewall loads (inet filter). Every table uproxy writes
// carries a comment that begins with CommentPrefix, and uproxy rewrites or
// deletes a table of its name only when the table is missing or carries that
// comment: anyone else's is left as it is, and the caller says so.

// CommentPrefix begins the comment of every table uproxy writes.
const CommentPrefix = "uproxy "

// NotOursError is a table that exists under uproxy's name without uproxy's
// comment: another program's, which uproxy does not touch.
type NotOursError struct {
	Table   Table
	Comment string // the table's comment; "" for none
}

func (e *NotOursError) Error() string {
	what := "it has no comment"
	if e.Comment != "" {
		what = fmt.Sprintf("its comment is %q", e.Comment)
	}
	return fmt.Sprintf("nftables table %s is not uproxy's (%s; uproxy's tables have comments beginning %q), so it is left as it is: choose another --chain-prefix",
		e.Table, what, CommentPrefix)
}

// Claim returns nil when k's table is missing or is uproxy's, a *NotOursError
// when it belongs to someone else, and the error of the read when the table
// could not be read.
func Claim(ctx context.Context, k Kernel) error {
	comment, exists, err := k.TableComment(ctx)
	if err != nil {
		return fmt.Errorf("read nftables table %s: %w", k.TableID(), err)
	}
	if exists && !strings.HasPrefix(comment, CommentPrefix) {
		return &NotOursError{Table: k.TableID(), Comment: comment}
	}
	return nil
}

// Netlink attributes of a table (uapi nf_tables.h), and the type of a table's
// comment in its user data (libnftnl's udata: a byte of type, a byte of
// length, the value; nft writes the comment with its terminating NUL).
const (
	attrTableName     = 1
	attrTableUserdata = 6
	udataTableComment = 0
)

// TableComment implements Kernel: one NFT_MSG_GETTABLE of the table by name,
// in the calling thread's namespace. nft's JSON leaves a table's comment out
// before nft 1.0.8 and lists every element of its maps with it; this reads
// the table alone.
func (k *kernel) TableComment(context.Context) (string, bool, error) {
	conn, err := netlink.Dial(unix.NETLINK_NETFILTER, nil)
	if err != nil {
		return "", false, fmt.Errorf("netlink: %w", err)
	}
	defer conn.Close()
	ae := netlink.NewAttributeEncoder()
	ae.String(attrTableName, k.table.Name)
	attrs, err := ae.Encode()
	if err != nil {
		return "", false, err
	}
	// nfgenmsg: family, version 0 (NFNETLINK_V0), resource id 0.
	data := append([]byte{byte(k.table.Family), unix.NFNETLINK_V0, 0, 0}, attrs...)
	msgs, err := conn.Execute(netlink.Message{
		Header: netlink.Header{
			Type:  netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_GETTABLE),
			Flags: netlink.Request,
		},
		Data: data,
	})
	if errors.Is(err, unix.ENOENT) {
		return "", false, nil
	}
	if err != nil {
		return "", false, err
	}
	if len(msgs) != 1 || len(msgs[0].Data) < 4 {
		return "", false, fmt.Errorf("netlink: %d answers to one table's read", len(msgs))
	}
	ad, err := netlink.NewAttributeDecoder(msgs[0].Data[4:])
	if err != nil {
		return "", false, err
	}
	var comment string
	for ad.Next() {
		if ad.Type() == attrTableUserdata {
			comment = udataComment(ad.Bytes())
		}
	}
	return comment, true, ad.Err()
}

// udataComment returns the comment in a table's user data ("" for none).
func udataComment(b []byte) string {
	for len(b) >= 2 {
		typ, n := b[0], int(b[1])
		if len(b) < 2+n {
			return ""
		}
		if typ == udataTableComment {
			return strings.TrimRight(string(b[2:2+n]), "\x00")
		}
		b = b[2+n:]
	}
	return ""
}

// TableID implements Kernel.
func (k *kernel) TableID() Table {
	return k.id
}
