package erasure

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
)

// erasureLockKey is the advisory lock epitaph.erasure_epoch() takes shared
// in every apply's insert statement ("erasure!" in ASCII).
const erasureLockKey int64 = 7310012293695300897

// EraseOptions is one "projector erase".
type EraseOptions struct {
	// Table is "schema.table".
	Table string
	// Key (exact key) or Match (top-level columns equal, JSON containment
	// on the row image): exactly one.
	Key, Match json.RawMessage
	// WithChildren also erases the rows of the same source transaction that
	// reference an erased row by the events' foreign keys, transitively.
	WithChildren bool
	Reason       string
	// Actor is who erases (the CLI defaults it to the OS user).
	Actor string
	// PurgeStream is recorded on the receipt; the stream purge itself is
	// PurgeStream (purge.go), run after Erase.
	PurgeStream bool
	// LockTimeout bounds the wait for applies in flight; default 60s.
	LockTimeout time.Duration
	// IgnoreHolds erases rows under a legal hold too (otherwise Erase
	// fails with ErrHeld and changes nothing).
	IgnoreHolds bool
}

// Receipt is one erasure (a row of epitaph.erasures): what was removed
// where and how many, never the data.
type Receipt struct {
	ID           int64          `json:"id"`
	Table        string         `json:"table"`
	Mode         string         `json:"mode"`
	Columns      []string       `json:"columns"`
	WithChildren bool           `json:"with_children"`
	PurgeStream  bool           `json:"purge_stream"`
	Reason       *string        `json:"reason"`
	Actor        string         `json:"actor"`
	Runs         int            `json:"runs"`
	Removed      map[string]int `json:"removed"`
	// Unchecked counts, per place, what the last run could not match by
	// value and so could not rule out: "epitaph.quarantine" is the
	// quarantine entries whose message cannot be decoded and did not match
	// by what could be read of them (quarantine.go).
	Unchecked   map[string]int `json:"unchecked"`
	CreatedAt   time.Time      `json:"created_at"`
	UpdatedAt   time.Time      `json:"updated_at"`
	CompletedAt *time.Time     `json:"completed_at"`
}

// ErrBadSelector is a usage error of Erase and AddLegalHold.
var ErrBadSelector = errors.New("bad selector")

// selector checks table and exactly one of key and match.
func selector(table string, key, match json.RawMessage) (schema, name, mode string, sel json.RawMessage, cols []string, err error) {
	schema, name, ok := strings.Cut(table, ".")
	if !ok || schema == "" || name == "" || strings.Contains(name, ".") {
		return "", "", "", nil, nil, fmt.Errorf("%w: --table %q: want schema.table", ErrBadSelector, table)
	}
	switch {
	case len(key) > 0 && len(match) > 0, len(key) == 0 && len(match) == 0:
		return "", "", "", nil, nil, fmt.Errorf("%w: give exactly one of --key JSON and --match JSON", ErrBadSelector)
	case len(key) > 0:
		mode, sel = EraseByKey, key
	default:
		mode, sel = EraseByMatch, match
	}
	cols, err = selectorColumns(mode, sel)
	if err != nil {
		return "", "", "", nil, nil, fmt.Errorf("%w: %w", ErrBadSelector, err)
	}
	return schema, name, mode, sel, cols, nil
}

