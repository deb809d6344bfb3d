package service

import "fmt"

// NetfilterName is the protocol as iptables and nft spell it ("tcp", "udp",
// "sctp"), or "" for one they cannot match.
func (p Protocol) NetfilterName() string {
	switch p {
	case TCP:
		return "tcp"
	case UDP:
		return "udp"
	case SCTP:
		return "sctp"
	}
	return ""
}

// NetfilterPorts splits ports into those netfilter rules can program (a known
// protocol, ports in range) and an error naming each of the others, which the
// kernel modes report while programming the rest.
func NetfilterPorts(ports []*Port) ([]*Port, []error) {
	var errs []error
	ok := make([]*Port, 0, len(ports))
	for _, sp := range ports {
		switch {
		case sp.Protocol.NetfilterName() == "":
			errs = append(errs, fmt.Errorf("service port %s: protocol %q not supported", sp.Name, sp.Protocol))
		case sp.Port <= 0 || sp.Port > 65535 || sp.NodePort < 0 || sp.NodePort > 65535:
			errs = append(errs, fmt.Errorf("service port %s: invalid port %d or NodePort %d", sp.Name, sp.Port, sp.NodePort))
		default:
			ok = append(ok, sp)
		}
	}
	return ok, errs
}
