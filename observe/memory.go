package observe

import (
	"net/http"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
)

// MemoryState is /debug/memory's answer: what the process holds, as the Go
// runtime and the kernel count it.
type MemoryState struct {
	// Collected is true when a garbage collection ran just before the reading
	// and the memory it freed went back to the kernel (?gc=1): the heap
	// figures are then what is live, and RSS holds no freed heap.
	Collected bool `json:"collected"`
	// HeapAllocBytes are the bytes of heap objects not yet freed (after a
	// collection: live), HeapObjects their number.
	HeapAllocBytes uint64 `json:"heapAllocBytes"`
	HeapObjects    uint64 `json:"heapObjects"`
	// HeapInuseBytes are the bytes of the heap's spans that hold objects.
	HeapInuseBytes uint64 `json:"heapInuseBytes"`
	// SysBytes is what the runtime obtained from the kernel, mapped or not.
	SysBytes uint64 `json:"sysBytes"`
	// RSSBytes is the process's resident memory (/proc/self/statm); 0 where
	// it cannot be read.
	RSSBytes   int64 `json:"rssBytes"`
	Goroutines int   `json:"goroutines"`
}

// ReadMemory reads the process's memory; collect first runs two garbage
// collections and returns the freed memory to the kernel (debug.FreeOSMemory,
// the second), so that what remains is what the process holds on to: objects
// in a sync.Pool survive one collection (in its victim cache), not two. A
// collection stops the world for a moment: it is for measuring, not for every
// scrape.
func ReadMemory(collect bool) MemoryState {
	if collect {
		runtime.GC()
		debug.FreeOSMemory()
	}
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return MemoryState{
		Collected:      collect,
		HeapAllocBytes: ms.HeapAlloc,
		HeapObjects:    ms.HeapObjects,
		HeapInuseBytes: ms.HeapInuse,
		SysBytes:       ms.Sys,
		RSSBytes:       residentBytes(),
		Goroutines:     runtime.NumGoroutine(),
	}
}

// residentBytes is the resident set of this process, from its second field of
// /proc/self/statm (in pages); 0 when it cannot be read.
func residentBytes() int64 {
	b, err := os.ReadFile("/proc/self/statm")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) < 2 {
		return 0
	}
	pages, err := strconv.ParseInt(f[1], 10, 64)
	if err != nil {
		return 0
	}
	return pages * int64(os.Getpagesize())
}

// serveMemory answers /debug/memory[?gc=1] with ReadMemory's MemoryState.
func serveMemory(w http.ResponseWriter, r *http.Request) {
	collect := false
	switch v := r.URL.Query().Get("gc"); v {
	case "", "0", "false":
	case "1", "true":
		collect = true
	default:
		http.Error(w, "gc: want 1 (collect first) or 0", http.StatusBadRequest)
		return
	}
	writeJSON(w, ReadMemory(collect))
}
