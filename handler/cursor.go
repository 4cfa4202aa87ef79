package handler

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
)

// UsesCursor reports whether d's deliveries follow a cursor over the
// archive instead of a queued row each: a webhook that batches without
// revalidation. The apply queues nothing for it; its pending deliveries
// are the verified archived rows of its table after its cursor, up to the
// archive's horizon (the smallest watermark of the live version's
// partitions), and each delivery's row in epitaph.deliveries is written
// once, settled, when its batch ends.
func (d Def) UsesCursor() bool {
	return d.Kind == KindWebhook && d.BatchSize > 1 && !d.Revalidate
}

// CursorHandlerSQL is Def.UsesCursor as a condition on a row h of
// epitaph.handlers, for the statements that find the cursor handlers.
const CursorHandlerSQL = `h.kind = 'webhook' AND h.batch_size > 1 AND NOT h.revalidate`

// archiveProjection is the archive's projection name (projection/archive
// imports this package).
const archiveProjection = "archive"

// cursorStartSQL follows the handler's INSERT (h, returning its id) in
// one statement, so a cursor handler never exists without its cursor: it
// creates the cursor at the archive's horizon, so that rows archived
// before the handler existed are not delivered.
const cursorStartSQL = `
INSERT INTO epitaph.handler_cursors (handler_id, commit_lsn, seq)
SELECT h.id, COALESCE((SELECT min(COALESCE(p.source_lsn, '0/0'::pg_lsn)) FROM epitaph.progress p JOIN epitaph.projection_versions v
                        ON v.projection = p.projection AND v.version = p.version
                       WHERE v.projection = 'archive' AND v.state = 'live'), '0/0'::pg_lsn), 2147483647
FROM h
ON CONFLICT (handler_id) DO NOTHING`

// cursorPlan is the plan settings of the walks from a cursor that count
// a backlog: the claim's, and a custom plan each time (the generic plan a
// prepared statement gets after five runs is planned without the cursor
// and the table).
var cursorPlan = append(append([]string{}, claimPlan...), `SET LOCAL plan_cache_mode = force_custom_plan`)

