package nftables

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"sigs.k8s.io/knftables"
)

// Element is an element of the mode's table that concerns a destination, for
// `uproxy explain`.
type Element struct {
	// Set is the set or map: backends4-2, reject4, affinity4, ...
	Set string `json:"set"`
	// Key and Value are as nft prints them: "10.96.0.10 . tcp . 80 . 0",
	// "10.244.1.2 . 8080"; Value is empty in a set.
	Key   string `json:"key"`
	Value string `json:"value,omitempty"`
	// Service is the element's comment: the Service port it belongs to.
	Service string `json:"service,omitempty"`
	// Meaning says what the element does to the destination's traffic.
	Meaning string `json:"meaning"`
	// Endpoint is where an element of a count map sends a new connection
	// (DNAT), and Share the part of new connections it gets: the rule draws
	// numgen random mod the map's count, one slot per element.
	Endpoint string  `json:"endpoint,omitempty"`
	Share    float64 `json:"share,omitempty"`
	// Local: the element is of a pick among this node's endpoints, which
	// only traffic from outside to a Service port with externalTrafficPolicy
	// Local reaches.
	Local bool `json:"local,omitempty"`
	// Affinity: the element sends the Service port's new connections to its
	// own chain first, where a client seen within the timeout goes back to
	// its endpoint.
	Affinity bool `json:"affinity,omitempty"`
}

// ErrNoTable is Find's error when the mode's table is not there.
var ErrNoTable = errors.New("the nftables mode's table does not exist")

// meanings say what an element of each set or map (without the family digit
// and count) does.
var meanings = map[string]string{
	"backends":          "DNAT to this endpoint, one slot of the random pick",
	"local-backends":    "DNAT to this node-local endpoint (externalTrafficPolicy Local, traffic from outside)",
	"np-backends":       "DNAT to this endpoint, one slot of the random pick",
	"np-local-backends": "DNAT to this node-local endpoint (externalTrafficPolicy Local, traffic from outside)",
	"affinity":          "ClientIP affinity: to the Service port's own chain",
	"local-affinity":    "ClientIP affinity among node-local endpoints: to the Service port's own chain",
	"np-affinity":       "ClientIP affinity: to the Service port's own chain",
	"np-local-affinity": "ClientIP affinity among node-local endpoints: to the Service port's own chain",
	"cluster-masq":      "masqueraded when the client is outside the pod networks",
	"external-masq":     "masqueraded (externalTrafficPolicy Cluster)",
	"np-masq":           "masqueraded (externalTrafficPolicy Cluster)",
	"external-local":    "externalTrafficPolicy Local: clients outside the node and pods keep their address and reach only node-local endpoints, or are dropped",
	"np-local":          "externalTrafficPolicy Local: clients outside the node and pods keep their address and reach only node-local endpoints, or are dropped",
	"firewall":          "loadBalancerSourceRanges: sources outside firewall-allow are dropped",
	"firewall-allow":    "loadBalancerSourceRanges: this source range is allowed",
	"reject":            "no endpoints: refused",
	"np-reject":         "no endpoints: refused",
	"drop":              "internalTrafficPolicy Local without an endpoint on this node: dropped",
}

// Find returns the elements of the mode's table (read through nft) that
// concern dst over proto ("tcp", "udp" or "sctp"): those keyed by its
// address, protocol and port, and, when local says dst is a node address,
// those of a NodePort on its port. It returns ErrNoTable when the table is not
// there.
func Find(ctx context.Context, nft knftables.Interface, dst netip.AddrPort, proto string, local bool) ([]Element, error) {
	fam := "4"
	if dst.Addr().Unmap().Is6() {
		fam = "6"
	}
	proto = strings.ToLower(proto)
	port := strconv.Itoa(int(dst.Port()))
	addrKey := dst.Addr().Unmap().String() + " . " + proto + " . " + port
	npKey := proto + " . " + port
	var out []Element
	for _, kind := range []string{"set", "map"} {
		names, err := nft.List(ctx, kind+"s")
		if knftables.IsNotFound(err) {
			return nil, ErrNoTable
		}
		if err != nil {
			return nil, fmt.Errorf("list the %ss: %w", kind, err)
		}
		slices.Sort(names)
		for _, name := range names {
			base, ok := familyBase(name, fam)
			meaning, known := meanings[base]
			if !ok || !known {
				continue
			}
			key := addrKey
			if strings.HasPrefix(base, "np-") {
				if !local {
					continue
				}
				key = npKey
			}
			elems, err := nft.ListElements(ctx, kind, name)
			if err != nil {
				return nil, fmt.Errorf("list %s %s: %w", kind, name, err)
			}
			for _, e := range elems {
				k := strings.Join(e.Key, " . ")
				if k != key && !strings.HasPrefix(k, key+" . ") {
					continue
				}
				el := Element{Set: name, Key: k, Value: strings.Join(e.Value, " . "), Meaning: meaning}
				if e.Comment != nil {
					el.Service = *e.Comment
				}
				if pk, n, ok := parseCountMap(name, fam); ok {
					// "ADDR . PORT", in one value or two, as nft lists it
					// or as it was written.
					ip, port, _ := strings.Cut(el.Value, " . ")
					a, aerr := netip.ParseAddr(ip)
					p, perr := strconv.ParseUint(port, 10, 16)
					if aerr != nil || perr != nil {
						return nil, fmt.Errorf("%s %s element %s: endpoint %q", kind, name, k, el.Value)
					}
					el.Endpoint = netip.AddrPortFrom(a, uint16(p)).String()
					el.Share = 1 / float64(n)
					el.Local = pk == pickLocal || pk == pickNPLocal
				}
				for pk := range numPicks {
					if name == picks[pk].affinity+fam {
						el.Affinity = true
						el.Local = pk == pickLocal || pk == pickNPLocal
					}
				}
				out = append(out, el)
			}
		}
	}
	return out, nil
}

// familyBase strips a set's family digit and, for a count map, its count:
// "backends4-2" is "backends" of family 4.
func familyBase(name, fam string) (string, bool) {
	if i := strings.LastIndexByte(name, '-'); i > 0 {
		if _, err := strconv.Atoi(name[i+1:]); err == nil {
			name = name[:i]
		}
	}
	base, ok := strings.CutSuffix(name, fam)
	return base, ok
}
