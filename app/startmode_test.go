package app

import (
	"runtime"
	"testing"
)

// The userspace mode keeps one P more than its event loops: GOMAXPROCS is raised
// when it is lower, never lowered.
func TestReserveEventLoopProcs(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	tests := []struct {
		name                 string
		gomaxprocs, loops    int
		wantLoops, wantProcs int
	}{
		{"automatic on one P", 1, 0, 1, 2},
		{"automatic on four Ps", 4, 0, 3, 4},
		{"more loops than Ps", 2, 3, 3, 4},
		{"fewer loops than Ps", 8, 2, 2, 8},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			runtime.GOMAXPROCS(tt.gomaxprocs)
			loops := reserveEventLoopProcs(tt.loops)
			if procs := runtime.GOMAXPROCS(0); loops != tt.wantLoops || procs != tt.wantProcs {
				t.Errorf("GOMAXPROCS %d, --event-loops %d: got %d loops, GOMAXPROCS %d; want %d, %d",
					tt.gomaxprocs, tt.loops, loops, procs, tt.wantLoops, tt.wantProcs)
			}
		})
	}
}
