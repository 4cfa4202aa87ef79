package version

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"time"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/progress"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
)

// CompareOptions say what Compare compares.
type CompareOptions struct {
	Projection string
	A, B       int
	// IgnoreExpiresAt accepts a difference of expires_at (an intended TTL
	// policy change): it is still counted and reported, but does not make
	// the versions differ.
	IgnoreExpiresAt bool
	// IgnoreSnapshots accepts a difference of the snapshot jobs (an
	// intended change of the snapshot roots): still reported.
	IgnoreSnapshots bool
	// MaxKeys bounds the list of differing keys (default 20).
	MaxKeys int
	// All compares every archived row. By default only transactions both
	// versions have certainly applied are compared: commit_lsn at or below
	// the lower of the two versions' watermarks (see UpTo), so a version
	// that is a page behind the other does not show as different.
	All bool
}

// TableComparison is one source table in both versions.
type TableComparison struct {
	Schema string `json:"schema"`
	Table  string `json:"table"`
	RowsA  int64  `json:"rows_a"`
	RowsB  int64  `json:"rows_b"`
	// ChecksumA/B: order-independent checksum of the archived content
	// (source, schema_name, table_name, key, row, identity, correlation_id,
	// commit_lsn, seq; not archived_at, not expires_at).
	ChecksumA string `json:"checksum_a"`
	ChecksumB string `json:"checksum_b"`
	OnlyA     int64  `json:"only_a"`
	OnlyB     int64  `json:"only_b"`
	// ContentDiffers counts rows in both versions with different content.
	ContentDiffers int64 `json:"content_differs"`
	// ExpiresAtDiffers counts rows in both with a different expires_at.
	ExpiresAtDiffers int64 `json:"expires_at_differs"`
}

// SnapshotComparison is the snapshot jobs of one root table and status.
type SnapshotComparison struct {
	RootTable string `json:"root_table"`
	Status    string `json:"status"`
	A         int64  `json:"a"`
	B         int64  `json:"b"`
}

// KeyDifference is one differing row.
type KeyDifference struct {
	Schema    string          `json:"schema"`
	Table     string          `json:"table"`
	Key       json.RawMessage `json:"key"`
	CommitLSN string          `json:"commit_lsn"`
	Seq       int             `json:"seq"`
	// What: only_a, only_b, content, expires_at.
	What string `json:"what"`
}

// Comparison is the result of Compare.
type Comparison struct {
	Projection string `json:"projection"`
	A          int    `json:"a"`
	B          int    `json:"b"`
	// UpTo is the commit LSN bound of the compared rows ("" = all rows).
	UpTo            string               `json:"up_to,omitempty"`
	IgnoreExpiresAt bool                 `json:"ignore_expires_at"`
	IgnoreSnapshots bool                 `json:"ignore_snapshots"`
	Tables          []TableComparison    `json:"tables"`
	Snapshots       []SnapshotComparison `json:"snapshots"`
	DifferingKeys   []KeyDifference      `json:"differing_keys"`
	// DocumentsDiffer counts the snapshot documents complete in both
	// versions whose content (meta.archived_at aside: each version
	// archived the rows at its own time) or fingerprint differs;
	// DifferingDocuments lists the first MaxKeys of them.
	DocumentsDiffer    int64                         `json:"documents_differ"`
	DifferingDocuments []snapshot.DocumentDifference `json:"differing_documents"`
	// ContentEqual: the same rows with the same content in every table.
	ContentEqual bool `json:"content_equal"`
	// SnapshotsEqual: the same number of snapshot jobs per root table, and
	// of failed ones (pending vs complete is progress, not a difference),
	// and no document complete in both that differs.
	SnapshotsEqual bool `json:"snapshots_equal"`
	// ExpiresAtDiffers counts rows whose expires_at differs.
	ExpiresAtDiffers int64 `json:"expires_at_differs"`
	// Equal is ContentEqual and, unless ignored, SnapshotsEqual and no
	// expires_at difference.
	Equal bool `json:"equal"`
}

const rowContent = `md5(ROW(%[1]s.source, %[1]s.schema_name, %[1]s.table_name, %[1]s.key, %[1]s.row, %[1]s.identity,
	%[1]s.correlation_id, %[1]s.commit_lsn, %[1]s.seq)::text)`

// hash64 folds an md5 into a bigint so sums are order-independent checksums.
func hash64(md5 string) string {
	return `('x' || substr(` + md5 + `, 1, 15))::bit(60)::bigint`
}

