package projection

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/progress"
)

// Version states (DESIGN.md section 4).
const (
	StateBuilding   = "building"
	StateCatchingUp = "catching_up"
	StateReady      = "ready"
	StateLive       = "live"
	StateRetired    = "retired"
)

// States lists every version state in lifecycle order.
var States = []string{StateBuilding, StateCatchingUp, StateReady, StateLive, StateRetired}

// Version is one row of epitaph.projection_versions.
type Version struct {
	Projection  string
	Version     int
	State       string
	Schema      string
	Partitions  int
	BoundarySeq *int64
	CreatedAt   time.Time
}

// Active reports whether workers run the version (every state but retired).
func (v Version) Active() bool { return v.State != StateRetired }

// ListVersions returns the versions of a projection (all projections when
// projection is ""), by projection and version.
func ListVersions(ctx context.Context, db progress.DB, projection string) ([]Version, error) {
	rows, err := db.Query(ctx, `
		SELECT projection, version, state, schema_name, COALESCE(partitions, 0), boundary_seq, created_at
		FROM epitaph.projection_versions
		WHERE $1 = '' OR projection = $1
		ORDER BY projection, version`, projection)
	if err != nil {
		return nil, fmt.Errorf("list versions: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Version, error) {
		var v Version
		var n, p int32
		err := r.Scan(&v.Projection, &n, &v.State, &v.Schema, &p, &v.BoundarySeq, &v.CreatedAt)
		v.Version, v.Partitions = int(n), int(p)
		return v, err
	})
	if err != nil {
		return nil, fmt.Errorf("list versions: %w", err)
	}
	return out, nil
}

// versionLockKey serializes creation of versions across workers.
const versionLockKey int64 = 0x65706974617069

// EnsureArchive makes sure the archive projection has a version: when none
// exists, version 1 is created live (schema archive_v1, its progress rows,
// the reader views) in one transaction. For every active version it
// (re)creates the version's tables idempotently. Safe to run from several
// workers at once.
func EnsureArchive(ctx context.Context, db interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}, partitions int, extraDDL func(schema string) string) error {
	return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, versionLockKey); err != nil {
			return fmt.Errorf("lock versions: %w", err)
		}
		vs, err := ListVersions(ctx, tx, ArchiveProjection)
		if err != nil {
			return err
		}
		if len(vs) == 0 {
			if partitions < 1 {
				return errors.New("create archive v1: partition count unknown")
			}
			_, err := tx.Exec(ctx, `
				INSERT INTO epitaph.projection_versions
				    (projection, version, state, schema_name, partitions, boundary_seq, live_at, config)
				VALUES ($1, 1, 'live', $2, $3, 0, now(), '{"created":"first run"}')`,
				ArchiveProjection, ArchiveSchema(1), partitions)
			if err != nil {
				return fmt.Errorf("create archive v1: %w", err)
			}
			vs, err = ListVersions(ctx, tx, ArchiveProjection)
			if err != nil {
				return err
			}
		}
		live := 0
		for _, v := range vs {
			if !v.Active() {
				continue
			}
			ddl := archiveDDL(v.Schema)
			if extraDDL != nil {
				ddl += extraDDL(v.Schema)
			}
			if _, err := tx.Exec(ctx, ddl); err != nil {
				return fmt.Errorf("create tables of %s: %w", v.Schema, err)
			}
			n := v.Partitions
			if n == 0 {
				n = partitions
			}
			if err := progress.Ensure(ctx, tx, v.Projection, v.Version, n); err != nil {
				return err
			}
			if v.State == StateLive {
				live = v.Version
			}
		}
		if live > 0 {
			return PointViews(ctx, tx, live)
		}
		return nil
	})
}
