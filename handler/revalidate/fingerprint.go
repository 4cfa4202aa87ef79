package revalidate

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// The set a delivery describes: the verified archive rows of one source
// transaction and table that have not expired. One predicate for the stamp,
// the cheap pair and the full read, over the index on correlation_id.
const setPredicate = `correlation_id = $1 AND verified AND (expires_at IS NULL OR expires_at > now())`

// pairMax is the "greatest archive identity" of the cheap pair. Rows of one
// group share their commit_lsn, so the identity's maximum is max(seq); it is
// joined with the greatest archived_at, which moves on every insert like
// SQL Server's rowversion, so a removal plus a late row inside the seq range
// (count and max(seq) unchanged) still changes the pair. Epoch microseconds,
// so the session's TimeZone cannot change the text.
const pairMax = `COALESCE(max(seq)::text || '@' ||
    (extract(epoch FROM max(archived_at)) * 1000000)::bigint::text, '')`

// fingerprintExpr hashes the complete set deterministically: identities and
// values (jsonb's text form is canonical: keys sorted, no whitespace
// choices), in identity order.
const fingerprintExpr = `encode(sha256(convert_to(COALESCE(string_agg(
    source || '/' || commit_lsn::text || '/' || seq::text || '/' ||
    COALESCE(key::text, 'null') || '/' || COALESCE(row::text, 'null'),
    E'\n' ORDER BY commit_lsn, seq), ''), 'UTF8')), 'hex')`

func rowsTable(schema string) string { return pgx.Identifier{schema, "rows"}.Sanitize() }

// stampSQL sets the promise of every released, pending, not yet stamped
// delivery of the groups (source, commit_lsn = ANY($2)) whose handler
// revalidates, per group and table, in one statement. The group of a
// delivery is its correlation_id, which names (source, xid, commit_lsn):
// the primary key's prefix. The groups are aggregated only when such a
// delivery waits (a one-time check): a handler that does not revalidate
// never reads its promise, and hashing every row of a page's groups for it
// cost the apply as much as archiving them (a handler's revalidate is
// fixed when it is added). The sets are MATERIALIZED: computed once (one
// range of the primary key per page), never again per delivery joined to
// them, which plans made on a fast-growing table's statistics did (the
// whole group hashed 700 times for 700 deliveries: 8 s per page).
func stampSQL(schema string) string {
	return `
WITH sets AS MATERIALIZED (
    SELECT commit_lsn, schema_name, table_name, count(*)::int AS n, ` + pairMax + ` AS mx, ` + fingerprintExpr + ` AS fp
    FROM ` + rowsTable(schema) + `
    WHERE source = $1 AND commit_lsn = ANY($2::pg_lsn[]) AND verified AND (expires_at IS NULL OR expires_at > now())
      -- No handler revalidates (a plain round): one look at the handlers,
      -- not a probe of the page's deliveries (1,400 buffers a page).
      AND EXISTS (SELECT 1 FROM epitaph.handlers WHERE revalidate)
      AND EXISTS (SELECT 1 FROM epitaph.deliveries w JOIN epitaph.handlers h ON h.id = w.handler_id AND h.revalidate
                  WHERE w.source = $1 AND w.commit_lsn = ANY($2::pg_lsn[])
                    AND w.state = 'pending' AND w.released_at IS NOT NULL AND w.fingerprint IS NULL)
    GROUP BY commit_lsn, schema_name, table_name)
UPDATE epitaph.deliveries d
SET fingerprint = s.fp, group_rows = s.n, group_max = s.mx, updated_at = now()
FROM sets s
WHERE d.source = $1 AND d.commit_lsn = s.commit_lsn AND d.schema_name = s.schema_name AND d.table_name = s.table_name
  AND d.state = 'pending' AND d.released_at IS NOT NULL AND d.fingerprint IS NULL
  AND EXISTS (SELECT 1 FROM epitaph.handlers h WHERE h.id = d.handler_id AND h.revalidate)
  -- Uncorrelated: checked once, before any delivery is read.
  AND EXISTS (SELECT 1 FROM epitaph.handlers WHERE revalidate)
  AND EXISTS (SELECT 1 FROM epitaph.projection_versions v
              WHERE v.projection = 'archive' AND v.schema_name = $3 AND v.state = 'live')`
}

// StampGroups stores, in tx, the fingerprint and the cheap pair
// (group_rows, group_max) of the set each released, pending, not yet
// stamped delivery of the source transactions commitLSNs (of source) was
// queued for, computed over archive schema (the live version's, e.g.
// "archive_v3") in one statement; nothing when schema is not the live
// version's (deliveries describe the live archive). Call it in the transaction that releases
// deliveries (after the archive rows are inserted and verified, and the
// deliveries inserted or released): unverified rows belong to no set.
// Idempotent: a delivery keeps the promise it was stamped with first. It
// returns how many deliveries it stamped.
func StampGroups(ctx context.Context, tx pgx.Tx, schema, source string, commitLSNs []string) (int64, error) {
	if len(commitLSNs) == 0 {
		return 0, nil
	}
	tag, err := tx.Exec(ctx, stampSQL(schema), source, commitLSNs, schema)
	if err != nil {
		return 0, fmt.Errorf("stamp deliveries of %d transactions: %w", len(commitLSNs), err)
	}
	return tag.RowsAffected(), nil
}

// fullSQL reads and hashes the whole current set, and lists the keys of
// its rows archived after the stamped pair's greatest archived_at ($4,
// epoch microseconds): the rows added since queueing, for the payload of
// the generation that replaces a changed delivery.
func fullSQL(schema string) string {
	return `
SELECT count(*)::int, ` + pairMax + `, ` + fingerprintExpr + `,
       COALESCE(jsonb_agg(key ORDER BY commit_lsn, seq)
                FILTER (WHERE (extract(epoch FROM archived_at) * 1000000)::bigint > $4), '[]'::jsonb)
FROM ` + rowsTable(schema) + `
WHERE ` + setPredicate + ` AND schema_name = $2 AND table_name = $3`
}

// archivedBound is the greatest archived_at (epoch microseconds) of a
// stamped pair ("<max seq>@<micros>"); -1 when there is none.
func archivedBound(groupMax *string) int64 {
	if groupMax == nil {
		return -1
	}
	_, micros, ok := strings.Cut(*groupMax, "@")
	if !ok {
		return -1
	}
	n, err := strconv.ParseInt(micros, 10, 64)
	if err != nil {
		return -1
	}
	return n
}

// set is one observation of a delivery's set.
type set struct {
	rows        int
	max         string
	fingerprint string
	added       []byte // jsonb array of the keys archived since queueing (full read only)
}

type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

func readFull(ctx context.Context, db querier, schema string, d delivery) (set, error) {
	var s set
	err := db.QueryRow(ctx, fullSQL(schema), d.correlationID, d.schemaName, d.table, archivedBound(d.groupMax)).
		Scan(&s.rows, &s.max, &s.fingerprint, &s.added)
	if err != nil {
		return set{}, fmt.Errorf("read the set of %s: %w", d.correlationID, err)
	}
	return s, nil
}