// cursorClaimSQL claims a handler's next batch in one statement (one
// snapshot): the horizon, the rows of its table after its cursor up to
// the horizon and before the first row not yet verified, and, when the
// batch is full, retried, or its first row has waited the handler's batch
// wait, the cursor row's claim (claimed_to, token, expiry, attempt). The
// cursor row is only claimed where it still is at the position read
// (another dispatcher's settle moved it: nothing claimed). It returns one
// row per claimed row, or one row with a NULL token and the number of rows
// found when it claimed nothing. %s is the live archive's rows table;
// %[2]s and %[3]s the handler's schema and table as literals, beside $4
// and $5: the statement is prepared once per handler, and the generic
// plan Postgres gives it after five runs then knows its table (planned
// with the table a parameter, it walked a dense table's rows for 20 ms a
// batch of 10 where the custom plan reads its 10 rows in 0.3 ms).
//
// A claim leaves out the rows that have a delivery of the handler
// already: rows archived late into a claimed range after its first
// claim, which the apply queued as rows (Enqueue), so a retry resends
// exactly the batch it sent first; rows a restore put back before their
// batch (StopCursorRows). A retried batch (claimed_to set) is the
// range it claimed before, and keeps that claimed_to: the claimed
// position never moves back. It waits until the horizon covers its whole
// range again (after a promotion of a version that lags, rows of the
// range may not be in the live archive yet), and while a row of the range
// reads unverified: resending part of it would settle, and pass, the rest
// unsent.
const cursorClaimSQL = `
-- A partition that has applied nothing yet (no watermark) holds the
-- horizon at 0/0: min() alone would skip it, and the cursor would pass its
-- rows before they are archived.
WITH hz AS (SELECT min(COALESCE(source_lsn, '0/0'::pg_lsn)) AS lsn FROM epitaph.progress WHERE projection = 'archive' AND version = $2),
cur AS (SELECT c.commit_lsn, c.seq, c.claimed_to_lsn, c.claimed_to_seq FROM epitaph.handler_cursors c
        WHERE c.handler_id = $1::uuid AND (c.claim_token IS NULL OR c.claim_expires_at < now()) AND c.next_attempt_at <= now()),
cand AS (SELECT a.key, CASE WHEN $9::boolean THEN a.row END AS row, a.correlation_id, a.commit_lsn, a.seq, a.commit_time,
             a.archived_at, a.verified
      FROM %s a
      WHERE a.source = $3::text AND (a.commit_lsn, a.seq) > ((SELECT commit_lsn FROM cur), (SELECT seq FROM cur))
        AND a.commit_lsn <= (SELECT lsn FROM hz)
        AND (a.commit_lsn, a.seq) <= (COALESCE((SELECT claimed_to_lsn FROM cur), 'FFFFFFFF/FFFFFFFF'::pg_lsn),
                                      COALESCE((SELECT claimed_to_seq FROM cur), 2147483647))
        AND a.schema_name = $4 AND a.table_name = $5 AND a.schema_name = %[2]s AND a.table_name = %[3]s
        AND ((SELECT claimed_to_lsn FROM cur) IS NULL
             OR (SELECT claimed_to_lsn FROM cur) <= (SELECT lsn FROM hz))
        AND (NOT EXISTS (SELECT 1 FROM epitaph.deliveries q WHERE q.handler_id = $1::uuid AND q.source = a.source
                              AND q.commit_lsn = a.commit_lsn AND q.seq = a.seq AND q.generation = 0 OFFSET 0))
      ORDER BY a.commit_lsn, a.seq LIMIT $6::int),
-- A row behind the horizon may still wait for its transaction's signed
-- commit (applied in another page or partition): the batch stops before
-- the first unverified row, so the cursor never passes it. It stops too
-- before a row whose key has an earlier delivery of the handler queued
-- and not yet terminal (a late row, or one an older build queued): a
-- key's deliveries go out in commit order. The handler's open queued
-- deliveries are looked up once first (deliveries_open_idx; there are
-- none but for such rows): a batch's rows are probed for their key only
-- while there are any.
-- (The first such row once, not an anti-join of the batch with itself.)
stop AS (SELECT c.commit_lsn, c.seq FROM cand c
         WHERE NOT c.verified
            OR ((SELECT EXISTS (SELECT 1 FROM epitaph.deliveries o
                                WHERE o.handler_id = $1::uuid AND o.state IN ('pending', 'in_flight')))
                AND EXISTS (SELECT 1 FROM epitaph.deliveries k
                       WHERE k.handler_id = $1::uuid AND jsonb_hash(k.key) = jsonb_hash(c.key) AND k.key = c.key
                         AND k.source = $3::text AND k.schema_name = $4 AND k.table_name = $5
                         AND k.state IN ('pending', 'in_flight') AND (k.commit_lsn, k.seq) < (c.commit_lsn, c.seq)))
         ORDER BY c.commit_lsn, c.seq LIMIT 1),
r AS (SELECT * FROM cand c
      WHERE NOT EXISTS (SELECT 1 FROM stop u WHERE (u.commit_lsn, u.seq) <= (c.commit_lsn, c.seq))),
n AS (SELECT count(*) AS found, min(archived_at) AS first_at FROM r),
-- Fewer rows than a batch, none unverified: every row of the table up to
-- the horizon is read, so the batch claims up to the horizon, and the
-- cursor passes the rows of other tables after its last row (a table
-- deleted from rarely would otherwise walk the stream from its last row
-- at every claim).
whole AS (SELECT count(*) < $6::int AND NOT EXISTS (SELECT 1 FROM stop) AS read FROM cand),
upd AS (UPDATE epitaph.handler_cursors c
           SET claimed_to_lsn = CASE WHEN cur.claimed_to_lsn IS NOT NULL THEN cur.claimed_to_lsn
                                     WHEN whole.read THEN hz.lsn ELSE l.commit_lsn END,
               claimed_to_seq = CASE WHEN cur.claimed_to_lsn IS NOT NULL THEN cur.claimed_to_seq
                                     WHEN whole.read THEN 2147483647 ELSE l.seq END,
               claim_token = gen_random_uuid(), claim_expires_at = now() + $8::bigint * interval '1 millisecond',
               attempt = c.attempt + 1, updated_at = now()
        FROM cur, n, hz, whole, (SELECT commit_lsn, seq FROM r ORDER BY commit_lsn DESC, seq DESC LIMIT 1) l
        WHERE c.handler_id = $1::uuid AND c.commit_lsn = cur.commit_lsn AND c.seq = cur.seq
          AND (c.claim_token IS NULL OR c.claim_expires_at < now())
          AND (n.found >= $6::int OR cur.claimed_to_lsn IS NOT NULL OR n.first_at <= now() - $7::bigint * interval '1 millisecond')
          -- A retry resends its whole range: it waits while a row of it
          -- reads unverified (the settle passes the range).
          AND (cur.claimed_to_lsn IS NULL OR NOT EXISTS (SELECT 1 FROM stop))
        RETURNING c.claim_token::text AS token, c.attempt),
-- A retried range with no row left (every one erased since, or queued as
-- a late row) is passed: there is nothing to resend, and a claim of
-- nothing would hold the cursor for good.
gone AS (UPDATE epitaph.handler_cursors c SET commit_lsn = cur.claimed_to_lsn, seq = cur.claimed_to_seq,
                claimed_to_lsn = NULL, claimed_to_seq = NULL, claim_token = NULL, claim_expires_at = NULL,
                attempt = 0, next_attempt_at = now(), updated_at = now()
         FROM cur, n, hz
         WHERE c.handler_id = $1::uuid AND c.commit_lsn = cur.commit_lsn AND c.seq = cur.seq
           AND (c.claim_token IS NULL OR c.claim_expires_at < now())
           AND cur.claimed_to_lsn IS NOT NULL AND cur.claimed_to_lsn <= hz.lsn AND n.found = 0 AND NOT EXISTS (SELECT 1 FROM stop)),
-- No row of the table up to the horizon: the cursor moves to it, so the
-- next claim reads only the rows archived since.
pass AS (UPDATE epitaph.handler_cursors c SET commit_lsn = hz.lsn, seq = 2147483647, updated_at = now()
         FROM cur, hz, whole
         WHERE c.handler_id = $1::uuid AND c.commit_lsn = cur.commit_lsn AND c.seq = cur.seq
           AND (c.claim_token IS NULL OR c.claim_expires_at < now())
           AND cur.claimed_to_lsn IS NULL AND whole.read AND NOT EXISTS (SELECT 1 FROM cand)
           AND (cur.commit_lsn, cur.seq) < (hz.lsn, 2147483647))
SELECT u.token, u.attempt, x.key, x.row, x.correlation_id, x.commit_lsn::text, x.seq, x.commit_time, n.found,
       GREATEST(0, ceil(extract(epoch FROM n.first_at + $7::bigint * interval '1 millisecond' - now()) * 1000))::bigint
FROM n LEFT JOIN (upd u CROSS JOIN r x) ON true
ORDER BY x.commit_lsn, x.seq`

