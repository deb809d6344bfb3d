package app

import (
	"cmp"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
)

// The image (deploy/Dockerfile) installs this binary as the alternative of
// iptables, ip6tables and their -save and -restore until the first of them
// runs; called by one of those names, uproxy hands the call to the wrapper
// script (deploy/iptables-wrapper) at its fixed path, which picks the node's
// backend and switches the commands to it.
//
// The link leads to a binary rather than to the script itself because the
// kernel starts a script's interpreter with the path the script was called
// through, and the interpreter opens that path again. When another command,
// started at the same moment, switches the link to the backend in between,
// the shell reads the backend's binary as a script and fails. A binary is
// mapped from the file the kernel resolved: nothing is opened by name again.
var iptablesCommands = map[string]bool{
	"iptables": true, "iptables-save": true, "iptables-restore": true,
	"ip6tables": true, "ip6tables-save": true, "ip6tables-restore": true,
}

// IsIPTablesCommand reports whether name, the name uproxy was called by, is
// one of the iptables commands whose alternative it is.
func IsIPTablesCommand(name string) bool { return iptablesCommands[name] }

// RunIPTablesWrapper replaces the process with the wrapper script, telling it
// the command's name and the file it came through. It returns only on error.
func RunIPTablesWrapper(name string, args []string) error {
	script := filepath.Join(cmp.Or(os.Getenv("IPTABLES_WRAPPER_SBIN"), "/usr/sbin"), "iptables-wrapper")
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("called as %s: %w", name, err)
	}
	env := append(os.Environ(), "IPTABLES_WRAPPER_NAME="+name, "IPTABLES_WRAPPER_SELF="+self)
	err = syscall.Exec("/bin/sh", append([]string{"/bin/sh", script}, args...), env)
	return fmt.Errorf("called as %s: run %s: %w", name, script, err)
}