// Erase records the erasure's fence (or finds it: erasing again is a no-op
// that counts a run) and then, in one transaction under the erasure lock,
// removes the matching rows (and with WithChildren their children) from
// every version's archive, the snapshot documents rooted at them (other
// documents of their transactions are rebuilt without them), the payloads
// of their quarantine entries (the entries stay, discarded, as audit) and
// of their deliveries (pending work stops as stop_revoked); quarantine
// entries that cannot be decoded are matched by what can be read of them
// and the rest counted on the receipt (Receipt.Unchecked). Applies in
// flight finish first; later ones see the fence (fence.go here).
func Erase(ctx context.Context, pool *pgxpool.Pool, opts EraseOptions) (Receipt, error) {
	schema, name, mode, sel, cols, err := selector(opts.Table, opts.Key, opts.Match)
	if err != nil {
		return Receipt{}, err
	}
	if opts.Actor == "" {
		return Receipt{}, fmt.Errorf("%w: an erasure needs an actor", ErrBadSelector)
	}
	if opts.LockTimeout <= 0 {
		opts.LockTimeout = time.Minute
	}
	var key []byte
	if err := pool.QueryRow(ctx, `SELECT key FROM epitaph.erasure_secret`).Scan(&key); err != nil {
		return Receipt{}, fmt.Errorf("read erasure key: %w", err)
	}
	var reason *string
	if opts.Reason != "" {
		reason = &opts.Reason
	}
	if sel, err = checkShape(ctx, pool, schema, name, mode, sel); err != nil {
		return Receipt{}, err
	}
	digest, _ := rowDigest(key, opts.Table, mode, cols, sel)
	if !opts.IgnoreHolds {
		if err := refuseHeld(ctx, pool, schema, name, mode, sel); err != nil {
			return Receipt{}, err
		}
	}
	// 1. The fence, committed before anything is removed: an apply that
	// starts from here on skips the rows.
	var id int64
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		err := tx.QueryRow(ctx, `
			INSERT INTO epitaph.erasures (schema_name, table_name, mode, columns, digest, with_children, purge_stream, reason, actor)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
			ON CONFLICT ON CONSTRAINT erasures_once DO UPDATE
			   SET runs = erasures.runs + 1, updated_at = now(), actor = EXCLUDED.actor,
			       reason = COALESCE(EXCLUDED.reason, erasures.reason),
			       with_children = erasures.with_children OR EXCLUDED.with_children,
			       purge_stream = erasures.purge_stream OR EXCLUDED.purge_stream
			RETURNING id`, schema, name, mode, cols, digest, opts.WithChildren, opts.PurgeStream, reason, opts.Actor).Scan(&id)
		if err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `UPDATE epitaph.erasure_epoch SET epoch = epoch + 1`)
		return err
	})
	if err != nil {
		return Receipt{}, fmt.Errorf("record erasure fence: %w", err)
	}
	// 2. The removal, under the erasure lock taken exclusively: it waits
	// for every apply that took it shared (their rows are then visible
	// here), and applies after it see the new counter.
	var removed map[string]int
	for attempt := 1; ; attempt++ {
		removed = map[string]int{}
		err = eraseOnce(ctx, pool, eraseParams{opts: opts, id: id, key: key, schema: schema, name: name,
			mode: mode, sel: sel, cols: cols, digest: digest, removed: removed})
		var pg *pgconn.PgError
		if attempt < 5 && errors.As(err, &pg) && pg.Code == "40P01" {
			continue // a deadlock with an apply (which retries too): again
		}
		break
	}
	if err != nil {
		return Receipt{}, fmt.Errorf("erase from %s (erasure %d recorded; run erase again to finish): %w", opts.Table, id, err)
	}
	return GetErasure(ctx, pool, id)
}

// eraseParams is one removal of Erase: the erasure's fence and its
// selector, read by eraseOnce and eraseVersions.
type eraseParams struct {
	opts               EraseOptions
	id                 int64  // the fence in epitaph.erasures
	key                []byte // the erasure secret the digests are keyed with
	schema, name, mode string
	sel                json.RawMessage
	cols               []string
	digest             string
	removed            map[string]int // filled in: rows removed per place
}

