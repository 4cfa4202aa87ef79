package handler

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Row is an archived row as the apply hands it to Enqueue.
type Row struct {
	Source, Schema, Table string
	Key, Image            json.RawMessage
	CorrelationID         string
	CommitLSN             string
	Seq                   int
	CommitTime            *time.Time
	// Verified: the row is not waiting for its signed commit.
	Verified bool
	// Committed: its source transaction's commit is applied (in the same
	// page).
	Committed bool
	// Late: the apply's transaction inserted the row at or behind its
	// partition's watermark (or cannot tell the watermark): a cursor
	// handler may have claimed past it already. A row ahead of the
	// watermark is ahead of every cursor's claimed position (a claim never
	// goes past the smallest watermark), so it needs no look at them.
	Late bool
}

// Cache keeps the handlers per table for the apply: it is reloaded when
// the handlers change (their count and latest updated_at, looked at most
// once per Refresh interval), never queried per page.
type Cache struct {
	db       DB
	interval time.Duration

	mu      sync.Mutex
	checked time.Time
	sig     string
	byTable map[string][]Def
}

// NewCache returns a cache over db that looks for changes at most every
// interval (default one second).
func NewCache(db DB, interval time.Duration) *Cache {
	if interval <= 0 {
		interval = time.Second
	}
	return &Cache{db: db, interval: interval}
}

// Refresh reloads the handlers when the last look is older than the
// interval and they changed. Cheap: one small query per interval.
func (c *Cache) Refresh(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if time.Since(c.checked) < c.interval && c.byTable != nil {
		return nil
	}
	var sig string
	if err := c.db.QueryRow(ctx, `SELECT count(*)::text || '/' || COALESCE(max(updated_at)::text, '') FROM epitaph.handlers`).Scan(&sig); err != nil {
		return fmt.Errorf("look up handlers: %w", err)
	}
	c.checked = time.Now()
	if sig == c.sig && c.byTable != nil {
		return nil
	}
	defs, err := List(ctx, c.db)
	if err != nil {
		return err
	}
	by := map[string][]Def{}
	for _, d := range defs {
		if d.RevokedAt == nil {
			by[d.QualifiedTable()] = append(by[d.QualifiedTable()], d)
		}
	}
	c.sig, c.byTable = sig, by
	return nil
}

// Invalidate makes the next Refresh reload.
func (c *Cache) Invalidate() {
	c.mu.Lock()
	c.checked, c.sig = time.Time{}, ""
	c.mu.Unlock()
}

// Any reports whether any handler (not revoked) exists.
func (c *Cache) Any() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.byTable) > 0
}

// For returns the handlers of a table ("schema.table").
func (c *Cache) For(table string) []Def {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.byTable[table]
}

// Stored payload: the key and the kept columns.
type storedPayload struct {
	Key     json.RawMessage            `json:"key"`
	Columns map[string]json.RawMessage `json:"columns"`
	// Group: set by revalidation on a delivery queued for a changed set.
	Group json.RawMessage `json:"group,omitempty"`
}

const enqueueSQL = `
INSERT INTO epitaph.deliveries (id, handler_id, source, commit_lsn, seq, schema_name, table_name, key, correlation_id,
    commit_time, version, phase, priority, released_at, verified, payload)
SELECT u.id::uuid, u.handler_id::uuid, u.source, u.commit_lsn::pg_lsn, u.seq, u.schema_name, u.table_name, u.key::jsonb,
       u.correlation_id, u.commit_time, $1, u.phase, u.priority, CASE WHEN u.released THEN now() END, u.verified, u.payload::jsonb
FROM unnest($3::text[], $4::text[], $5::text[], $6::text[], $7::int[], $8::text[], $9::text[], $10::text[], $11::text[],
            $12::timestamptz[], $13::text[], $14::int[], $15::boolean[], $16::boolean[], $17::text[])
     AS u(id, handler_id, source, commit_lsn, seq, schema_name, table_name, key, correlation_id, commit_time, phase,
          priority, released, verified, payload)
WHERE EXISTS (SELECT 1 FROM epitaph.projection_versions v WHERE v.projection = $2 AND v.version = $1 AND v.state = 'live')
ON CONFLICT (handler_id, source, commit_lsn, seq, generation) DO UPDATE
    SET state = 'pending', outcome = NULL, payload = EXCLUDED.payload, key = EXCLUDED.key, released_at = EXCLUDED.released_at,
        verified = EXCLUDED.verified, payload_scrubbed_at = NULL, settled_at = NULL, attempt = 0, updated_at = now()
    -- Only a delivery stopped because its row was not authentic is replaced:
    -- the slow path of verification re-inserts the real row (trust.go).
    WHERE epitaph.deliveries.state = 'stopped' AND epitaph.deliveries.outcome = 'unverified'`

