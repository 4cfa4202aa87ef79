// Package lowgc lowers the garbage collector's target while a process
// carries a large row, so the row's copies that are garbage already (read
// buffers, the object store's chunks) are collected before the next copy is
// made: the heap stays near what is live (about twice the row) instead of
// growing to GOGC percent above it. The buffers of a large row are mostly
// pointer-free, so the extra collections cost little.
package lowgc

import (
	"runtime/debug"
	"sync"
)

// Percent is the GC target percentage while a large row is held.
const Percent = 10

var (
	mu    sync.Mutex
	holds int
	prev  int
)

// Hold lowers the GC target to Percent until every Hold is released (the
// goroutines of a process may carry large rows at once); release restores
// the target the process had. A process with GC off (GOGC=off) is left
// alone.
func Hold() (release func()) {
	mu.Lock()
	defer mu.Unlock()
	if holds == 0 {
		prev = debug.SetGCPercent(Percent)
		if prev < 0 || prev <= Percent {
			debug.SetGCPercent(prev)
		}
	}
	holds++
	var once sync.Once
	return func() {
		once.Do(func() {
			mu.Lock()
			defer mu.Unlock()
			holds--
			if holds == 0 {
				debug.SetGCPercent(prev)
			}
		})
	}
}