// cursorSettleSQL ends a claimed batch in one statement: the cursor
// passes its range and the batch's deliveries are inserted settled ($9:
// done or dead), guarded by the claim token (a reclaimed batch inserts
// nothing). It returns whether the cursor moved, the ids it inserted and
// the ids of erased rows it left out.
//
// A row erased while its batch was in flight is left out: the erasure
// recorded its delivery stopped, without its key.
//
// A delivery whose id exists already (it was queued as a row too) is not
// inserted again, and the cursor passes it all the same: the batch was
// sent, and a settle that failed on it would be retried, and sent again,
// forever. cursorSend reports such ids as an error. The claim's lock
// keeps a late row off the cursor's batches once it is queued, so this
// does not happen unless that serialisation is broken: the settle runs
// without ON CONFLICT (cursorSettlePlainSQL; its speculative insertion
// costs an index probe, a lock and a WAL record per delivery) and again
// with it only after a unique violation.
const cursorSettleSQL = `
WITH adv AS (UPDATE epitaph.handler_cursors SET commit_lsn = claimed_to_lsn, seq = claimed_to_seq,
                    claimed_to_lsn = NULL, claimed_to_seq = NULL, claim_token = NULL, claim_expires_at = NULL,
                    attempt = 0, next_attempt_at = now(), updated_at = now()
             WHERE handler_id = $1::uuid AND claim_token = $2::uuid RETURNING 1),
u AS (SELECT u.*, EXISTS (SELECT 1 FROM epitaph.erased_rows e
                          WHERE e.source = $3::text AND e.commit_lsn = u.lsn::pg_lsn AND e.seq = u.seq) AS erased
      FROM unnest($13::text[], $14::text[], $15::int[], $16::text[], $17::text[], $18::timestamptz[])
           AS u(id, lsn, seq, key, corr, ct)),
ins AS (INSERT INTO epitaph.deliveries (id, handler_id, source, commit_lsn, seq, schema_name, table_name, key, correlation_id,
    commit_time, version, phase, priority, released_at, verified, state, outcome, last_error, attempt, settled_at,
    payload_scrubbed_at)
SELECT u.id::uuid, $1::uuid, $3::text, u.lsn::pg_lsn, u.seq, $4::text, $5::text, u.key::jsonb, u.corr, u.ct, $6::int,
       $7::text, $8::int, now(), true, $9::text, $10::text, $11::text, $12::int, now(), now()
FROM u
WHERE EXISTS (SELECT 1 FROM adv) AND NOT u.erased
ON CONFLICT DO NOTHING
RETURNING id::text)
SELECT EXISTS (SELECT 1 FROM adv), ARRAY(SELECT id FROM ins), ARRAY(SELECT id FROM u WHERE erased)`

// cursorSettlePlainSQL is cursorSettleSQL without its ON CONFLICT clause.
var cursorSettlePlainSQL = strings.Replace(cursorSettleSQL, "ON CONFLICT DO NOTHING\n", "", 1)

// cursorRetrySQL releases a failed batch's claim: its range stays claimed
// (claimed_to), retried as a whole after the backoff.
const cursorRetrySQL = `
UPDATE epitaph.handler_cursors SET claim_token = NULL, claim_expires_at = NULL,
       next_attempt_at = now() + $3::bigint * interval '1 millisecond', updated_at = now()
WHERE handler_id = $1::uuid AND claim_token = $2::uuid`

// liveArchive is the live archive version and its rows table.
type liveArchive struct {
	version int
	rows    string
}

