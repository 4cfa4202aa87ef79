package main

import (
	"bytes"
	"compress/gzip"
	"errors"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// ballast is what TestHeapProfileHoldsThePeak allocates and keeps live.
var ballast [][]byte

//go:noinline
func heapProfileBallast(n int) [][]byte {
	b := make([][]byte, n)
	for i := range b {
		b[i] = make([]byte, 64<<10)
	}
	return b
}

// profileHolds reports whether the heap profile b names fn (in its string
// table, which lists the functions of the profile's stacks); an error if b
// is not a gzipped heap profile.
func profileHolds(b []byte, fn string) (bool, error) {
	zr, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		return false, err
	}
	raw, err := io.ReadAll(zr)
	if err != nil {
		return false, err
	}
	if !bytes.Contains(raw, []byte("inuse_space")) {
		return false, errors.New("not a heap profile")
	}
	return bytes.Contains(raw, []byte(fn)), nil
}

// TestHeapProfileHoldsThePeak: --heap-profile's file is rewritten when
// the live heap grows (here by 32 MiB allocated after the start), and not
// when it shrinks again, so a run's profile shows what was live at its
// peak; whole, no temporary left beside it.
func TestHeapProfileHoldsThePeak(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "heap.pprof")
	h, err := startHeapProfile(path)
	require.NoError(t, err)
	first, err := os.ReadFile(path)
	require.NoError(t, err)

	_, err = profileHolds(first, "heapProfileBallast") // an earlier run of the test may be in it
	require.NoError(t, err, "the file is a gzipped heap profile")

	ballast = heapProfileBallast(512)
	var peak []byte
	require.Eventually(t, func() bool {
		runtime.GC() // the live heap and the profile are as of the last collection
		b, err := os.ReadFile(path)
		if err != nil || bytes.Equal(b, first) {
			return false
		}
		ok, err := profileHolds(b, "heapProfileBallast")
		if ok && err == nil {
			peak = b
		}
		return ok && err == nil
	}, 60*time.Second, 50*time.Millisecond)

	ballast = nil
	runtime.GC()
	require.NoError(t, h.Stop()) // checks once more: the live heap is lower now
	last, err := os.ReadFile(path)
	require.NoError(t, err)
	require.Equal(t, peak, last, "the profile of the peak stays")
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Len(t, entries, 1, "only the profile is left")
}

// TestHeapProfileUnwritablePathFailsTheStart: a path that cannot be
// written is refused at the start, naming it.
func TestHeapProfileUnwritablePathFailsTheStart(t *testing.T) {
	path := filepath.Join(t.TempDir(), "no-such-dir", "heap.pprof")
	_, err := startHeapProfile(path)
	require.Error(t, err)
	require.Contains(t, err.Error(), "write heap profile")
	require.Contains(t, err.Error(), "no-such-dir")
}