// eraseOnce is the removal of Erase, in one transaction.
func eraseOnce(ctx context.Context, pool *pgxpool.Pool, p eraseParams) error {
	opts, id, key, removed := p.opts, p.id, p.key, p.removed
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, fmt.Sprintf(`SET LOCAL lock_timeout = %d`, opts.LockTimeout.Milliseconds())); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, erasureLockKey); err != nil {
			return fmt.Errorf("wait for applies in flight: %w", err)
		}
		// No JIT: the recursive statement's estimate made Postgres compile
		// it, seconds of a statement that reads a few index pages.
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = 0; SET LOCAL jit = off`); err != nil {
			return err
		}
		ids, refs, parents, err := eraseVersions(ctx, tx, p)
		if err != nil {
			return err
		}
		if err := insertErasedParents(ctx, tx, key, parents); err != nil {
			return err
		}
		if err := stopCursorDeliveries(ctx, tx, refs); err != nil {
			return err
		}
		if err := eraseDeliveries(ctx, tx, ids, removed); err != nil {
			return err
		}
		if err := scrubRestores(ctx, tx, refs, removed); err != nil {
			return err
		}
		q := quarantineMatcher{key: key, table: opts.Table, mode: p.mode, cols: p.cols, sel: decodeObject(p.sel), digest: p.digest, erased: ids}
		unchecked, err := q.erase(ctx, tx, id, removed)
		if err != nil {
			return err
		}
		if len(ids) > 0 {
			// erased_rows changed: the workers reload their fences.
			if _, err := tx.Exec(ctx, `UPDATE epitaph.erasure_epoch SET epoch = epoch + 1`); err != nil {
				return err
			}
		}
		b, err := json.Marshal(removed)
		if err != nil {
			return err
		}
		u, err := json.Marshal(unchecked)
		if err != nil {
			return err
		}
		// removed adds up over the runs; unchecked is the last run's.
		_, err = tx.Exec(ctx, `
			UPDATE epitaph.erasures SET removed = (SELECT COALESCE(jsonb_object_agg(k, COALESCE((removed->>k)::int, 0) + v::int), '{}')
			                                       FROM jsonb_each_text($2::jsonb) AS x(k, v)) || (removed - ARRAY(SELECT jsonb_object_keys($2::jsonb))),
			       unchecked = $3::jsonb, completed_at = now(), updated_at = now()
			WHERE id = $1`, id, string(b), string(u))
		return err
	})
}

// ErrHeld: a legal hold covers a row the erasure would remove.
var ErrHeld = errors.New("a legal hold covers rows to erase")

// refuseHeld fails with ErrHeld when a matched row of any version is
// under a legal hold (the rows it would take as children are not checked).
func refuseHeld(ctx context.Context, pool *pgxpool.Pool, schema, name, mode string, sel json.RawMessage) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("check legal holds: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // read only
	vss, err := allVersionSchemas(ctx, tx)
	if err != nil {
		return err
	}
	cond := `r.key = $3::jsonb`
	if mode == EraseByMatch {
		cond = `r.row @> $3::jsonb`
	}
	for _, vs := range vss {
		var hold *int64
		err := tx.QueryRow(ctx, `SELECT min(h.id) FROM `+archive.Ident(vs.Schema, "rows")+` r JOIN epitaph.legal_holds h
			ON h.schema_name = r.schema_name AND h.table_name = r.table_name AND (h.key = r.key OR r.row @> h.match)
			WHERE r.schema_name = $1 AND r.table_name = $2 AND `+cond, schema, name, string(sel)).Scan(&hold)
		if err != nil {
			return fmt.Errorf("check legal holds: %w", err)
		}
		if hold != nil {
			return fmt.Errorf("%w: hold %d (projector hold list); nothing was erased (remove the hold first, or erase with --ignore-holds)", ErrHeld, *hold)
		}
	}
	return nil
}

// eraseRowsSQL deletes the rows matched ($3: key or match) of one version,
// with their children when $4, and records their identities as erased.
// Two indexed passes: the match (GIN or key index) and, per erased row,
// its transaction's rows by the primary key (the LATERAL .. OFFSET 0 keeps
// the planner from hashing the whole archive for the recursive step, which
// it did).
const eraseRowsSQL = `
WITH RECURSIVE hit AS (
    SELECT r.source, r.commit_lsn, r.seq, r.schema_name, r.table_name, r.row
    FROM %[1]s r
    WHERE r.schema_name = $1 AND r.table_name = $2 AND %[2]s
  UNION
    SELECT c.source, c.commit_lsn, c.seq, c.schema_name, c.table_name, c.row
    FROM hit p, LATERAL (
        SELECT c.* FROM %[1]s c
        WHERE c.source = p.source AND c.commit_lsn = p.commit_lsn
          AND $4 AND ` + childRefSQL + `
        OFFSET 0) c
), del AS (
    DELETE FROM %[1]s r USING hit h
    WHERE r.source = h.source AND r.commit_lsn = h.commit_lsn AND r.seq = h.seq
    RETURNING r.source, r.commit_lsn, r.seq, r.correlation_id, r.schema_name || '.' || r.table_name AS tbl,
              CASE WHEN $4 THEN COALESCE(r.row, r.key) END AS row, r.key
), fenced AS (
    INSERT INTO epitaph.erased_rows (source, commit_lsn, seq, erasure_id)
    SELECT source, commit_lsn, seq, $5 FROM del
    ON CONFLICT DO NOTHING
)
SELECT source, commit_lsn::text, seq, correlation_id, tbl, row, key FROM del`

// eraseSnapshotsSQL deletes the snapshot documents rooted at the erased
// rows of one version. A statement of its own, after eraseRowsSQL: an
// apply of a transaction's commit that inserts no row (its rows came in
// earlier pages) does not take the erasure lock; it makes the rows
// visible and their jobs, and eraseRowsSQL waits for those rows. The jobs
// committed meanwhile are not in eraseRowsSQL's snapshot but are in this
// statement's.
const eraseSnapshotsSQL = `
DELETE FROM %s s USING unnest($1::text[], $2::pg_lsn[], $3::int[], $4::text[]) AS d(source, commit_lsn, seq, correlation_id)
 WHERE s.correlation_id = d.correlation_id
   AND s.source = d.source AND s.commit_lsn = d.commit_lsn AND s.root_seq = d.seq`

// eraseVersions removes the matched rows from every version of the archive
// and returns their identities (and, in the same order, their tables and
// transactions).
func eraseVersions(ctx context.Context, tx pgx.Tx, p eraseParams) ([]rowIdentity, []erasedRef, []parentRow, error) {
	id, mode, withChildren, removed := p.id, p.mode, p.opts.WithChildren, p.removed
	vss, err := allVersionSchemas(ctx, tx)
	if err != nil {
		return nil, nil, nil, err
	}
	cond := `r.key = $3::jsonb`
	if mode == EraseByMatch {
		cond = `r.row @> $3::jsonb`
	}
	seen := map[rowIdentity]bool{}
	var ids []rowIdentity
	var refs []erasedRef
	var parents []parentRow // with children: kept for the pages not applied yet (fence_children.go)
	for _, vs := range vss {
		rows, err := tx.Query(ctx, fmt.Sprintf(eraseRowsSQL, archive.Ident(vs.Schema, "rows"), cond),
			p.schema, p.name, string(p.sel), withChildren, id)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("erase rows of %s: %w", vs.Schema, err)
		}
		var r rowIdentity
		var lsn, corr, tbl string
		var row, rkey json.RawMessage
		corrs := map[string]bool{}
		var gone []snapshot.FencedRow
		_, err = pgx.ForEachRow(rows, []any{&r.source, &lsn, &r.seq, &corr, &tbl, &row, &rkey}, func() error {
			l, err := event.ParseLSN(lsn)
			if err != nil {
				return err
			}
			r.lsn = l
			removed[vs.Schema+".rows"]++
			removed["rows:"+tbl]++
			corrs[corr] = true
			gone = append(gone, snapshot.FencedRow{CorrelationID: corr, Source: r.source, CommitLSN: r.lsn, Seq: r.seq, Table: tbl})
			if !seen[r] {
				seen[r] = true
				ids = append(ids, r)
				refs = append(refs, erasedRef{id: r, table: tbl, corr: corr, key: slices.Clone(rkey)})
				if withChildren {
					parents = append(parents, parentRow{id: r, table: tbl, row: slices.Clone(row), erasure: id})
				}
			}
			return nil
		})
		if err != nil {
			return nil, nil, nil, fmt.Errorf("erase rows of %s: %w", vs.Schema, err)
		}
		if vs.Snapshots && len(corrs) > 0 {
			if err := eraseSnapshots(ctx, tx, vs.Schema, gone, removed); err != nil {
				return nil, nil, nil, err
			}
			list := make([]string, 0, len(corrs))
			for c := range corrs {
				list = append(list, c)
			}
			// The other documents of these transactions: rebuilt without
			// the erased rows (their payload is cleared at once), which
			// their transactions' counts no longer expect.
			// A version retired before snapshot_fenced existed has none
			// (the DDL runs for active versions): its counts stay.
			var fencedTable bool
			if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`,
				archive.Ident(vs.Schema, "snapshot_fenced")).Scan(&fencedTable); err != nil {
				return nil, nil, nil, fmt.Errorf("erase rows of %s: %w", vs.Schema, err)
			}
			if fencedTable {
				if _, err := snapshot.Discount(ctx, tx, vs.Schema, gone); err != nil {
					return nil, nil, nil, err
				}
			}
			n, err := snapshot.Invalidate(ctx, tx, vs.Schema, list)
			if err != nil {
				return nil, nil, nil, err
			}
			removed[vs.Schema+".snapshots_rebuilt"] += n
		}
		if removed[vs.Schema+".snapshots"] == 0 {
			delete(removed, vs.Schema+".snapshots")
		}
	}
	return ids, refs, parents, nil
}

