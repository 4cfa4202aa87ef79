package projection

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/progress"
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
		o.Projection = ArchiveProjection
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
	sa, sb := ident(va.Schema), ident(vb.Schema)
	tables := map[[2]string]*TableComparison{}
	get := func(s, t string) *TableComparison {
		k := [2]string{s, t}
		if tables[k] == nil {
			tables[k] = &TableComparison{Schema: s, Table: t}
		}
		return tables[k]
	}
	for i, schema := range []string{sa, sb} {
		rows, err := db.Query(ctx, `SELECT schema_name, table_name, count(*), COALESCE(sum(`+hash64(fmt.Sprintf(rowContent, "r"))+`), 0)::text
			FROM `+schema+`.rows r WHERE r.verified AND ($1::pg_lsn IS NULL OR r.commit_lsn <= $1::pg_lsn) GROUP BY 1, 2`, bound)
		if err != nil {
			return nil, fmt.Errorf("checksum %s: %w", schema, err)
		}
		for rows.Next() {
			var s, t, sum string
			var n int64
			if err := rows.Scan(&s, &t, &n, &sum); err != nil {
				rows.Close()
				return nil, fmt.Errorf("checksum %s: %w", schema, err)
			}
			tc := get(s, t)
			if i == 0 {
				tc.RowsA, tc.ChecksumA = n, sum
			} else {
				tc.RowsB, tc.ChecksumB = n, sum
			}
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return nil, fmt.Errorf("checksum %s: %w", schema, err)
		}
	}
	// Row by row: what is only in one version, or different.
	join := ` FROM (SELECT * FROM ` + sa + `.rows WHERE verified AND ($1::pg_lsn IS NULL OR commit_lsn <= $1::pg_lsn)) a
		FULL JOIN (SELECT * FROM ` + sb + `.rows WHERE verified AND ($1::pg_lsn IS NULL OR commit_lsn <= $1::pg_lsn)) b
		ON a.source = b.source AND a.commit_lsn = b.commit_lsn AND a.seq = b.seq `
	rows, err := db.Query(ctx, `SELECT COALESCE(a.schema_name, b.schema_name), COALESCE(a.table_name, b.table_name),
		count(*) FILTER (WHERE b.seq IS NULL), count(*) FILTER (WHERE a.seq IS NULL),
		count(*) FILTER (WHERE a.seq IS NOT NULL AND b.seq IS NOT NULL AND `+fmt.Sprintf(rowContent, "a")+` <> `+fmt.Sprintf(rowContent, "b")+`),
		count(*) FILTER (WHERE a.seq IS NOT NULL AND b.seq IS NOT NULL AND a.expires_at IS DISTINCT FROM b.expires_at)`+
		join+`GROUP BY 1, 2`, bound)
	if err != nil {
		return nil, fmt.Errorf("compare rows: %w", err)
	}
	for rows.Next() {
		var s, t string
		var oa, ob, cd, ed int64
		if err := rows.Scan(&s, &t, &oa, &ob, &cd, &ed); err != nil {
			rows.Close()
			return nil, fmt.Errorf("compare rows: %w", err)
		}
		tc := get(s, t)
		tc.OnlyA, tc.OnlyB, tc.ContentDiffers, tc.ExpiresAtDiffers = oa, ob, cd, ed
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("compare rows: %w", err)
	}
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
	expiresCond := "false"
	if !o.IgnoreExpiresAt {
		expiresCond = "a.expires_at IS DISTINCT FROM b.expires_at"
	}
	rows, err = db.Query(ctx, `SELECT COALESCE(a.schema_name, b.schema_name), COALESCE(a.table_name, b.table_name),
		COALESCE(a.key, b.key), COALESCE(a.commit_lsn, b.commit_lsn)::text, COALESCE(a.seq, b.seq),
		CASE WHEN b.seq IS NULL THEN 'only_a' WHEN a.seq IS NULL THEN 'only_b'
		     WHEN `+fmt.Sprintf(rowContent, "a")+` <> `+fmt.Sprintf(rowContent, "b")+` THEN 'content' ELSE 'expires_at' END`+
		join+`WHERE a.seq IS NULL OR b.seq IS NULL OR `+fmt.Sprintf(rowContent, "a")+` <> `+fmt.Sprintf(rowContent, "b")+` OR `+expiresCond+`
		ORDER BY 4, 5 LIMIT $2`, bound, o.MaxKeys)
	if err != nil {
		return nil, fmt.Errorf("list differing rows: %w", err)
	}
	for rows.Next() {
		var d KeyDifference
		var key []byte
		var seq int32
		if err := rows.Scan(&d.Schema, &d.Table, &key, &d.CommitLSN, &seq, &d.What); err != nil {
			rows.Close()
			return nil, fmt.Errorf("list differing rows: %w", err)
		}
		d.Key, d.Seq = key, int(seq)
		c.DifferingKeys = append(c.DifferingKeys, d)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list differing rows: %w", err)
	}
	if c.Snapshots, err = compareSnapshots(ctx, db, va.Schema, vb.Schema, bound); err != nil {
		return nil, err
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
	if c.DocumentsDiffer, c.DifferingDocuments, err = snapshot.CompareDocuments(ctx, db, va.Schema, vb.Schema, upTo, o.MaxKeys); err != nil {
		return nil, err
	}
	if c.DocumentsDiffer > 0 {
		c.SnapshotsEqual = false
	}
	c.Equal = c.ContentEqual && (o.IgnoreSnapshots || c.SnapshotsEqual) && (o.IgnoreExpiresAt || c.ExpiresAtDiffers == 0)
	return c, nil
}

