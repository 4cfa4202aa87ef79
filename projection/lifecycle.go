package projection

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/progress"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
)

// RebuildOptions say how a new version is built.
type RebuildOptions struct {
	// Projection to rebuild; only ArchiveProjection exists.
	Projection string
	// Source names the stream (EPITAPH_<SOURCE>); default "main".
	Source string
	// FromTime, when set, makes a partial rebuild: every partition starts at
	// its first message stored in the stream at or after FromTime (found
	// with a DeliverByStartTime probe consumer), so the version holds only
	// what was deleted since. Zero = from the start of the stream.
	FromTime time.Time
	// Note is recorded in the version's config (who asked and why).
	Note string
}

// CreateVersion creates the next version of a projection for a rebuild:
// version N+1 (N the highest version ever created, so a number, a schema
// archive_v<N+1> and the consumers <projection>-v<N+1>-p<p> are never
// reused), in state building, with an empty schema created by the
// projection's own DDL, its progress rows at the start (or at FromTime),
// and the boundary: the stream's last sequence now and the source LSN of
// the message there. Running workers discover it on their next balance and
// build it beside the live version. Everything is one transaction: on
// error nothing is created.
func CreateVersion(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, opts RebuildOptions) (Version, error) {
	if opts.Projection == "" {
		opts.Projection = ArchiveProjection
	}
	if opts.Projection != ArchiveProjection {
		return Version{}, fmt.Errorf("rebuild %q: unknown projection (only %q exists)", opts.Projection, ArchiveProjection)
	}
	if opts.Source == "" {
		opts.Source = "main"
	}
	stream, err := js.Stream(ctx, event.StreamName(opts.Source))
	if err != nil {
		return Version{}, fmt.Errorf("stream %s: %w", event.StreamName(opts.Source), err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		return Version{}, fmt.Errorf("stream info: %w", err)
	}
	partitions, err := partitionsOf(info)
	if err != nil {
		return Version{}, err
	}
	boundary := info.State.LastSeq
	var boundaryLSN any
	if boundary > 0 {
		raw, err := stream.GetMsg(ctx, boundary)
		switch {
		case err == nil:
			if e, err := (&event.Decoder{}).Decode(raw.Data); err == nil && positionLSN(e) != 0 {
				boundaryLSN = positionLSN(e).String()
			}
		case errors.Is(err, jetstream.ErrMsgNotFound):
		default:
			return Version{}, fmt.Errorf("read the boundary message %d: %w", boundary, err)
		}
	}
	head, err := removedHead(ctx, stream, info, opts.FromTime)
	if err != nil {
		return Version{}, err
	}
	var starts []uint64
	if !opts.FromTime.IsZero() {
		if starts, err = startsAt(ctx, stream, opts.Source, partitions, opts.FromTime, boundary); err != nil {
			return Version{}, err
		}
	}
	from := "start"
	var fromTime *time.Time
	if !opts.FromTime.IsZero() {
		from, fromTime = "time", &opts.FromTime
	}
	cfg, err := json.Marshal(map[string]any{"created": "rebuild", "note": opts.Note, "from": from})
	if err != nil {
		return Version{}, fmt.Errorf("encode version config: %w", err)
	}
	var v Version
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := lockVersions(ctx, tx); err != nil {
			return err
		}
		var n int
		if err := tx.QueryRow(ctx, `SELECT COALESCE(max(version), 0) + 1 FROM epitaph.projection_versions WHERE projection = $1`,
			opts.Projection).Scan(&n); err != nil {
			return fmt.Errorf("next version: %w", err)
		}
		if n == 1 {
			return errors.New("no live version yet: start a projector worker first (it creates version 1)")
		}
		v = Version{Projection: opts.Projection, Version: n, State: StateBuilding, Schema: ArchiveSchema(n), Partitions: partitions}
		_, err := tx.Exec(ctx, `
			INSERT INTO epitaph.projection_versions
			    (projection, version, state, schema_name, partitions, boundary_seq, boundary_lsn, building_at, from_time, config)
			VALUES ($1, $2, 'building', $3, $4, $5, $6::pg_lsn, now(), $7, $8)`,
			v.Projection, v.Version, v.Schema, partitions, int64(boundary), boundaryLSN, fromTime, string(cfg))
		if err != nil {
			return fmt.Errorf("create %s v%d: %w", v.Projection, v.Version, err)
		}
		if err := createVersionTables(ctx, tx, v, snapshot.DDL); err != nil {
			return err
		}
		if err := progress.Ensure(ctx, tx, v.Projection, v.Version, partitions); err != nil {
			return err
		}
		if head != nil {
			if _, err := tx.Exec(ctx, `INSERT INTO `+ident(v.Schema, "gaps")+` (kind, to_lsn, from_seq, to_seq)
				VALUES ('removed_from_stream', $1::pg_lsn, 1, $2)`, nullLSNText(head.toLSN), int64(head.toSeq)); err != nil {
				return fmt.Errorf("record the removed head of the stream: %w", err)
			}
		}
		for p, start := range starts {
			if _, err := tx.Exec(ctx, `UPDATE epitaph.progress SET cursor = $4
				WHERE projection = $1 AND version = $2 AND partition = $3`, v.Projection, v.Version, p, int64(start)); err != nil {
				return fmt.Errorf("start partition %d at %d: %w", p, start, err)
			}
		}
		return nil
	})
	if err != nil {
		return Version{}, err
	}
	return GetVersion(ctx, pool, v.Projection, v.Version)
}