// enqueueLateSQL queues late rows for cursor handlers: a row gets its
// delivery only when the handler's claimed position (its cursor, or the
// end of the range it claimed) is at or past it; otherwise the cursor will
// reach it. The cursor rows are read FOR SHARE: a claim locks its cursor
// row FOR UPDATE before it reads rows (cursorClaim), so either the claim
// waits for this transaction and then sees the row and its delivery, or
// this statement waits for the claim and reads its claimed_to.
var enqueueLateSQL = `
WITH cur AS MATERIALIZED (
    SELECT c.handler_id, c.commit_lsn, c.seq, c.claimed_to_lsn, c.claimed_to_seq FROM epitaph.handler_cursors c
    WHERE c.handler_id = ANY($4::text[]::uuid[]) ORDER BY c.handler_id FOR SHARE)
` + strings.Replace(enqueueSQL, "\nWHERE EXISTS", `
JOIN cur ON cur.handler_id = u.handler_id::uuid
WHERE ((u.commit_lsn::pg_lsn, u.seq) <= (cur.commit_lsn, cur.seq)
       OR (u.commit_lsn::pg_lsn, u.seq) <= (cur.claimed_to_lsn, cur.claimed_to_seq))
  AND EXISTS`, 1)

// Enqueue inserts, in tx (the transaction that archives rows), one
// delivery per (handler of the row's table, row) when version is the live
// version of projection, and nothing otherwise (a rebuild never creates
// deliveries). Idempotent by the delivery identity. A cursor handler
// (Def.UsesCursor) gets a delivery only for a Late row its cursor has
// claimed past (enqueueLateSQL); no query for it otherwise. It returns how
// many deliveries it offered (0 without a query when no row has a
// handler).
func Enqueue(ctx context.Context, tx pgx.Tx, c *Cache, projection string, version int, rows []Row) (int, error) {
	var a, late enqueueArgs
	for i := range rows {
		r := &rows[i]
		defs := c.For(r.Schema + "." + r.Table)
		if len(defs) == 0 {
			continue
		}
		var image map[string]json.RawMessage
		for _, d := range defs {
			to := &a
			if d.UsesCursor() {
				if !r.Late {
					// Its cursor will reach the row.
					continue
				}
				to = &late
			}
			p := storedPayload{Key: r.Key, Columns: map[string]json.RawMessage{}}
			if len(d.Columns) > 0 && image == nil {
				if err := json.Unmarshal(r.Image, &image); err != nil {
					image = map[string]json.RawMessage{}
				}
			}
			for _, col := range d.Columns {
				if v, ok := image[col]; ok {
					p.Columns[col] = v
				}
			}
			b, err := json.Marshal(p)
			if err != nil {
				return 0, fmt.Errorf("encode delivery payload: %w", err)
			}
			released := r.Verified && (d.Phase == PhaseImmediate || r.Committed)
			to.add(d, r, string(b), released)
		}
	}
	n, err := a.insert(ctx, tx, projection, version)
	if err != nil || len(late.ids) == 0 {
		return n, err
	}
	if _, err := tx.Exec(ctx, enqueueLateSQL, late.args(projection, version)...); err != nil {
		return n, fmt.Errorf("queue %d late deliveries of cursor handlers: %w", len(late.ids), err)
	}
	return n + len(late.ids), nil
}

// insert queues a's deliveries (the queued path).
func (a *enqueueArgs) insert(ctx context.Context, tx pgx.Tx, projection string, version int) (int, error) {
	if len(a.ids) == 0 {
		return 0, nil
	}
	args := a.args(projection, version)
	// Plainly first, in a savepoint: a page's deliveries are almost always
	// new, and ON CONFLICT's speculative insertion costs a probe of the
	// unique index, a lock and a second WAL record for each. A page that
	// repeats a delivery fails with a unique violation and goes again
	// with ON CONFLICT, so the result is the same.
	sp, err := tx.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("queue %d deliveries: savepoint: %w", len(a.ids), err)
	}
	_, err = sp.Exec(ctx, enqueuePlainSQL, args...)
	if err == nil {
		if err := sp.Commit(ctx); err != nil {
			return 0, fmt.Errorf("queue %d deliveries: release savepoint: %w", len(a.ids), err)
		}
		return len(a.ids), nil
	}
	if rbErr := sp.Rollback(ctx); rbErr != nil || !uniqueViolation(err) {
		return 0, fmt.Errorf("queue %d deliveries: %w", len(a.ids), err)
	}
	if _, err := tx.Exec(ctx, enqueueSQL, args...); err != nil {
		return 0, fmt.Errorf("queue %d deliveries: %w", len(a.ids), err)
	}
	return len(a.ids), nil
}

