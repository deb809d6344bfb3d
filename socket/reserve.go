package socket

import (
	"fmt"
	"math"
	"syscall"

	"golang.org/x/sys/unix"
)

// The data path never takes the process's last descriptors. However many
// connections arrive, the rest of the process - the API or manifest watch, the
// metrics and health servers, the syncs with their new proxy sockets and rule
// commands - keeps a reserve to open what it needs, so a flood of connections
// cannot blind the proxy to its own configuration, nor its operator to it.
//
// The kernel gives every new descriptor the lowest free number: a descriptor
// numbered n means that 0 to n-1 are all open. So the data path keeps no
// descriptor numbered at or above a ceiling, the open-file limit less the
// reserve: the accept, dial or pipe that gets one closes it again at once (a
// client is reset, and accepting backs off, as when the limit itself is hit).
// The numbers above the ceiling are then the rest of the process's, whatever
// the data path holds, and checking costs a comparison, no system call.

// ReservedDescriptors is how many descriptors of the open-file limit
// (RLIMIT_NOFILE) the data path leaves to the rest of the process; a limit
// under four times as many keeps a quarter of it instead (Reserve).
const ReservedDescriptors = 256

// Reserve returns how many descriptors of an open-file limit the data path
// leaves to the rest of the process.
func Reserve(limit uint64) int {
	return int(min(ReservedDescriptors, limit/4))
}

// CurrentReserve is Reserve of the process's soft open-file limit now
// (ReservedDescriptors when it is unlimited or cannot be read).
func CurrentReserve() int {
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil || rl.Cur == unix.RLIM_INFINITY {
		return ReservedDescriptors
	}
	return Reserve(rl.Cur)
}

// descriptorCeiling returns the lowest descriptor number the data path may
// not keep under the process's current soft open-file limit.
func descriptorCeiling() int {
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil || rl.Cur == unix.RLIM_INFINITY || rl.Cur > math.MaxInt32 {
		return math.MaxInt32
	}
	return int(rl.Cur) - Reserve(rl.Cur)
}

// keep reports whether the data path may keep descriptor fd, opened on this
// loop; one it may not is the caller's to close. The limit is read again when
// a descriptor reaches the ceiling, in case it was raised since.
func (l *loop) keep(fd int) bool {
	if fd < l.fdCeiling {
		return true
	}
	l.fdCeiling = descriptorCeiling()
	return fd < l.fdCeiling
}

// reserveError is the error of a descriptor the data path opened but may not
// keep. It is the process short of descriptors (EMFILE) for the data path, and
// is handled as such.
type reserveError struct{ ceiling int }

func (e reserveError) Error() string {
	return fmt.Sprintf("%v: the descriptors from %d up are kept for the control plane", syscall.EMFILE, e.ceiling)
}

func (e reserveError) Unwrap() error { return syscall.EMFILE }