// cursorState is the Dispatcher's part for cursor handlers.
type cursorState struct {
	cursorWake chan struct{}
	curMu      sync.Mutex
	curBusy    map[string]bool
	// curQuiet: handlers whose last step found nothing to claim; only
	// their next step reads the cursor before claiming (cursorIdleSQL), so
	// a busy handler pays no extra round trip per batch.
	curQuiet map[string]bool
	// curOwed: the loop left a handler for want of a slot since a slot
	// was last given back.
	curOwed bool
	// curNotBefore: handlers whose rows wait for their batch to fill are
	// not claimed again before this (a wake by every commit would
	// otherwise claim them at every commit).
	curNotBefore map[string]time.Time
	// Archived's last wake (unix ns) and whether one is due at the end
	// of its gap.
	curArchivedAt  atomic.Int64
	curArchivedDue atomic.Bool
	curNext        int
	curLive        liveArchive
	curLiveAt      time.Time
}

func (d *Dispatcher) wakeCursors() {
	select {
	case d.cursorWake <- struct{}{}:
	default:
	}
}

// archivedWakeGap is the least time between two wakes by Archived: a busy
// apply commits hundreds of pages a second, and each wake costs every
// idle cursor handler a read.
const archivedWakeGap = 20 * time.Millisecond

// Archived tells the dispatcher that the archive committed rows or moved
// a watermark: its claim loop (deliveries the apply queued and released)
// and its cursor handlers (rows now behind the horizon) look for work
// now rather than at the next poll, so a delivery leaves within
// milliseconds of its row's commit (at most one wake per
// archivedWakeGap; one that comes sooner is kept for the end of the gap,
// so the last commit of a burst is never left to the poll). Safe to call
// from any goroutine, and cheap.
func (d *Dispatcher) Archived() {
	now := time.Now().UnixNano()
	last := d.curArchivedAt.Load()
	if wait := time.Duration(last + int64(archivedWakeGap) - now); wait > 0 {
		if d.curArchivedDue.CompareAndSwap(false, true) {
			time.AfterFunc(wait, func() {
				d.curArchivedDue.Store(false)
				d.curArchivedAt.Store(time.Now().UnixNano())
				d.wakeForArchive()
			})
		}
		return
	}
	if d.curArchivedAt.CompareAndSwap(last, now) {
		d.wakeForArchive()
	}
}

// wakeForArchive wakes the cursor loop, and the claim loop when its last
// claim found nothing, unless every handler is a cursor handler (nothing
// for it to claim that the apply could have queued, but a late row: the
// poll finds that).
func (d *Dispatcher) wakeForArchive() {
	d.wakeCursors()
	if !d.claimIdle.Load() {
		return
	}
	d.mu.Lock()
	queued := d.defCache == nil
	for _, def := range d.defCache {
		if !def.UsesCursor() {
			queued = true
			break
		}
	}
	d.mu.Unlock()
	if queued {
		d.Wake()
	}
}

// cursorDefs are the enabled cursor handlers (the claim's handler cache,
// or read now when reload).
func (d *Dispatcher) cursorDefs(ctx context.Context, reload bool) ([]Def, error) {
	d.mu.Lock()
	if reload {
		d.defAt = time.Time{}
	}
	byID, fresh := d.defCache, time.Since(d.defAt) < time.Second
	d.mu.Unlock()
	if !fresh {
		var err error
		if byID, err = d.defs(ctx, nil); err != nil {
			return nil, err
		}
	}
	var out []Def
	for _, def := range byID {
		if def.UsesCursor() && def.Enabled && def.RevokedAt == nil {
			out = append(out, def)
		}
	}
	return out, nil
}

// live returns the live archive version (looked up at most every second).
func (d *Dispatcher) live(ctx context.Context) (liveArchive, error) {
	d.curMu.Lock()
	l, at := d.curLive, d.curLiveAt
	d.curMu.Unlock()
	if l.version > 0 && time.Since(at) < time.Second {
		return l, nil
	}
	var schema string
	err := d.pool.QueryRow(ctx, `SELECT version, schema_name FROM epitaph.projection_versions
		WHERE projection = $1 AND state = 'live'`, archiveProjection).Scan(&l.version, &schema)
	if errors.Is(err, pgx.ErrNoRows) {
		return liveArchive{}, nil
	}
	if err != nil {
		return liveArchive{}, fmt.Errorf("look up the live archive: %w", err)
	}
	l.rows = pgx.Identifier{schema, "rows"}.Sanitize()
	d.curMu.Lock()
	d.curLive, d.curLiveAt = l, time.Now()
	d.curMu.Unlock()
	return l, nil
}