// Compare compares two versions of a projection as the projection's
// content defines them (see TableComparison): row counts and checksums
// per source table, snapshot jobs by root table and status, and a bounded
// list of differing rows. It compares what readers see: rows of
// transactions not verified (pending or forged) are not compared. It only
// reads.
func Compare(ctx context.Context, db progress.DB, o CompareOptions) (*Comparison, error) {
	if o.Projection == "" {
		o.Projection = archive.Projection
	}
	if o.MaxKeys <= 0 {
		o.MaxKeys = 20
	}
	va, err := GetVersion(ctx, db, o.Projection, o.A)
	if err != nil {
		return nil, err
	}
	vb, err := GetVersion(ctx, db, o.Projection, o.B)
	if err != nil {
		return nil, err
	}
	c := &Comparison{Projection: o.Projection, A: o.A, B: o.B, IgnoreExpiresAt: o.IgnoreExpiresAt, IgnoreSnapshots: o.IgnoreSnapshots}
	var bound any // nil: every row
	if !o.All {
		upTo, err := commonWatermark(ctx, db, o.Projection, o.A, o.B)
		if err != nil {
			return nil, err
		}
		c.UpTo = upTo.String()
		bound = c.UpTo
	}
	q := rowQueries{db: db, a: ident(va.Schema), b: ident(vb.Schema), bound: bound, at: time.Now()}
	tables := tableSet{}
	if err := q.checksums(ctx, tables); err != nil {
		return nil, err
	}
	if err := q.rowDifferences(ctx, tables); err != nil {
		return nil, err
	}
	c.addTables(tables)
	if c.DifferingKeys, err = q.differingKeys(ctx, !o.IgnoreExpiresAt, o.MaxKeys); err != nil {
		return nil, err
	}
	if err := c.compareSnapshotsOf(ctx, db, va.Schema, vb.Schema, bound, q.at, o.MaxKeys); err != nil {
		return nil, err
	}
	c.Equal = c.ContentEqual && (o.IgnoreSnapshots || c.SnapshotsEqual) && (o.IgnoreExpiresAt || c.ExpiresAtDiffers == 0)
	return c, nil
}

// tableKey is a source table.
type tableKey struct{ schema, table string }

// snapshotKey is a root table and a snapshot job status.
type snapshotKey struct{ root, status string }

// tableSet gathers the comparison of each source table.
type tableSet map[tableKey]*TableComparison

func (ts tableSet) get(s, t string) *TableComparison {
	k := tableKey{s, t}
	if ts[k] == nil {
		ts[k] = &TableComparison{Schema: s, Table: t}
	}
	return ts[k]
}

// rowQueries compares the rows of the schemas a and b (quoted) of
// transactions committed at or before bound (nil: all). A row that had
// expired at the time at in every version that holds it is hidden from
// readers in each (the reader views' rule) and is left out: whether
// retention has deleted it from a version yet makes no difference. A row
// one version still shows is compared as before (an expires_at
// difference when the other holds it expired).
type rowQueries struct {
	db    progress.DB
	a, b  string
	bound any
	at    time.Time
}

// join is the FROM clause pairing the compared rows of both versions by
// their identity, and the WHERE clause leaving out the rows expired in
// both; at is the placeholder of the time.
func (q rowQueries) join(at string) string {
	shown := func(r string) string {
		return `(` + r + `.seq IS NOT NULL AND (` + r + `.expires_at IS NULL OR ` + r + `.expires_at > ` + at + `::timestamptz))`
	}
	return ` FROM (SELECT * FROM ` + q.a + `.rows WHERE verified AND ($1::pg_lsn IS NULL OR commit_lsn <= $1::pg_lsn)) a
		FULL JOIN (SELECT * FROM ` + q.b + `.rows WHERE verified AND ($1::pg_lsn IS NULL OR commit_lsn <= $1::pg_lsn)) b
		ON a.source = b.source AND a.commit_lsn = b.commit_lsn AND a.seq = b.seq
		WHERE (` + shown("a") + ` OR ` + shown("b") + `) `
}

// checksums counts and checksums the rows per source table of both
// versions.
func (q rowQueries) checksums(ctx context.Context, tables tableSet) error {
	rows, err := q.db.Query(ctx, `SELECT COALESCE(a.schema_name, b.schema_name), COALESCE(a.table_name, b.table_name),
		count(a.seq), COALESCE(sum(`+hash64(fmt.Sprintf(rowContent, "a"))+`) FILTER (WHERE a.seq IS NOT NULL), 0)::text,
		count(b.seq), COALESCE(sum(`+hash64(fmt.Sprintf(rowContent, "b"))+`) FILTER (WHERE b.seq IS NOT NULL), 0)::text`+
		q.join("$2")+`GROUP BY 1, 2`, q.bound, q.at)
	if err != nil {
		return fmt.Errorf("checksum %s and %s: %w", q.a, q.b, err)
	}
	defer rows.Close()
	for rows.Next() {
		var s, t, sumA, sumB string
		var nA, nB int64
		if err := rows.Scan(&s, &t, &nA, &sumA, &nB, &sumB); err != nil {
			return fmt.Errorf("checksum %s and %s: %w", q.a, q.b, err)
		}
		tc := tables.get(s, t)
		tc.RowsA, tc.ChecksumA, tc.RowsB, tc.ChecksumB = nA, sumA, nB, sumB
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("checksum %s and %s: %w", q.a, q.b, err)
	}
	return nil
}

