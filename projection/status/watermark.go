package status

import (
	"context"
	"fmt"
	"time"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/progress"
)

// Reflects reports how far the live version of projection reflects the
// source: the lowest watermark (source_lsn) over its partitions, and
// whether every partition has one. Watermarks advance with commits,
// marks and heartbeats, which the capture fans out to every partition, so
// an idle partition does not hold it back.
func Reflects(ctx context.Context, db progress.DB, projection string) (event.LSN, bool, error) {
	var lsn *string
	var all bool
	err := db.QueryRow(ctx, `
		SELECT min(p.source_lsn)::text, COALESCE(bool_and(p.source_lsn IS NOT NULL), false)
		FROM epitaph.projection_versions v
		JOIN epitaph.progress p ON p.projection = v.projection AND p.version = v.version
		WHERE v.projection = $1 AND v.state = 'live'`, projection).Scan(&lsn, &all)
	if err != nil {
		return 0, false, fmt.Errorf("read watermarks of %s: %w", projection, err)
	}
	if lsn == nil {
		return 0, false, nil
	}
	l, err := event.ParseLSN(*lsn)
	return l, all, err
}

// WaitLSN returns when the live version of projection reflects every
// source transaction committed at or before lsn (every partition's
// watermark is at or past it), or ctx's error (with how far it got) when
// ctx ends first. Polls every interval (default 50ms).
//
// To read your own deletes, take lsn = pg_current_wal_insert_lsn() in the
// source session after the deleting transaction committed: every record
// written later (the capture's next heartbeat) is at or past it. Do not
// use pg_current_wal_lsn() (the WAL write position): with
// synchronous_commit = off it can be behind your own commit.
func WaitLSN(ctx context.Context, db progress.DB, projection string, lsn event.LSN, interval time.Duration) (event.LSN, error) {
	if interval <= 0 {
		interval = 50 * time.Millisecond
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	var last event.LSN // from the last read that the deadline did not cut short
	for {
		at, all, err := Reflects(ctx, db, projection)
		if err == nil && all && at >= lsn {
			return at, nil
		}
		if err != nil && ctx.Err() == nil {
			return at, err
		}
		if err == nil {
			last = at
		}
		select {
		case <-ctx.Done():
			return last, fmt.Errorf("wait for %s to reflect %s (it reflects %s): %w", projection, lsn, last, ctx.Err())
		case <-t.C:
		}
	}
}