// eraseSnapshots deletes the snapshot documents of version schema rooted
// at the erased rows gone (eraseSnapshotsSQL).
func eraseSnapshots(ctx context.Context, tx pgx.Tx, schema string, gone []snapshot.FencedRow, removed map[string]int) error {
	sources, lsns, seqs, corrs := make([]string, len(gone)), make([]string, len(gone)), make([]int32, len(gone)), make([]string, len(gone))
	for i, g := range gone {
		sources[i], lsns[i], seqs[i], corrs[i] = g.Source, g.CommitLSN.String(), int32(g.Seq), g.CorrelationID
	}
	tag, err := tx.Exec(ctx, fmt.Sprintf(eraseSnapshotsSQL, archive.Ident(schema, "snapshots")), sources, lsns, seqs, corrs)
	if err != nil {
		return fmt.Errorf("erase snapshots of %s: %w", schema, err)
	}
	removed[schema+".snapshots"] += int(tag.RowsAffected())
	return nil
}

// allVersionSchemas are the archive schemas of every version of every
// projection that has a rows table.
func allVersionSchemas(ctx context.Context, tx pgx.Tx) ([]archive.VersionSchema, error) {
	rows, err := tx.Query(ctx, `
		SELECT DISTINCT schema_name, to_regclass(quote_ident(schema_name) || '.snapshots') IS NOT NULL
		FROM epitaph.projection_versions
		WHERE to_regclass(quote_ident(schema_name) || '.rows') IS NOT NULL
		ORDER BY 1`)
	if err != nil {
		return nil, fmt.Errorf("list version schemas: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (archive.VersionSchema, error) {
		var v archive.VersionSchema
		return v, r.Scan(&v.Schema, &v.Snapshots)
	})
	if err != nil {
		return nil, fmt.Errorf("list version schemas: %w", err)
	}
	return out, nil
}