// rowDifferences counts, row by row, what is only in one version, or
// different, per source table.
func (q rowQueries) rowDifferences(ctx context.Context, tables tableSet) error {
	rows, err := q.db.Query(ctx, `SELECT COALESCE(a.schema_name, b.schema_name), COALESCE(a.table_name, b.table_name),
		count(*) FILTER (WHERE b.seq IS NULL), count(*) FILTER (WHERE a.seq IS NULL),
		count(*) FILTER (WHERE a.seq IS NOT NULL AND b.seq IS NOT NULL AND `+fmt.Sprintf(rowContent, "a")+` <> `+fmt.Sprintf(rowContent, "b")+`),
		count(*) FILTER (WHERE a.seq IS NOT NULL AND b.seq IS NOT NULL AND a.expires_at IS DISTINCT FROM b.expires_at)`+
		q.join("$2")+`GROUP BY 1, 2`, q.bound, q.at)
	if err != nil {
		return fmt.Errorf("compare rows: %w", err)
	}
	for rows.Next() {
		var s, t string
		var oa, ob, cd, ed int64
		if err := rows.Scan(&s, &t, &oa, &ob, &cd, &ed); err != nil {
			rows.Close()
			return fmt.Errorf("compare rows: %w", err)
		}
		tc := tables.get(s, t)
		tc.OnlyA, tc.OnlyB, tc.ContentDiffers, tc.ExpiresAtDiffers = oa, ob, cd, ed
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("compare rows: %w", err)
	}
	return nil
}

// differingKeys lists the first max differing rows (an expires_at
// difference counts when expires is set).
func (q rowQueries) differingKeys(ctx context.Context, expires bool, limit int) ([]KeyDifference, error) {
	expiresCond := "false"
	if expires {
		expiresCond = "a.expires_at IS DISTINCT FROM b.expires_at"
	}
	rows, err := q.db.Query(ctx, `SELECT COALESCE(a.schema_name, b.schema_name), COALESCE(a.table_name, b.table_name),
		COALESCE(a.key, b.key), COALESCE(a.commit_lsn, b.commit_lsn)::text, COALESCE(a.seq, b.seq),
		CASE WHEN b.seq IS NULL THEN 'only_a' WHEN a.seq IS NULL THEN 'only_b'
		     WHEN `+fmt.Sprintf(rowContent, "a")+` <> `+fmt.Sprintf(rowContent, "b")+` THEN 'content' ELSE 'expires_at' END`+
		q.join("$3")+`AND (a.seq IS NULL OR b.seq IS NULL OR `+fmt.Sprintf(rowContent, "a")+` <> `+fmt.Sprintf(rowContent, "b")+` OR `+expiresCond+`)
		ORDER BY 4, 5 LIMIT $2`, q.bound, limit, q.at)
	if err != nil {
		return nil, fmt.Errorf("list differing rows: %w", err)
	}
	var out []KeyDifference
	for rows.Next() {
		var d KeyDifference
		var key []byte
		var seq int32
		if err := rows.Scan(&d.Schema, &d.Table, &key, &d.CommitLSN, &seq, &d.What); err != nil {
			rows.Close()
			return nil, fmt.Errorf("list differing rows: %w", err)
		}
		d.Key, d.Seq = key, int(seq)
		out = append(out, d)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list differing rows: %w", err)
	}
	return out, nil
}

// addTables sets the tables of the comparison (by name), the expires_at
// differences and whether the content is equal.
func (c *Comparison) addTables(tables tableSet) {
	c.ContentEqual = true
	for _, tc := range tables {
		c.Tables = append(c.Tables, *tc)
		c.ExpiresAtDiffers += tc.ExpiresAtDiffers
		if tc.OnlyA > 0 || tc.OnlyB > 0 || tc.ContentDiffers > 0 || tc.RowsA != tc.RowsB || tc.ChecksumA != tc.ChecksumB {
			c.ContentEqual = false
		}
	}
	sort.Slice(c.Tables, func(i, j int) bool {
		return c.Tables[i].Schema+"."+c.Tables[i].Table < c.Tables[j].Schema+"."+c.Tables[j].Table
	})
}