// cursorLoop runs the cursor handlers' batches beside the claim loop, at
// most Parallelism at once and one per handler at a time, until the soft
// stop; batches in flight finish (their POSTs bounded by hard).
func (d *Dispatcher) cursorLoop(soft, hard context.Context) {
	slots := make(chan struct{}, d.cfg.Parallelism)
	var running sync.WaitGroup
	t := time.NewTicker(d.cfg.Poll)
	defer t.Stop()
	for soft.Err() == nil {
		defs, err := d.cursorDefs(soft, false)
		if err != nil && soft.Err() == nil {
			d.log.Warn("listing cursor handlers failed; retrying", "err", err)
		}
		d.curMu.Lock()
		start := d.curNext
		d.curNext++
		d.curMu.Unlock()
	handlers:
		for i := range defs {
			def := defs[(start+i)%len(defs)]
			d.curMu.Lock()
			busy := d.curBusy[def.ID] || time.Now().Before(d.curNotBefore[def.ID])
			d.curMu.Unlock()
			if busy {
				continue
			}
			// A handler left for want of a slot is owed a pass when one
			// frees: the step that frees it may have found nothing (and
			// would wake no one), and the handler would wait a poll per
			// batch. The slot is taken, and the debt recorded, under
			// curMu, as the slot is given back, so a step ending between
			// the two cannot miss it.
			d.curMu.Lock()
			select {
			case slots <- struct{}{}:
			default:
				d.curOwed = true
				d.curMu.Unlock()
				break handlers
			}
			d.curBusy[def.ID] = true
			d.curMu.Unlock()
			running.Add(1)
			go func() {
				defer running.Done()
				next, err := d.cursorStep(soft, hard, def)
				if err != nil && soft.Err() == nil {
					d.log.Warn("cursor batch failed; retrying", "handler", def.ID, "err", err)
				}
				d.curMu.Lock()
				delete(d.curBusy, def.ID)
				delete(d.curNotBefore, def.ID)
				if next > 0 {
					// Looked at again when its first row has waited the
					// batch wait, or at the poll if that is sooner (rows may
					// fill the batch before).
					d.curNotBefore[def.ID] = time.Now().Add(min(next, d.cfg.Poll))
				}
				<-slots
				owed := d.curOwed
				d.curOwed = false
				d.curMu.Unlock()
				if next == 0 || owed {
					d.wakeCursors()
				}
				if next > 0 {
					time.AfterFunc(next, d.wakeCursors)
				}
			}()
		}
		select {
		case <-soft.Done():
		case <-t.C:
		case <-d.cursorWake:
		}
	}
	running.Wait()
}

// cursorStep claims, sends and settles one batch of def. It returns when
// to look at def again: 0 at once (it sent a batch), > 0 after that long
// (rows wait for the batch to fill), < 0 at the next poll (nothing to do).
//
// A claim that expired at the handler's last attempt (its dispatcher died
// or stalled past the claim timeout) is reclaimed by the next claim with
// one attempt more than the handler allows: as the queued path's
// maintenance does with an expired claim at max attempts, its deliveries
// are written dead (claim_expired) without another POST, and the cursor
// passes them.
func (d *Dispatcher) cursorStep(soft, hard context.Context, def Def) (time.Duration, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(soft), claimStatementTimeout)
	defer cancel()
	live, err := d.live(ctx)
	if err != nil || live.version == 0 {
		return -1, err
	}
	// At 0 before any duplicate: increase() (EpitaphDeliveriesDuplicated)
	// cannot see a series' first sample.
	d.met.duplicates.WithLabelValues(def.ID)
	d.curMu.Lock()
	quiet := d.curQuiet[def.ID]
	d.curMu.Unlock()
	if quiet {
		var idle bool
		if err := d.pool.QueryRow(ctx, cursorIdleSQL, def.ID, live.version).Scan(&idle); err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return -1, fmt.Errorf("read the cursor: %w", err)
		}
		if idle {
			return -1, nil
		}
	}
	claimedAt := time.Now()
	send, tok, found, wait, err := d.cursorClaim(ctx, def, live)
	if err != nil {
		return -1, err
	}
	d.curMu.Lock()
	d.curQuiet[def.ID] = len(send) == 0 && found == 0
	d.curMu.Unlock()
	if len(send) == 0 {
		if found > 0 {
			// Rows wait for the batch to fill: look again when the first
			// of them has waited the batch wait (a claim that finds nothing
			// due costs as much as one that sends).
			return max(wait, time.Millisecond), nil
		}
		return -1, nil
	}
	if at := send[0].Attempt; at > def.MaxAttempts {
		d.log.Warn("reclaimed a batch whose claim expired at its last attempt: its deliveries are dead",
			"handler", def.ID, "deliveries", len(send), "attempt", at-1, "max_attempts", def.MaxAttempts)
		d.met.reclaimed.Add(float64(len(send)))
		msg := "type=claim_expired code=claim_expired diag=-"
		s := settlement{state: StateDead, outcome: OutcomeClaimExpired, lastError: &msg}
		return 0, d.cursorSettle(hard, def, live, send, tok, s, at-1)
	}
	return 0, d.cursorSend(hard, def, live, send, tok, claimedAt)
}

// cursorIdleSQL tells, without a lock or a write, a cursor with nothing
// to claim: no range claimed (nothing to retry) and the position at the
// horizon, past its last row (a claim or a pass put it there). A claim
// locks the cursor row, which assigns a transaction id and writes WAL: an
// idle handler polled twice a second would burn both for nothing.
const cursorIdleSQL = `
SELECT COALESCE(c.claimed_to_lsn IS NULL AND c.seq = 2147483647
       AND c.commit_lsn >= (SELECT min(COALESCE(source_lsn, '0/0'::pg_lsn)) FROM epitaph.progress
                            WHERE projection = 'archive' AND version = $2), false)
FROM epitaph.handler_cursors c WHERE c.handler_id = $1::uuid`

