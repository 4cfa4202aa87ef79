// Package migrations holds the SQL of Epitaph's control schema "epitaph" as
// numbered files (NNNN_name.sql) embedded in the binary, and applies them.
//
// Apply is idempotent and safe to run from several processes at once: it
// takes a session advisory lock, applies every file not yet recorded in
// epitaph.schema_migrations in version order, each in its own transaction
// together with its record, and releases the lock.
package migrations

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

//go:embed *.sql
var files embed.FS

// LockKey is the pg_advisory_lock key that serializes migrations
// ("epitaph" in ASCII).
const LockKey int64 = 0x65706974617068

// Migration is one embedded SQL file.
type Migration struct {
	Version int    `json:"version"`
	Name    string `json:"name"`
	SQL     string `json:"-"`
}

// All returns the embedded migrations in version order.
func All() ([]Migration, error) {
	entries, err := fs.ReadDir(files, ".")
	if err != nil {
		return nil, fmt.Errorf("read embedded migrations: %w", err)
	}
	var out []Migration
	seen := map[int]string{}
	for _, e := range entries {
		name := e.Name()
		if e.IsDir() || !strings.HasSuffix(name, ".sql") {
			continue
		}
		num, rest, ok := strings.Cut(strings.TrimSuffix(name, ".sql"), "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil || v <= 0 {
			return nil, fmt.Errorf("migration file %q: name must be NNNN_name.sql", name)
		}
		if prev, dup := seen[v]; dup {
			return nil, fmt.Errorf("migration version %d used by both %q and %q", v, prev, name)
		}
		seen[v] = name
		body, err := fs.ReadFile(files, name)
		if err != nil {
			return nil, fmt.Errorf("read migration %s: %w", name, err)
		}
		out = append(out, Migration{Version: v, Name: rest, SQL: string(body)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}

const createSchema = `
CREATE SCHEMA IF NOT EXISTS epitaph;
CREATE TABLE IF NOT EXISTS epitaph.schema_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)`

// Apply brings the control schema up to date. It is idempotent; concurrent
// callers wait for each other on an advisory lock.
func Apply(ctx context.Context, pool *pgxpool.Pool) error {
	all, err := All()
	if err != nil {
		return err
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("migrate: acquire connection: %w", err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock($1)`, LockKey); err != nil {
		return fmt.Errorf("migrate: take advisory lock: %w", err)
	}
	defer func() {
		// A fresh context: the lock must be released even when ctx is done.
		_, err := conn.Exec(context.WithoutCancel(ctx), `SELECT pg_advisory_unlock($1)`, LockKey)
		if err != nil {
			// The session may be broken; dropping it releases the lock.
			conn.Conn().Close(context.WithoutCancel(ctx))
		}
	}()
	if _, err := conn.Exec(ctx, createSchema); err != nil {
		return fmt.Errorf("migrate: create schema epitaph: %w", err)
	}
	applied := map[int]bool{}
	rows, err := conn.Query(ctx, `SELECT version FROM epitaph.schema_migrations`)
	if err != nil {
		return fmt.Errorf("migrate: read applied versions: %w", err)
	}
	vs, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return fmt.Errorf("migrate: read applied versions: %w", err)
	}
	for _, v := range vs {
		applied[int(v)] = true
	}
	if err := checkNotNewer(all, applied); err != nil {
		return err
	}
	for _, m := range all {
		if applied[m.Version] {
			continue
		}
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `INSERT INTO epitaph.schema_migrations (version, name) VALUES ($1, $2)`, m.Version, m.Name)
			return err
		})
		if err != nil {
			return fmt.Errorf("migrate: apply %04d_%s: %w", m.Version, m.Name, err)
		}
	}
	return nil
}

// Applied returns the versions recorded in epitaph.schema_migrations, in
// order (empty when the schema does not exist yet).
func Applied(ctx context.Context, db interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}) ([]int, error) {
	rows, err := db.Query(ctx, `SELECT version FROM epitaph.schema_migrations ORDER BY version`)
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42P01" { // undefined_table
			return nil, nil
		}
		return nil, fmt.Errorf("read applied migrations: %w", err)
	}
	vs, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return nil, fmt.Errorf("read applied migrations: %w", err)
	}
	out := make([]int, len(vs))
	for i, v := range vs {
		out[i] = int(v)
	}
	return out, nil
}

// NewerSchemaError: the target's control schema has migrations this binary
// does not know (a newer binary migrated it). Running an older binary
// against it, or migrating it, is refused: upgrade the binary.
type NewerSchemaError struct {
	// Unknown are the applied versions this binary does not have.
	Unknown []int
	// Latest is the newest version this binary knows.
	Latest int
}

func (e *NewerSchemaError) Error() string {
	return fmt.Sprintf("the epitaph schema is newer than this binary: migration(s) %v applied, this binary knows up to %d; use a newer binary", e.Unknown, e.Latest)
}

func checkNotNewer(all []Migration, applied map[int]bool) error {
	known := map[int]bool{}
	latest := 0
	for _, m := range all {
		known[m.Version] = true
		latest = max(latest, m.Version)
	}
	var unknown []int
	for v := range applied {
		if !known[v] {
			unknown = append(unknown, v)
		}
	}
	if len(unknown) == 0 {
		return nil
	}
	sort.Ints(unknown)
	return &NewerSchemaError{Unknown: unknown, Latest: latest}
}

// State is where a target's control schema stands against this binary.
type State struct {
	// Applied versions, in order (empty: the schema does not exist yet).
	Applied []int `json:"applied"`
	// Pending are the embedded migrations not applied yet, in order.
	Pending []Migration `json:"pending"`
	// Unknown are applied versions this binary does not have (the schema
	// is newer than the binary; Apply refuses).
	Unknown []int `json:"unknown"`
	// Latest is the newest version this binary knows.
	Latest int `json:"latest"`
}

// Status reads the applied migrations and compares them with the embedded
// ones. It changes nothing.
func Status(ctx context.Context, db interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}) (State, error) {
	all, err := All()
	if err != nil {
		return State{}, err
	}
	applied, err := Applied(ctx, db)
	if err != nil {
		return State{}, err
	}
	st := State{Applied: applied, Pending: []Migration{}, Unknown: []int{}}
	done := map[int]bool{}
	for _, v := range applied {
		done[v] = true
	}
	for _, m := range all {
		st.Latest = max(st.Latest, m.Version)
		if !done[m.Version] {
			st.Pending = append(st.Pending, m)
		}
	}
	var nerr *NewerSchemaError
	if errors.As(checkNotNewer(all, done), &nerr) {
		st.Unknown = nerr.Unknown
	}
	if st.Applied == nil {
		st.Applied = []int{}
	}
	return st, nil
}
