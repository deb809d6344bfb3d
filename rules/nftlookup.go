package rules

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	"sigs.k8s.io/knftables"

	"github.com/uproxy/uproxy/netfilter/iptables"
	"github.com/uproxy/uproxy/netfilter/nftables"
)

// NFTPortal is the element of the nftables portals that catches a destination.
type NFTPortal struct {
	Map string `json:"map"` // service-ips4, external-ips4, nodeports4, no-endpoint-service-ips4, ...
	// Key is the element's key as nft prints it: "10.96.0.10 . tcp . 80".
	Key string `json:"key"`
	// ProxyPort is where a steering element leads; 0 for a refusing one.
	ProxyPort int `json:"proxyPort,omitempty"`
	// Refused is true for an element of a no-endpoint map: the destination
	// is refused (TCP reset, ICMP port unreachable), its Service port having
	// no endpoints.
	Refused bool `json:"refused,omitempty"`
	// Service is the element's comment: the Service port it belongs to.
	Service string `json:"service,omitempty"`
}

// NFTPortalTable returns the table of the nftables portals of prefix
// (--chain-prefix).
func NFTPortalTable(prefix string) (nftables.Table, error) {
	p, err := iptables.ChainPrefix(prefix)
	if err != nil {
		return nftables.Table{}, err
	}
	name, err := nftables.TableName(p)
	if err != nil {
		return nftables.Table{}, err
	}
	return nftables.Table{Family: knftables.InetFamily, Name: name}, nil
}

// FindNFTPortals returns the elements of the nftables portals (read through
// nft, which names the table) that catch dst over proto ("tcp" or "udp"): its
// Service IP, ExternalIP or, when local says dst is a node address, NodePort
// element, in the steering maps or in the no-endpoint ones that refuse it. It
// returns ErrNoNFTPortals when the table is not there.
func FindNFTPortals(ctx context.Context, nft knftables.Interface, dst netip.AddrPort, proto string, local bool) ([]NFTPortal, error) {
	fam := newNFTFamily(v4, netip.Addr{}, nil)
	if dst.Addr().Is6() {
		fam = newNFTFamily(v6, netip.Addr{}, nil)
	}
	proto = strings.ToLower(proto)
	port := strconv.Itoa(int(dst.Port()))
	type lookup struct {
		name string
		key  []string
	}
	vip := []string{dst.Addr().String(), proto, port}
	lookups := []lookup{
		{fam.serviceIPs, vip},
		{fam.externalIPs, vip},
		{fam.noEndpointServiceIPs, vip},
		{fam.noEndpointExternalIPs, vip},
	}
	if local {
		lookups = append(lookups, lookup{fam.nodePortMap, []string{proto, port}}, lookup{fam.noEndpointNodePorts, []string{proto, port}})
	}
	var out []NFTPortal
	for i, l := range lookups {
		elems, err := nft.ListElements(ctx, "map", l.name)
		if knftables.IsNotFound(err) {
			if i == 0 {
				return nil, ErrNoNFTPortals
			}
			continue // a family without NodePorts has no NodePort map
		}
		if err != nil {
			return nil, fmt.Errorf("list map %s: %w", l.name, err)
		}
		for _, e := range elems {
			if !equalKey(e.Key, l.key) || len(e.Value) != 1 {
				continue
			}
			np := NFTPortal{Map: l.name, Key: strings.Join(e.Key, " . ")}
			if e.Value[0] == nftRefuseVerdict {
				np.Refused = true
			} else if np.ProxyPort, err = strconv.Atoi(e.Value[0]); err != nil {
				return nil, fmt.Errorf("map %s element %s: proxy port %q: %w", l.name, strings.Join(e.Key, " . "), e.Value[0], err)
			}
			if e.Comment != nil {
				np.Service = *e.Comment
			}
			out = append(out, np)
		}
	}
	return out, nil
}

// ErrNoNFTPortals says the nftables portals' table is not there.
var ErrNoNFTPortals = errors.New("no nftables portals")

func equalKey(got, want []string) bool {
	// A concatenated key may be listed as its fields or as one string of them
	// joined by " . ", the form the portals write it in.
	return strings.EqualFold(strings.Join(got, " . "), strings.Join(want, " . "))
}
