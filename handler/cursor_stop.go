package handler

import (
	"cmp"
	"context"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
)

// CursorRow is an archived row whose pending cursor deliveries a caller
// stops (StopCursorRows).
type CursorRow struct {
	Source, Schema, Table, CommitLSN string
	Seq                              int
	// Correlation is the row's transaction; "": read from the archive.
	Correlation string
}

// CursorStop is why StopCursorRows stops a row's cursor deliveries.
type CursorStop int

const (
	// StopRestored: a restore put the row back, so acting on its delete
	// is superseded (stop_superseded), as the restore stops the row's
	// pending queued deliveries. Rows at or behind a handler's claimed
	// position are left alone: delivered, dead, or in a batch in flight,
	// which goes out as a queued delivery in flight does. The handlers'
	// cursor rows are locked FOR SHARE: a claim locks its cursor row
	// before it reads rows, so a row after the position read here is in
	// no claimed batch until this transaction ends, and the claim then
	// sees its stopped delivery.
	StopRestored CursorStop = iota
	// StopErased: the row is erased (stop_revoked); the stopped delivery
	// has neither key nor payload, what an erased row's open queued
	// delivery becomes. Every row after a handler's cursor gets one, a
	// row in a batch in flight included: that batch was read before the
	// erasure and is sent as it is (a request cannot be recalled), and
	// the stopped row makes its settle find the delivery recorded
	// already, so the settle leaves it stopped and keyless instead of
	// writing the erased key back as done. A settle racing the erasure
	// waits for its transaction on the delivery's id. The cursor rows are
	// not locked.
	StopErased
)

// cursorsOfTablesSQL are the cursor handlers of the tables $1
// ("schema.table"), disabled ones included, not revoked, with their
// cursor and their claimed position (the cursor, or the end of the batch
// in flight).
const cursorsOfTablesSQL = `
SELECT h.id::text, h.schema_name || '.' || h.table_name, h.phase, h.priority,
       c.commit_lsn::text, c.seq,
       GREATEST(c.commit_lsn, COALESCE(c.claimed_to_lsn, '0/0'::pg_lsn))::text,
       CASE WHEN c.claimed_to_lsn > c.commit_lsn OR (c.claimed_to_lsn = c.commit_lsn AND c.claimed_to_seq > c.seq)
            THEN c.claimed_to_seq ELSE c.seq END,
       COALESCE((SELECT max(version) FROM epitaph.projection_versions WHERE projection = 'archive' AND state = 'live'), 0)
FROM epitaph.handlers h JOIN epitaph.handler_cursors c ON c.handler_id = h.id
WHERE ` + CursorHandlerSQL + ` AND h.revoked_at IS NULL
  AND h.schema_name || '.' || h.table_name = ANY ($1::text[])
ORDER BY h.id`

// stopCursorDeliveriesSQL inserts the stopped deliveries; $11: keyless
// (erased), $12: the outcome. A restored row's key and transaction come
// from the archive.
const stopCursorDeliveriesSQL = `
INSERT INTO epitaph.deliveries (id, handler_id, source, commit_lsn, seq, schema_name, table_name, key, correlation_id,
    version, phase, priority, state, outcome, settled_at, payload_scrubbed_at)
SELECT u.id::uuid, u.handler::uuid, u.source, u.lsn::pg_lsn, u.seq, u.schema, u.name,
       a.key, COALESCE(NULLIF(u.corr, ''), a.correlation_id, ''), u.ver, u.phase, u.prio, 'stopped', $12, now(), now()
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int[], $6::text[], $7::text[], $8::text[], $9::int[], $10::int[], $13::text[])
     AS u(id, handler, source, lsn, seq, schema, name, phase, prio, ver, corr)
LEFT JOIN LATERAL (SELECT r.key, r.correlation_id FROM archive.rows r
                   WHERE NOT $11::bool AND r.source = u.source AND r.commit_lsn = u.lsn::pg_lsn AND r.seq = u.seq LIMIT 1) a ON true
ON CONFLICT DO NOTHING`

