//go:build linux

package capture

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// autogroupsHere skips a test that needs autogroups that apply to
// processes it starts: on, and the test in the root CPU cgroup (its
// children are in the same one).
func autogroupsHere(t *testing.T) {
	t.Helper()
	b, err := os.ReadFile("/proc/sys/kernel/sched_autogroup_enabled")
	if err != nil || strings.TrimSpace(string(b)) != "1" {
		t.Skip("autogroups are off on this kernel: --tail-nice cannot apply")
	}
	cg, err := os.ReadFile("/proc/self/cgroup")
	require.NoError(t, err)
	if p, root := cpuCgroup(cg, func(dir string) ([]byte, error) {
		return os.ReadFile(filepath.Join("/sys/fs/cgroup", dir, "cgroup.controllers"))
	}); !root {
		t.Skipf("the test runs in CPU cgroup %s: autogroups do not apply", p)
	}
}

// autogroupOf is /proc/PID/autogroup ("/autogroup-N nice K").
func autogroupOf(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/autogroup")
	require.NoError(t, err)
	return strings.TrimSpace(string(b))
}

// The capture binary in a session of its own, tailing, sets its
// autogroup's nice value to --tail-nice (19 by default), and the rows
// still reach the stream; one that shares the test's session leaves the
// session's autogroup alone and says why in /status.
func TestTailNiceSetsTheAutogroup(t *testing.T) {
	autogroupsHere(t)
	t.Parallel()
	db := testenv.NewDatabase(t)
	testenv.Exec(t, db, `CREATE TABLE items (id int PRIMARY KEY, pad text); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT i, md5(i::text) FROM generate_series(1, 100) i`)
	bin := buildCapture(t)
	start := func(name string, session bool) (*capProc, *testenv.NATS) {
		port, err := testenv.FreePort()
		require.NoError(t, err)
		listen := "127.0.0.1:" + strconv.Itoa(port)
		dataDir := t.TempDir()
		env := map[string]string{
			"EPITAPH_SOURCE_URL": db, "EPITAPH_SLOT": dbName(t, db) + "_" + name, "EPITAPH_PUBLICATION": dbName(t, db) + "_" + name,
			"EPITAPH_SOURCE_NAME": name, "EPITAPH_TABLES": "public.items",
			"EPITAPH_DATA_DIR": dataDir, "EPITAPH_NATS_LISTEN": listen,
			"EPITAPH_TAIL_CPUS": "1", "EPITAPH_HEARTBEAT_INTERVAL": "1s",
		}
		p := startCapProcWith(t, "capture-"+name, bin, env, session)
		require.Eventually(t, func() bool { v, ok := p.active(); return ok && v == 1 }, 60*time.Second, 100*time.Millisecond)
		return p, &testenv.NATS{URL: "nats://" + listen, Opts: []nats.Option{natsconn.UserCredentials(broker.CaptureCreds(EmbeddedCredsDir(dataDir)))}}
	}
	status := func(p *capProc) Status {
		t.Helper()
		code, body := httpGet(t, p.url("/status"))
		require.Equal(t, http.StatusOK, code)
		var st Status
		require.NoError(t, json.Unmarshal([]byte(body), &st))
		return st
	}

	leader, srv := start("leader", true)
	var st Status
	require.Eventually(t, func() bool { st = status(leader); return st.CPUMode == CPUModeTail }, 30*time.Second, 50*time.Millisecond)
	require.Equal(t, 19, st.CPUNice)
	require.Empty(t, st.CPUNiceUnavailable)
	require.True(t, strings.HasSuffix(autogroupOf(t, leader.pid()), " nice 19"), "autogroup of the capture: %s", autogroupOf(t, leader.pid()))
	require.NotEqual(t, autogroupOf(t, os.Getpid()), autogroupOf(t, leader.pid()), "a group of its own")
	_, body := httpGet(t, leader.url("/metrics"))
	require.Contains(t, body, "\nepitaph_capture_autogroup_nice 19\n")
	testenv.Exec(t, db, `DELETE FROM items WHERE id <= 50`)
	nc, js := srv.Connect(t)
	defer nc.Close()
	require.Len(t, (&env{js: js}).deletes(t, "leader", 50), 50, "every row reaches the stream at nice 19")

	// The test's own session may run at any nice value (a CI runner's
	// may be niced): untouched means as it was before the capture began.
	ours := autogroupOf(t, os.Getpid())
	shared, _ := start("shared", false)
	require.Eventually(t, func() bool { st = status(shared); return st.CPUMode == CPUModeTail }, 30*time.Second, 50*time.Millisecond)
	require.Equal(t, 0, st.CPUNice)
	require.Contains(t, st.CPUNiceUnavailable, "does not lead its own session")
	require.Equal(t, ours, autogroupOf(t, shared.pid()), "the test's session's group, untouched")
	require.Equal(t, ours, autogroupOf(t, os.Getpid()))
}

// autogroupChildEnv makes the test binary run the child half of
// TestAutogroupNiceUnprivileged.
const autogroupChildEnv = "EPITAPH_TEST_AUTOGROUP_CHILD"

