package cli

import (
	"fmt"

	"github.com/epitaph-dev/epitaph/internal/cpuprofile"
)

// StartCPUProfile writes a CPU profile to path (the --cpu-profile of both
// binaries) until the returned stop is called. The error names the flag.
func StartCPUProfile(path string) (stop func(), err error) {
	stop, err = cpuprofile.Start(path)
	if err != nil {
		return nil, fmt.Errorf("--cpu-profile: %w", err)
	}
	return stop, nil
}
