package rules

import (
	"github.com/uproxy/uproxy/netfilter/iptables"
)

// Cleanup removes every chain and jump rule the portals with this chain prefix
// install, in both families, through the real iptables commands. What is already
// gone, including a missing ip6tables, is not an error. It is `uproxy cleanup`.
func Cleanup(prefix string) error {
	prefix, err := iptables.ChainPrefix(prefix)
	if err != nil {
		return err
	}
	return cleanup(iptables.Commands{}, chainNames(prefix))
}

func cleanup(k iptables.Kernel, c chains) error {
	return iptables.RemoveChains(k, iptables.ChainSet{"nat": c.nat(), "filter": c.filter()}.Has)
}
