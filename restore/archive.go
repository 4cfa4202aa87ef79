package restore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// archived is one archive row to put back.
type archived struct {
	schema, table string
	key           json.RawMessage
	// row: the archived image with text_values laid over it, so every
	// member is the event's exact value.
	row       map[string]json.RawMessage
	columns   []event.Column
	source    string
	commitLSN string
	seq       int
	restored  bool // inserted by this restore (not skipped)
	// The INSERT (planned).
	insert string
	args   []any
}

func (a *archived) qualified() string { return a.schema + "." + a.table }

func (a *archived) ref() RowRef { return RowRef{Table: a.qualified(), Key: a.key} }

// Reads go through the reader views (archive.rows, archive.snapshots), so
// what retention or erasure hides is never restored.
const selectRows = `
SELECT schema_name, table_name, key, row, identity, columns, text_values, source, commit_lsn::text, seq
FROM archive.rows WHERE source = $1 AND correlation_id = $2`

// loadRows reads the archived rows cfg names, in delete order.
func loadRows(ctx context.Context, target *pgxpool.Pool, cfg Config) ([]*archived, error) {
	q, args := selectRows, []any{cfg.Source, cfg.CorrelationID}
	var want map[string]bool // table + key of a snapshot subtree
	switch {
	case len(cfg.Key) > 0:
		schema, table, _ := strings.Cut(cfg.Table, ".")
		q += ` AND schema_name = $3 AND table_name = $4 AND key = $5::jsonb`
		args = append(args, schema, table, string(cfg.Key))
	case len(cfg.RootKey) > 0:
		var err error
		if want, err = subtree(ctx, target, cfg); err != nil {
			return nil, err
		}
	}
	rows, err := target.Query(ctx, q+` ORDER BY seq`, args...)
	if err != nil {
		return nil, fmt.Errorf("read archived rows of %s: %w", cfg.CorrelationID, err)
	}
	all, err := pgx.CollectRows(rows, scanArchived)
	if err != nil {
		return nil, fmt.Errorf("read archived rows of %s: %w", cfg.CorrelationID, err)
	}
	// A key deleted twice in one transaction (deleted, inserted again,
	// deleted) is put back as it was last: the later version wins. Rows of
	// a table without a key are each a row of their own, duplicates
	// included: nothing says two of them were one row.
	last := map[string]int{}
	for i, a := range all {
		if hasKey(a.key) {
			last[nodeID(a.qualified(), a.key)] = i
		}
	}
	var out []*archived
	for i, a := range all {
		id := nodeID(a.qualified(), a.key)
		if (!hasKey(a.key) || last[id] == i) && (want == nil || want[id]) {
			out = append(out, a)
		}
	}
	if len(out) == 0 {
		return nil, cannot("no archived rows of %s match (not archived yet, not verified, expired or erased; archive.status tells whether the archive is complete)", cfg.CorrelationID)
	}
	return out, nil
}

func scanArchived(r pgx.CollectableRow) (*archived, error) {
	a := &archived{}
	var key, row, cols, texts []byte
	var identity *string
	if err := r.Scan(&a.schema, &a.table, &key, &row, &identity, &cols, &texts, &a.source, &a.commitLSN, &a.seq); err != nil {
		return nil, err
	}
	a.key = canonical(key)
	if identity == nil || *identity != event.IdentityFull || len(row) == 0 {
		return nil, cannot("%s %s was archived with its key only (replica identity not FULL): the rest of the row is not known", a.qualified(), a.key)
	}
	if err := json.Unmarshal(row, &a.row); err != nil || a.row == nil {
		return nil, fmt.Errorf("archived row %s %s is not a JSON object", a.qualified(), a.key)
	}
	if len(a.row) == 0 {
		return nil, cannot("%s has no columns: its archived rows hold no value, so how many there were and what they were cannot be put back", a.qualified())
	}
	if len(cols) == 0 || json.Unmarshal(cols, &a.columns) != nil || len(a.columns) == 0 {
		return nil, cannot("%s %s has no column types in the archive", a.qualified(), a.key)
	}
	if len(texts) > 0 {
		var tv map[string]string
		if err := json.Unmarshal(texts, &tv); err != nil {
			return nil, fmt.Errorf("archived row %s %s: text_values: %w", a.qualified(), a.key, err)
		}
		for name, text := range tv {
			a.row[name] = json.RawMessage(text)
		}
	}
	return a, nil
}

