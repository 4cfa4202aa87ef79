package status

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/progress"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/version"
)

const gapColumns = `id, kind, schema_name, table_name, partition, from_lsn::text, to_lsn::text, from_seq, to_seq,
	detected_at, acknowledged_at, ack_reason`

// listGaps reads gaps of a version's schema matching where (SQL over the
// gaps table, with args from $1), oldest first; a schema without a gaps
// table has none.
func listGaps(ctx context.Context, db progress.DB, schema, where string, limit int, args ...any) ([]archive.Gap, error) {
	var exists bool
	if err := db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, archive.Ident(schema, "gaps")).Scan(&exists); err != nil {
		return nil, fmt.Errorf("look up %s.gaps: %w", schema, err)
	}
	if !exists {
		return nil, nil
	}
	if where == "" {
		where = "true"
	}
	q := `SELECT ` + gapColumns + ` FROM ` + archive.Ident(schema, "gaps") + ` WHERE ` + where + ` ORDER BY id`
	if limit > 0 {
		q += fmt.Sprintf(" LIMIT %d", limit)
	}
	rows, err := db.Query(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("list gaps of %s: %w", schema, err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (archive.Gap, error) {
		var g archive.Gap
		var from, to *string
		var part *int32
		if err := r.Scan(&g.ID, &g.Kind, &g.Schema, &g.Table, &part, &from, &to, &g.FromSeq, &g.ToSeq,
			&g.DetectedAt, &g.AcknowledgedAt, &g.AckReason); err != nil {
			return g, err
		}
		if part != nil {
			p := int(*part)
			g.Partition = &p
		}
		var err error
		if g.FromLSN, err = parseNullLSN(from); err != nil {
			return g, err
		}
		g.ToLSN, err = parseNullLSN(to)
		return g, err
	})
	if err != nil {
		return nil, fmt.Errorf("list gaps of %s: %w", schema, err)
	}
	return out, nil
}

func parseNullLSN(s *string) (*event.LSN, error) {
	if s == nil {
		return nil, nil
	}
	l, err := event.ParseLSN(*s)
	if err != nil {
		return nil, err
	}
	return &l, nil
}

// VersionGaps is the gaps table of one version.
type VersionGaps struct {
	Projection string        `json:"projection"`
	Version    int           `json:"version"`
	State      string        `json:"state"`
	Gaps       []archive.Gap `json:"gaps"`
}

// ListGaps returns the gaps of every active version of projection (live
// first), oldest first within each.
func ListGaps(ctx context.Context, db progress.DB, projection string) ([]VersionGaps, error) {
	vs, err := version.ListVersions(ctx, db, projection)
	if err != nil {
		return nil, err
	}
	var out []VersionGaps
	for _, v := range vs {
		if !v.Active() {
			continue
		}
		gs, err := listGaps(ctx, db, v.Schema, "", 0)
		if err != nil {
			return nil, err
		}
		vg := VersionGaps{Projection: v.Projection, Version: v.Version, State: v.State, Gaps: gs}
		if vg.Gaps == nil {
			vg.Gaps = []archive.Gap{}
		}
		if v.State == version.StateLive {
			out = append([]VersionGaps{vg}, out...)
		} else {
			out = append(out, vg)
		}
	}
	return out, nil
}

// ErrGapNotFound is returned by AckGap for an id the version does not have.
var ErrGapNotFound = errors.New("no such gap")

// AckGap acknowledges gap id of projection's version n (the live version when
// n is 0): an operator says the loss is known and accepted, with a
// reason (required), recorded in acknowledged_at and ack_reason. An
// acknowledged lost_upstream or removed_from_stream gap no longer keeps the
// archive from being ready or complete. Acknowledging twice is refused.
func AckGap(ctx context.Context, db progress.DB, projection string, n int, id int64, reason string) (archive.Gap, error) {
	reason = strings.TrimSpace(reason)
	if reason == "" {
		return archive.Gap{}, errors.New("acknowledge a gap: a reason is required (--reason TEXT)")
	}
	var v *version.Version
	if n == 0 {
		lv, err := liveVersion(ctx, db, projection)
		if err != nil {
			return archive.Gap{}, err
		}
		if lv == nil {
			return archive.Gap{}, fmt.Errorf("acknowledge gap %d: %s has no live version", id, projection)
		}
		v = lv
	} else {
		gv, err := version.GetVersion(ctx, db, projection, n)
		if err != nil {
			return archive.Gap{}, err
		}
		v = &gv
	}
	gs, err := listGaps(ctx, db, v.Schema, "id = $1", 1, id)
	if err != nil {
		return archive.Gap{}, err
	}
	if len(gs) == 0 {
		return archive.Gap{}, fmt.Errorf("acknowledge gap %d of %s v%d: %w", id, v.Projection, v.Version, ErrGapNotFound)
	}
	if gs[0].AcknowledgedAt != nil {
		return gs[0], fmt.Errorf("gap %d of %s v%d was already acknowledged at %s (%s)", id, v.Projection, v.Version,
			gs[0].AcknowledgedAt.UTC().Format(time.RFC3339), deref(gs[0].AckReason))
	}
	tag, err := db.Exec(ctx, `UPDATE `+archive.Ident(v.Schema, "gaps")+` SET acknowledged_at = now(), ack_reason = $2
		WHERE id = $1 AND acknowledged_at IS NULL`, id, reason)
	if err != nil {
		return archive.Gap{}, fmt.Errorf("acknowledge gap %d of %s v%d: %w", id, v.Projection, v.Version, err)
	}
	if tag.RowsAffected() == 0 {
		return archive.Gap{}, fmt.Errorf("gap %d of %s v%d was acknowledged meanwhile", id, v.Projection, v.Version)
	}
	gs, err = listGaps(ctx, db, v.Schema, "id = $1", 1, id)
	if err != nil || len(gs) == 0 {
		return archive.Gap{}, err
	}
	return gs[0], nil
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}
