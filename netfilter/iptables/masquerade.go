package iptables

import "fmt"

// DefaultMasqueradeBit is the packet mark bit meaning "masquerade this":
// kube-proxy's 14 (its --iptables-masquerade-bit), in every kernel mode.
const DefaultMasqueradeBit = 14

// MasqueradeBit returns bit, or DefaultMasqueradeBit when it is 0, once it has
// checked that it is a bit of the 32-bit mark. Every kernel mode resolves its
// masquerade bit through it.
func MasqueradeBit(bit int) (int, error) {
	if bit == 0 {
		bit = DefaultMasqueradeBit
	}
	if bit < 0 || bit > 31 {
		return 0, fmt.Errorf("masquerade bit %d: want 0 to 31", bit)
	}
	return bit, nil
}
