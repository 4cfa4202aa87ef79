package archive

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/epitaph-dev/epitaph/internal/pgquote"
)

// Partition periods of a version's rows table (range partitions by
// commit_time). The period is stored with the version (its config's
// "archive_partition"), so every worker creates the same bounds.
const (
	PeriodDay   = "day"
	PeriodWeek  = "week"
	PeriodMonth = "month"
	// DefaultPeriod is the period of a version whose config names none.
	DefaultPeriod = PeriodMonth
)

// ParsePeriod checks a --archive-partition value ("" is DefaultPeriod).
func ParsePeriod(s string) (string, error) {
	switch s {
	case "":
		return DefaultPeriod, nil
	case PeriodDay, PeriodWeek, PeriodMonth:
		return s, nil
	}
	return "", fmt.Errorf("archive partition %q: want day, week or month", s)
}

// PeriodStart is the start (UTC) of the period of period that holds t:
// the day, the ISO week (from Monday) or the month.
func PeriodStart(period string, t time.Time) time.Time {
	t = t.UTC()
	d := time.Date(t.Year(), t.Month(), t.Day(), 0, 0, 0, 0, time.UTC)
	switch period {
	case PeriodDay:
		return d
	case PeriodWeek:
		return d.AddDate(0, 0, -((int(d.Weekday()) + 6) % 7))
	default:
		return time.Date(t.Year(), t.Month(), 1, 0, 0, 0, 0, time.UTC)
	}
}

// PeriodEnd is the start of the period after the one starting at start.
func PeriodEnd(period string, start time.Time) time.Time {
	switch period {
	case PeriodDay:
		return start.AddDate(0, 0, 1)
	case PeriodWeek:
		return start.AddDate(0, 0, 7)
	default:
		return start.AddDate(0, 1, 0)
	}
}

// PartitionName is the table (in the version's schema) of the partition
// starting at start: rows_p<yyyymmdd>.
func PartitionName(start time.Time) string { return "rows_p" + start.UTC().Format("20060102") }

// DefaultPartition is the table that holds the rows no other partition
// covers: a commit_time older than the oldest partition (or newer than the
// newest), or NULL. It exists from the table's creation, so an insert never
// fails for want of a partition.
const DefaultPartition = "rows_default"

// Partitioned reports whether the schema's rows table is partitioned (a
// version created by an earlier release is not, and keeps working so).
func Partitioned(ctx context.Context, db interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}, schema string) (bool, error) {
	var p bool
	err := db.QueryRow(ctx, `SELECT COALESCE((SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass($1)), false)`,
		Ident(schema, "rows")).Scan(&p)
	if err != nil {
		return false, fmt.Errorf("is %s.rows partitioned: %w", schema, err)
	}
	return p, nil
}

// partitionLockSQL serializes the creation of partitions of one schema
// across workers (two-key advisory lock, its own space).
const partitionLockSQL = `SELECT pg_advisory_xact_lock(hashtext('epitaph.partitions'), hashtext($1))`

// EnsurePartitions creates, in tx, the partitions of the schema's rows
// table for the periods holding times (skipping those that exist). A
// period whose rows already went to the default partition (they arrived
// before it existed) gets them moved into its new partition in the same
// transaction. A rows table that is not partitioned is left alone. It
// returns the starts of the periods that now have a partition.
func EnsurePartitions(ctx context.Context, tx pgx.Tx, schema, period string, times ...time.Time) ([]time.Time, error) {
	part, err := Partitioned(ctx, tx, schema)
	if err != nil || !part {
		return nil, err
	}
	if _, err := tx.Exec(ctx, partitionLockSQL, schema); err != nil {
		return nil, fmt.Errorf("lock partitions of %s: %w", schema, err)
	}
	seen := map[time.Time]bool{}
	var out []time.Time
	for _, t := range times {
		start := PeriodStart(period, t)
		if seen[start] {
			continue
		}
		seen[start] = true
		if err := ensurePartition(ctx, tx, schema, period, start); err != nil {
			return out, err
		}
		out = append(out, start)
	}
	return out, nil
}

// partitionColumns are the rows table's columns, for moving rows out of
// the default partition.
const partitionColumns = `source, schema_name, table_name, key, row, identity, correlation_id, is_root, xid, commit_lsn,
commit_time, seq, archived_at, expires_at, refs, columns, verified, text_values`

