package version

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/progress"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// Version states. A version moves
// building -> catching_up -> ready -> live -> retired; promotion turns the
// previous live version back to ready (it keeps consuming, so a rollback is
// instant and current). failed: its schema could not be created; workers
// do not run it; retire it.
const (
	StateBuilding   = "building"
	StateCatchingUp = "catching_up"
	StateReady      = "ready"
	StateLive       = "live"
	StateRetired    = "retired"
	StateFailed     = "failed"
)

// States lists every version state in lifecycle order.
var States = []string{StateBuilding, StateCatchingUp, StateReady, StateLive, StateRetired, StateFailed}

// Version is one row of epitaph.projection_versions.
type Version struct {
	Projection string
	Version    int
	State      string
	Schema     string
	Partitions int
	// BoundarySeq is the stream's last sequence when the version was
	// created: the version is building until every partition has applied
	// its messages up to it.
	BoundarySeq *int64
	// BoundaryLSN is the source position of the message at BoundarySeq.
	BoundaryLSN event.LSN
	// FromTime is set for a partial rebuild (from the first message of
	// each partition stored at or after it).
	FromTime     *time.Time
	CreatedAt    time.Time
	BuildingAt   *time.Time
	CatchingUpAt *time.Time
	ReadyAt      *time.Time
	LiveAt       *time.Time
	RetiredAt    *time.Time
	FailedAt     *time.Time
	FailedReason string
	// Period is the rows table's partition period (archive.PeriodDay,
	// PeriodWeek or PeriodMonth), stored in the version's config
	// ("archive_partition"); archive.DefaultPeriod when the config names
	// none.
	Period string
}

// VersionKey identifies one version of a projection: the key of maps
// per version (a comparable struct instead of [2]any).
type VersionKey struct {
	Projection string
	Version    int
}

// Key returns the version's map key.
func (v Version) Key() VersionKey { return VersionKey{Projection: v.Projection, Version: v.Version} }

// Active reports whether workers run the version (every state but retired
// and failed).
func (v Version) Active() bool { return v.State != StateRetired && v.State != StateFailed }

// ListVersions returns the versions of a projection (all projections when
// projection is ""), by projection and version.
func ListVersions(ctx context.Context, db progress.DB, projection string) ([]Version, error) {
	rows, err := db.Query(ctx, `
		SELECT projection, version, state, schema_name, COALESCE(partitions, 0), boundary_seq, boundary_lsn::text,
		       from_time, created_at, building_at, catching_up_at, ready_at, live_at, retired_at, failed_at,
		       COALESCE(failed_reason, ''), COALESCE(config->>'archive_partition', '')
		FROM epitaph.projection_versions
		WHERE $1 = '' OR projection = $1
		ORDER BY projection, version`, projection)
	if err != nil {
		return nil, fmt.Errorf("list versions: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Version, error) {
		var v Version
		var n, p int32
		var lsn *string
		err := r.Scan(&v.Projection, &n, &v.State, &v.Schema, &p, &v.BoundarySeq, &lsn, &v.FromTime, &v.CreatedAt,
			&v.BuildingAt, &v.CatchingUpAt, &v.ReadyAt, &v.LiveAt, &v.RetiredAt, &v.FailedAt, &v.FailedReason, &v.Period)
		if err != nil {
			return v, err
		}
		if v.Period, err = archive.ParsePeriod(v.Period); err != nil {
			v.Period = archive.DefaultPeriod // a hand-edited config: the default, not a dead worker
		}
		v.Version, v.Partitions = int(n), int(p)
		if lsn != nil {
			if v.BoundaryLSN, err = event.ParseLSN(*lsn); err != nil {
				return v, err
			}
		}
		return v, nil
	})
	if err != nil {
		return nil, fmt.Errorf("list versions: %w", err)
	}
	return out, nil
}

// GetVersion returns one version; ErrNoVersion when it does not exist.
func GetVersion(ctx context.Context, db progress.DB, projection string, version int) (Version, error) {
	vs, err := ListVersions(ctx, db, projection)
	if err != nil {
		return Version{}, err
	}
	for _, v := range vs {
		if v.Version == version {
			return v, nil
		}
	}
	return Version{}, fmt.Errorf("%s v%d: %w", projection, version, ErrNoVersion)
}

// ErrNoVersion is returned for a version that does not exist.
var ErrNoVersion = errors.New("no such version")

// versionLockKey serializes creation of versions and every state change
// that re-points the reader views across workers and operators.
const versionLockKey int64 = 0x65706974617069

// LockVersions takes the version lock for the rest of tx: it serializes
// creating versions and every state change that re-points the reader
// views (package version).
func LockVersions(ctx context.Context, tx pgx.Tx) error {
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, versionLockKey); err != nil {
		return fmt.Errorf("lock versions: %w", err)
	}
	return nil
}

// EnsureArchive makes sure the archive projection has a version: when none
// exists, version 1 is created live (schema archive_v1, its progress rows,
// the reader views) in one transaction. For every active version it
// (re)creates the version's tables idempotently; a version other than the
// live one whose tables cannot be created (the DDL is rejected) is marked
// failed rather than blocking the others. Safe to run from several workers
// at once.
func EnsureArchive(ctx context.Context, db interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}, partitions int, extraDDL func(schema string) string) error {
	_, err := EnsureArchiveVersions(ctx, db, partitions, extraDDL)
	return err
}

