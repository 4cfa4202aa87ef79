package bench

import "syscall"

// DiesWithParent has a child started with a killed when the process that
// started it dies first (a go test timeout, a SIGKILL of the bench), so
// nothing is left running: Linux's parent-death signal.
func DiesWithParent(a *syscall.SysProcAttr) *syscall.SysProcAttr {
	a.Pdeathsig = syscall.SIGKILL
	return a
}
