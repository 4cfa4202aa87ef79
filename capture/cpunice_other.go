//go:build !linux

package capture

// autogroupNice: autogroups are Linux's (cpunice_linux.go).
func autogroupNice() (func(nice int) error, string) {
	return nil, "autogroups are Linux's"
}
