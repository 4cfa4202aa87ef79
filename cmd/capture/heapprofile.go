package main

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime/metrics"
	"runtime/pprof"
	"time"
)

// heapProfiler is --heap-profile: it writes a pprof heap profile to its
// file whenever the live heap has grown a sixteenth past the one last
// written (checked every heapProfileEvery), so at the end of a run the
// file holds the heap at (near) its peak, which a profile written at exit
// would not show. The profile is the runtime's, as of the last collection
// (where a transaction's memory was).
type heapProfiler struct {
	path string
	stop chan struct{}
	done chan struct{}
	live []metrics.Sample
	last uint64 // live heap when the profile on file was written
	err  error  // the first write that failed (written by the loop only)
}

const heapProfileEvery = 100 * time.Millisecond

// startHeapProfile writes a first profile to path (so a path that cannot
// be written fails the start) and starts watching the live heap.
func startHeapProfile(path string) (*heapProfiler, error) {
	h := &heapProfiler{path: path, stop: make(chan struct{}), done: make(chan struct{}),
		live: []metrics.Sample{{Name: "/gc/heap/live:bytes"}}}
	if err := h.write(); err != nil {
		return nil, err
	}
	go h.loop()
	return h, nil
}

func (h *heapProfiler) loop() {
	defer close(h.done)
	tick := time.NewTicker(heapProfileEvery)
	defer tick.Stop()
	for {
		select {
		case <-h.stop:
			h.check()
			return
		case <-tick.C:
			h.check()
		}
	}
}

// check writes a profile if the live heap has grown past the last one's.
func (h *heapProfiler) check() {
	metrics.Read(h.live)
	if v := h.live[0].Value; v.Kind() == metrics.KindUint64 && v.Uint64() > h.last+h.last/16 {
		if err := h.write(); err != nil && h.err == nil {
			h.err = err
		}
	}
}

// write replaces the file with the heap profile as of now: written beside
// it and renamed, so the file is never half a profile.
func (h *heapProfiler) write() error {
	metrics.Read(h.live)
	if v := h.live[0].Value; v.Kind() == metrics.KindUint64 {
		h.last = v.Uint64()
	}
	f, err := os.CreateTemp(filepath.Dir(h.path), filepath.Base(h.path)+".*")
	if err != nil {
		return fmt.Errorf("write heap profile: %w", err)
	}
	err = pprof.Lookup("heap").WriteTo(f, 0)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), h.path)
	}
	if err != nil {
		_ = os.Remove(f.Name())
		return fmt.Errorf("write heap profile %s: %w", h.path, err)
	}
	return nil
}

// Stop checks once more, stops watching and returns the first failed
// write, if any.
func (h *heapProfiler) Stop() error {
	close(h.stop)
	<-h.done
	return h.err
}