// startsAt finds, per partition, the cursor just before its first message
// stored at or after t (the last sequence when there is none).
func startsAt(ctx context.Context, stream jetstream.Stream, source string, partitions int, t time.Time, last uint64) ([]uint64, error) {
	out := make([]uint64, partitions)
	for p := range out {
		c, err := stream.CreateConsumer(ctx, jetstream.ConsumerConfig{
			FilterSubject:     event.PartitionFilter(source, p),
			DeliverPolicy:     jetstream.DeliverByStartTimePolicy,
			OptStartTime:      &t,
			AckPolicy:         jetstream.AckNonePolicy,
			InactiveThreshold: time.Minute,
		})
		if err != nil {
			return nil, fmt.Errorf("probe partition %d from %s: %w", p, t.Format(time.RFC3339), err)
		}
		name := c.CachedInfo().Name
		out[p] = last
		if c.CachedInfo().NumPending > 0 {
			first, err := firstSequence(ctx, c)
			if err != nil {
				return nil, fmt.Errorf("probe partition %d: %w", p, err)
			}
			if first > 0 {
				out[p] = first - 1
			}
		}
		_ = stream.DeleteConsumer(ctx, name)
	}
	return out, nil
}

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
func Promote(ctx context.Context, pool *pgxpool.Pool, projection string, version int, force bool) (previous int, err error) {
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := lockVersions(ctx, tx); err != nil {
			return err
		}
		v, err := GetVersion(ctx, tx, projection, version)
		if err != nil {
			return err
		}
		switch {
		case v.State == StateLive:
			return fmt.Errorf("%s v%d is live already", projection, version)
		case !v.Active():
			return fmt.Errorf("%s v%d is %s: it cannot be promoted", projection, version, v.State)
		case v.State != StateReady && !force:
			return fmt.Errorf("%s v%d is %s: %w (wait for it, or --force)", projection, version, v.State, ErrNotReady)
		}
		if !force {
			var open int
			if err := tx.QueryRow(ctx, `SELECT count(*) FROM epitaph.quarantine
				WHERE projection = $1 AND version = $2 AND status = 'open'`, projection, version).Scan(&open); err != nil {
				return fmt.Errorf("count quarantine: %w", err)
			}
			if open > 0 {
				return fmt.Errorf("%s v%d has %d unresolved quarantined events: %w", projection, version, open, ErrNotReady)
			}
			var gaps int
			if err := tx.QueryRow(ctx, `SELECT unacknowledged FROM epitaph.version_gaps($1)`, v.Schema).Scan(&gaps); err != nil {
				return fmt.Errorf("count gaps: %w", err)
			}
			if gaps > 0 {
				return fmt.Errorf("%s v%d has %d unacknowledged gaps (projector gaps): %w", projection, version, gaps, ErrNotReady)
			}
			if err := snapshotsCaughtUp(ctx, tx, v); err != nil {
				return err
			}
		}
		previous, err = switchLive(ctx, tx, projection, version)
		return err
	})
	return previous, err
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
func switchLive(ctx context.Context, tx pgx.Tx, projection string, version int) (previous int, err error) {
	err = tx.QueryRow(ctx, `UPDATE epitaph.projection_versions SET state = 'ready', ready_at = now()
		WHERE projection = $1 AND state = 'live' RETURNING version`, projection).Scan(&previous)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return 0, fmt.Errorf("demote the live version: %w", err)
	}
	tag, err := tx.Exec(ctx, `UPDATE epitaph.projection_versions SET state = 'live', live_at = now()
		WHERE projection = $1 AND version = $2`, projection, version)
	if err != nil {
		return 0, fmt.Errorf("make %s v%d live: %w", projection, version, err)
	}
	if tag.RowsAffected() != 1 {
		return 0, fmt.Errorf("make %s v%d live: %w", projection, version, ErrNoVersion)
	}
	if err := PointViews(ctx, tx, version); err != nil {
		return 0, err
	}
	return previous, nil
}