func identityArrays(ids []rowIdentity) (sources, lsns []string, seqs []int32) {
	for _, r := range ids {
		sources, lsns, seqs = append(sources, r.source), append(lsns, r.lsn.String()), append(seqs, int32(r.seq))
	}
	return sources, lsns, seqs
}

// eraseDeliveries stops the open deliveries of the erased rows as
// stop_revoked and clears the key and payload of all of them.
func eraseDeliveries(ctx context.Context, tx pgx.Tx, ids []rowIdentity, removed map[string]int) error {
	if len(ids) == 0 {
		return nil
	}
	sources, lsns, seqs := identityArrays(ids)
	tag, err := tx.Exec(ctx, `
		UPDATE epitaph.deliveries d
		   SET state = CASE WHEN d.state IN ('pending', 'in_flight') THEN 'stopped' ELSE d.state END,
		       outcome = CASE WHEN d.state IN ('pending', 'in_flight') THEN 'stop_revoked' ELSE d.outcome END,
		       settled_at = CASE WHEN d.state IN ('pending', 'in_flight') THEN now() ELSE d.settled_at END,
		       claim_token = NULL, claim_expires_at = NULL,
		       key = NULL, payload = NULL, payload_scrubbed_at = COALESCE(d.payload_scrubbed_at, now()), updated_at = now()
		  FROM unnest($1::text[], $2::pg_lsn[], $3::int[]) AS e(source, commit_lsn, seq)
		 WHERE d.source = e.source AND d.commit_lsn = e.commit_lsn AND d.seq = e.seq`, sources, lsns, seqs)
	if err != nil {
		return fmt.Errorf("erase deliveries: %w", err)
	}
	if tag.RowsAffected() > 0 {
		removed["epitaph.deliveries"] += int(tag.RowsAffected())
	}
	return nil
}

