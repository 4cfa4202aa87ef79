package version

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/projection/snapshot"
)

// ErrNotReady is returned when promoting a version that is not ready.
var ErrNotReady = errors.New("version is not ready")

// Promote makes version the live version of its projection in ONE
// transaction: the previous live version becomes ready (it keeps
// consuming, so Rollback is instant and current), version becomes live,
// and the reader views archive.* are re-pointed at its schema. Readers see
// the old or the new version, never a missing or half-switched view. It
// refuses (ErrNotReady) unless the version is ready, without unresolved
// quarantine or unacknowledged gaps, and has complete every snapshot document the live version
// has complete (none of them pending or failed in it), unless force. The
// comparison with the live version is the caller's (see Compare).
func Promote(ctx context.Context, pool *pgxpool.Pool, name string, version int, force bool) (previous int, err error) {
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := LockVersions(ctx, tx); err != nil {
			return err
		}
		v, err := GetVersion(ctx, tx, name, version)
		if err != nil {
			return err
		}
		switch {
		case v.State == StateLive:
			return fmt.Errorf("%s v%d is live already", name, version)
		case !v.Active():
			return fmt.Errorf("%s v%d is %s: it cannot be promoted", name, version, v.State)
		case v.State != StateReady && !force:
			return fmt.Errorf("%s v%d is %s: %w (wait for it, or --force)", name, version, v.State, ErrNotReady)
		}
		if !force {
			if err := promotable(ctx, tx, v); err != nil {
				return err
			}
		}
		previous, err = switchLive(ctx, tx, name, version)
		return err
	})
	return previous, err
}

// promotable refuses (ErrNotReady) a version with unresolved quarantine,
// unacknowledged gaps, or snapshot documents behind the live version's.
func promotable(ctx context.Context, tx pgx.Tx, v Version) error {
	var open int
	if err := tx.QueryRow(ctx, `SELECT count(*) FROM epitaph.quarantine
		WHERE projection = $1 AND version = $2 AND status = 'open'`, v.Projection, v.Version).Scan(&open); err != nil {
		return fmt.Errorf("count quarantine: %w", err)
	}
	if open > 0 {
		return fmt.Errorf("%s v%d has %d unresolved quarantined events: %w", v.Projection, v.Version, open, ErrNotReady)
	}
	var gaps int
	if err := tx.QueryRow(ctx, `SELECT unacknowledged FROM epitaph.version_gaps($1)`, v.Schema).Scan(&gaps); err != nil {
		return fmt.Errorf("count gaps: %w", err)
	}
	if gaps > 0 {
		return fmt.Errorf("%s v%d has %d unacknowledged gaps (projector gaps): %w", v.Projection, v.Version, gaps, ErrNotReady)
	}
	return snapshotsCaughtUp(ctx, tx, v)
}

// snapshotsCaughtUp refuses (ErrNotReady) a version that has documents
// pending or failed which the live version has complete: readers would get
// "pending" (or nothing) where they had a document.
func snapshotsCaughtUp(ctx context.Context, tx pgx.Tx, v Version) error {
	var live Version
	vs, err := ListVersions(ctx, tx, v.Projection)
	if err != nil {
		return err
	}
	for _, o := range vs {
		if o.State == StateLive {
			live = o
		}
	}
	if live.Schema == "" {
		return nil
	}
	behind, err := snapshot.Behind(ctx, tx, v.Schema, live.Schema)
	if err != nil {
		return err
	}
	if behind > 0 {
		return fmt.Errorf("%s v%d has %d snapshot documents pending or failed that the live v%d has complete: %w (wait for its snapshot batcher, or --force)",
			v.Projection, v.Version, behind, live.Version, ErrNotReady)
	}
	return nil
}

// switchLive demotes the live version to ready and makes version live,
// re-pointing the views, inside tx (the caller holds the version lock).
func switchLive(ctx context.Context, tx pgx.Tx, name string, version int) (previous int, err error) {
	err = tx.QueryRow(ctx, `UPDATE epitaph.projection_versions SET state = 'ready', ready_at = now()
		WHERE projection = $1 AND state = 'live' RETURNING version`, name).Scan(&previous)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return 0, fmt.Errorf("demote the live version: %w", err)
	}
	tag, err := tx.Exec(ctx, `UPDATE epitaph.projection_versions SET state = 'live', live_at = now()
		WHERE projection = $1 AND version = $2`, name, version)
	if err != nil {
		return 0, fmt.Errorf("make %s v%d live: %w", name, version, err)
	}
	if tag.RowsAffected() != 1 {
		return 0, fmt.Errorf("make %s v%d live: %w", name, version, ErrNoVersion)
	}
	if err := PointViews(ctx, tx, version); err != nil {
		return 0, err
	}
	return previous, nil
}

// Rollback makes the previous live version (the active version other than
// the live one that was live most recently; it kept consuming) live again
// in one transaction with the view switch, and returns (from, to). Unless
// force, it refuses (ErrNotReady) as Promote does: a previous version not
// ready (behind, catching up), with unresolved quarantine, unacknowledged
// gaps or snapshot documents behind the live version's.
func Rollback(ctx context.Context, pool *pgxpool.Pool, name string, force bool) (from, to int, err error) {
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := LockVersions(ctx, tx); err != nil {
			return err
		}
		err := tx.QueryRow(ctx, `SELECT version FROM epitaph.projection_versions
			WHERE projection = $1 AND state IN ('ready', 'catching_up', 'building') AND live_at IS NOT NULL
			ORDER BY live_at DESC LIMIT 1`, name).Scan(&to)
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("rollback %s: no previous live version is still active", name)
		}
		if err != nil {
			return fmt.Errorf("find the previous live version: %w", err)
		}
		if !force {
			// What promote asks of a version: readers switched to one
			// behind, or missing events, would see an older archive.
			v, err := GetVersion(ctx, tx, name, to)
			if err != nil {
				return err
			}
			if v.State != StateReady {
				return fmt.Errorf("rollback %s to v%d: it is %s: %w (wait for it, or --force)", name, to, v.State, ErrNotReady)
			}
			if err := promotable(ctx, tx, v); err != nil {
				return fmt.Errorf("rollback %s to v%d: %w (or --force)", name, to, err)
			}
		}
		from, err = switchLive(ctx, tx, name, to)
		return err
	})
	return from, to, err
}
