package cli

import (
	"os"

	"golang.org/x/sys/unix"
)

// IsTerminal reports whether v is a terminal (a tty, not merely a
// character device such as /dev/null).
func IsTerminal(v any) bool {
	f, ok := v.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}
