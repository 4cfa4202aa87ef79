// Package bench holds what Epitaph's benchmarks (internal/bench/capture,
// internal/bench/projector) and end-to-end tests (e2e/) share: building the
// real binaries, running them as child processes that can be SIGKILLed, and
// watching a stream and a process from outside.
package bench

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// ModuleRoot is the directory of the go.mod of the module being built.
func ModuleRoot() (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	mod := strings.TrimSpace(string(out))
	if mod == "" || mod == os.DevNull {
		return "", errors.New("not inside a Go module")
	}
	return filepath.Dir(mod), nil
}

// Build compiles the commands (e.g. "capture", "projector" for ./cmd/<name>)
// into dir and returns their paths by name.
func Build(ctx context.Context, dir string, names ...string) (map[string]string, error) {
	root, err := ModuleRoot()
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, n := range names {
		bin := filepath.Join(dir, n)
		cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "./cmd/"+n)
		cmd.Dir = root
		if b, err := cmd.CombinedOutput(); err != nil {
			return nil, fmt.Errorf("go build ./cmd/%s: %w\n%s", n, err, b)
		}
		out[n] = bin
	}
	return out, nil
}

// Proc is a child process with its output in a log file. Kill is a real
// SIGKILL: the process gets no chance to flush or confirm anything.
type Proc struct {
	Name    string
	LogPath string
	cmd     *exec.Cmd
	started time.Time
	done    chan struct{}
	mu      sync.Mutex
	err     error
}

// StartProc starts bin with args and extra environment (appended to the
// current one), output to logDir/<name>.log (appended across restarts).
func StartProc(name, bin string, env []string, logDir string, args ...string) (*Proc, error) {
	// Its own process group (a signal to the test's group does not reach
	// it), and killed if the test or bench process dies first (a go test
	// timeout), so nothing is left running.
	return startProc(name, bin, env, logDir, DiesWithParent(&syscall.SysProcAttr{Setpgid: true}), args...)
}

// StartSessionProc is StartProc with the process in a session of its own
// (setsid), as a service manager starts one: its own autogroup on Linux.
func StartSessionProc(name, bin string, env []string, logDir string, args ...string) (*Proc, error) {
	return startProc(name, bin, env, logDir, DiesWithParent(&syscall.SysProcAttr{Setsid: true}), args...)
}

func startProc(name, bin string, env []string, logDir string, attr *syscall.SysProcAttr, args ...string) (*Proc, error) {
	logPath := filepath.Join(logDir, name+".log")
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open log of %s: %w", name, err)
	}
	fmt.Fprintf(f, "\n==== start %s %s\n", name, time.Now().Format(time.RFC3339Nano))
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout = f
	cmd.Stderr = f
	cmd.SysProcAttr = attr
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &Proc{Name: name, LogPath: logPath, cmd: cmd, started: time.Now(), done: make(chan struct{})}
	go func() {
		err := cmd.Wait()
		f.Close()
		p.mu.Lock()
		p.err = err
		p.mu.Unlock()
		close(p.done)
	}()
	return p, nil
}

// Pid of the process.
func (p *Proc) Pid() int { return p.cmd.Process.Pid }

// Started is when the process was started.
func (p *Proc) Started() time.Time { return p.started }

// Exited reports whether the process has ended, and how.
func (p *Proc) Exited() (bool, error) {
	select {
	case <-p.done:
		p.mu.Lock()
		defer p.mu.Unlock()
		return true, p.err
	default:
		return false, nil
	}
}

// Done is closed when the process has ended.
func (p *Proc) Done() <-chan struct{} { return p.done }

// Kill sends SIGKILL and waits for the process to be gone.
func (p *Proc) Kill() {
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// Quit sends SIGQUIT, which makes a Go program print every goroutine's
// stack to its log and exit, and waits for it: the diagnosis of a stall.
func (p *Proc) Quit() {
	_ = p.cmd.Process.Signal(syscall.SIGQUIT)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		p.Kill()
	}
}

// Stop sends SIGTERM and waits up to timeout, then SIGKILL. It returns the
// process's exit error of a graceful stop (nil for exit status 0).
func (p *Proc) Stop(timeout time.Duration) error {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.err
	case <-time.After(timeout):
		p.Kill()
		return fmt.Errorf("%s did not stop within %s after SIGTERM; killed", p.Name, timeout)
	}
}

