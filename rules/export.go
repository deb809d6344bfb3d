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

// CheckChainPrefix reports whether prefix is usable as a chain prefix (1 to 9
// letters, digits, '_' or '-'), the same bound for every mode.
func CheckChainPrefix(prefix string) error { return checkPrefix(prefix) }

// IsMissingCommand reports whether err says an iptables binary is absent.
func IsMissingCommand(err error) bool { return missingCommand(err) }