// compareSnapshotsOf compares the snapshot jobs and the documents of the
// schemas a and b and sets whether they are equal.
func (c *Comparison) compareSnapshotsOf(ctx context.Context, db progress.DB, a, b string, bound any, at time.Time, maxKeys int) error {
	var err error
	if c.Snapshots, err = compareSnapshots(ctx, db, a, b, bound, at); err != nil {
		return err
	}
	c.SnapshotsEqual = true
	totals := map[string][2]int64{}
	for _, s := range c.Snapshots {
		t := totals[s.RootTable]
		t[0] += s.A
		t[1] += s.B
		totals[s.RootTable] = t
		if s.Status == "failed" && s.A != s.B {
			c.SnapshotsEqual = false
		}
	}
	for _, t := range totals {
		if t[0] != t[1] {
			c.SnapshotsEqual = false
		}
	}
	upTo := ""
	if bound != nil {
		upTo = c.UpTo
	}
	if c.DocumentsDiffer, c.DifferingDocuments, err = snapshot.CompareDocuments(ctx, db, a, b, upTo, maxKeys); err != nil {
		return err
	}
	if c.DocumentsDiffer > 0 {
		c.SnapshotsEqual = false
	}
	return nil
}

// compareSnapshots counts snapshot jobs by root table and status in both
// schemas (versions without a snapshots table count none). A job whose
// root row had expired at the time at in both versions (or expired in one
// and gone from the other) is left out, as its row is (rowQueries): the
// reader views hide it with its root.
func compareSnapshots(ctx context.Context, db progress.DB, a, b string, bound any, at time.Time) ([]SnapshotComparison, error) {
	counts := map[snapshotKey]*SnapshotComparison{}
	for i, schema := range []string{a, b} {
		other := b
		if i == 1 {
			other = a
		}
		var exists bool
		if err := db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, ident(schema, "snapshots")).Scan(&exists); err != nil {
			return nil, fmt.Errorf("look up %s.snapshots: %w", schema, err)
		}
		if !exists {
			continue
		}
		rows, err := db.Query(ctx, `SELECT s.root_table, s.status, count(*) FROM `+ident(schema, "snapshots")+` s
			WHERE ($1::pg_lsn IS NULL OR s.commit_lsn <= $1::pg_lsn)
			  AND NOT (EXISTS (SELECT 1 FROM `+ident(schema, "rows")+` r WHERE r.source = s.source AND r.commit_lsn = s.commit_lsn
			                   AND r.seq = s.root_seq AND r.expires_at <= $2::timestamptz)
			       AND NOT EXISTS (SELECT 1 FROM `+ident(other, "rows")+` r WHERE r.source = s.source AND r.commit_lsn = s.commit_lsn
			                   AND r.seq = s.root_seq AND (r.expires_at IS NULL OR r.expires_at > $2::timestamptz)))
			GROUP BY 1, 2`, bound, at)
		if err != nil {
			return nil, fmt.Errorf("count snapshots of %s: %w", schema, err)
		}
		for rows.Next() {
			var root, status string
			var n int64
			if err := rows.Scan(&root, &status, &n); err != nil {
				rows.Close()
				return nil, fmt.Errorf("count snapshots of %s: %w", schema, err)
			}
			k := snapshotKey{root, status}
			if counts[k] == nil {
				counts[k] = &SnapshotComparison{RootTable: root, Status: status}
			}
			if i == 0 {
				counts[k].A = n
			} else {
				counts[k].B = n
			}
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return nil, fmt.Errorf("count snapshots of %s: %w", schema, err)
		}
	}
	out := make([]SnapshotComparison, 0, len(counts))
	for _, s := range counts {
		out = append(out, *s)
	}
	sort.Slice(out, func(i, j int) bool {
		return out[i].RootTable+"/"+out[i].Status < out[j].RootTable+"/"+out[j].Status
	})
	return out, nil
}

// commonWatermark is the highest source LSN both versions certainly
// reflect: the lowest partition watermark of either (0 when a partition of
// either has none yet).
func commonWatermark(ctx context.Context, db progress.DB, projection string, a, b int) (event.LSN, error) {
	var lsn *string
	var all bool
	err := db.QueryRow(ctx, `SELECT min(source_lsn)::text, COALESCE(bool_and(source_lsn IS NOT NULL), false)
		FROM epitaph.progress WHERE projection = $1 AND version IN ($2, $3)`, projection, a, b).Scan(&lsn, &all)
	if err != nil {
		return 0, fmt.Errorf("read watermarks: %w", err)
	}
	if lsn == nil || !all {
		return 0, nil
	}
	return event.ParseLSN(*lsn)
}
