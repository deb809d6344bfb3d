package main

import (
	"errors"
	"fmt"
	"net"
	"syscall"

	"github.com/uproxy/uproxy/rules"
)

// rulesLock says that this process programs the node's rules under one chain
// prefix. It is an abstract unix socket: abstract names belong to a network
// namespace, as the rules do, and the kernel frees the name when the process
// dies, however it dies, so a crash never leaves a stale lock behind.
type rulesLock struct{ ln net.Listener }

// lockRules takes the lock of prefix, or says which process holds it.
func lockRules(prefix string) (*rulesLock, error) {
	name := "@uproxy-rules-" + prefix
	ln, err := net.Listen("unix", name)
	if err == nil {
		return &rulesLock{ln: ln}, nil
	}
	if !errors.Is(err, syscall.EADDRINUSE) {
		return nil, fmt.Errorf("lock the rules of --chain-prefix %s: %w", prefix, err)
	}
	held := &rulesHeldError{prefix: prefix, holder: "another process",
		remedy: "stop it first, or give this one another --chain-prefix (or --rules none, which touches no rule)"}
	if pid := rules.SocketHolder(name); pid > 0 {
		held.holder = fmt.Sprintf("process %d", pid)
	}
	return nil, held
}

// rulesHeldError is lockRules' refusal: another process holds the lock. Its
// remedy is the run command's; another command says its own.
type rulesHeldError struct {
	prefix string
	holder string // "process PID", or "another process" when the pid is unknown
	remedy string
}

func (e *rulesHeldError) Error() string {
	return fmt.Sprintf("another uproxy (%s) programs this node's rules with --chain-prefix %s: %s", e.holder, e.prefix, e.remedy)
}

// Close releases the lock.
func (l *rulesLock) Close() error {
	if l == nil {
		return nil
	}
	return l.ln.Close()
}
