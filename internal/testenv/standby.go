package testenv

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// NewStandby makes a physical standby of pg (a private server of the test,
// NewPostgres or NewPostgresMajor) and stops it when the test ends. The
// standby is seeded by copying pg's data directory while pg is cleanly
// stopped (the npm servers have no pg_basebackup), streams from pg through
// the physical slot standby_<port>, and has hot_standby_feedback on. On
// PostgreSQL 17+ it syncs pg's failover slots (sync_replication_slots), and
// pg holds its logical walsenders back until the standby has the WAL
// (synchronized_standby_slots). pg is restarted on the way.
func (pg *Postgres) NewStandby(tb testing.TB) *Postgres {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, pg.URL("postgres"))
	if err != nil {
		tb.Fatalf("testenv: connect: %v", err)
	}
	var version int
	if err := conn.QueryRow(ctx, `SELECT current_setting('server_version_num')::int`).Scan(&version); err != nil {
		tb.Fatalf("testenv: server version: %v", err)
	}
	port, err := FreePort()
	if err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	slot := "standby_" + strconv.Itoa(port)
	if _, err := conn.Exec(ctx, `SELECT pg_create_physical_replication_slot($1)`, slot); err != nil {
		tb.Fatalf("testenv: create physical slot: %v", err)
	}
	conn.Close(ctx)
	if version >= 170000 {
		if err := pg.SetConfig(fmt.Sprintf("synchronized_standby_slots = '%s'", slot)); err != nil {
			tb.Fatalf("testenv: %v", err)
		}
	}
	if err := pg.Stop(); err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	root, err := os.MkdirTemp("", "epitaph-pg-")
	if err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	sb := &Postgres{BinDir: pg.BinDir, DataDir: filepath.Join(root, "data"), Host: pg.Host, Port: port,
		cred: pg.cred, logFile: filepath.Join(root, "postgres.log")}
	tb.Cleanup(func() {
		_ = sb.Stop()
		_ = os.RemoveAll(root)
	})
	if err := os.WriteFile(filepath.Join(root, ownerFile), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	// cp -a keeps the owner (the postgres user) and the modes initdb set.
	if out, err := exec.Command("cp", "-a", pg.DataDir, sb.DataDir).CombinedOutput(); err != nil {
		tb.Fatalf("testenv: copy data directory: %v\n%s", err, out)
	}
	if err := pg.Start(); err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	if sb.cred != nil {
		if err := os.Chown(root, int(sb.cred.Uid), int(sb.cred.Gid)); err != nil {
			tb.Fatalf("testenv: %v", err)
		}
		if err := os.Chmod(root, 0o755); err != nil {
			tb.Fatalf("testenv: %v", err)
		}
	}
	lines := []string{
		fmt.Sprintf("port = %d", port),
		fmt.Sprintf("unix_socket_directories = '%s'", root),
		fmt.Sprintf("primary_conninfo = 'host=%s port=%d user=postgres dbname=postgres application_name=%s'", pg.Host, pg.Port, slot),
		fmt.Sprintf("primary_slot_name = '%s'", slot),
		"hot_standby = on",
		"hot_standby_feedback = on",
	}
	if version >= 170000 {
		// The copy has the primary's synchronized_standby_slots, naming a
		// slot the standby lacks: promoted, it would hold back its own
		// logical walsenders for good.
		lines = append(lines, "sync_replication_slots = on", "synchronized_standby_slots = ''")
	}
	if err := sb.SetConfig(lines...); err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	signal := filepath.Join(sb.DataDir, "standby.signal")
	if err := os.WriteFile(signal, nil, 0o600); err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	if sb.cred != nil {
		_ = os.Chown(signal, int(sb.cred.Uid), int(sb.cred.Gid))
	}
	if err := sb.Start(); err != nil {
		tb.Fatalf("testenv: start standby: %v", err)
	}
	return sb
}

// Promote promotes a standby to a primary and waits until it is one.
func (pg *Postgres) Promote() error {
	if out, err := pg.run("pg_ctl", "-D", pg.DataDir, "-w", "-t", "60", "promote"); err != nil {
		return fmt.Errorf("pg_ctl promote: %v\n%s", err, out)
	}
	return nil
}

// Kill stops the server at once (immediate mode: no shutdown checkpoint,
// as after a crash); Start starts it again with crash recovery.
func (pg *Postgres) Kill() error {
	pg.mu.Lock()
	defer pg.mu.Unlock()
	if !pg.running {
		return nil
	}
	if out, err := pg.run("pg_ctl", "-D", pg.DataDir, "-m", "immediate", "-w", "-t", "60", "stop"); err != nil {
		return fmt.Errorf("pg_ctl stop -m immediate: %v\n%s", err, out)
	}
	pg.running = false
	return nil
}
