package handler

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
)

// CursorRow is an archived row whose pending cursor deliveries a caller
// stops (SupersedeCursorRows).
type CursorRow struct {
	Source, Schema, Table, CommitLSN string
	Seq                              int
}

// cursorsOfTablesSQL are the cursor handlers of the tables $1
// ("schema.table"), not revoked, with their claimed position (the
// cursor, or the end of the batch in flight), their cursor rows locked
// FOR SHARE: a claim locks its cursor row before it reads rows, so a row
// after the position read here is in no claimed batch until this
// transaction ends, and the claim then sees its stopped delivery.
const cursorsOfTablesSQL = `
SELECT h.id::text, h.schema_name || '.' || h.table_name, h.phase, h.priority,
       GREATEST(c.commit_lsn, COALESCE(c.claimed_to_lsn, '0/0'::pg_lsn))::text,
       CASE WHEN c.claimed_to_lsn > c.commit_lsn OR (c.claimed_to_lsn = c.commit_lsn AND c.claimed_to_seq > c.seq)
            THEN c.claimed_to_seq ELSE c.seq END,
       COALESCE((SELECT max(version) FROM epitaph.projection_versions WHERE projection = 'archive' AND state = 'live'), 0)
FROM epitaph.handlers h JOIN epitaph.handler_cursors c ON c.handler_id = h.id
WHERE ` + CursorHandlerSQL + ` AND h.revoked_at IS NULL
  AND h.schema_name || '.' || h.table_name = ANY ($1::text[])
ORDER BY h.id
FOR SHARE OF c`

// SupersedeCursorRows records, in tx, the pending deliveries of rows to
// cursor handlers as stopped with outcome stop_superseded, as a restore
// stops the pending queued deliveries of the rows it put back: the row
// is back, so acting on its delete is superseded. A cursor handler's
// pending delivery has no row until its batch settles; the stopped row,
// under the id the delivery would have had, is what keeps the cursor
// from sending it (a claim leaves out rows with a delivery of the
// handler) and what `deliveries list` shows. Rows at or behind a
// handler's claimed position are left alone: delivered, dead, or in a
// batch in flight, which goes out as a queued delivery in flight does.
// It returns how many deliveries it stopped.
func SupersedeCursorRows(ctx context.Context, tx pgx.Tx, rows []CursorRow) (int, error) {
	if len(rows) == 0 {
		return 0, nil
	}
	byTable := map[string][]CursorRow{}
	var tables []string
	for _, r := range rows {
		t := r.Schema + "." + r.Table
		if _, ok := byTable[t]; !ok {
			tables = append(tables, t)
		}
		byTable[t] = append(byTable[t], r)
	}
	type cursor struct {
		id, table, phase, lsn string
		priority, seq, ver    int
	}
	var curs []cursor
	var c cursor
	q, err := tx.Query(ctx, cursorsOfTablesSQL, tables)
	if err != nil {
		return 0, fmt.Errorf("read the cursor handlers: %w", err)
	}
	if _, err := pgx.ForEachRow(q, []any{&c.id, &c.table, &c.phase, &c.priority, &c.lsn, &c.seq, &c.ver}, func() error {
		curs = append(curs, c)
		return nil
	}); err != nil {
		return 0, fmt.Errorf("read the cursor handlers: %w", err)
	}
	var ids, handlers, sources, lsns, schemas, names, phases []string
	var seqs, prios, vers []int32
	for _, c := range curs {
		at, err := event.ParseLSN(c.lsn)
		if err != nil {
			return 0, fmt.Errorf("the cursor of handler %s: %w", c.id, err)
		}
		for _, r := range byTable[c.table] {
			l, err := event.ParseLSN(r.CommitLSN)
			if err != nil {
				return 0, fmt.Errorf("row %s/%d: %w", r.CommitLSN, r.Seq, err)
			}
			if l < at || (l == at && r.Seq <= c.seq) {
				continue
			}
			ids = append(ids, DeliveryID(c.id, r.Source, l.String(), r.Seq, 0))
			handlers, sources, lsns, seqs = append(handlers, c.id), append(sources, r.Source), append(lsns, l.String()), append(seqs, int32(r.Seq))
			schemas, names = append(schemas, r.Schema), append(names, r.Table)
			phases, prios, vers = append(phases, c.phase), append(prios, int32(c.priority)), append(vers, int32(c.ver))
		}
	}
	if len(ids) == 0 {
		return 0, nil
	}
	tag, err := tx.Exec(ctx, `
		INSERT INTO epitaph.deliveries (id, handler_id, source, commit_lsn, seq, schema_name, table_name, key, correlation_id,
		    version, phase, priority, state, outcome, settled_at, payload_scrubbed_at)
		SELECT u.id::uuid, u.handler::uuid, u.source, u.lsn::pg_lsn, u.seq, u.schema, u.name,
		       a.key, COALESCE(a.correlation_id, ''), u.ver, u.phase, u.prio, 'stopped', 'stop_superseded', now(), now()
		FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int[], $6::text[], $7::text[], $8::text[], $9::int[], $10::int[])
		     AS u(id, handler, source, lsn, seq, schema, name, phase, prio, ver)
		LEFT JOIN LATERAL (SELECT r.key, r.correlation_id FROM archive.rows r
		                   WHERE r.source = u.source AND r.commit_lsn = u.lsn::pg_lsn AND r.seq = u.seq LIMIT 1) a ON true
		ON CONFLICT DO NOTHING`, ids, handlers, sources, lsns, seqs, schemas, names, phases, prios, vers)
	if err != nil {
		return 0, fmt.Errorf("stop the restored rows' cursor deliveries: %w", err)
	}
	return int(tag.RowsAffected()), nil
}
