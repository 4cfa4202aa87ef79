package capture

import (
	"bytes"
	"fmt"
	"os"
	"path"
	"strconv"
	"strings"
)

// autogroupNice returns how to set the nice value of the process's
// scheduling group (its Linux autogroup, /proc/self/autogroup), or nil
// and why it would change nothing here. Linux shares the CPUs fairly
// between autogroups (one per session) before it looks at a thread's own
// nice value, so a capture in a session of its own competes with the
// source's backends (the postmaster's session) as an equal whatever its
// threads' nice values, and only its group's nice lowers it. It is set
// only when that group is the capture's alone (it leads its session, as a
// service or a process started with setsid does: a capture started from
// a shell would lower the shell's session with it), autogroups are on
// (kernel.sched_autogroup_enabled) and the process is scheduled in the
// root CPU cgroup (in any other, its cgroup's cpu.weight decides and the
// autogroup is not used). Raising the nice needs no privilege; lowering
// it back to 0 neither (only below 0 does).
func autogroupNice() (func(nice int) error, string) {
	b, err := os.ReadFile("/proc/sys/kernel/sched_autogroup_enabled")
	if err != nil {
		return nil, "the kernel has no autogroups"
	}
	if strings.TrimSpace(string(b)) != "1" {
		return nil, "autogroups are disabled (kernel.sched_autogroup_enabled = 0)"
	}
	stat, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		return nil, "cannot read /proc/self/stat"
	}
	if sid, ok := sessionOf(stat); !ok || sid != os.Getpid() {
		return nil, "the capture does not lead its own session (start it as a service, or with setsid), so its autogroup is shared"
	}
	cg, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return nil, "cannot read /proc/self/cgroup"
	}
	if p, ok := cpuCgroup(cg, func(dir string) ([]byte, error) {
		return os.ReadFile(path.Join("/sys/fs/cgroup", dir, "cgroup.controllers"))
	}); !ok {
		return nil, fmt.Sprintf("the capture is scheduled in CPU cgroup %s, whose cpu.weight decides, not its autogroup", p)
	}
	return func(nice int) error {
		return os.WriteFile("/proc/self/autogroup", []byte(strconv.Itoa(nice)), 0)
	}, ""
}

// sessionOf is the session id in a /proc/PID/stat text (the sixth field;
// the second, the command, is in parentheses and may hold anything).
func sessionOf(stat []byte) (int, bool) {
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(string(stat[i+1:])) // state, ppid, pgrp, session, ...
	if len(f) < 4 {
		return 0, false
	}
	sid, err := strconv.Atoi(f[3])
	return sid, err == nil
}

// cpuCgroup reports whether a /proc/self/cgroup text puts the process in
// the root CPU cgroup, with the cgroup path it found. cgroup v1: the line
// of the cpu controller. cgroup v2 ("0::path"): the task is scheduled in
// the nearest cgroup on its path whose cgroup.controllers (read by
// controllers, a path below /sys/fs/cgroup) has cpu; none but the root
// has it, or the path is the root: the root group.
func cpuCgroup(text []byte, controllers func(dir string) ([]byte, error)) (string, bool) {
	unified := ""
	for _, line := range strings.Split(strings.TrimSpace(string(text)), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		if parts[1] == "" {
			unified = parts[2]
			continue
		}
		for _, c := range strings.Split(parts[1], ",") {
			if c == "cpu" {
				return parts[2], parts[2] == "/"
			}
		}
	}
	if unified == "" {
		return "(unknown)", false
	}
	for dir := unified; dir != "/" && dir != "." && dir != ""; dir = path.Dir(dir) {
		b, err := controllers(dir)
		if err != nil {
			return unified, false // cannot tell
		}
		for _, c := range strings.Fields(string(b)) {
			if c == "cpu" {
				return unified, false
			}
		}
	}
	return unified, true
}
