package kubeapi

import (
	"bytes"
	"errors"
	"fmt"
	"io"
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
	// logStart is where this run's output begins in the log, which may hold
	// earlier runs of the same server before it.
	logStart int64
	logFile  *os.File
	done     chan struct{}
	waitErr  error
}

// startProcess runs bin with args, appending stdout and stderr to logPath.
// Appending keeps the output of earlier runs (a restart) in the same file.
func startProcess(name, bin string, args []string, logPath string) (*process, error) {
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open %s log: %w", name, err)
	}
	info, err := logFile.Stat()
	if err != nil {
		logFile.Close()
		return nil, fmt.Errorf("stat %s log: %w", name, err)
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
	p := &process{name: name, cmd: cmd, logPath: logPath, logStart: info.Size(), logFile: logFile, done: make(chan struct{})}
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

// output returns what this run of the process has written so far.
func (p *process) output() []byte {
	f, err := os.Open(p.logPath)
	if err != nil {
		return []byte(fmt.Sprintf("(cannot read %s: %v)", p.logPath, err))
	}
	defer f.Close()
	data, err := io.ReadAll(io.NewSectionReader(f, p.logStart, 1<<40))
	if err != nil {
		return []byte(fmt.Sprintf("(cannot read %s: %v)", p.logPath, err))
	}
	return data
}

// tail returns the last n lines of this run's output.
func (p *process) tail(n int) string {
	lines := bytes.Split(bytes.TrimRight(p.output(), "\n"), []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return string(bytes.Join(lines, []byte("\n")))
}

// addrInUse reports whether this run failed to listen because a port was taken.
func (p *process) addrInUse() bool {
	return bytes.Contains(p.output(), []byte("address already in use"))
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
