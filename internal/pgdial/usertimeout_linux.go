package pgdial

import (
	"fmt"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// UserTimeoutApplies: Set gives sockets TCP_USER_TIMEOUT here.
const UserTimeoutApplies = true

// setUserTimeout sets TCP_USER_TIMEOUT on the socket rc.
func setUserTimeout(rc syscall.RawConn, timeout time.Duration) error {
	var serr error
	err := rc.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(timeout.Milliseconds()))
	})
	if err == nil && serr != nil {
		err = fmt.Errorf("set TCP_USER_TIMEOUT to %v: %w", timeout, serr)
	}
	return err
}