// canonical compacts a JSON text, so keys compare as text.
func canonical(b []byte) json.RawMessage {
	var v any
	if json.Unmarshal(b, &v) != nil {
		return b
	}
	out, err := json.Marshal(v)
	if err != nil {
		return b
	}
	return out
}

// hasKey reports whether key names a row: a JSON object with a member
// (a table without a primary key or replica identity index has none).
func hasKey(key json.RawMessage) bool {
	var m map[string]json.RawMessage
	return json.Unmarshal(key, &m) == nil && len(m) > 0
}

func nodeID(table string, key json.RawMessage) string { return table + " " + string(canonical(key)) }

// snapshotNode is one node of a snapshot payload.
type snapshotNode struct {
	Table    string                    `json:"table"`
	Key      json.RawMessage           `json:"key"`
	Children map[string][]snapshotNode `json:"children"`
}

// subtree returns the rows (table + key) of the root's snapshot.
func subtree(ctx context.Context, target *pgxpool.Pool, cfg Config) (map[string]bool, error) {
	rows, err := target.Query(ctx, `
		SELECT root_table, status, payload FROM archive.snapshots
		WHERE correlation_id = $1 AND root_key = $2::jsonb AND ($3 = '' OR root_table = $3)`,
		cfg.CorrelationID, string(cfg.RootKey), cfg.Table)
	if err != nil {
		return nil, fmt.Errorf("read snapshot of %s %s: %w", cfg.CorrelationID, cfg.RootKey, err)
	}
	type snap struct {
		table, status string
		payload       []byte
	}
	snaps, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (snap, error) {
		var s snap
		return s, r.Scan(&s.table, &s.status, &s.payload)
	})
	if err != nil {
		return nil, fmt.Errorf("read snapshot of %s %s: %w", cfg.CorrelationID, cfg.RootKey, err)
	}
	switch {
	case len(snaps) == 0:
		return nil, cannot("no snapshot of root %s in %s (is its table a --snapshot-roots table?)", cfg.RootKey, cfg.CorrelationID)
	case len(snaps) > 1:
		return nil, cannot("roots of several tables have key %s in %s: name the root's table with --table", cfg.RootKey, cfg.CorrelationID)
	case snaps[0].status != "complete":
		return nil, cannot("the snapshot of %s %s is %s, not complete", snaps[0].table, cfg.RootKey, snaps[0].status)
	}
	// {"root": node, "children": {table: [node, ...]}, "meta": ...}
	var payload struct {
		Root     snapshotNode              `json:"root"`
		Children map[string][]snapshotNode `json:"children"`
	}
	if err := json.Unmarshal(snaps[0].payload, &payload); err != nil {
		return nil, fmt.Errorf("snapshot of %s %s: %w", snaps[0].table, cfg.RootKey, err)
	}
	want := map[string]bool{}
	var walk func(n snapshotNode)
	walk = func(n snapshotNode) {
		want[nodeID(n.Table, n.Key)] = true
		for _, kids := range n.Children {
			for _, k := range kids {
				walk(k)
			}
		}
	}
	payload.Root.Children = payload.Children
	walk(payload.Root)
	return want, nil
}

