// Package restore puts archived rows back into the source database: the
// rows one source transaction deleted, one root's snapshot subtree of it,
// or one row (`projector restore`).
//
// A restore is one source transaction: every row is inserted, parents
// before children in the foreign-key order of the source's current
// catalog, or none is. Values are rebuilt from the archive alone (the
// row, the event's column types and the exact text of the values jsonb
// would change, text_values), each cast from its text form to the type
// the event named, so a restored row equals the deleted one by row::text.
// Each restore that writes is recorded in epitaph.restores of the target,
// and the pending row-handler deliveries of the rows it restored stop as
// stop_superseded.
package restore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// On-conflict modes: what a row whose key exists in the source does.
const (
	OnConflictAbort = "abort" // the restore stops, naming the row; nothing is written
	OnConflictSkip  = "skip"  // the row is left as the source has it
)

// Outcomes recorded in epitaph.restores.outcome (OutcomePlanned: a dry
// run's Result only; a dry run records nothing).
const (
	OutcomeRunning  = "running"
	OutcomeRestored = "restored"
	OutcomeConflict = "conflict"
	OutcomeFailed   = "failed"
	OutcomePlanned  = "planned"
)

// Config says what to restore, and where.
type Config struct {
	// Source is the source name (archive.rows.source); CorrelationID the
	// source transaction (<src>:<xid>:<commit_lsn>). Required.
	Source        string
	CorrelationID string
	// RootKey with RootTable (optional when the transaction has roots of
	// one table only): restore that root's snapshot subtree.
	RootTable string
	RootKey   json.RawMessage
	// Table with Key: restore that one row of the transaction.
	Table string
	Key   json.RawMessage
	// OnConflict is OnConflictAbort (default) or OnConflictSkip.
	OnConflict string
	// DryRun plans (tables, rows, order, conflicts) in a read-only source
	// transaction and writes nothing anywhere.
	DryRun bool
	// Actor is who restores (recorded); required unless DryRun.
	Actor string
}

func (c *Config) validate() error {
	if c.OnConflict == "" {
		c.OnConflict = OnConflictAbort
	}
	switch {
	case c.Source == "":
		return errors.New("restore: a source name is required")
	case c.CorrelationID == "":
		return errors.New("restore: a correlation id is required")
	case c.OnConflict != OnConflictAbort && c.OnConflict != OnConflictSkip:
		return fmt.Errorf("restore: on-conflict %q: want abort or skip", c.OnConflict)
	case len(c.RootKey) > 0 && (len(c.Key) > 0):
		return errors.New("restore: a root key and a row key exclude each other")
	case len(c.Key) > 0 && c.Table == "":
		return errors.New("restore: a row key needs its table")
	case len(c.Key) == 0 && len(c.RootKey) == 0 && c.Table != "":
		return errors.New("restore: a table needs --key (one row) or --root-key (a snapshot subtree)")
	case !c.DryRun && c.Actor == "":
		return errors.New("restore: who restores (the actor) is required")
	}
	for name, v := range map[string]json.RawMessage{"root key": c.RootKey, "key": c.Key} {
		if len(v) > 0 && !isObject(v) {
			return fmt.Errorf("restore: %s %s: want a JSON object such as {\"id\":42}", name, v)
		}
	}
	if c.Table != "" && strings.Count(c.Table, ".") != 1 {
		return fmt.Errorf("restore: table %q: want schema.table", c.Table)
	}
	return nil
}

func isObject(v json.RawMessage) bool {
	var m map[string]json.RawMessage
	return json.Unmarshal(v, &m) == nil && m != nil
}

// Result is what a restore did, or (DryRun) would do.
type Result struct {
	// ID is the epitaph.restores row (0 for a dry run).
	ID            int64  `json:"id"`
	CorrelationID string `json:"correlation_id"`
	DryRun        bool   `json:"dry_run"`
	OnConflict    string `json:"on_conflict"`
	Outcome       string `json:"outcome"`
	// Tables in insert order (parents first).
	Tables    []TablePlan `json:"tables"`
	Conflicts []RowRef    `json:"conflicts"`
	// Deferred names the foreign keys deferred to the commit because the
	// tables form a cycle.
	Deferred []string `json:"deferred_constraints"`
	Rows     int      `json:"rows"`
	Restored int      `json:"restored"`
	Skipped  int      `json:"skipped"`
	// Superseded counts the pending deliveries stopped as stop_superseded.
	Superseded int `json:"deliveries_superseded"`
}

// TablePlan is one table of the plan.
type TablePlan struct {
	Table string `json:"table"`
	Rows  int    `json:"rows"`
	// Columns of the archived rows the table no longer has (reported, not
	// restored), and columns it has gained (they take their defaults).
	DroppedColumns []string `json:"dropped_columns"`
	AddedColumns   []string `json:"added_columns"`
	// Generated columns are computed by the server, never inserted.
	GeneratedColumns []string `json:"generated_columns"`
}

// RowRef names a row: its table and key.
type RowRef struct {
	Table string          `json:"table"`
	Key   json.RawMessage `json:"key"`
}

func (r RowRef) String() string { return r.Table + " " + string(r.Key) }

// ConflictError is a restore stopped by rows whose keys exist in the
// source (OnConflictAbort). Nothing was written to the source.
//
// Constraint is empty when the rows' own keys exist. It names a unique
// constraint other than the key when the key was free but another row of
// the source holds a value the restored row needs (a unique email taken
// since): that row is not one of the restored ones, so --on-conflict skip
// leaves the restored row out too.
type ConflictError struct {
	Rows       []RowRef
	Constraint string
}

