package status

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/progress"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// Readiness is one version's row of archive.status.
type Readiness struct {
	Projection         string     `json:"projection"`
	Version            int        `json:"version"`
	State              string     `json:"state"`
	Ready              bool       `json:"ready"`
	NotReadyReasons    []string   `json:"not_ready_reasons,omitempty"`
	SourceLSN          string     `json:"source_lsn,omitempty"`
	CompleteUpToLSN    string     `json:"complete_up_to_lsn,omitempty"`
	CompleteUpToTime   *time.Time `json:"complete_up_to_time,omitempty"`
	GapsUnacknowledged int        `json:"gaps_unacknowledged"`
	Truncates          int        `json:"truncates"`
	QuarantineOpen     int        `json:"quarantine_open"`
	completeUpTo       *event.LSN
}

// ReadReadiness returns archive.status for every non-retired version of
// projection (all projections when ""), computed from the same query as the
// view, so it works before the view exists.
func ReadReadiness(ctx context.Context, db progress.DB, projection string) ([]Readiness, error) {
	rows, err := db.Query(ctx, `SELECT projection, version, state, ready, not_ready_reasons, source_lsn::text,
		complete_up_to_lsn::text, complete_up_to_time, gaps_unacknowledged, truncates, quarantine_open
		FROM (`+archive.StatusQuery(`($1 = '' OR v.projection = $1)`)+`) st ORDER BY projection, version`, projection)
	if err != nil {
		return nil, fmt.Errorf("read readiness: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Readiness, error) {
		var x Readiness
		var src, complete *string
		if err := r.Scan(&x.Projection, &x.Version, &x.State, &x.Ready, &x.NotReadyReasons, &src, &complete,
			&x.CompleteUpToTime, &x.GapsUnacknowledged, &x.Truncates, &x.QuarantineOpen); err != nil {
			return x, err
		}
		if src != nil {
			x.SourceLSN = *src
		}
		if complete != nil {
			l, err := event.ParseLSN(*complete)
			if err != nil {
				return x, err
			}
			x.CompleteUpToLSN, x.completeUpTo = *complete, &l
		}
		return x, nil
	})
	if err != nil {
		return nil, fmt.Errorf("read readiness: %w", err)
	}
	return out, nil
}

// Blocker is what keeps a version from being complete up to an LSN: an
// unacknowledged blocking gap or an open quarantined event.
type Blocker struct {
	// Gap is set for a gap, Quarantine (its id) for a quarantined event.
	Gap        *archive.Gap
	Quarantine int64
	Partition  int
	StreamSeq  int64
	Category   string
	After      event.LSN // the quarantined event lies after this position
}

func (b Blocker) String() string {
	if b.Gap != nil {
		return b.Gap.String()
	}
	return fmt.Sprintf("quarantined event %d (partition %d, stream seq %d, %s) after %s", b.Quarantine, b.Partition, b.StreamSeq, b.Category, b.After)
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// Blockers lists what keeps the live version of projection from being
// complete up to lsn: unacknowledged blocking gaps that start before it
// (from_lsn, the last position known complete, below lsn; unknown counts as
// 0/0) and open quarantined events that lie before it (their partition's
// watermark when met below lsn). At most limit of each.
func Blockers(ctx context.Context, db progress.DB, projection string, lsn event.LSN, limit int) ([]Blocker, error) {
	live, err := liveVersion(ctx, db, projection)
	if err != nil || live == nil {
		return nil, err
	}
	var out []Blocker
	gaps, err := listGaps(ctx, db, live.Schema, `acknowledged_at IS NULL AND kind <> 'truncate'
		AND COALESCE(from_lsn, '0/0'::pg_lsn) < $1::text::pg_lsn`, limit, lsn.String())
	if err != nil {
		return nil, err
	}
	for i := range gaps {
		out = append(out, Blocker{Gap: &gaps[i]})
	}
	rows, err := db.Query(ctx, `SELECT id, partition, stream_seq, category, COALESCE(after_lsn, '0/0')::text
		FROM epitaph.quarantine
		WHERE projection = $1 AND version = $2 AND status = 'open' AND COALESCE(after_lsn, '0/0'::pg_lsn) < $3::text::pg_lsn
		ORDER BY COALESCE(after_lsn, '0/0'::pg_lsn), id LIMIT $4`, live.Projection, live.Version, lsn.String(), limit)
	if err != nil {
		return nil, fmt.Errorf("list quarantine before %s: %w", lsn, err)
	}
	qs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Blocker, error) {
		var b Blocker
		var after string
		if err := r.Scan(&b.Quarantine, &b.Partition, &b.StreamSeq, &b.Category, &after); err != nil {
			return b, err
		}
		b.After, err = event.ParseLSN(after)
		return b, err
	})
	if err != nil {
		return nil, fmt.Errorf("list quarantine before %s: %w", lsn, err)
	}
	return append(out, qs...), nil
}

