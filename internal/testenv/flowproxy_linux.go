//go:build linux

package testenv

import (
	"fmt"
	"net"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// silence attaches a socket filter to c that drops every packet arriving
// for it before TCP sees it: nothing is received or acknowledged.
func silence(c net.Conn) error {
	drop := []unix.SockFilter{{Code: unix.BPF_RET | unix.BPF_K, K: 0}}
	return sockopt(c, func(fd int) error {
		return unix.SetsockoptSockFprog(fd, unix.SOL_SOCKET, unix.SO_ATTACH_FILTER, &unix.SockFprog{Len: 1, Filter: &drop[0]})
	})
}

// unsilence removes silence's filter, if any.
func unsilence(c net.Conn) error {
	return sockopt(c, func(fd int) error {
		err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_DETACH_FILTER, 0)
		if err == unix.ENOENT {
			return nil // never silenced
		}
		return err
	})
}

// UserTimeoutOf reads TCP_USER_TIMEOUT of c (0: the system's default).
func UserTimeoutOf(c net.Conn) (time.Duration, error) {
	var ms int
	err := sockopt(c, func(fd int) error {
		var err error
		ms, err = unix.GetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT)
		return err
	})
	return time.Duration(ms) * time.Millisecond, err
}

func sockopt(c net.Conn, f func(fd int) error) error {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return fmt.Errorf("%T has no socket", c)
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return err
	}
	var ferr error
	if err := rc.Control(func(fd uintptr) { ferr = f(int(fd)) }); err != nil {
		return err
	}
	return ferr
}
