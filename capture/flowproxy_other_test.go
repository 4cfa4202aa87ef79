//go:build !linux

package capture

import (
	"errors"
	"net"
	"time"
)

var errNoSocketFilter = errors.New("socket filters and TCP_USER_TIMEOUT are Linux's")

func silence(net.Conn) error                        { return errNoSocketFilter }
func unsilence(net.Conn) error                      { return nil }
func userTimeoutOf(net.Conn) (time.Duration, error) { return 0, errNoSocketFilter }