// StopCursorRows records, in tx, the pending deliveries of rows to cursor
// handlers as stopped, for the reason why. A cursor handler's pending
// delivery has no row until its batch settles; the stopped row, under
// the id the delivery would have had, is what keeps the cursor from
// sending it (a claim leaves out rows with a delivery of the handler)
// and what `deliveries list` shows. It returns how many deliveries it
// stopped.
func StopCursorRows(ctx context.Context, tx pgx.Tx, rows []CursorRow, why CursorStop) (int, error) {
	if len(rows) == 0 {
		return 0, nil
	}
	type row struct {
		CursorRow
		lsn event.LSN
	}
	byTable := map[string][]row{}
	var tables []string
	for _, r := range rows {
		l, err := event.ParseLSN(r.CommitLSN)
		if err != nil {
			return 0, fmt.Errorf("row %s/%d: %w", r.CommitLSN, r.Seq, err)
		}
		t := r.Schema + "." + r.Table
		if _, ok := byTable[t]; !ok {
			tables = append(tables, t)
		}
		byTable[t] = append(byTable[t], row{r, l})
	}
	// Each handler's rows in commit order, the order a batch's settle
	// inserts them in: two transactions inserting the same delivery ids in
	// opposite orders wait for each other (a deadlock).
	for _, rs := range byTable {
		slices.SortFunc(rs, func(a, b row) int {
			return cmp.Or(cmp.Compare(a.lsn, b.lsn), cmp.Compare(a.Seq, b.Seq))
		})
	}
	type cursor struct {
		id, table, phase, lsn, claimedLSN string
		priority, seq, claimedSeq, ver    int
	}
	sql, outcome, what := cursorsOfTablesSQL+"\nFOR SHARE OF c", StopSuperseded, "restored"
	if why == StopErased {
		sql, outcome, what = cursorsOfTablesSQL, StopRevoked, "erased"
	}
	var curs []cursor
	var c cursor
	q, err := tx.Query(ctx, sql, tables)
	if err != nil {
		return 0, fmt.Errorf("read the cursor handlers: %w", err)
	}
	if _, err := pgx.ForEachRow(q, []any{&c.id, &c.table, &c.phase, &c.priority, &c.lsn, &c.seq, &c.claimedLSN, &c.claimedSeq, &c.ver}, func() error {
		curs = append(curs, c)
		return nil
	}); err != nil {
		return 0, fmt.Errorf("read the cursor handlers: %w", err)
	}
	var ids, handlers, sources, lsns, schemas, names, phases, corrs []string
	var seqs, prios, vers []int32
	for _, c := range curs {
		pos, posSeq := c.claimedLSN, c.claimedSeq
		if why == StopErased {
			pos, posSeq = c.lsn, c.seq
		}
		at, err := event.ParseLSN(pos)
		if err != nil {
			return 0, fmt.Errorf("the cursor of handler %s: %w", c.id, err)
		}
		for _, r := range byTable[c.table] {
			l := r.lsn
			if l < at || (l == at && r.Seq <= posSeq) {
				continue // its delivery is recorded, or (restored) in a batch in flight
			}
			ids = append(ids, DeliveryID(c.id, r.Source, l.String(), r.Seq, 0))
			handlers, sources, lsns, seqs = append(handlers, c.id), append(sources, r.Source), append(lsns, l.String()), append(seqs, int32(r.Seq))
			schemas, names, corrs = append(schemas, r.Schema), append(names, r.Table), append(corrs, r.Correlation)
			phases, prios, vers = append(phases, c.phase), append(prios, int32(c.priority)), append(vers, int32(c.ver))
		}
	}
	if len(ids) == 0 {
		return 0, nil
	}
	tag, err := tx.Exec(ctx, stopCursorDeliveriesSQL, ids, handlers, sources, lsns, seqs, schemas, names, phases, prios, vers,
		why == StopErased, string(outcome), corrs)
	if err != nil {
		return 0, fmt.Errorf("stop the %s rows' cursor deliveries: %w", what, err)
	}
	return int(tag.RowsAffected()), nil
}