// cursorClaim runs cursorClaimSQL for def: the claimed batch's deliveries
// and token, or none and how many rows wait for the batch to fill.
func (d *Dispatcher) cursorClaim(ctx context.Context, def Def, live liveArchive) ([]Delivery, string, int64, time.Duration, error) {
	source := d.cfg.Source
	// One round trip: the claim in a transaction of its own with the
	// claim's plan settings. Without them, on an archive growing faster
	// than it is analyzed, the planner read every row of the handler's
	// table through rows_table_key_idx for each batch (13 ms a claim on
	// 43k rows) where walking rows_key from the cursor stops at the batch.
	//
	// The cursor row is locked FOR UPDATE in a statement of its own, before
	// the statement that reads the rows and the horizon. An apply that
	// archives a row at or behind its partition's watermark (a late row:
	// a replayed quarantined event, a rewound partition) reads the cursor
	// FOR SHARE in its transaction and queues the row as a delivery when
	// the claimed position (the cursor, or claimed_to) is at or past it
	// (Enqueue). The two locks conflict, so one of them goes first: the
	// claim waits for such an apply to commit, and under READ COMMITTED its
	// next statement takes a new snapshot that holds the late row and its
	// queued delivery (left out of a retried range, and a first claim
	// starts after it). An apply that comes after the claim waits for the
	// claim's commit and reads the new claimed_to (a locking read returns
	// the row's latest version). Either way a late row is on exactly one
	// path. Locking inside the claim statement would not do: its snapshot
	// is taken before the lock is granted.
	var b pgx.Batch
	b.Queue(`BEGIN`)
	for _, q := range claimPlan {
		b.Queue(q)
	}
	b.Queue(`SELECT 1 FROM epitaph.handler_cursors WHERE handler_id = $1::uuid FOR UPDATE`, def.ID)
	b.Queue(fmt.Sprintf(cursorClaimSQL, live.rows, quoteLiteral(def.Schema), quoteLiteral(def.Table)), def.ID, live.version, source, def.Schema, def.Table,
		def.BatchSize, def.BatchWait.Milliseconds(), def.ClaimTimeout.Milliseconds(), len(def.Columns) > 0)
	b.Queue(`COMMIT`)
	br := d.pool.SendBatch(ctx, &b)
	defer br.Close()
	for range 2 + len(claimPlan) {
		if _, err := br.Exec(); err != nil {
			return nil, "", 0, 0, fmt.Errorf("claim a batch: %w", err)
		}
	}
	rows, err := br.Query()
	if err != nil {
		return nil, "", 0, 0, fmt.Errorf("claim a batch: %w", err)
	}
	var (
		token         *string
		attempt       *int
		key, image    []byte
		corr, lsn     *string
		seq           *int
		commitTime    *time.Time
		found, waitMS int64
		send          []Delivery
		columnsWanted = len(def.Columns) > 0
	)
	_, err = pgx.ForEachRow(rows, []any{&token, &attempt, &key, &image, &corr, &lsn, &seq, &commitTime, &found, &waitMS}, func() error {
		if token == nil {
			return nil
		}
		dv := Delivery{ID: DeliveryID(def.ID, source, *lsn, *seq, 0), HandlerID: def.ID, Source: source,
			CommitLSN: *lsn, Seq: *seq, Schema: def.Schema, Table: def.Table, CorrelationID: *corr,
			Version: live.version, Phase: def.Phase, Attempt: *attempt}
		if len(key) > 0 {
			dv.Key = json.RawMessage(append([]byte(nil), key...))
		}
		if commitTime != nil {
			ct := *commitTime
			dv.CommitTime = &ct
		}
		if columnsWanted && len(image) > 0 {
			var img map[string]json.RawMessage
			if json.Unmarshal(image, &img) == nil {
				dv.Columns = map[string]json.RawMessage{}
				for _, col := range def.Columns {
					if v, ok := img[col]; ok {
						dv.Columns[col] = v
					}
				}
			}
		}
		send = append(send, dv)
		return nil
	})
	if err != nil {
		return nil, "", 0, 0, fmt.Errorf("claim a batch: %w", err)
	}
	if _, err := br.Exec(); err != nil {
		// Not committed (or not known to be): the claim expires.
		return nil, "", 0, 0, fmt.Errorf("claim a batch: commit: %w", err)
	}
	if err := br.Close(); err != nil {
		return nil, "", 0, 0, fmt.Errorf("claim a batch: %w", err)
	}
	if len(send) == 0 {
		return nil, "", found, time.Duration(waitMS) * time.Millisecond, nil
	}
	return send, *token, found, 0, nil
}