const receiptColumns = `id, schema_name || '.' || table_name, mode, columns, with_children, purge_stream, reason, actor, runs,
       removed, unchecked, created_at, updated_at, completed_at`

func scanReceipt(r pgx.CollectableRow) (Receipt, error) {
	var x Receipt
	err := r.Scan(&x.ID, &x.Table, &x.Mode, &x.Columns, &x.WithChildren, &x.PurgeStream, &x.Reason, &x.Actor, &x.Runs,
		&x.Removed, &x.Unchecked, &x.CreatedAt, &x.UpdatedAt, &x.CompletedAt)
	return x, err
}

// GetErasure returns one receipt.
func GetErasure(ctx context.Context, db interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}, id int64) (Receipt, error) {
	rows, err := db.Query(ctx, `SELECT `+receiptColumns+` FROM epitaph.erasures WHERE id = $1`, id)
	if err != nil {
		return Receipt{}, fmt.Errorf("read erasure %d: %w", id, err)
	}
	r, err := pgx.CollectExactlyOneRow(rows, scanReceipt)
	if err != nil {
		return Receipt{}, fmt.Errorf("read erasure %d: %w", id, err)
	}
	return r, nil
}

// ListErasures returns every receipt, oldest first.
func ListErasures(ctx context.Context, db interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}) ([]Receipt, error) {
	rows, err := db.Query(ctx, `SELECT `+receiptColumns+` FROM epitaph.erasures ORDER BY id`)
	if err != nil {
		return nil, fmt.Errorf("list erasures: %w", err)
	}
	out, err := pgx.CollectRows(rows, scanReceipt)
	if err != nil {
		return nil, fmt.Errorf("list erasures: %w", err)
	}
	return out, nil
}

// scrubRestores clears, in epitaph.restores, what names an erased row:
// the key or root key a restore was asked for, and an error naming the
// row (a conflict names the rows' table and key).
func scrubRestores(ctx context.Context, tx pgx.Tx, refs []erasedRef, removed map[string]int) error {
	var corrs, tables, keys, names []string
	for _, r := range refs {
		if len(r.key) == 0 {
			continue
		}
		var v any
		if json.Unmarshal(r.key, &v) != nil {
			continue
		}
		compact, err := json.Marshal(v) // as restore.RowRef names it
		if err != nil {
			continue
		}
		corrs, tables, keys = append(corrs, r.corr), append(tables, r.table), append(keys, string(r.key))
		names = append(names, r.table+" "+string(compact))
	}
	if len(keys) == 0 {
		return nil
	}
	tag, err := tx.Exec(ctx, `
		UPDATE epitaph.restores x
		   SET key = CASE WHEN x.key = e.key::jsonb AND x.table_name = e.tbl THEN NULL ELSE x.key END,
		       root_key = CASE WHEN x.root_key = e.key::jsonb AND COALESCE(x.root_table, e.tbl) = e.tbl THEN NULL ELSE x.root_key END,
		       error = CASE WHEN strpos(x.error, e.name) > 0 THEN 'the error named a row erased since' ELSE x.error END
		  FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) AS e(corr, tbl, key, name)
		 WHERE x.correlation_id = e.corr
		   AND ((x.key = e.key::jsonb AND x.table_name = e.tbl)
		     OR (x.root_key = e.key::jsonb AND COALESCE(x.root_table, e.tbl) = e.tbl)
		     OR strpos(x.error, e.name) > 0)`, corrs, tables, keys, names)
	if err != nil {
		return fmt.Errorf("erase restore records: %w", err)
	}
	if tag.RowsAffected() > 0 {
		removed["epitaph.restores"] += int(tag.RowsAffected())
	}
	return nil
}
