package erasure

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/handler"
)

// erasedRef is what an erased row's delivery records besides its
// identity: its table ("schema.table") and its transaction.
type erasedRef struct {
	id    rowIdentity
	table string
	corr  string
}

// cursorHandlersSQL are the cursor handlers (handler.Def.UsesCursor:
// webhooks that batch without revalidation) of the tables $1 ("schema.table")
// that are not revoked, disabled ones included, with their cursors.
const cursorHandlersSQL = `
SELECT h.id::text, h.schema_name || '.' || h.table_name, h.phase, h.priority, c.commit_lsn::text, c.seq,
       COALESCE((SELECT max(version) FROM epitaph.projection_versions WHERE projection = 'archive' AND state = 'live'), 0)
FROM epitaph.handlers h JOIN epitaph.handler_cursors c ON c.handler_id = h.id
WHERE ` + handler.CursorHandlerSQL + ` AND h.revoked_at IS NULL
  AND h.schema_name || '.' || h.table_name = ANY ($1::text[])`

// stopCursorDeliveries records, in the erasure's transaction, the
// pending deliveries of the erased rows to cursor handlers as stopped
// (stop_revoked), with neither key nor payload: what an erased row's
// open queued delivery becomes (eraseDeliveries). A cursor handler's
// pending deliveries have no row until their batch settles: they are the
// archived rows of its table after its cursor, so an erased row, gone
// from the archive, is never delivered; the stopped row says so where
// `deliveries list` looks, under the id it would have had.
//
// A batch in flight (claimed, not settled) that holds an erased row was
// read before the erasure and is sent as it is: a request cannot be
// recalled, as a queued delivery in flight cannot. The row inserted here
// makes the batch's settle find the erased row's delivery recorded
// already: it must leave it stopped and keyless, never write the erased
// key back as a done delivery. The insert comes before eraseDeliveries,
// which then also clears the key of a delivery a settle wrote first. A
// settle racing it waits for this transaction on the delivery's id.
func stopCursorDeliveries(ctx context.Context, tx pgx.Tx, erased []erasedRef) error {
	if len(erased) == 0 {
		return nil
	}
	byTable := map[string][]erasedRef{}
	for _, e := range erased {
		byTable[e.table] = append(byTable[e.table], e)
	}
	tables := make([]string, 0, len(byTable))
	for t := range byTable {
		tables = append(tables, t)
	}
	rows, err := tx.Query(ctx, cursorHandlersSQL, tables)
	if err != nil {
		return fmt.Errorf("read the cursor handlers: %w", err)
	}
	type cursor struct {
		id, table, phase, lsn string
		priority, seq, ver    int
	}
	var curs []cursor
	var c cursor
	if _, err := pgx.ForEachRow(rows, []any{&c.id, &c.table, &c.phase, &c.priority, &c.lsn, &c.seq, &c.ver}, func() error {
		curs = append(curs, c)
		return nil
	}); err != nil {
		return fmt.Errorf("read the cursor handlers: %w", err)
	}
	var ids, handlers, sources, lsns, schemas, names, corrs, phases []string
	var seqs, prios, vers []int32
	for _, c := range curs {
		at, err := event.ParseLSN(c.lsn)
		if err != nil {
			return fmt.Errorf("the cursor of handler %s: %w", c.id, err)
		}
		schema, name, _ := strings.Cut(c.table, ".")
		for _, e := range byTable[c.table] {
			if e.id.lsn < at || (e.id.lsn == at && e.id.seq <= c.seq) {
				continue // delivered already (or dead): its row records it
			}
			lsn := e.id.lsn.String()
			ids = append(ids, handler.DeliveryID(c.id, e.id.source, lsn, e.id.seq, 0))
			handlers, sources, lsns, seqs = append(handlers, c.id), append(sources, e.id.source), append(lsns, lsn), append(seqs, int32(e.id.seq))
			schemas, names, corrs = append(schemas, schema), append(names, name), append(corrs, e.corr)
			phases, prios, vers = append(phases, c.phase), append(prios, int32(c.priority)), append(vers, int32(c.ver))
		}
	}
	if len(ids) == 0 {
		return nil
	}
	if _, err := tx.Exec(ctx, `
		INSERT INTO epitaph.deliveries (id, handler_id, source, commit_lsn, seq, schema_name, table_name, key, correlation_id,
		    version, phase, priority, state, outcome, settled_at, payload_scrubbed_at)
		SELECT u.id::uuid, u.handler::uuid, u.source, u.lsn::pg_lsn, u.seq, u.schema, u.name, NULL, u.corr,
		       u.ver, u.phase, u.prio, 'stopped', 'stop_revoked', now(), now()
		FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int[], $6::text[], $7::text[], $8::text[], $9::text[], $10::int[], $11::int[])
		     AS u(id, handler, source, lsn, seq, schema, name, corr, phase, prio, ver)
		ON CONFLICT DO NOTHING`, ids, handlers, sources, lsns, seqs, schemas, names, corrs, phases, prios, vers); err != nil {
		return fmt.Errorf("stop the erased rows' cursor deliveries: %w", err)
	}
	return nil
}