// Rollback makes the previous live version (the active version other than
// the live one that was live most recently; it kept consuming) live again
// in one transaction with the view switch, and returns (from, to).
func Rollback(ctx context.Context, pool *pgxpool.Pool, projection string) (from, to int, err error) {
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := lockVersions(ctx, tx); err != nil {
			return err
		}
		err := tx.QueryRow(ctx, `SELECT version FROM epitaph.projection_versions
			WHERE projection = $1 AND state IN ('ready', 'catching_up', 'building') AND live_at IS NOT NULL
			ORDER BY live_at DESC LIMIT 1`, projection).Scan(&to)
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("rollback %s: no previous live version is still active", projection)
		}
		if err != nil {
			return fmt.Errorf("find the previous live version: %w", err)
		}
		from, err = switchLive(ctx, tx, projection, to)
		return err
	})
	return from, to, err
}

// RetireOptions say how a version is retired.
type RetireOptions struct {
	Source string
	// Drop drops the version's schema (its rows and snapshots) too.
	Drop bool
	// WaitReleased bounds the wait for workers to hand the version's
	// partitions back (they notice on their next balance) before its
	// consumers are deleted. Default 30s; leases of dead workers expire.
	WaitReleased time.Duration
	// Group is the consumer group whose consumers are deleted besides the
	// ones recorded on the progress rows; default the target's
	// (DefaultGroup).
	Group string
}