func (e *ConflictError) Error() string {
	if e.Constraint != "" && len(e.Rows) == 1 {
		return fmt.Sprintf("restore aborted: %s conflicts with a row of the source on unique constraint %s; nothing was written (--on-conflict skip leaves it out)",
			e.Rows[0], e.Constraint)
	}
	names := make([]string, 0, 3)
	for i, r := range e.Rows {
		if i == 3 {
			names = append(names, fmt.Sprintf("and %d more", len(e.Rows)-3))
			break
		}
		names = append(names, r.String())
	}
	return fmt.Sprintf("restore aborted: %d rows exist in the source (%s); nothing was written (--on-conflict skip leaves them as they are)",
		len(e.Rows), strings.Join(names, ", "))
}

// CannotError is a restore that cannot be done as asked: nothing archived
// matches, a table is gone, a row's image is incomplete. Nothing was
// written to the source.
type CannotError struct{ Reason string }

func (e *CannotError) Error() string { return "cannot restore: " + e.Reason }

func cannot(format string, args ...any) error {
	return &CannotError{Reason: fmt.Sprintf(format, args...)}
}

// Run restores what cfg names from the archive of target into source.
// With cfg.DryRun it only plans. A ConflictError or CannotError means
// nothing was written to the source; any other error after the source
// transaction began rolled it back (the record says failed).
func Run(ctx context.Context, target *pgxpool.Pool, source *pgx.Conn, cfg Config) (*Result, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	rows, err := loadRows(ctx, target, cfg)
	if err != nil {
		return nil, err
	}
	res := &Result{CorrelationID: cfg.CorrelationID, DryRun: cfg.DryRun, OnConflict: cfg.OnConflict, Rows: len(rows)}
	if !cfg.DryRun {
		if res.ID, err = record(ctx, target, cfg); err != nil {
			return nil, err
		}
	}
	err = restoreInSource(ctx, target, source, cfg, rows, res)
	if cfg.DryRun {
		if err == nil {
			res.Outcome = OutcomePlanned
		}
		return res, err
	}
	res.Outcome = outcomeOf(err)
	if err == nil {
		res.Superseded, err = settle(ctx, target, res, rows)
		if err != nil {
			return res, fmt.Errorf("restore %d committed in the source, but recording it failed: %w", res.ID, err)
		}
		return res, nil
	}
	if serr := finish(ctx, target, res, err); serr != nil {
		return res, fmt.Errorf("%w (and recording the outcome failed: %v)", err, serr)
	}
	return res, err
}

func outcomeOf(err error) string {
	var ce *ConflictError
	switch {
	case err == nil:
		return OutcomeRestored
	case errors.As(err, &ce):
		return OutcomeConflict
	default:
		return OutcomeFailed
	}
}

// holdUnerased takes the erasure lock shared (as every apply does, in
// epitaph.erasure_epoch()) in a target transaction and checks that every
// row is still archived: an erasure that ran since the restore read them
// removed them, and they must not go back into the source. The release
// ends the transaction; until then no erasure can start.
func holdUnerased(ctx context.Context, target *pgxpool.Pool, rows []*archived) (release func(), err error) {
	guard, err := target.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("check the rows are not erased: %w", err)
	}
	release = func() { _ = guard.Rollback(context.WithoutCancel(ctx)) }
	srcs, lsns, seqs := make([]string, len(rows)), make([]string, len(rows)), make([]int32, len(rows))
	for i, a := range rows {
		srcs[i], lsns[i], seqs[i] = a.source, a.commitLSN, int32(a.seq)
	}
	// The lock first, in a statement of its own: the check's snapshot is
	// taken after it, so it sees an erasure that committed meanwhile.
	if _, err := guard.Exec(ctx, `SELECT epitaph.erasure_epoch()`); err != nil {
		release()
		return nil, fmt.Errorf("check the rows are not erased: %w", err)
	}
	var present int
	err = guard.QueryRow(ctx, `SELECT count(*) FROM unnest($1::text[], $2::pg_lsn[], $3::int[]) AS u(source, commit_lsn, seq)
		WHERE EXISTS (SELECT 1 FROM archive.rows r WHERE r.source = u.source AND r.commit_lsn = u.commit_lsn AND r.seq = u.seq)`,
		srcs, lsns, seqs).Scan(&present)
	if err != nil {
		release()
		return nil, fmt.Errorf("check the rows are not erased: %w", err)
	}
	if present != len(rows) {
		release()
		return nil, cannot("%d of the rows were erased or expired while the restore ran; nothing was written", len(rows)-present)
	}
	return release, nil
}

// restoreInSource plans and (unless a dry run) inserts in one source
// transaction.
func restoreInSource(ctx context.Context, target *pgxpool.Pool, source *pgx.Conn, cfg Config, rows []*archived, res *Result) error {
	opts := pgx.TxOptions{}
	if cfg.DryRun {
		opts.AccessMode = pgx.ReadOnly
	}
	tx, err := source.BeginTx(ctx, opts)
	if err != nil {
		return fmt.Errorf("begin source transaction: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	p, err := plan(ctx, tx, rows)
	if err != nil {
		return err
	}
	res.Tables, res.Deferred = p.tables, p.deferred
	if res.Conflicts, err = conflicts(ctx, tx, p); err != nil {
		return err
	}
	if len(res.Conflicts) > 0 && cfg.OnConflict == OnConflictAbort {
		return &ConflictError{Rows: res.Conflicts}
	}
	if cfg.DryRun {
		return nil
	}
	if err := insertAll(ctx, tx, p, cfg.OnConflict == OnConflictSkip, res); err != nil {
		return err
	}
	// An erasure that ran since the rows were read wins: they are checked
	// again under the erasure lock, held until the source commits.
	release, err := holdUnerased(ctx, target, rows)
	if err != nil {
		return err
	}
	defer release()
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("commit restore in the source: %w", err)
	}
	return nil
}