// record inserts the restore's row (outcome running) before the source
// is touched.
func record(ctx context.Context, target *pgxpool.Pool, cfg Config) (int64, error) {
	var id int64
	err := target.QueryRow(ctx, `
		INSERT INTO epitaph.restores (actor, source, correlation_id, root_table, root_key, table_name, key, on_conflict)
		VALUES ($1, $2, $3, NULLIF($4, ''), $5::jsonb, NULLIF($6, ''), $7::jsonb, $8) RETURNING id`,
		cfg.Actor, cfg.Source, cfg.CorrelationID, rootTable(cfg), nullable(cfg.RootKey), rowTable(cfg), nullable(cfg.Key),
		cfg.OnConflict).Scan(&id)
	var pg *pgconn.PgError
	if errors.As(err, &pg) && pg.Code == "42P01" {
		return 0, errors.New("record restore: epitaph.restores does not exist: run `projector migrate` on the target")
	}
	if err != nil {
		return 0, fmt.Errorf("record restore: %w", err)
	}
	return id, nil
}

func rootTable(cfg Config) string {
	if len(cfg.RootKey) > 0 {
		return cfg.Table
	}
	return ""
}

func rowTable(cfg Config) string {
	if len(cfg.Key) > 0 {
		return cfg.Table
	}
	return ""
}

func nullable(v json.RawMessage) *string {
	if len(v) == 0 {
		return nil
	}
	s := string(v)
	return &s
}

// finish records a restore's outcome.
func finish(ctx context.Context, db interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, res *Result, cause error) error {
	planJSON, err := json.Marshal(res.Tables)
	if err != nil {
		return fmt.Errorf("encode plan: %w", err)
	}
	var reason *string
	if cause != nil {
		s := quarantine.Sanitize(cause)
		reason = &s
	}
	_, err = db.Exec(context.WithoutCancel(ctx), `
		UPDATE epitaph.restores SET outcome = $2, rows_restored = $3, rows_skipped = $4, plan = $5::jsonb,
		       error = $6, finished_at = now()
		WHERE id = $1`, res.ID, res.Outcome, res.Restored, res.Skipped, string(planJSON), reason)
	if err != nil {
		return fmt.Errorf("record outcome of restore %d: %w", res.ID, err)
	}
	return nil
}

// supersedeSQL stops the pending deliveries of restored rows: the row is
// back, so acting on its delete is superseded.
const supersedeSQL = `
UPDATE epitaph.deliveries d
SET state = 'stopped', outcome = 'stop_superseded', payload = NULL, payload_scrubbed_at = now(),
    settled_at = now(), updated_at = now()
FROM unnest($1::text[], $2::pg_lsn[], $3::int[]) AS r(source, commit_lsn, seq)
WHERE d.state = 'pending' AND d.source = r.source AND d.commit_lsn = r.commit_lsn AND d.seq = r.seq`

// settle records a restore that committed in the source, and stops the
// restored rows' pending deliveries, in one target transaction.
func settle(ctx context.Context, target *pgxpool.Pool, res *Result, rows []*archived) (int, error) {
	var n int
	err := pgx.BeginFunc(context.WithoutCancel(ctx), target, func(tx pgx.Tx) error {
		var sources, lsns []string
		var seqs []int32
		var cursorRows []handler.CursorRow
		for _, a := range rows {
			if !a.restored {
				continue
			}
			sources, lsns, seqs = append(sources, a.source), append(lsns, a.commitLSN), append(seqs, int32(a.seq))
			cursorRows = append(cursorRows, handler.CursorRow{Source: a.source, Schema: a.schema, Table: a.table,
				CommitLSN: a.commitLSN, Seq: a.seq})
		}
		tag, err := tx.Exec(ctx, supersedeSQL, sources, lsns, seqs)
		if err != nil {
			return fmt.Errorf("stop deliveries of restored rows: %w", err)
		}
		n = int(tag.RowsAffected())
		// A handler that follows a cursor has no row for a pending
		// delivery: it gets a stopped one, which keeps the cursor from it.
		c, err := handler.StopCursorRows(ctx, tx, cursorRows, handler.StopRestored)
		if err != nil {
			return err
		}
		n += c
		return finish(ctx, tx, res, nil)
	})
	return n, err
}
