//go:build !linux

package bench

import "syscall"

// DiesWithParent returns a as it is: only Linux has a parent-death
// signal; elsewhere the bench's own cleanup stops its children.
func DiesWithParent(a *syscall.SysProcAttr) *syscall.SysProcAttr { return a }
