package handler

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"
)

// CursorCountCap bounds how many rows after a cursor handler's cursor are
// counted: its pending deliveries are the archived rows of its table after
// the cursor, found by walking the archive's key from the cursor, and a
// backlog of millions is not walked at every scrape. A count that reaches
// the cap is a lower bound (CursorBacklog.AtLeast, Stat.AtLeast): "at least
// 10000 pending". It is larger than the largest batch, so a claimed batch
// is always counted whole.
const CursorCountCap = 10 * MaxBatchSize

// CursorBacklog is a cursor handler's open work: the archived rows of its
// table after its cursor (pending deliveries without a row in
// epitaph.deliveries), and its claimed batch, the rows up to ClaimedTo.
type CursorBacklog struct {
	HandlerID string `json:"handler_id"`
	// CommitLSN and Seq: the cursor; every row up to it is settled.
	CommitLSN string `json:"commit_lsn"`
	Seq       int    `json:"seq"`
	// ClaimedToLSN and ClaimedToSeq end the claimed batch (nil: none). It
	// is in flight while its claim is held and not expired (Claimed),
	// pending otherwise: waiting for its next attempt (NextAttemptAt)
	// after a failure, or to be claimed again after its claim expired.
	ClaimedToLSN   *string    `json:"claimed_to_lsn,omitempty"`
	ClaimedToSeq   *int       `json:"claimed_to_seq,omitempty"`
	Claimed        bool       `json:"claimed"`
	ClaimExpiresAt *time.Time `json:"claim_expires_at,omitempty"`
	// Attempt is the claimed batch's attempts so far (0: none claimed).
	Attempt       int       `json:"attempt"`
	NextAttemptAt time.Time `json:"next_attempt_at"`
	// Pending: rows after the cursor that are not in flight (a claimed
	// batch waiting for its retry counts here); InFlight: the rows of the
	// batch whose claim is held. AtLeast: the walk stopped at
	// CursorCountCap rows, there are more.
	Pending  int64 `json:"pending"`
	InFlight int64 `json:"in_flight"`
	AtLeast  bool  `json:"at_least"`
	// OldestPendingSec, OldestInFlightSec: how long ago the oldest of them
	// was archived (0 when none).
	OldestPendingSec  float64 `json:"oldest_pending_age_seconds"`
	OldestInFlightSec float64 `json:"oldest_in_flight_age_seconds"`
}

// cursorsSQL reads the cursors of the handlers not revoked (a revoked
// handler's rows are not delivered: nothing of it is pending). A claim
// that expired (its dispatcher died) is not held: its batch waits to be
// claimed again, pending.
const cursorsSQL = `
SELECT c.handler_id::text, c.commit_lsn::text, c.seq, c.claimed_to_lsn::text, c.claimed_to_seq,
       c.claim_token IS NOT NULL AND c.claim_expires_at >= now(), c.claim_expires_at, c.attempt, c.next_attempt_at
FROM epitaph.handler_cursors c JOIN epitaph.handlers h ON h.id = c.handler_id
WHERE h.revoked_at IS NULL`

// cursorSourcesSQL lists the sources of an archive's rows by a skip scan
// of its key (one index probe per source). %s is the rows table.
const cursorSourcesSQL = `
WITH RECURSIVE s AS (
    (SELECT source FROM %[1]s ORDER BY source LIMIT 1)
    UNION ALL
    SELECT (SELECT r.source FROM %[1]s r WHERE r.source > s.source ORDER BY r.source LIMIT 1) FROM s WHERE s.source IS NOT NULL)
SELECT source FROM s WHERE source IS NOT NULL`

// cursorCountSQL counts one handler's rows of one source after its cursor
// ($2, $3), at most $8, walking the archive's key from the cursor: how
// many, how many of them in the claimed range (up to $6, $7), and how
// long ago the oldest of each was archived. A row with a delivery of the
// handler ($9) already is not counted: queued as a late row (counted as
// queued), or stopped (a restore superseded it). %s is the rows table.
const cursorCountSQL = `
SELECT count(*) FILTER (WHERE NOT x.claimed), count(*) FILTER (WHERE x.claimed),
       COALESCE(extract(epoch FROM now() - min(x.archived_at) FILTER (WHERE NOT x.claimed)), 0)::float8,
       COALESCE(extract(epoch FROM now() - min(x.archived_at) FILTER (WHERE x.claimed)), 0)::float8
FROM (SELECT a.archived_at, (a.commit_lsn, a.seq) <= ($6::pg_lsn, $7::int) AS claimed
      FROM %s a
      WHERE a.source = $1::text AND (a.commit_lsn, a.seq) > ($2::pg_lsn, $3::int)
        AND a.schema_name = $4 AND a.table_name = $5
        AND NOT EXISTS (SELECT 1 FROM epitaph.deliveries q WHERE q.handler_id = $9::uuid AND q.source = a.source
                          AND q.commit_lsn = a.commit_lsn AND q.seq = a.seq AND q.generation = 0 OFFSET 0)
      ORDER BY a.commit_lsn, a.seq LIMIT $8::int) x`