// Retire takes a version out of service: it refuses the live version; it
// marks the version retired (workers stop its partitions on their next
// balance), waits for its leases to be given back or expire, deletes its
// JetStream consumers, deletes its progress rows (the consumer identity is
// never reused, so there is nothing to resume), resolves its open
// quarantine as discarded ("version retired"; the rows are kept as the
// audit record), and with Drop drops its schema. Retiring a retired
// version again finishes the cleanup.
func Retire(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, projection string, version int, opts RetireOptions) error {
	if opts.Source == "" {
		opts.Source = "main"
	}
	if opts.WaitReleased == 0 {
		opts.WaitReleased = 30 * time.Second
	}
	var v Version
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := lockVersions(ctx, tx); err != nil {
			return err
		}
		var err error
		if v, err = GetVersion(ctx, tx, projection, version); err != nil {
			return err
		}
		if v.State == StateLive {
			return fmt.Errorf("%s v%d is live: promote another version (or roll back) first", projection, version)
		}
		_, err = tx.Exec(ctx, `UPDATE epitaph.projection_versions SET state = 'retired', retired_at = COALESCE(retired_at, now())
			WHERE projection = $1 AND version = $2`, projection, version)
		return err
	})
	if err != nil {
		return fmt.Errorf("retire %s v%d: %w", projection, version, err)
	}
	deadline := time.Now().Add(opts.WaitReleased)
	for {
		var held int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM epitaph.progress WHERE projection = $1 AND version = $2
			AND owner IS NOT NULL AND lease_expires_at > now()`, projection, version).Scan(&held); err != nil {
			return fmt.Errorf("retire %s v%d: count leases: %w", projection, version, err)
		}
		if held == 0 {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("retire %s v%d: %d partitions still leased after %s (retry to finish the cleanup)", projection, version, held, opts.WaitReleased)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	n := v.Partitions
	if n == 0 {
		var p int
		if err := pool.QueryRow(ctx, `SELECT COALESCE(max(partition) + 1, 0) FROM epitaph.progress WHERE projection = $1 AND version = $2`,
			projection, version).Scan(&p); err != nil {
			return fmt.Errorf("retire %s v%d: %w", projection, version, err)
		}
		n = p
	}
	if js != nil {
		stream, err := js.Stream(ctx, event.StreamName(opts.Source))
		if err != nil {
			return fmt.Errorf("retire %s v%d: stream: %w", projection, version, err)
		}
		if err := deleteVersionConsumers(ctx, pool, stream, projection, version, n, opts.Group); err != nil {
			return fmt.Errorf("retire %s v%d: %w", projection, version, err)
		}
	}
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `DELETE FROM epitaph.progress WHERE projection = $1 AND version = $2`, projection, version); err != nil {
			return fmt.Errorf("retire %s v%d: delete progress: %w", projection, version, err)
		}
		// Nothing can replay into a retired version: its open quarantine
		// is resolved (kept as the audit record) so it stops counting as
		// unresolved.
		if _, err := tx.Exec(ctx, `UPDATE epitaph.quarantine
			SET status = 'discarded', resolved_at = now(), resolution_reason = 'version retired'
			WHERE projection = $1 AND version = $2 AND status = 'open'`, projection, version); err != nil {
			return fmt.Errorf("retire %s v%d: resolve its quarantine: %w", projection, version, err)
		}
		if opts.Drop {
			if _, err := tx.Exec(ctx, `DROP SCHEMA IF EXISTS `+ident(v.Schema)+` CASCADE`); err != nil {
				return fmt.Errorf("retire %s v%d: drop schema %s: %w", projection, version, v.Schema, err)
			}
		}
		return nil
	})
}

// deleteVersionConsumers deletes every consumer partitions 0..n-1 of a
// version may have: the one recorded on its progress row, the group's, and
// the name from before consumer groups.
func deleteVersionConsumers(ctx context.Context, pool *pgxpool.Pool, stream jetstream.Stream, projection string, version, n int, group string) error {
	group, err := resolveGroup(ctx, pool, group)
	if err != nil {
		return err
	}
	rows, err := progress.List(ctx, pool, projection, version)
	if err != nil {
		return err
	}
	recorded := map[int]string{}
	for _, r := range rows {
		recorded[r.Partition] = r.Consumer
	}
	for p := 0; p < n; p++ {
		k := progress.Key{Projection: projection, Version: version, Partition: p}
		if err := deleteConsumers(ctx, stream, recorded[p], k.GroupConsumerName(group), k.ConsumerName()); err != nil {
			return err
		}
	}
	return nil
}

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

// firstSequence is the stream sequence of the first message c delivers,
// 0 when none is.
// The fetch's context ends with the call, so that nats.go's fetch
// goroutine never outlives it.
func firstSequence(ctx context.Context, c jetstream.Consumer) (uint64, error) {
	fctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	msgs, err := c.Fetch(1, jetstream.FetchContext(fctx))
	if err != nil {
		return 0, err
	}
	var seq uint64
	for m := range msgs.Messages() {
		md, err := m.Metadata()
		if err != nil {
			return 0, err
		}
		seq = md.Sequence.Stream
	}
	if err := msgs.Error(); err != nil {
		return 0, err
	}
	return seq, nil // 0: none delivered (they left the stream meanwhile)
}

// removedHead is what a full rebuild cannot see: the stream's first
// sequences, removed (purged, aged out, discarded by a limit) before the
// version was created. A version built from such a stream lacks their
// rows, so it is created with a removed_from_stream gap for them (every
// partition, from the beginning up to the stream's first message): it is
// not ready, and cannot be promoted, until an operator acknowledges that
// the history is gone (projector gaps ack). nil when the stream holds its
// beginning, or for a partial rebuild (--from-time), which asks for less.
func removedHead(ctx context.Context, stream jetstream.Stream, info *jetstream.StreamInfo, fromTime time.Time) (*gapRow, error) {
	first := info.State.FirstSeq
	if !fromTime.IsZero() || first <= 1 {
		return nil, nil
	}
	g := &gapRow{fromSeq: 1, toSeq: first - 1}
	if first <= info.State.LastSeq {
		raw, err := stream.GetMsg(ctx, first)
		switch {
		case err == nil:
			if e, err := (&event.Decoder{}).Decode(raw.Data); err == nil {
				g.toLSN = positionLSN(e)
			}
		case errors.Is(err, jetstream.ErrMsgNotFound):
		default:
			return nil, fmt.Errorf("read the stream's first message %d: %w", first, err)
		}
	}
	return g, nil
}
