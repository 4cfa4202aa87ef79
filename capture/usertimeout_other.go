//go:build !linux

package capture

import (
	"syscall"
	"time"
)

// userTimeoutApplies: only Linux has TCP_USER_TIMEOUT; elsewhere the
// system's retransmission limits apply.
const userTimeoutApplies = false

// setUserTimeout does nothing off Linux.
func setUserTimeout(syscall.RawConn, time.Duration) error { return nil }
