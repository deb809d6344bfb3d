package app

import (
	"errors"
	"fmt"
	"os"
	"syscall"

	"github.com/uproxy/uproxy/rules"
	"github.com/uproxy/uproxy/socket/handover"
)

// rulesLock says that this process programs the node's rules under one chain
// prefix. It is an abstract unix socket: abstract names belong to a network
// namespace, as the rules do, and the kernel frees the name when the process
// dies, however it dies, so a crash never leaves a stale lock behind.
//
// It is also where a successor finds the uproxy it takes over from: the
// socket is a handover.Listener, on which the running uproxy accepts
// (takeover.go), and which it hands to its successor last of all, so the
// lock itself never is free in between.
type rulesLock struct{ ln *handover.Listener }

// lockRules takes the lock of prefix, or says which process holds it.
func lockRules(prefix string) (*rulesLock, error) {
	name := lockName(prefix)
	ln, err := handover.Listen(name)
	if err == nil {
		return &rulesLock{ln: ln}, nil
	}
	if !errors.Is(err, syscall.EADDRINUSE) {
		return nil, fmt.Errorf("lock the rules of --chain-prefix %s: %w", prefix, err)
	}
	held := &rulesHeldError{prefix: prefix, name: name, holder: "another process",
		remedy: "stop it first, or give this one another --chain-prefix (or --rules none, which touches no rule)"}
	if cred, ok := rules.SocketHolder(name); ok {
		held.holder = fmt.Sprintf("process %d", cred.Pid)
		// Any process may bind an abstract name; a uproxy that programs
		// rules runs as root.
		held.notUproxy = cred.Uid != 0 && os.Geteuid() == 0
		if held.notUproxy {
			held.holder = fmt.Sprintf("process %d of uid %d", cred.Pid, cred.Uid)
		}
	}
	return nil, held
}

// lockName is the abstract name of the rules lock of prefix.
func lockName(prefix string) string { return "@uproxy-rules-" + prefix }

// rulesHeldError is lockRules' refusal: another process holds the lock. Its
// remedy is the run command's; another command says its own.
type rulesHeldError struct {
	prefix, name string
	holder       string // "process PID", or "another process" when the pid is unknown
	// notUproxy says the holder is not root, as every uproxy that programs
	// rules is: another program has taken the lock's name.
	notUproxy bool
	remedy    string
}

func (e *rulesHeldError) Error() string {
	if e.notUproxy {
		return fmt.Sprintf("the lock of --chain-prefix %s, the abstract unix socket %s, is held by %s, which is not root and so no uproxy that programs rules: stop that process (any process may bind such a name), or give this one another --chain-prefix",
			e.prefix, e.name, e.holder)
	}
	return fmt.Sprintf("another uproxy (%s) programs this node's rules with --chain-prefix %s: %s", e.holder, e.prefix, e.remedy)
}

// Close releases the lock.
func (l *rulesLock) Close() error {
	if l == nil {
		return nil
	}
	return l.ln.Close()
}
