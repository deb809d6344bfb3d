package socket

import (
	"os"
	"runtime"
	"sync"

	"golang.org/x/sys/unix"
)

// A bulk TCP transfer moves bytes from one socket to the other through a pipe with
// splice(2), so they never enter user space. A direction takes a pipe only while
// the source has something to read and gives it back when the pipe is empty again,
// so an idle connection holds its two sockets and nothing else, and a few pooled
// pipes serve every connection of the process.

const (
	// maxSplice is the most one splice moves, and the size asked for every pipe:
	// a bulk transfer moves up to a megabyte per pair of calls.
	maxSplice = 1 << 20
	// The sockets are non-blocking; SPLICE_F_NONBLOCK also keeps the pipe from
	// blocking. SPLICE_F_MOVE is only a hint.
	spliceFlags = unix.SPLICE_F_NONBLOCK | unix.SPLICE_F_MOVE
)

// splicePipe is a pipe lent to one copy direction while bytes are in it.
type splicePipe struct {
	r, w int
	// n is how many bytes the pipe holds; only an empty pipe goes back to the pool.
	n       int
	cleanup runtime.Cleanup
}

// splicePipes holds idle, empty pipes. A pipe dropped from the pool by the garbage
// collector is closed by its cleanup, so the pool never holds descriptors for long
// after traffic stops.
var splicePipes sync.Pool

func closePipeFDs(fds [2]int) {
	unix.Close(fds[0])
	unix.Close(fds[1])
}

// getPipe takes a pipe from the pool, or makes one on loop l.
func getPipe(l *loop) (*splicePipe, error) {
	if v := splicePipes.Get(); v != nil {
		return v.(*splicePipe), nil
	}
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		return nil, os.NewSyscallError("pipe2", err)
	}
	if !l.keep(max(fds[0], fds[1])) {
		closePipeFDs(fds)
		return nil, os.NewSyscallError("pipe2", reserveError{l.fdCeiling})
	}
	// A smaller pipe (the limit is /proc/sys/fs/pipe-max-size) still works, with
	// more calls per megabyte; so the error is ignored.
	unix.FcntlInt(uintptr(fds[0]), unix.F_SETPIPE_SZ, maxSplice)
	p := &splicePipe{r: fds[0], w: fds[1]}
	p.cleanup = runtime.AddCleanup(p, closePipeFDs, fds)
	return p, nil
}

// putPipe returns an empty pipe to the pool and closes one that still holds bytes
// (a copy that failed half way): those bytes belong to no one. A pipe with no
// write end (w -1: one resumed from another process, which kept it) is closed
// once empty.
func putPipe(p *splicePipe) {
	if p.n == 0 && p.w >= 0 {
		splicePipes.Put(p)
		return
	}
	p.cleanup.Stop()
	unix.Close(p.r)
	if p.w >= 0 {
		unix.Close(p.w)
	}
}
