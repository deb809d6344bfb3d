package rules

// Exported doors into Kernel for the kernel modes, which program the same
// iptables and conntrack through the same boundary (and the same fakes).

// RunRestore feeds input to `iptables-restore --noflush` (ip6tables-restore when
// v6), or to k.Restore when set. A nil k runs the real command.
func (k *Kernel) RunRestore(v6 bool, input []byte) error { return k.restore(v6, input) }

// RunSave returns the output of `iptables-save` (ip6tables-save when v6), or of
// k.Save when set. A nil k runs the real command.
func (k *Kernel) RunSave(v6 bool) ([]byte, error) { return k.save(v6) }

// OpenTables returns the rule API of one family: k.Tables when set, else go-iptables.
func (k *Kernel) OpenTables(v6 bool) (Tables, error) { return k.tables(v6) }

// ConntrackHandle returns k.Conntrack when set, else netlink in the calling
// thread's namespace.
func (k *Kernel) ConntrackHandle() ConntrackDeleter { return k.conntrack() }

// ChainPrefix returns prefix, or DefaultChainPrefix when it is empty, once it
// has checked that every chain name built on it fits iptables' limit (1 to 9
// letters, digits, '_' or '-'). Every mode resolves its prefix through it.
func ChainPrefix(prefix string) (string, error) {
	if prefix == "" {
		prefix = DefaultChainPrefix
	}
	if err := checkPrefix(prefix); err != nil {
		return "", err
	}
	return prefix, nil
}

// IsMissingCommand reports whether err says an iptables binary is absent.
func IsMissingCommand(err error) bool { return missingCommand(err) }
