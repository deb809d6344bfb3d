package socket

import (
	"io"
	"net"
	"os"
	"runtime"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// The TCP copy moves bytes from one socket to the other through a pipe with
// splice(2), so they never enter user space. io.Copy between two *net.TCPConn
// splices too, but it takes its pipe before waiting for data and keeps it for the
// whole connection: an idle proxied connection then holds six descriptors (two
// sockets, two pipes) and the pipes' kernel memory. spliceStream takes a pipe only
// once the source has something to read and gives it back when the pipe is empty
// again, so an idle connection holds its two sockets and nothing else, and a few
// pooled pipes serve every connection of the process.

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

func getPipe() (*splicePipe, error) {
	if v := splicePipes.Get(); v != nil {
		return v.(*splicePipe), nil
	}
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		return nil, os.NewSyscallError("pipe2", err)
	}
	// A smaller pipe (the limit is /proc/sys/fs/pipe-max-size) still works, with
	// more calls per megabyte; so the error is ignored.
	unix.FcntlInt(uintptr(fds[0]), unix.F_SETPIPE_SZ, maxSplice)
	p := &splicePipe{r: fds[0], w: fds[1]}
	p.cleanup = runtime.AddCleanup(p, closePipeFDs, fds)
	return p, nil
}

// putPipe returns an empty pipe to the pool and closes one that still holds bytes
// (a copy that failed half way): those bytes belong to no one.
func putPipe(p *splicePipe) {
	if p.n == 0 {
		splicePipes.Put(p)
		return
	}
	p.cleanup.Stop()
	closePipeFDs([2]int{p.r, p.w})
}

// spliceStream copies src to dst until src reaches EOF (nil error) or either side
// fails, and returns the bytes written to dst. It is io.Copy(dst, src) for two TCP
// sockets, without a pipe held while src is idle. An error from a socket closed
// under it (abort) satisfies errors.Is(err, net.ErrClosed), as io.Copy's does.
func spliceStream(dst, src *net.TCPConn) (int64, error) {
	srcRC, err := src.SyscallConn()
	if err != nil {
		return 0, err
	}
	dstRC, err := dst.SyscallConn()
	if err != nil {
		return 0, err
	}
	s := spliceState{}
	s.fillFn, s.drainFn = s.fill, s.drain
	defer func() {
		if s.pipe != nil {
			putPipe(s.pipe)
		}
	}()
	var written int64
	for {
		if err := srcRC.Read(s.fillFn); err != nil {
			return written, err
		}
		if s.errno != nil {
			return written, os.NewSyscallError("splice", s.errno)
		}
		if s.n == 0 {
			return written, nil
		}
		s.pipe.n = s.n
		for s.pipe.n > 0 {
			if err := dstRC.Write(s.drainFn); err != nil {
				return written, err
			}
			if s.errno != nil {
				return written, os.NewSyscallError("splice", s.errno)
			}
			if s.n <= 0 {
				// A socket that takes nothing without saying why would loop forever.
				return written, io.ErrShortWrite
			}
			s.pipe.n -= s.n
			written += int64(s.n)
		}
	}
}

// spliceState is one direction's copy in progress. fill and drain run inside
// RawConn.Read and Write (bound once to fillFn and drainFn rather than per call);
// each leaves the outcome of its last splice in n and errno.
type spliceState struct {
	pipe            *splicePipe // nil while waiting for the source
	n               int
	errno           error
	fillFn, drainFn func(fd uintptr) bool
}

// fill moves what the source socket holds into a pipe, taking one first. When
// the socket has nothing, the pipe (empty) goes back to the pool before
// RawConn.Read waits for readability.
func (s *spliceState) fill(fd uintptr) bool {
	if s.pipe == nil {
		if s.pipe, s.errno = getPipe(); s.errno != nil {
			return true
		}
	}
	for {
		n, err := unix.Splice(int(fd), nil, s.pipe.w, nil, maxSplice, spliceFlags)
		switch err {
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			putPipe(s.pipe)
			s.pipe = nil
			return false
		}
		s.n, s.errno = int(n), err
		return true
	}
}

// drain moves the pipe's bytes to the destination socket, waiting (false) while
// the socket's send buffer is full.
func (s *spliceState) drain(fd uintptr) bool {
	for {
		n, err := unix.Splice(s.pipe.r, nil, int(fd), nil, s.pipe.n, spliceFlags)
		switch err {
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			return false
		}
		s.n, s.errno = int(n), err
		return true
	}
}
