//go:build !linux

package pgdial

import (
	"syscall"
	"time"
)

// UserTimeoutApplies: only Linux has TCP_USER_TIMEOUT; elsewhere the
// system's retransmission limits apply.
const UserTimeoutApplies = false

// setUserTimeout does nothing off Linux.
func setUserTimeout(syscall.RawConn, time.Duration) error { return nil }