// PeakRSS is the process's peak resident set size in bytes (VmHWM).
func (p *Proc) PeakRSS() (int64, error) { return procStatus(p.Pid(), "VmHWM") }

// RSS is the process's current resident set size in bytes (VmRSS).
func (p *Proc) RSS() (int64, error) { return procStatus(p.Pid(), "VmRSS") }

func procStatus(pid int, field string) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, fmt.Errorf("read status of %d: %w", pid, err)
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		line := sc.Text()
		if rest, ok := strings.CutPrefix(line, field+":"); ok {
			f := strings.Fields(rest)
			if len(f) == 0 {
				break
			}
			kb, err := strconv.ParseInt(f[0], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("parse %s of %d: %w", field, pid, err)
			}
			return kb * 1024, nil
		}
	}
	return 0, fmt.Errorf("no %s in /proc/%d/status", field, pid)
}

// LogTail returns the last n bytes of the process's log, for failure
// messages.
func (p *Proc) LogTail(n int) string {
	b, err := os.ReadFile(p.LogPath)
	if err != nil {
		return ""
	}
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// BuildNATSServer compiles the nats-server of the module's dependency (the
// version the capture embeds) into dir: an external JetStream server for
// the benchmarks, in a process of its own.
func BuildNATSServer(ctx context.Context, dir string) (string, error) {
	root, err := ModuleRoot()
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "nats-server")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "github.com/nats-io/nats-server/v2")
	cmd.Dir = root
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build nats-server: %w\n%s", err, b)
	}
	return bin, nil
}

// CPU is the process's CPU seconds so far (user and system, with its reaped
// children).
func (p *Proc) CPU() (float64, error) { return ProcCPU(p.Pid()) }

// ProcCPU is a process's utime+stime+cutime+cstime in seconds (clock ticks
// of 1/100 s, from /proc/<pid>/stat).
func ProcCPU(pid int) (float64, error) {
	ticks, err := sumStatFields(pid, 11, 15)
	return float64(ticks) / 100, err
}

// MinorFaults is the process's minor page faults so far (with its reaped
// children), from /proc/<pid>/stat: each is a page of its own memory (its
// heap, a file it maps) it touched for the first time. Page cache the
// kernel fills inside the process's write calls is not counted.
func (p *Proc) MinorFaults() (int64, error) { return sumStatFields(p.Pid(), 7, 9) } // minflt, cminflt

// sumStatFields is the sum of the numeric fields [lo, hi) of procStatFields.
func sumStatFields(pid, lo, hi int) (int64, error) {
	f, err := procStatFields(pid)
	if err != nil {
		return 0, err
	}
	if len(f) < hi {
		return 0, fmt.Errorf("short /proc/%d/stat", pid)
	}
	var n int64
	for _, x := range f[lo:hi] {
		v, err := strconv.ParseInt(x, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc/%d/stat: %w", pid, err)
		}
		n += v
	}
	return n, nil
}

// PostgresCPU is the CPU seconds of the Postgres server whose data
// directory is dataDir: the postmaster with its reaped children and every
// live child (backends, walsenders).
func PostgresCPU(dataDir string) (float64, error) {
	b, err := os.ReadFile(filepath.Join(dataDir, "postmaster.pid"))
	if err != nil {
		return 0, fmt.Errorf("read postmaster.pid: %w", err)
	}
	pm, err := strconv.Atoi(strings.TrimSpace(strings.SplitN(string(b), "\n", 2)[0]))
	if err != nil {
		return 0, fmt.Errorf("postmaster.pid: %w", err)
	}
	total, err := ProcCPU(pm)
	if err != nil {
		return 0, err
	}
	dirs, err := os.ReadDir("/proc")
	if err != nil {
		return 0, fmt.Errorf("read /proc: %w", err)
	}
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		if f, err := procStatFields(pid); err == nil && len(f) > 1 && f[1] == strconv.Itoa(pm) {
			c, _ := ProcCPU(pid) // a backend may exit meanwhile
			total += c
		}
	}
	return total, nil
}

// procStatFields are the fields of /proc/<pid>/stat from the third (state)
// on: the command name, which may hold spaces, is cut off.
func procStatFields(pid int) ([]string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil, fmt.Errorf("read /proc/%d/stat: %w", pid, err)
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return nil, fmt.Errorf("bad /proc/%d/stat", pid)
	}
	return strings.Fields(s[i+1:]), nil
}