// compareSnapshots counts snapshot jobs by root table and status in both
// schemas (versions without a snapshots table count none).
func compareSnapshots(ctx context.Context, db progress.DB, a, b string, bound any) ([]SnapshotComparison, error) {
	counts := map[[2]string]*SnapshotComparison{}
	for i, schema := range []string{a, b} {
		var exists bool
		if err := db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, ident(schema, "snapshots")).Scan(&exists); err != nil {
			return nil, fmt.Errorf("look up %s.snapshots: %w", schema, err)
		}
		if !exists {
			continue
		}
		rows, err := db.Query(ctx, `SELECT root_table, status, count(*) FROM `+ident(schema, "snapshots")+`
			WHERE $1::pg_lsn IS NULL OR commit_lsn <= $1::pg_lsn GROUP BY 1, 2`, bound)
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
			k := [2]string{root, status}
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

// WriteText prints the comparison for people.
func (c *Comparison) WriteText(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	bound := "every archived row"
	if c.UpTo != "" {
		bound = "transactions committed at or before " + c.UpTo + " (both versions reflect them)"
	}
	fmt.Fprintf(tw, "%s v%d vs v%d: %s\n\n", c.Projection, c.A, c.B, bound)
	fmt.Fprintln(tw, "TABLE\tROWS A\tROWS B\tCHECKSUM A\tCHECKSUM B\tONLY A\tONLY B\tCONTENT DIFFERS\tEXPIRES_AT DIFFERS")
	for _, t := range c.Tables {
		fmt.Fprintf(tw, "%s.%s\t%d\t%d\t%s\t%s\t%d\t%d\t%d\t%d\n", t.Schema, t.Table, t.RowsA, t.RowsB,
			orDash(t.ChecksumA), orDash(t.ChecksumB), t.OnlyA, t.OnlyB, t.ContentDiffers, t.ExpiresAtDiffers)
	}
	if len(c.Snapshots) > 0 {
		fmt.Fprintln(tw, "\nSNAPSHOT ROOT\tSTATUS\tA\tB")
		for _, s := range c.Snapshots {
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\n", s.RootTable, s.Status, s.A, s.B)
		}
	}
	if len(c.DifferingDocuments) > 0 {
		fmt.Fprintf(tw, "\nDIFFERING DOCUMENT (%d)\tROOT KEY\tCORRELATION ID\tWHAT\n", c.DocumentsDiffer)
		for _, d := range c.DifferingDocuments {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", d.RootTable, string(d.RootKey), d.CorrelationID, d.What)
		}
	}
	if len(c.DifferingKeys) > 0 {
		fmt.Fprintln(tw, "\nDIFFERING ROW\tKEY\tCOMMIT LSN\tSEQ\tWHAT")
		for _, d := range c.DifferingKeys {
			fmt.Fprintf(tw, "%s.%s\t%s\t%s\t%d\t%s\n", d.Schema, d.Table, string(d.Key), d.CommitLSN, d.Seq, d.What)
		}
	}
	var verdict []string
	switch {
	case !c.ContentEqual:
		verdict = append(verdict, "DIFFERENT content")
	case c.Equal:
		verdict = append(verdict, "EQUAL content")
	default:
		verdict = append(verdict, "EQUAL content, but DIFFERENT")
	}
	switch {
	case c.ExpiresAtDiffers > 0 && c.IgnoreExpiresAt:
		verdict = append(verdict, fmt.Sprintf("expires_at differs on %d rows (accepted: --ignore expires_at)", c.ExpiresAtDiffers))
	case c.ExpiresAtDiffers > 0:
		verdict = append(verdict, fmt.Sprintf("expires_at differs on %d rows (pass --ignore expires_at if the TTL change is intended)", c.ExpiresAtDiffers))
	}
	switch {
	case !c.SnapshotsEqual && c.IgnoreSnapshots:
		verdict = append(verdict, "snapshot jobs or documents differ (accepted: --ignore snapshots)")
	case !c.SnapshotsEqual:
		verdict = append(verdict, "snapshot jobs or documents differ (pass --ignore snapshots if the change of snapshot roots is intended)")
	}
	fmt.Fprintf(tw, "\n%s\n", strings.Join(verdict, "; "))
	return tw.Flush()
}
