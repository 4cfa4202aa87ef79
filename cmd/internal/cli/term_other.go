//go:build !linux

package cli

import "os"

// IsTerminal reports whether v is a character device (on Linux, a tty).
func IsTerminal(v any) bool {
	f, ok := v.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