func ensurePartition(ctx context.Context, tx pgx.Tx, schema, period string, start time.Time) error {
	name := PartitionName(start)
	end := PeriodEnd(period, start)
	var exists bool
	if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, Ident(schema, name)).Scan(&exists); err != nil {
		return fmt.Errorf("partition %s.%s: %w", schema, name, err)
	}
	if exists {
		return nil
	}
	rows, tbl, def := Ident(schema, "rows"), Ident(schema, name), Ident(schema, DefaultPartition)
	lo, hi := pgquote.Literal(start.Format(time.RFC3339)), pgquote.Literal(end.Format(time.RFC3339))
	var stray bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+def+` WHERE commit_time >= $1 AND commit_time < $2)`,
		start, end).Scan(&stray); err != nil {
		return fmt.Errorf("rows of %s in %s: %w", name, DefaultPartition, err)
	}
	sp, err := tx.Begin(ctx)
	if err != nil {
		return fmt.Errorf("savepoint: %w", err)
	}
	var sql string
	if !stray {
		sql = `CREATE TABLE ` + tbl + ` PARTITION OF ` + rows + ` FOR VALUES FROM (` + lo + `) TO (` + hi + `)`
	} else {
		// Attaching checks that the default partition holds no row of the
		// range: move them first, in this transaction.
		sql = `CREATE TABLE ` + tbl + ` (LIKE ` + rows + ` INCLUDING DEFAULTS);
WITH moved AS (DELETE FROM ` + def + ` WHERE commit_time >= ` + lo + ` AND commit_time < ` + hi + ` RETURNING ` + partitionColumns + `)
INSERT INTO ` + tbl + ` (` + partitionColumns + `) SELECT ` + partitionColumns + ` FROM moved;
ALTER TABLE ` + rows + ` ATTACH PARTITION ` + tbl + ` FOR VALUES FROM (` + lo + `) TO (` + hi + `)`
	}
	if _, err := sp.Exec(ctx, sql); err != nil {
		_ = sp.Rollback(ctx)
		var pg *pgconn.PgError
		if errors.As(err, &pg) && pg.Code == "42P07" { // created meanwhile without the lock (an older worker)
			return nil
		}
		return fmt.Errorf("create partition %s.%s [%s, %s): %w", schema, name, start.Format(time.DateOnly), end.Format(time.DateOnly), err)
	}
	return sp.Commit(ctx)
}

// PartitionInfo is one partition of a rows table, with its bounds (nil
// for the default partition).
type PartitionInfo struct {
	Name     string
	From, To *time.Time
}

// Partitions lists the partitions of the schema's rows table, oldest
// first, the default partition last; none when the table is not
// partitioned.
func Partitions(ctx context.Context, db interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}, schema string) ([]PartitionInfo, error) {
	// The bounds are read back as timestamptz by the server: their text
	// (pg_get_expr) follows the session's DateStyle and TimeZone, and the
	// cast reads it under the same settings.
	rows, err := db.Query(ctx, `
		SELECT c.relname, pg_get_expr(c.relpartbound, c.oid), b[1]::timestamptz, b[2]::timestamptz
		FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		CROSS JOIN LATERAL (SELECT regexp_match(pg_get_expr(c.relpartbound, c.oid),
		                                        $re$^FOR VALUES FROM \('([^']*)'\) TO \('([^']*)'\)$$re$) AS b) m
		WHERE i.inhparent = to_regclass($1)`, Ident(schema, "rows"))
	if err != nil {
		return nil, fmt.Errorf("partitions of %s: %w", schema, err)
	}
	var out, def []PartitionInfo
	var name, bound string
	var from, to *time.Time
	_, err = pgx.ForEachRow(rows, []any{&name, &bound, &from, &to}, func() error {
		p := PartitionInfo{Name: name}
		if bound == "DEFAULT" {
			def = append(def, p)
			return nil
		}
		if from == nil || to == nil {
			return fmt.Errorf("partition %s: bound %q", name, bound)
		}
		f, t := from.UTC(), to.UTC()
		p.From, p.To = &f, &t
		out = append(out, p)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("partitions of %s: %w", schema, err)
	}
	for i := 1; i < len(out); i++ { // a handful: insertion sort by From
		for j := i; j > 0 && out[j].From.Before(*out[j-1].From); j-- {
			out[j], out[j-1] = out[j-1], out[j]
		}
	}
	return append(out, def...), nil
}