// An unprivileged process leading its session sets its autogroup's nice
// value to 19 and back to 0 (the catch-up mode's), the way autogroupNice
// does it; a set within 100 ms of the last fails (the kernel's rate limit
// for the unprivileged: applyNice tries again at the next check, a second
// later). The test binary runs itself as nobody in a new session.
func TestAutogroupNiceUnprivileged(t *testing.T) {
	if os.Getenv(autogroupChildEnv) == "1" {
		autogroupChild()
		return
	}
	autogroupsHere(t)
	self, err := os.Executable()
	require.NoError(t, err)
	dir, err := os.MkdirTemp("", "epitaph-autogroup-") // t.TempDir's parent is the owner's alone
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o755))
	bin := filepath.Join(dir, "capture.test")
	b, err := os.ReadFile(self)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(bin, b, 0o755))
	// Parallel only once the copy is written and closed: a test forking
	// meanwhile would inherit its open descriptor, and the exec would fail
	// with "text file busy".
	t.Parallel()
	cmd := exec.Command(bin, "-test.run=^TestAutogroupNiceUnprivileged$")
	cmd.Env = append(os.Environ(), autogroupChildEnv+"=1")
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	uid := os.Getuid()
	if uid == 0 {
		uid = 65534 // nobody: root may set any nice value at any rate
		cmd.SysProcAttr.Credential = &syscall.Credential{Uid: uint32(uid), Gid: 65534}
	}
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	require.GreaterOrEqual(t, len(lines), 4, "%s", out)
	require.Equal(t, "uid "+strconv.Itoa(uid), lines[0])
	require.True(t, strings.HasSuffix(lines[1], " nice 19"), "%s", out)
	require.Contains(t, lines[2], "again at once: resource temporarily unavailable", "%s", out)
	require.True(t, strings.HasSuffix(lines[3], " nice 0"), "back to 0 unprivileged: %s", out)
}

func autogroupChild() {
	fmt.Printf("uid %d\n", os.Getuid())
	set, why := autogroupNice()
	if set == nil {
		fmt.Println("unavailable:", why)
		os.Exit(1)
	}
	read := func() string {
		b, _ := os.ReadFile("/proc/self/autogroup")
		return strings.TrimSpace(string(b))
	}
	// The kernel's 100 ms is one for the whole machine: another process's
	// set (a capture of a parallel test) may hold it.
	retry := func(nice int) error {
		var err error
		for range 10 {
			if err = set(nice); err == nil || !errors.Is(err, syscall.EAGAIN) {
				return err
			}
			time.Sleep(120 * time.Millisecond)
		}
		return err
	}
	if err := retry(19); err != nil {
		fmt.Println("set 19:", err)
		os.Exit(1)
	}
	fmt.Println(read())
	if err := set(0); err != nil {
		fmt.Println("again at once:", errorText(err))
	} else {
		fmt.Println("again at once: no error")
	}
	time.Sleep(120 * time.Millisecond)
	if err := retry(0); err != nil {
		fmt.Println("set 0:", err)
		os.Exit(1)
	}
	fmt.Println(read())
	os.Exit(0)
}

// errorText is err's errno text (without the path).
func errorText(err error) string {
	var pe *os.PathError
	if errors.As(err, &pe) {
		return pe.Err.Error()
	}
	return err.Error()
}

// cpuCgroup: the root CPU cgroup in cgroup v1 and v2 texts.
func TestCPUCgroup(t *testing.T) {
	t.Parallel()
	none := func(string) ([]byte, error) { return []byte("memory pids"), nil }
	withCPU := func(dir string) ([]byte, error) {
		if dir == "/system.slice/epitaph.service" || dir == "/system.slice" {
			return []byte("cpuset cpu io memory pids"), nil
		}
		return []byte("memory pids"), nil
	}
	for _, c := range []struct {
		text     string
		ctl      func(string) ([]byte, error)
		wantPath string
		root     bool
	}{
		{"4:memory:/x\n1:cpu,cpuacct:/\n0::/\n", none, "/", true},                       // v1, cpu at the root
		{"1:cpu,cpuacct:/docker/abc\n0::/\n", none, "/docker/abc", false},               // v1, in a container's group
		{"0::/\n", none, "/", true},                                                     // v2 at the root
		{"0::/user.slice/session-3.scope\n", none, "/user.slice/session-3.scope", true}, // v2, no cpu controller below the root
		{"0::/system.slice/epitaph.service\n", withCPU, "/system.slice/epitaph.service", false},
		{"", none, "(unknown)", false},
	} {
		p, root := cpuCgroup([]byte(c.text), c.ctl)
		require.Equal(t, c.wantPath, p, "%q", c.text)
		require.Equal(t, c.root, root, "%q", c.text)
	}
	unreadable := func(string) ([]byte, error) { return nil, errors.New("no such file") }
	_, root := cpuCgroup([]byte("0::/a/b\n"), unreadable)
	require.False(t, root, "cannot tell: not applied")
}

func TestSessionOf(t *testing.T) {
	t.Parallel()
	sid, ok := sessionOf([]byte("4242 (a (strange) name) S 1 4242 4240 0 -1 4194560"))
	require.True(t, ok)
	require.Equal(t, 4240, sid)
	_, ok = sessionOf([]byte("4242 (cut"))
	require.False(t, ok)
}
