package app

import (
	"fmt"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/socket"
)

// raiseFileLimit lifts the soft RLIMIT_NOFILE to the hard limit. Every proxied TCP
// connection holds two sockets (and a splice pipe per busy direction), and the
// default soft limit of 1024 would cap a busy node at a few hundred connections
// although the hard limit allows far more. Raising the soft limit needs no
// privilege. Go's runtime does the same at start on current versions; doing it
// here keeps the guarantee independent of that and states it in the log. Failing to raise it is not fatal: the accept loops back off when
// descriptors run out. The result is logged either way, so an operator who sees
// accept backoffs can tell which limit was in force. Of the soft limit, the
// userspace mode's data path leaves socket.Reserve to the control plane (the
// source's watch, the metrics and health servers, the syncs), so no flood of
// connections can take it all.
func raiseFileLimit() {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		klog.ErrorS(err, "Reading the open file limit (RLIMIT_NOFILE)")
		return
	}
	if lim.Cur < lim.Max {
		want := lim
		want.Cur = lim.Max
		if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &want); err != nil {
			klog.ErrorS(err, "Raising the open file limit (RLIMIT_NOFILE) failed", "soft", limitString(lim.Cur), "hard", limitString(lim.Max))
			return
		}
		lim = want
	}
	klog.InfoS("Open file limit (RLIMIT_NOFILE)", "soft", limitString(lim.Cur), "hard", limitString(lim.Max),
		"reservedForControlPlane", socket.Reserve(lim.Cur))
}

func limitString(v uint64) string {
	if v == unix.RLIM_INFINITY {
		return "unlimited"
	}
	return fmt.Sprint(v)
}