// notMigrated reports an error of a target the projector has not set up
// yet (its tables do not exist): a wait keeps waiting for it.
func notMigrated(err error) bool {
	var pg *pgconn.PgError
	return errors.As(err, &pg) && (pg.Code == "42P01" || pg.Code == "3F000" || pg.Code == "42883")
}

func liveVersion(ctx context.Context, db progress.DB, projection string) (*version.Version, error) {
	vs, err := version.ListVersions(ctx, db, projection)
	if err != nil {
		return nil, err
	}
	for _, v := range vs {
		if v.State == version.StateLive {
			return &v, nil
		}
	}
	return nil, nil
}

// IncompleteError is WaitComplete's answer when the archive cannot become
// complete up to the LSN without an operator: it names what is in the way.
type IncompleteError struct {
	LSN          event.LSN
	CompleteUpTo string
	Blockers     []Blocker
}

func (e *IncompleteError) Error() string {
	names := make([]string, len(e.Blockers))
	for i, b := range e.Blockers {
		names[i] = b.String()
	}
	return fmt.Sprintf("the archive cannot be complete up to %s (complete up to %s): %s", e.LSN, orDash(e.CompleteUpTo), strings.Join(names, "; "))
}

// TimeoutError is WaitComplete's answer when ctx ended first: it says where
// the archive is.
type TimeoutError struct {
	LSN    event.LSN
	Status *Readiness // nil when the live version could not be read
	Err    error
}

func (e *TimeoutError) Error() string {
	if e.Status == nil {
		return fmt.Sprintf("timed out waiting for the archive to be complete up to %s: no live version could be read (%v)", e.LSN, e.Err)
	}
	s := fmt.Sprintf("timed out waiting for %s v%d to be complete up to %s: it is complete up to %s",
		e.Status.Projection, e.Status.Version, e.LSN, orDash(e.Status.CompleteUpToLSN))
	if len(e.Status.NotReadyReasons) > 0 {
		s += " (not ready: " + strings.Join(e.Status.NotReadyReasons, "; ") + ")"
	}
	return s
}

func (e *TimeoutError) Unwrap() error { return e.Err }

// WaitComplete returns when the live version of projection is complete up
// to lsn (every source transaction committed at or before lsn is applied,
// no gap or quarantine before it), with its readiness row. It returns an
// *IncompleteError at once when an unacknowledged blocking gap or an open
// quarantined event lies before lsn (waiting cannot help), and a
// *TimeoutError naming where the archive is when ctx ends first (also
// while the target is not set up yet: no projector has run). Polls every
// interval (default 50ms).
func WaitComplete(ctx context.Context, db progress.DB, projection string, lsn event.LSN, interval time.Duration) (*Readiness, error) {
	if interval <= 0 {
		interval = 50 * time.Millisecond
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	var last *Readiness
	for {
		rs, err := ReadReadiness(ctx, db, projection)
		if err == nil {
			last = nil
			for i := range rs {
				if rs[i].State == version.StateLive {
					last = &rs[i]
				}
			}
			if last != nil && last.completeUpTo != nil && *last.completeUpTo >= lsn {
				return last, nil
			}
			bs, err := Blockers(ctx, db, projection, lsn, 10)
			if err == nil && len(bs) > 0 {
				ie := &IncompleteError{LSN: lsn, Blockers: bs}
				if last != nil {
					ie.CompleteUpTo = last.CompleteUpToLSN
				}
				return last, ie
			}
			if err != nil && ctx.Err() == nil {
				return last, err
			}
		} else if ctx.Err() == nil && !notMigrated(err) {
			return nil, err
		}
		select {
		case <-ctx.Done():
			err := ctx.Err()
			if last == nil {
				err = errors.Join(err, errors.New("no live version"))
			}
			return last, &TimeoutError{LSN: lsn, Status: last, Err: err}
		case <-t.C:
		}
	}
}
