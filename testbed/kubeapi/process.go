package kubeapi

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"
)

// process is one child program whose output goes to a log file.
//
// done is closed once the program has exited and been reaped; waitErr is
// valid only after that.
type process struct {
	name    string
	cmd     *exec.Cmd
	logPath string
	logFile *os.File
	done    chan struct{}
	waitErr error
}

// startProcess runs bin with args, appending stdout and stderr to logPath.
// Appending keeps the output of earlier runs (a restart) in the same file.
func startProcess(name, bin string, args []string, logPath string) (*process, error) {
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open %s log: %w", name, err)
	}
	fmt.Fprintf(logFile, "==== %s %s %s\n", time.Now().Format(time.RFC3339Nano), bin, strings.Join(args, " "))
	cmd := exec.Command(bin, args...)
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	// Pdeathsig kills the child if the test binary dies without running its
	// cleanups (a panic, a test timeout), so no server outlives its test.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return nil, fmt.Errorf("start %s (%s): %w", name, bin, err)
	}
	p := &process{name: name, cmd: cmd, logPath: logPath, logFile: logFile, done: make(chan struct{})}
	go p.reap()
	return p, nil
}

func (p *process) reap() {
	p.waitErr = p.cmd.Wait()
	p.logFile.Close()
	close(p.done)
}

// exited reports whether the process has ended, and how.
func (p *process) exited() (bool, error) {
	select {
	case <-p.done:
		return true, p.waitErr
	default:
		return false, nil
	}
}

// stop asks the process to end with SIGTERM, so that it shuts down as it
// would in a cluster, and kills it if it is still running after grace.
func (p *process) stop(grace time.Duration) error {
	if done, _ := p.exited(); done {
		return nil
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("signal %s: %w", p.name, err)
	}
	select {
	case <-p.done:
		return nil
	case <-time.After(grace):
	}
	if err := p.cmd.Process.Kill(); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("kill %s: %w", p.name, err)
	}
	<-p.done
	return fmt.Errorf("%s did not stop within %v of SIGTERM and was killed", p.name, grace)
}

// tail returns the last n lines of the process's log.
func (p *process) tail(n int) string {
	return tailFile(p.logPath, n)
}

func tailFile(path string, n int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(cannot read %s: %v)", path, err)
	}
	lines := bytes.Split(bytes.TrimRight(data, "\n"), []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return string(bytes.Join(lines, []byte("\n")))
}

// freePorts returns n distinct TCP ports on 127.0.0.1 that were free a moment
// ago. All listeners are held until every port is chosen, so the ports differ;
// another program may still take one before the server binds it, which the
// callers detect in the log (addrInUse) and answer with fresh ports.
func freePorts(n int) ([]int, error) {
	ports := make([]int, 0, n)
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("find a free port: %w", err)
		}
		defer l.Close()
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// addrInUse reports whether a log says that a listen failed because the
// port was taken.
func addrInUse(logPath string) bool {
	data, err := os.ReadFile(logPath)
	return err == nil && bytes.Contains(data, []byte("address already in use"))
}