// enqueuePlainSQL is enqueueSQL without its ON CONFLICT clause.
var enqueuePlainSQL, _, _ = strings.Cut(enqueueSQL, "ON CONFLICT")

func uniqueViolation(err error) bool {
	var pg *pgconn.PgError
	return errors.As(err, &pg) && pg.Code == "23505"
}

// deadlock reports a statement Postgres aborted to break a deadlock
// (40P01): nothing of it was done, and running it again is safe.
func deadlock(err error) bool {
	var pg *pgconn.PgError
	return errors.As(err, &pg) && pg.Code == "40P01"
}

// settleAgainOnDeadlock runs settle, and again (five runs at most) while
// Postgres aborts it to break a deadlock: a batch sent is recorded, rather
// than left in flight until its claim expires and sent again. An erasure
// stopping deliveries of the batch locks them in another order.
func (d *Dispatcher) settleAgainOnDeadlock(settle func() error, logArgs ...any) error {
	err := settle()
	for attempt := 1; deadlock(err) && attempt < 5; attempt++ {
		d.log.Warn("recording a batch's outcome was chosen as a deadlock's victim; recording it again", append(logArgs, "attempt", attempt)...)
		err = settle()
	}
	return err
}

type enqueueArgs struct {
	ids, handlers, sources, lsns, schemas, tables, corrs, phases, payloads []string
	keys                                                                   []*string
	seqs, prios                                                            []int32
	times                                                                  []*time.Time
	released, verified                                                     []bool
}

func (a *enqueueArgs) args(projection string, version int) []any {
	return []any{version, projection, a.ids, a.handlers, a.sources, a.lsns, a.seqs, a.schemas,
		a.tables, a.keys, a.corrs, a.times, a.phases, a.prios, a.released, a.verified, a.payloads}
}

func (a *enqueueArgs) add(d Def, r *Row, payload string, released bool) {
	a.ids = append(a.ids, DeliveryID(d.ID, r.Source, r.CommitLSN, r.Seq, 0))
	a.handlers = append(a.handlers, d.ID)
	a.sources = append(a.sources, r.Source)
	a.lsns = append(a.lsns, r.CommitLSN)
	a.seqs = append(a.seqs, int32(r.Seq))
	a.schemas = append(a.schemas, r.Schema)
	a.tables = append(a.tables, r.Table)
	var key *string
	if len(r.Key) > 0 {
		k := string(r.Key)
		key = &k
	}
	a.keys = append(a.keys, key)
	a.corrs = append(a.corrs, r.CorrelationID)
	a.times = append(a.times, r.CommitTime)
	a.phases = append(a.phases, d.Phase)
	a.prios = append(a.prios, int32(d.Priority))
	a.released = append(a.released, released)
	a.verified = append(a.verified, r.Verified)
	a.payloads = append(a.payloads, payload)
}

// Release marks, in tx, the deliveries of the source transactions whose
// commits (commit LSNs) were applied and verified: their rows are
// verified, and every one of them is released (immediate and after-group
// alike).
func Release(ctx context.Context, tx pgx.Tx, source string, commitLSNs []string) error {
	if len(commitLSNs) == 0 {
		return nil
	}
	if _, err := tx.Exec(ctx, `UPDATE epitaph.deliveries SET released_at = now(), verified = true, updated_at = now()
		WHERE source = $1 AND commit_lsn = ANY($2::pg_lsn[]) AND released_at IS NULL AND state = 'pending'`,
		source, commitLSNs); err != nil {
		return fmt.Errorf("release deliveries: %w", err)
	}
	return nil
}

// StopUnverified ends, in tx, the deliveries of rows that verification
// dropped (not part of an authentic transaction): stopped, outcome
// unverified, payload scrubbed. They never ran: they were not released.
func StopUnverified(ctx context.Context, tx pgx.Tx, source string, lsns []string, seqs []int32) error {
	if len(lsns) == 0 {
		return nil
	}
	if _, err := tx.Exec(ctx, `UPDATE epitaph.deliveries d SET state = 'stopped', outcome = 'unverified', payload = NULL,
		payload_scrubbed_at = now(), settled_at = now(), updated_at = now()
		FROM unnest($2::text[], $3::int[]) AS u(lsn, seq)
		WHERE d.source = $1 AND d.commit_lsn = u.lsn::pg_lsn AND d.seq = u.seq AND d.state = 'pending' AND NOT d.verified`,
		source, lsns, seqs); err != nil {
		return fmt.Errorf("stop unverified deliveries: %w", err)
	}
	return nil
}
