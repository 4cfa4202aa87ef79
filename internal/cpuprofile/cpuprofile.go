// Package cpuprofile writes a CPU profile of the process to a file: the
// binaries' --cpu-profile and the benches' profiling flags.
package cpuprofile

import (
	"os"
	"runtime/pprof"
)

// Start writes a CPU profile to path until the returned stop is called
// (stop closes the file).
func Start(path string) (stop func(), err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}, nil
}