// cursorListSQL lists one handler's rows of one source after ($2, $3)
// up to ($7, $8), newest first, at most $6, but for rows with a delivery
// of the handler ($9) already (listed as such). %s is the rows table.
const cursorListSQL = `
SELECT a.commit_lsn::text, a.seq, a.key, a.correlation_id, a.verified, a.archived_at
FROM %s a
WHERE a.source = $1::text AND (a.commit_lsn, a.seq) > ($2::pg_lsn, $3::int)
  AND (a.commit_lsn, a.seq) <= ($7::pg_lsn, $8::int)
  AND a.schema_name = $4 AND a.table_name = $5
  AND NOT EXISTS (SELECT 1 FROM epitaph.deliveries q WHERE q.handler_id = $9::uuid AND q.source = a.source
                          AND q.commit_lsn = a.commit_lsn AND q.seq = a.seq AND q.generation = 0 OFFSET 0)
ORDER BY a.commit_lsn DESC, a.seq DESC LIMIT $6::int`

// cursorRead runs f in one read-only snapshot of db with the claim's plan
// settings (the walks from a cursor read the archive's key in order, not
// every row of the table), given the live archive's rows table ("" when
// no archive is live). A db that is a transaction already is read as it is.
func cursorRead(ctx context.Context, db DB, f func(q DB, rows string) error) error {
	type beginner interface {
		BeginTx(context.Context, pgx.TxOptions) (pgx.Tx, error)
	}
	q := db
	if b, ok := db.(beginner); ok {
		if _, inTx := db.(pgx.Tx); !inTx {
			tx, err := b.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
			if err != nil {
				return fmt.Errorf("read the cursor handlers' backlog: %w", err)
			}
			defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
			for _, s := range cursorPlan {
				if _, err := tx.Exec(ctx, s); err != nil {
					return fmt.Errorf("read the cursor handlers' backlog: %w", err)
				}
			}
			q = tx
		}
	}
	var schema string
	var exists bool
	err := q.QueryRow(ctx, `SELECT schema_name, to_regclass(format('%I.rows', schema_name)) IS NOT NULL
		FROM epitaph.projection_versions WHERE projection = $1 AND state = 'live'`,
		archiveProjection).Scan(&schema, &exists)
	if errors.Is(err, pgx.ErrNoRows) || (err == nil && !exists) {
		// No live archive, or one without rows yet: nothing is pending.
		return f(q, "")
	}
	if err != nil {
		return fmt.Errorf("look up the live archive: %w", err)
	}
	return f(q, pgx.Identifier{schema, "rows"}.Sanitize())
}

// anyCursor reports whether one of defs uses a cursor.
func anyCursor(defs []Def) bool {
	for _, d := range defs {
		if d.UsesCursor() && d.RevokedAt == nil {
			return true
		}
	}
	return false
}

// cursorHandlers reads the cursors of defs' cursor handlers, by handler.
func cursorHandlers(ctx context.Context, q DB, defs []Def) (map[string]*CursorBacklog, error) {
	uses := map[string]bool{}
	for _, d := range defs {
		if d.UsesCursor() && d.RevokedAt == nil {
			uses[d.ID] = true
		}
	}
	out := map[string]*CursorBacklog{}
	if len(uses) == 0 {
		return out, nil
	}
	rows, err := q.Query(ctx, cursorsSQL)
	if err != nil {
		return nil, fmt.Errorf("read the handlers' cursors: %w", err)
	}
	list, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (*CursorBacklog, error) {
		var b CursorBacklog
		err := r.Scan(&b.HandlerID, &b.CommitLSN, &b.Seq, &b.ClaimedToLSN, &b.ClaimedToSeq, &b.Claimed, &b.ClaimExpiresAt,
			&b.Attempt, &b.NextAttemptAt)
		return &b, err
	})
	if err != nil {
		return nil, fmt.Errorf("read the handlers' cursors: %w", err)
	}
	for _, b := range list {
		if uses[b.HandlerID] {
			out[b.HandlerID] = b
		}
	}
	return out, nil
}

