package snapshot

import (
	"context"
	"fmt"
	"maps"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
)

// FencedRow is a row of a source transaction that a version will never
// hold: an erasure removed it, or an erasure fence kept it out when the
// version applied it.
type FencedRow struct {
	CorrelationID string
	Source        string
	CommitLSN     event.LSN
	Seq           int
	Table         string // "schema.table"
}

// discountSQL records fenced rows and takes the ones not recorded before
// out of the expected counts of their transactions' jobs and group.
const discountSQL = `
WITH f AS (
    INSERT INTO %[1]s (source, commit_lsn, seq, correlation_id, table_name)
    SELECT * FROM unnest($1::text[], $2::pg_lsn[], $3::int[], $4::text[], $5::text[])
    ON CONFLICT DO NOTHING
    RETURNING correlation_id, table_name
), per AS (
    SELECT correlation_id, jsonb_object_agg(table_name, n) AS tables, sum(n)::int AS n
      FROM (SELECT correlation_id, table_name, count(*)::int AS n FROM f GROUP BY 1, 2) t
     GROUP BY 1
), jobs AS (
    UPDATE %[2]s s
       SET expected_tables = (SELECT coalesce(jsonb_object_agg(k, greatest(v::int - coalesce((per.tables->>k)::int, 0), 0)), '{}'::jsonb)
                                FROM jsonb_each_text(s.expected_tables) AS e(k, v)),
           expected_rows = greatest(s.expected_rows - per.n, 0), updated_at = now()
      FROM per
     WHERE s.correlation_id = per.correlation_id
    RETURNING 1
), groups AS (
    UPDATE %[3]s g
       SET expected_tables = (SELECT coalesce(jsonb_object_agg(k, greatest(v::int - coalesce((per.tables->>k)::int, 0), 0)), '{}'::jsonb)
                                FROM jsonb_each_text(g.expected_tables) AS e(k, v)),
           expected_rows = greatest(g.expected_rows - per.n, 0)
      FROM per
     WHERE g.correlation_id = per.correlation_id
    RETURNING 1
)
SELECT count(*)::int FROM f`

// Discount records, in the caller's transaction, rows of source
// transactions that version schema will never hold (erased from it, or
// left out by an erasure fence when applied), so that the transactions'
// documents are complete without them: jobs already made have the rows
// taken out of their expected counts now, jobs made later (the commit
// applied after, a late root row) are made with them taken out. Each row
// counts once, however often it is recorded (a replayed event fenced
// again). It returns how many rows were new. The caller invalidates the
// jobs whose documents held the rows (Invalidate).
func Discount(ctx context.Context, tx pgx.Tx, schema string, rows []FencedRow) (int, error) {
	if len(rows) == 0 {
		return 0, nil
	}
	var sources, lsns, corrs, tables []string
	var seqs []int32
	for _, r := range rows {
		sources, lsns, seqs = append(sources, r.Source), append(lsns, r.CommitLSN.String()), append(seqs, int32(r.Seq))
		corrs, tables = append(corrs, r.CorrelationID), append(tables, r.Table)
	}
	var n int
	err := tx.QueryRow(ctx, fmt.Sprintf(discountSQL, table(schema, "snapshot_fenced"), table(schema, "snapshots"),
		table(schema, "snapshot_groups")), sources, lsns, seqs, corrs, tables).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("discount %d fenced rows from snapshot jobs: %w", len(rows), err)
	}
	return n, nil
}

// fencedTx is what snapshot_fenced holds of one transaction.
type fencedTx struct {
	tables map[string]int
	seqs   []int
}

// counts are commit c's counts less the fenced rows: per table (none when
// the commit has no per-table counts) and in all.
func (f *fencedTx) counts(c *event.Event) (map[string]int, int) {
	tables := maps.Clone(c.Tables)
	if tables == nil {
		tables = map[string]int{}
	}
	if f == nil {
		return tables, c.Rows
	}
	for t, n := range f.tables {
		if _, ok := tables[t]; ok {
			tables[t] = max(tables[t]-n, 0)
		}
	}
	return tables, max(c.Rows-len(f.seqs), 0)
}

// loadFenced reads the fenced rows of the transactions (sources[i],
// lsns[i]), one query for all.
func loadFenced(ctx context.Context, tx pgx.Tx, schema string, sources, lsns []string) (map[txKey]*fencedTx, error) {
	rows, err := tx.Query(ctx, fmt.Sprintf(`
SELECT source, commit_lsn::text, seq, table_name FROM %s
 WHERE (source, commit_lsn) IN (SELECT * FROM unnest($1::text[], $2::pg_lsn[]))`, table(schema, "snapshot_fenced")), sources, lsns)
	if err != nil {
		return nil, fmt.Errorf("read fenced rows of %d transactions: %w", len(sources), err)
	}
	out := map[txKey]*fencedTx{}
	var k txKey
	var seq int
	var tbl string
	_, err = pgx.ForEachRow(rows, []any{&k[0], &k[1], &seq, &tbl}, func() error {
		f := out[k]
		if f == nil {
			f = &fencedTx{tables: map[string]int{}}
			out[k] = f
		}
		f.tables[tbl]++
		f.seqs = append(f.seqs, seq)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read fenced rows of %d transactions: %w", len(sources), err)
	}
	return out, nil
}
