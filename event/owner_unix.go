//go:build unix

package event

import (
	"io/fs"
	"syscall"
)

// ownedByRoot reports whether the file is owned by uid 0.
func ownedByRoot(fi fs.FileInfo) bool {
	st, ok := fi.Sys().(*syscall.Stat_t)
	return ok && st.Uid == 0
}
