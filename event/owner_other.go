//go:build !unix

package event

import "io/fs"

// ownedByRoot is false where file ownership is not a uid.
func ownedByRoot(fs.FileInfo) bool { return false }