// archiveSources lists the sources of the rows table's rows.
func archiveSources(ctx context.Context, q DB, rowsTable string) ([]string, error) {
	rows, err := q.Query(ctx, fmt.Sprintf(cursorSourcesSQL, rowsTable))
	if err != nil {
		return nil, fmt.Errorf("list the archive's sources: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("list the archive's sources: %w", err)
	}
	return out, nil
}

// CursorBacklogs reads the open work of defs' cursor handlers (those
// using one, not revoked), by handler id: the rows of each one's table
// after its cursor in the live archive, counted up to CursorCountCap, and
// its claimed batch.
func CursorBacklogs(ctx context.Context, db DB, defs []Def) (map[string]*CursorBacklog, error) {
	out := map[string]*CursorBacklog{}
	if !anyCursor(defs) {
		return out, nil
	}
	err := cursorRead(ctx, db, func(q DB, rowsTable string) error {
		var err error
		if out, err = cursorHandlers(ctx, q, defs); err != nil || len(out) == 0 || rowsTable == "" {
			return err
		}
		sources, err := archiveSources(ctx, q, rowsTable)
		if err != nil {
			return err
		}
		for _, d := range defs {
			b := out[d.ID]
			if b == nil {
				continue
			}
			toLSN, toSeq := "0/0", -1
			if b.ClaimedToLSN != nil && b.ClaimedToSeq != nil {
				toLSN, toSeq = *b.ClaimedToLSN, *b.ClaimedToSeq
			}
			for _, src := range sources {
				var open, claimed int64
				var openAge, claimedAge float64
				err := q.QueryRow(ctx, fmt.Sprintf(cursorCountSQL, rowsTable), src, b.CommitLSN, b.Seq, d.Schema, d.Table,
					toLSN, toSeq, CursorCountCap, d.ID).Scan(&open, &claimed, &openAge, &claimedAge)
				if err != nil {
					return fmt.Errorf("count the pending deliveries of handler %s: %w", d.ID, err)
				}
				if open+claimed >= CursorCountCap {
					b.AtLeast = true
				}
				if !b.Claimed {
					// A claimed batch waiting for its retry is pending.
					open, openAge, claimed, claimedAge = open+claimed, max(openAge, claimedAge), 0, 0
				}
				b.Pending += open
				b.InFlight += claimed
				b.OldestPendingSec = max(b.OldestPendingSec, openAge)
				b.OldestInFlightSec = max(b.OldestInFlightSec, claimedAge)
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// cursorStats are the cursor handlers' pending and in-flight deliveries
// as Stats (merged with their queued rows' by mergeStats).
func cursorStats(ctx context.Context, db DB, defs []Def) ([]Stat, error) {
	bs, err := CursorBacklogs(ctx, db, defs)
	if err != nil {
		return nil, err
	}
	var out []Stat
	for _, b := range bs {
		out = append(out, Stat{HandlerID: b.HandlerID, State: StatePending, Count: b.Pending, AtLeast: b.AtLeast,
			OldestSec: b.OldestPendingSec})
		if b.InFlight > 0 {
			out = append(out, Stat{HandlerID: b.HandlerID, State: StateInFlight, Count: b.InFlight,
				OldestSec: b.OldestInFlightSec})
		}
	}
	for i := range out {
		out[i].OldestAge = time.Duration(out[i].OldestSec * float64(time.Second))
	}
	return out, nil
}

// ListCursorDeliveries lists the pending and in-flight deliveries of the
// cursor handlers f selects (by handler, table, and state pending or
// in_flight; none for another state), newest first, at most f.Limit: the
// archived rows after each one's cursor, with the delivery id the row's
// delivery has when its batch is sent and settled (DeliveryID). They have
// no row in epitaph.deliveries until they settle: "deliveries show",
// retry and discard do not find them.
func ListCursorDeliveries(ctx context.Context, db DB, f Filter) ([]Info, error) {
	if f.HandlerID != "" && !ValidID(f.HandlerID) {
		return nil, fmt.Errorf("handler id %q is not a UUID", f.HandlerID)
	}
	if f.State != "" && f.State != StatePending && f.State != StateInFlight {
		return nil, nil
	}
	if f.Limit <= 0 {
		f.Limit = 1000
	}
	defs, err := List(ctx, db)
	if err != nil || !anyCursor(defs) {
		return nil, err
	}
	var out []Info
	err = cursorRead(ctx, db, func(q DB, rowsTable string) error {
		curs, err := cursorHandlers(ctx, q, defs)
		if err != nil || len(curs) == 0 || rowsTable == "" {
			return err
		}
		sources, err := archiveSources(ctx, q, rowsTable)
		if err != nil {
			return err
		}
		for _, d := range defs {
			b := curs[d.ID]
			if b == nil || (f.HandlerID != "" && f.HandlerID != d.ID) || (f.Schema != "" && f.Schema != d.Schema) ||
				(f.Table != "" && f.Table != d.Table) {
				continue
			}
			for _, src := range sources {
				is, err := listCursorRows(ctx, q, rowsTable, d, b, src, f)
				if err != nil {
					return err
				}
				out = append(out, is...)
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].CreatedAt.After(out[j].CreatedAt) })
	if len(out) > f.Limit {
		out = out[:f.Limit]
	}
	return out, nil
}

// listCursorRows lists the rows of one source after d's cursor b in f's
// state, newest first, at most f.Limit.
func listCursorRows(ctx context.Context, q DB, rowsTable string, d Def, b *CursorBacklog, src string, f Filter) ([]Info, error) {
	// The range of f's state: in flight, the claimed batch while its
	// claim is held; pending, the rows after it (all after the cursor
	// when no claim is held).
	fromLSN, fromSeq, toLSN, toSeq := b.CommitLSN, b.Seq, "FFFFFFFF/FFFFFFFF", math.MaxInt32
	held := b.Claimed && b.ClaimedToLSN != nil && b.ClaimedToSeq != nil
	switch {
	case f.State == StateInFlight && !held:
		return nil, nil
	case f.State == StateInFlight:
		toLSN, toSeq = *b.ClaimedToLSN, *b.ClaimedToSeq
	case f.State == StatePending && held:
		fromLSN, fromSeq = *b.ClaimedToLSN, *b.ClaimedToSeq
	}
	rows, err := q.Query(ctx, fmt.Sprintf(cursorListSQL, rowsTable), src, fromLSN, fromSeq, d.Schema, d.Table, f.Limit,
		toLSN, toSeq, d.ID)
	if err != nil {
		return nil, fmt.Errorf("list the pending deliveries of handler %s: %w", d.ID, err)
	}
	var (
		out        []Info
		lsn, corr  string
		seq        int
		key        []byte
		verified   bool
		archivedAt time.Time
	)
	_, err = pgx.ForEachRow(rows, []any{&lsn, &seq, &key, &corr, &verified, &archivedAt}, func() error {
		i := cursorInfo(d, b, src, lsn, seq, key, corr, verified, archivedAt)
		if f.State == "" || f.State == i.State {
			out = append(out, i)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list the pending deliveries of handler %s: %w", d.ID, err)
	}
	return out, nil
}

// cursorInfo is a cursor handler's pending or in-flight delivery of one
// archived row, as ListDeliveries shows a queued one.
func cursorInfo(d Def, b *CursorBacklog, source, lsn string, seq int, key []byte, corr string, verified bool, archivedAt time.Time) Info {
	i := Info{ID: DeliveryID(d.ID, source, lsn, seq, 0), HandlerID: d.ID, Schema: d.Schema, Table: d.Table,
		CorrelationID: corr, State: StatePending, Phase: d.Phase, Priority: d.Priority, Released: true, Verified: verified,
		FromArchive: true, NextAttemptAt: archivedAt, CreatedAt: archivedAt, UpdatedAt: archivedAt}
	if len(key) > 0 {
		i.Key = json.RawMessage(append([]byte(nil), key...))
	}
	if b.ClaimedToLSN != nil && b.ClaimedToSeq != nil && !lsnSeqAfter(lsn, seq, *b.ClaimedToLSN, *b.ClaimedToSeq) {
		// In the claimed batch: in flight while its claim is held,
		// waiting for its next attempt otherwise.
		i.Attempt, i.NextAttemptAt = b.Attempt, b.NextAttemptAt
		if b.Claimed {
			i.State, i.ClaimExpiresAt = StateInFlight, b.ClaimExpiresAt
		}
	}
	return i
}

// lsnSeqAfter reports whether (lsn, seq) is after (toLSN, toSeq).
func lsnSeqAfter(lsn string, seq int, toLSN string, toSeq int) bool {
	a, b := parseLSN(lsn), parseLSN(toLSN)
	return a > b || (a == b && seq > toSeq)
}

// ListWithCursors lists deliveries as ListDeliveries does, and beside
// them the cursor handlers' pending and in-flight ones from the archive
// (ListCursorDeliveries, FromArchive set), newest first, at most f.Limit.
func ListWithCursors(ctx context.Context, db DB, f Filter) ([]Info, error) {
	if f.Limit <= 0 {
		f.Limit = 1000
	}
	queued, err := ListDeliveries(ctx, db, f)
	if err != nil {
		return nil, err
	}
	cursor, err := ListCursorDeliveries(ctx, db, f)
	if err != nil {
		return nil, err
	}
	if len(cursor) == 0 {
		return queued, nil
	}
	out := append(queued, cursor...)
	sort.SliceStable(out, func(i, j int) bool { return out[i].CreatedAt.After(out[j].CreatedAt) })
	if len(out) > f.Limit {
		out = out[:f.Limit]
	}
	return out, nil
}