// cursorSend sends a claimed batch and settles it: done (the cursor
// passes it), retried as a whole after the backoff, or dead.
func (d *Dispatcher) cursorSend(hard context.Context, def Def, live liveArchive, send []Delivery, tok string, claimedAt time.Time) error {
	deadline := claimedAt.Add(def.ClaimTimeout * 9 / 10)
	actx, acancel := context.WithDeadline(hard, deadline)
	defer acancel()
	body := BatchBody{Deliveries: make([]Body, len(send))}
	ids := make([]string, len(send))
	for i, dv := range send {
		body.Deliveries[i], ids[i] = dv.Body(), dv.ID
	}
	at := send[0].Attempt
	start := time.Now()
	payload, err := json.Marshal(body)
	if err == nil {
		err = d.run.webhook(actx, def, BatchID(ids), at, len(send), payload)
	} else {
		err = Permanent("encode_body", err)
	}
	s := settlement{state: StateDone, outcome: OutcomeDone}
	if err != nil {
		c := &claimed{d: send[0], def: def}
		s = d.failure(c, err)
		if s.state == StateDead {
			// failure counted the first; the queued path counts each.
			d.met.dead.WithLabelValues(def.ID).Add(float64(len(send) - 1))
		}
	}
	d.met.observeN(def, s.outcome, time.Since(start), len(send))
	return d.cursorSettle(hard, def, live, send, tok, s, at)
}

// cursorSettle records a claimed batch's result, guarded by its claim
// token: a failure releases the claim for a retry of the whole range
// after the backoff; done or dead inserts the batch's deliveries settled
// (attempt at) and the cursor passes them.
func (d *Dispatcher) cursorSettle(hard context.Context, def Def, live liveArchive, send []Delivery, tok string, s settlement, at int) error {
	sctx, scancel := context.WithTimeout(context.WithoutCancel(hard), 30*time.Second)
	defer scancel()
	if s.state == StatePending {
		if _, err := d.pool.Exec(sctx, cursorRetrySQL, def.ID, tok, Backoff(def.Backoff, at).Milliseconds()); err != nil {
			return fmt.Errorf("release a failed batch: %w", err)
		}
		return nil
	}
	ids := make([]string, len(send))
	lsns, seqs, keys, corrs := make([]string, len(send)), make([]int32, len(send)), make([]*string, len(send)), make([]string, len(send))
	times := make([]*time.Time, len(send))
	for i, dv := range send {
		ids[i], lsns[i], seqs[i], corrs[i], times[i] = dv.ID, dv.CommitLSN, int32(dv.Seq), dv.CorrelationID, dv.CommitTime
		if len(dv.Key) > 0 {
			k := string(dv.Key)
			keys[i] = &k
		}
	}
	var moved bool
	var inserted, erased []string
	args := []any{def.ID, tok, d.cfg.Source, def.Schema, def.Table, live.version, def.Phase,
		def.Priority, s.state, s.outcome, s.lastError, at, ids, lsns, seqs, keys, corrs, times}
	err := d.settleAgainOnDeadlock(func() error {
		err := d.pool.QueryRow(sctx, cursorSettlePlainSQL, args...).Scan(&moved, &inserted, &erased)
		if uniqueViolation(err) {
			err = d.pool.QueryRow(sctx, cursorSettleSQL, args...).Scan(&moved, &inserted, &erased)
		}
		return err
	}, "handler", def.ID, "deliveries", len(send))
	if err != nil {
		return fmt.Errorf("settle a batch of %d: %w", len(send), err)
	}
	if !moved {
		d.log.Warn("batch outcome discarded: its claim was reclaimed", "handler", def.ID, "deliveries", len(send))
		d.met.stale.Add(float64(len(send)))
		return nil
	}
	if dup := missingIDs(ids, append(inserted, erased...)); len(dup) > 0 {
		d.log.Error("a cursor batch held deliveries that were queued as rows too: they may be sent twice; the cursor passed them",
			"handler", def.ID, "deliveries", dup)
		d.met.duplicates.WithLabelValues(def.ID).Add(float64(len(dup)))
	}
	return nil
}

// missingIDs returns the ids of want not in got.
func missingIDs(want, got []string) []string {
	in := make(map[string]bool, len(got))
	for _, id := range got {
		in[id] = true
	}
	var out []string
	for _, id := range want {
		if !in[id] {
			out = append(out, id)
		}
	}
	return out
}