// EnsureArchiveVersions is EnsureArchive, returning the versions it processed, with
// the states it gave them. A caller that remembers which versions it has
// ensured must remember these, not a list read after the commit: a version
// inserted in between would be remembered without having been ensured.
func EnsureArchiveVersions(ctx context.Context, db interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}, partitions int, extraDDL func(schema string) string) ([]Version, error) {
	return EnsureArchiveVersionsFrom(ctx, db, partitions, "", extraDDL, nil)
}

// EnsureArchiveVersionsFrom is EnsureArchiveVersions creating version 1
// (when there is none) with the rows partitioned by period (""
// archive.DefaultPeriod; an existing version keeps its own); when it
// creates version 1 and head is not nil (StreamHead: the stream lost its
// beginning), version 1 records the removed head as a removed_from_stream
// gap, as a rebuild does: a new target must not take a stream that starts
// late for the whole history.
func EnsureArchiveVersionsFrom(ctx context.Context, db interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}, partitions int, period string, extraDDL func(schema string) string, head *Head) ([]Version, error) {
	period, err := archive.ParsePeriod(period)
	if err != nil {
		return nil, err
	}
	var ensured []Version
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if err := LockVersions(ctx, tx); err != nil {
			return err
		}
		vs, err := ListVersions(ctx, tx, archive.Projection)
		if err != nil {
			return err
		}
		created := len(vs) == 0
		if created {
			if partitions < 1 {
				return errors.New("create archive v1: partition count unknown")
			}
			_, err := tx.Exec(ctx, `
				INSERT INTO epitaph.projection_versions
				    (projection, version, state, schema_name, partitions, boundary_seq, live_at, config)
				VALUES ($1, 1, 'live', $2, $3, 0, now(), jsonb_build_object('created', 'first run', 'archive_partition', $4::text))`,
				archive.Projection, archive.Schema(1), partitions, period)
			if err != nil {
				return fmt.Errorf("create archive v1: %w", err)
			}
			vs, err = ListVersions(ctx, tx, archive.Projection)
			if err != nil {
				return err
			}
		}
		live := 0
		for i, v := range vs {
			if !v.Active() {
				continue
			}
			if err := CreateVersionTables(ctx, tx, v, extraDDL); err != nil {
				if !ddlRejected(err) || v.State == StateLive {
					return err
				}
				if _, err := tx.Exec(ctx, `UPDATE epitaph.projection_versions
					SET state = 'failed', failed_at = now(), failed_reason = $3
					WHERE projection = $1 AND version = $2`, v.Projection, v.Version, quarantine.Sanitize(err)); err != nil {
					return fmt.Errorf("mark %s v%d failed: %w", v.Projection, v.Version, err)
				}
				vs[i].State = StateFailed
				continue
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
		ensured = vs
		if created && head != nil {
			p := &rebuildPlan{head: &removedGap{toSeq: head.ToSeq, toLSN: head.ToLSN}}
			if err := p.position(ctx, tx, vs[0]); err != nil {
				return err
			}
		}
		if live > 0 {
			return PointViews(ctx, tx, live)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return ensured, nil
}

// CreateVersionTables runs the projection's DDL (and extraDDL, e.g. the
// snapshot tables) for the version's schema in a savepoint (so a rejected
// DDL leaves tx usable), and creates the partitions of the current and
// the next period. Idempotent.
func CreateVersionTables(ctx context.Context, tx pgx.Tx, v Version, extraDDL func(schema string) string) error {
	ddl := archive.DDL(v.Schema)
	if extraDDL != nil {
		ddl += extraDDL(v.Schema)
	}
	sp, err := tx.Begin(ctx)
	if err != nil {
		return fmt.Errorf("savepoint: %w", err)
	}
	if _, err := sp.Exec(ctx, ddl); err != nil {
		_ = sp.Rollback(ctx)
		return fmt.Errorf("create tables of %s: %w", v.Schema, err)
	}
	if _, err := EnsurePartitionsAhead(ctx, sp, v, time.Now()); err != nil {
		_ = sp.Rollback(ctx)
		return err
	}
	return sp.Commit(ctx)
}

// ddlRejected reports whether the server rejected the DDL itself (syntax,
// undefined or duplicate object, privileges, data or constraint errors), as
// opposed to a connection or concurrency failure worth retrying.
func ddlRejected(err error) bool {
	var pg *pgconn.PgError
	if !errors.As(err, &pg) || len(pg.Code) != 5 {
		return false
	}
	switch pg.Code[:2] {
	case "42", "22", "23", "54", "2B", "0A":
		return true
	}
	return false
}

// EnsurePartitionsAhead creates, in tx, the version's partitions of the
// period holding now and of the next one (none for a rows table that is
// not partitioned), and returns their starts.
func EnsurePartitionsAhead(ctx context.Context, tx pgx.Tx, v Version, now time.Time) ([]time.Time, error) {
	period := v.Period
	if period == "" {
		period = archive.DefaultPeriod
	}
	cur := archive.PeriodStart(period, now)
	return archive.EnsurePartitions(ctx, tx, v.Schema, period, cur, archive.PeriodEnd(period, cur))
}
