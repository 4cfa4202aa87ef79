//go:build !linux

package testenv

import (
	"errors"
	"net"
	"time"
)

var errNoSocketFilter = errors.New("socket filters and TCP_USER_TIMEOUT are Linux's")

func silence(net.Conn) error                        { return errNoSocketFilter }
func unsilence(net.Conn) error                      { return nil }
func UserTimeoutOf(net.Conn) (time.Duration, error) { return 0, errNoSocketFilter }