// cursorOpenSQL counts a cursor handler's open deliveries as Flush waits
// for them: the rows of its table after its cursor up to the horizon, or
// up to its claimed range when that is further (a batch in flight or
// waiting for its retry), before the first row still waiting for its
// commit (the cursor stops there). %s is the live archive's rows table.
const cursorOpenSQL = `
WITH hz AS (SELECT min(COALESCE(source_lsn, '0/0'::pg_lsn)) AS lsn FROM epitaph.progress WHERE projection = 'archive' AND version = $2),
cur AS (SELECT commit_lsn, seq, COALESCE(claimed_to_lsn, '0/0'::pg_lsn) AS to_lsn, COALESCE(claimed_to_seq, 0) AS to_seq
        FROM epitaph.handler_cursors WHERE handler_id = $1::uuid),
after AS (SELECT a.commit_lsn, a.seq, a.verified FROM %s a, cur
          WHERE a.source = $3::text AND a.schema_name = $4 AND a.table_name = $5
            AND (a.commit_lsn, a.seq) > (cur.commit_lsn, cur.seq)
            AND (a.commit_lsn <= (SELECT lsn FROM hz) OR (a.commit_lsn, a.seq) <= (cur.to_lsn, cur.to_seq))
            AND NOT EXISTS (SELECT 1 FROM epitaph.deliveries q WHERE q.handler_id = $1::uuid AND q.source = a.source
                              AND q.commit_lsn = a.commit_lsn AND q.seq = a.seq AND q.generation = 0 OFFSET 0)),
stop AS (SELECT commit_lsn, seq FROM after WHERE NOT verified ORDER BY commit_lsn, seq LIMIT 1)
SELECT (SELECT count(*) FROM after a
        WHERE NOT EXISTS (SELECT 1 FROM stop WHERE (stop.commit_lsn, stop.seq) <= (a.commit_lsn, a.seq))),
       EXISTS (SELECT 1 FROM cur)
         OR NOT EXISTS (SELECT 1 FROM epitaph.handlers h WHERE h.id = $1::uuid AND h.revoked_at IS NULL)`

// cursorOpen counts the open deliveries of the cursor handlers defs. A
// cursor handler without a cursor is an error: nothing would deliver its
// rows, and a count of 0 would say all is done.
func (d *Dispatcher) cursorOpen(ctx context.Context, live liveArchive, defs []Def) (int, error) {
	total := 0
	for _, def := range defs {
		var n int
		var hasCursor bool
		// An unnamed statement each time: a custom plan (see cursorPlan).
		if err := d.pool.QueryRow(ctx, fmt.Sprintf(cursorOpenSQL, live.rows), pgx.QueryExecModeExec, def.ID, live.version, d.cfg.Source,
			def.Schema, def.Table).Scan(&n, &hasCursor); err != nil {
			return -1, fmt.Errorf("count the open deliveries of handler %s: %w", def.ID, err)
		}
		if !hasCursor {
			return -1, fmt.Errorf("handler %s batches without revalidation but has no cursor: its archived rows are not delivered", def.ID)
		}
		total += n
	}
	return total, nil
}

// flushCursors is Flush's part for cursor handlers: it sends their
// batches without waiting for batches to fill, and waits out a failed
// batch's backoff (or another dispatcher's batch in flight), until no
// enabled cursor handler has an open delivery, or ctx ends. It returns
// how many remain (0 when done), as flushRows does.
func (d *Dispatcher) flushCursors(ctx context.Context) (int, error) {
	// The handlers and the live archive as they are now (an enable or a
	// promote just before Flush counts).
	d.curMu.Lock()
	d.curLiveAt = time.Time{}
	d.curMu.Unlock()
	left := -1
	// ended: ctx ended after a count, which is returned (as flushRows
	// does), not ctx's error.
	ended := func(err error) (int, error) {
		if ctx.Err() != nil && left > 0 {
			return left, nil
		}
		return -1, err
	}
	for {
		defs, err := d.cursorDefs(ctx, true)
		if err != nil {
			return ended(err)
		}
		if len(defs) == 0 {
			return 0, nil
		}
		for _, def := range defs {
			def.BatchWait = 0
			for ctx.Err() == nil {
				next, err := d.cursorStep(ctx, ctx, def)
				if err != nil {
					return ended(err)
				}
				if next != 0 {
					break
				}
			}
		}
		if ctx.Err() != nil {
			return ended(ctx.Err())
		}
		live, err := d.live(ctx)
		if err != nil {
			return ended(err)
		}
		if live.version == 0 {
			return 0, nil
		}
		n, err := d.cursorOpen(ctx, live, defs)
		if err != nil {
			return ended(err)
		}
		left = n
		if left == 0 {
			return 0, nil
		}
		// A cursor's rows may wait for an earlier delivery of their key
		// that is queued (a late row, or one an older build queued): those
		// go first.
		if queued, err := d.cursorsQueued(ctx, defs); err != nil {
			return ended(err)
		} else if queued {
			if _, err := d.flushRows(ctx); err != nil {
				return ended(err)
			}
		}
		select {
		case <-ctx.Done():
			return left, nil
		case <-time.After(min(d.cfg.Poll, 200*time.Millisecond)):
		}
	}
}

// cursorsQueued reports whether a cursor handler of defs has a queued
// delivery not yet terminal.
func (d *Dispatcher) cursorsQueued(ctx context.Context, defs []Def) (bool, error) {
	ids := make([]string, len(defs))
	for i, def := range defs {
		ids[i] = def.ID
	}
	var queued bool
	err := d.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM epitaph.deliveries
		WHERE handler_id = ANY($1::text[]::uuid[]) AND state IN ('pending', 'in_flight'))`, ids).Scan(&queued)
	if err != nil {
		return false, fmt.Errorf("look up the queued deliveries of cursor handlers: %w", err)
	}
	return queued, nil
}

// quoteLiteral is s as an SQL string literal.
func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
