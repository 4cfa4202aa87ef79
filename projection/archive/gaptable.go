package archive

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
)

// Gap is one row of a version's gaps table (archive.gaps for the live
// version): a range the archive is known to miss. Nil fields are unknown or
// not specific (Schema and Table nil: every table; Partition nil: every
// partition).
type Gap struct {
	ID             int64      `json:"id"`
	Kind           string     `json:"kind"`
	Schema         *string    `json:"schema_name"`
	Table          *string    `json:"table_name"`
	Partition      *int       `json:"partition"`
	FromLSN        *event.LSN `json:"from_lsn"`
	ToLSN          *event.LSN `json:"to_lsn"`
	FromSeq        *int64     `json:"from_seq"`
	ToSeq          *int64     `json:"to_seq"`
	DetectedAt     time.Time  `json:"detected_at"`
	AcknowledgedAt *time.Time `json:"acknowledged_at"`
	AckReason      *string    `json:"ack_reason"`
}

// Blocking reports whether the gap keeps the archive from being complete
// (lost_upstream and removed_from_stream do until acknowledged; a truncate
// is informational).
func (g Gap) Blocking() bool {
	return g.Kind != event.GapTruncate && g.AcknowledgedAt == nil
}

const insertGapSQL = `
INSERT INTO %s.gaps (kind, schema_name, table_name, partition, from_lsn, to_lsn, from_seq, to_seq)
VALUES ($1, $2, $3, $4, $5::text::pg_lsn, $6::text::pg_lsn, $7, $8)
ON CONFLICT (kind, COALESCE(schema_name, ''), COALESCE(table_name, ''), from_lsn, to_lsn) WHERE partition IS NULL
DO NOTHING`

// InsertGap records g in the gaps table of schema, inside tx (the apply
// transaction that met it, so a gap is recorded exactly when the partition
// moves past it). A gap without a partition (one that concerns every
// partition) is recorded once however many partitions meet a copy of it.
func InsertGap(ctx context.Context, tx pgx.Tx, schema string, g Gap) error {
	lsn := func(l *event.LSN) *string {
		if l == nil {
			return nil
		}
		s := l.String()
		return &s
	}
	if _, err := tx.Exec(ctx, fmt.Sprintf(insertGapSQL, Ident(schema)),
		g.Kind, g.Schema, g.Table, g.Partition, lsn(g.FromLSN), lsn(g.ToLSN), g.FromSeq, g.ToSeq); err != nil {
		return fmt.Errorf("record %s gap in %s: %w", g.Kind, schema, err)
	}
	return nil
}

// String names a gap for people: id, kind, table, partition and range.
func (g Gap) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "gap %d (%s", g.ID, g.Kind)
	if g.Schema != nil && g.Table != nil {
		fmt.Fprintf(&b, ", table %s.%s", *g.Schema, *g.Table)
	}
	if g.Partition != nil {
		fmt.Fprintf(&b, ", partition %d", *g.Partition)
	}
	b.WriteString(")")
	if g.FromLSN != nil || g.ToLSN != nil {
		from, to := g.LSNRange()
		fmt.Fprintf(&b, " after %s up to %s", from, to)
	}
	if g.FromSeq != nil || g.ToSeq != nil {
		fmt.Fprintf(&b, " stream seq %s", g.SeqRange())
	}
	return b.String()
}

// LSNRange is the gap's range of source positions as text; an end that is
// not known is "?".
func (g Gap) LSNRange() (from, to string) {
	return lsnOrUnknown(g.FromLSN), lsnOrUnknown(g.ToLSN)
}

// SeqRange is the gap's range of stream sequences as "from-to"; an end that
// is not known is "?".
func (g Gap) SeqRange() string { return seqOrUnknown(g.FromSeq) + "-" + seqOrUnknown(g.ToSeq) }

func lsnOrUnknown(l *event.LSN) string {
	if l == nil {
		return "?"
	}
	return l.String()
}

func seqOrUnknown(n *int64) string {
	if n == nil {
		return "?"
	}
	return fmt.Sprint(*n)
}
