package snapshot

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
)

// Beginner starts a transaction: a *pgxpool.Pool or a *pgx.Conn.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Config of one batch step.
type Config struct {
	// Schema is the version schema (e.g. "archive_v1") holding both the
	// archive's rows table and the snapshots table. Required.
	Schema string
	// BatchSize is the most jobs claimed by one batch. Default 50.
	BatchSize int
	// MaxAttempts is how many times an incomplete group is tried before
	// the job is parked as failed. Default 8.
	MaxAttempts int
	// RetryDelay is the wait before the second attempt; it doubles per
	// attempt up to MaxRetryDelay, each wait randomized by ±20%. Default 5s.
	RetryDelay time.Duration
	// MaxRetryDelay caps the wait between attempts. Default 5m.
	MaxRetryDelay time.Duration
	// Clock gives the time used for retry schedules and completed_at.
	// Default time.Now.
	Clock func() time.Time
}

func (c *Config) setDefaults() {
	if c.BatchSize == 0 {
		c.BatchSize = 50
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = 8
	}
	if c.RetryDelay == 0 {
		c.RetryDelay = 5 * time.Second
	}
	if c.MaxRetryDelay == 0 {
		c.MaxRetryDelay = 5 * time.Minute
	}
	if c.Clock == nil {
		c.Clock = time.Now
	}
}

func (c *Config) validate() error {
	switch {
	case c.Schema == "":
		return errors.New("snapshot config: Schema is required")
	case c.BatchSize < 1 || c.BatchSize > 10000:
		return fmt.Errorf("snapshot config: BatchSize %d out of range 1..10000", c.BatchSize)
	case c.MaxAttempts < 1:
		return fmt.Errorf("snapshot config: MaxAttempts %d must be at least 1", c.MaxAttempts)
	case c.RetryDelay < 0 || c.MaxRetryDelay < c.RetryDelay:
		return errors.New("snapshot config: need 0 <= RetryDelay <= MaxRetryDelay")
	}
	return nil
}

// retryJitter is the randomization of retry delays (±20%): jobs that
// failed together (a quarantined event holds up many) do not all come due
// in the same batch again. Small enough that each doubling stays longer
// than the one before.
const retryJitter = 0.2

// delay is the wait after the given number of failed attempts: RetryDelay,
// doubling per attempt, within ±retryJitter, at most MaxRetryDelay.
func (c *Config) delay(failed int) time.Duration {
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval = c.RetryDelay
	bo.Multiplier = 2
	bo.RandomizationFactor = retryJitter
	bo.MaxInterval = c.MaxRetryDelay
	bo.MaxElapsedTime = 0 // never backoff.Stop
	bo.Reset()
	d := bo.NextBackOff()
	for i := 1; i < failed; i++ {
		d = bo.NextBackOff()
	}
	return min(d, c.MaxRetryDelay)
}

// Result counts what one batch did.
type Result struct {
	Claimed   int // jobs claimed
	Completed int // jobs written complete
	Retried   int // incomplete groups left pending for a later attempt
	Failed    int // jobs parked as failed
}

const claimSQL = `
SELECT id, correlation_id, source, commit_lsn::text, root_table, root_seq, expected_tables, retry_count
  FROM %s
 WHERE status = 'pending' AND (next_attempt_at IS NULL OR next_attempt_at <= $1)
 ORDER BY next_attempt_at NULLS FIRST, id
 LIMIT $2
   FOR UPDATE SKIP LOCKED`

const groupRowsSQL = `
SELECT schema_name, table_name, key, row, refs, commit_lsn::text, seq, archived_at, commit_time
  FROM %s
 WHERE source = $1 AND commit_lsn = $2::pg_lsn AND verified
 ORDER BY seq`

const groupRootsSQL = `SELECT root_seq FROM %s WHERE source = $1 AND commit_lsn = $2::pg_lsn`

const completeSQL = `
UPDATE %s SET status = 'complete', payload = $2, fingerprint = $3, completed_at = $4,
       failure_reason = NULL, next_attempt_at = NULL, pending_since = NULL, updated_at = now()
 WHERE id = $1`

const retrySQL = `
UPDATE %s SET retry_count = $2, next_attempt_at = $3, failure_reason = $4, updated_at = now()
 WHERE id = $1`

const failSQL = `
UPDATE %s SET status = 'failed', retry_count = $2, failure_reason = $3, fingerprint = $4,
       payload = NULL, next_attempt_at = NULL, pending_since = NULL, updated_at = now()
 WHERE id = $1`

type job struct {
	id            int64
	correlationID string
	source        string
	commitLSN     string
	rootTable     string
	rootSeq       int
	expected      map[string]int
	retryCount    int
}

// RunBatch claims up to BatchSize due pending jobs of cfg.Schema, assembles
// their documents from the archive and writes the outcome, all in one
// transaction, and returns. When a claimed job's transaction has more
// roots, the batch takes more of that transaction's due jobs (up to
// 10*BatchSize jobs in all), so a transaction's rows are read once for many
// documents. Any host may call it, on any schedule, from any
// number of processes: jobs are claimed with FOR UPDATE SKIP LOCKED, so
// concurrent batches never assemble the same job, and a batch that fails
// part way leaves its jobs pending for the next one.
//
// Per job: a complete group (as many archive rows per table as the commit
// counted) becomes a complete document; a group with no archive rows at
// all fails at once; a short group is retried by later batches
// (retry_count+1, after RetryDelay doubling) and fails after MaxAttempts
// with a reason naming the tables and counts missing.
func RunBatch(ctx context.Context, db Beginner, cfg Config) (Result, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return Result{}, err
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return Result{}, fmt.Errorf("begin snapshot batch: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // after Commit it is a no-op

	res, err := runBatch(ctx, tx, &cfg)
	if err != nil {
		return Result{}, err
	}
	if err := tx.Commit(ctx); err != nil {
		return Result{}, fmt.Errorf("commit snapshot batch: %w", err)
	}
	return res, nil
}

func runBatch(ctx context.Context, tx pgx.Tx, cfg *Config) (Result, error) {
	snapshots := table(cfg.Schema, "snapshots")
	now := cfg.Clock()
	jobs, err := claim(ctx, tx, snapshots, now, cfg.BatchSize)
	if err != nil {
		return Result{}, err
	}
	var res Result
	groups := map[[2]string]*loadedGroup{}
	var batch pgx.Batch
	for i := 0; i < len(jobs); i++ {
		j := jobs[i]
		gk := [2]string{j.source, j.commitLSN}
		lg, ok := groups[gk]
		if !ok {
			if lg, err = loadGroup(ctx, tx, cfg.Schema, j); err != nil {
				return Result{}, err
			}
			groups[gk] = lg
			// A transaction with many roots: take more of its jobs now,
			// while its rows are in memory.
			if room := groupFactor*cfg.BatchSize - len(jobs); lg.roots > 1 && room > 0 {
				var ids []int64
				for _, o := range jobs {
					if o.source == j.source && o.commitLSN == j.commitLSN {
						ids = append(ids, o.id)
					}
				}
				if room = min(room, lg.roots-len(ids)); room > 0 {
					more, err := claimGroup(ctx, tx, snapshots, j, ids, now, room)
					if err != nil {
						return Result{}, err
					}
					jobs = append(jobs, more...)
				}
			}
		}
		switch out := lg.outcome(j, cfg); out.status {
		case StatusComplete:
			res.Completed++
			batch.Queue(fmt.Sprintf(completeSQL, snapshots), j.id, out.payload, lg.fp, now)
		case StatusFailed:
			res.Failed++
			batch.Queue(fmt.Sprintf(failSQL, snapshots), j.id, out.attempts, out.reason, lg.fp)
		default:
			res.Retried++
			batch.Queue(fmt.Sprintf(retrySQL, snapshots), j.id, out.attempts, now.Add(cfg.delay(out.attempts)), out.reason)
		}
	}
	res.Claimed = len(jobs)
	if batch.Len() > 0 {
		if err := tx.SendBatch(ctx, &batch).Close(); err != nil {
			return Result{}, fmt.Errorf("write snapshot results: %w", err)
		}
	}
	return res, nil
}

// groupFactor bounds a batch that extends its claim with more jobs of one
// transaction: at most groupFactor * BatchSize jobs.
const groupFactor = 10

func claim(ctx context.Context, tx pgx.Tx, snapshots string, now time.Time, limit int) ([]job, error) {
	rows, err := tx.Query(ctx, fmt.Sprintf(claimSQL, snapshots), now, limit)
	if err != nil {
		return nil, fmt.Errorf("claim snapshot jobs: %w", err)
	}
	jobs, err := pgx.CollectRows(rows, scanJob)
	if err != nil {
		return nil, fmt.Errorf("claim snapshot jobs: %w", err)
	}
	return jobs, nil
}

const claimGroupSQL = `
SELECT id, correlation_id, source, commit_lsn::text, root_table, root_seq, expected_tables, retry_count
  FROM %s
 WHERE source = $1 AND commit_lsn = $2::pg_lsn AND id <> ALL ($3)
   AND status = 'pending' AND (next_attempt_at IS NULL OR next_attempt_at <= $4)
 ORDER BY id
 LIMIT $5
   FOR UPDATE SKIP LOCKED`

func claimGroup(ctx context.Context, tx pgx.Tx, snapshots string, j job, exclude []int64, now time.Time, limit int) ([]job, error) {
	rows, err := tx.Query(ctx, fmt.Sprintf(claimGroupSQL, snapshots), j.source, j.commitLSN, exclude, now, limit)
	if err != nil {
		return nil, fmt.Errorf("claim snapshot jobs of %s: %w", j.correlationID, err)
	}
	jobs, err := pgx.CollectRows(rows, scanJob)
	if err != nil {
		return nil, fmt.Errorf("claim snapshot jobs of %s: %w", j.correlationID, err)
	}
	return jobs, nil
}

func scanJob(r pgx.CollectableRow) (job, error) {
	var j job
	err := r.Scan(&j.id, &j.correlationID, &j.source, &j.commitLSN, &j.rootTable, &j.rootSeq, &j.expected, &j.retryCount)
	return j, err
}

// loadedGroup is a transaction's archive rows, read once per batch for all
// of its claimed jobs.
type loadedGroup struct {
	g         *group
	fp        string
	have      map[string]int
	unrelated int
	roots     int // jobs of the transaction, any status
	// loadErr is a permanent problem with the stored rows (not a database
	// error): the jobs fail with it.
	loadErr string
}

func loadGroup(ctx context.Context, tx pgx.Tx, schema string, j job) (*loadedGroup, error) {
	rows, err := tx.Query(ctx, fmt.Sprintf(groupRowsSQL, table(schema, "rows")), j.source, j.commitLSN)
	if err != nil {
		return nil, fmt.Errorf("read archive rows of %s: %w", j.correlationID, err)
	}
	lg := &loadedGroup{}
	var list []*archiveRow
	for rows.Next() {
		var (
			r        archiveRow
			refs     []byte
			lsn      string
			archived *time.Time
			commit   *time.Time
		)
		if err := rows.Scan(&r.Schema, &r.Table, &r.Key, &r.Row, &refs, &lsn, &r.Seq, &archived, &commit); err != nil {
			rows.Close()
			return nil, fmt.Errorf("read archive rows of %s: %w", j.correlationID, err)
		}
		if archived != nil {
			r.ArchivedAt = *archived
		}
		if commit != nil {
			r.CommitTime = *commit
		}
		if r.CommitLSN, err = event.ParseLSN(lsn); err != nil {
			rows.Close()
			return nil, fmt.Errorf("read archive rows of %s: %w", j.correlationID, err)
		}
		if len(refs) > 0 && string(refs) != "null" {
			if err := json.Unmarshal(refs, &r.Refs); err != nil && lg.loadErr == "" {
				lg.loadErr = fmt.Sprintf("archive row %s seq %d has unreadable refs", sanitize(r.qualified()), r.Seq)
			}
		}
		list = append(list, &r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read archive rows of %s: %w", j.correlationID, err)
	}
	if lg.loadErr == "" && keyOnlyRefs(list) {
		lg.loadErr = ReasonKeyOnly
	}
	lg.g = newGroup(j.correlationID, list)
	lg.fp = lg.g.fingerprint()
	lg.have = lg.g.counts()

	seqs, err := tx.Query(ctx, fmt.Sprintf(groupRootsSQL, table(schema, "snapshots")), j.source, j.commitLSN)
	if err != nil {
		return nil, fmt.Errorf("read snapshot roots of %s: %w", j.correlationID, err)
	}
	rootSeqs, err := pgx.CollectRows(seqs, pgx.RowTo[int])
	if err != nil {
		return nil, fmt.Errorf("read snapshot roots of %s: %w", j.correlationID, err)
	}
	var roots []int
	for _, s := range rootSeqs {
		if i, ok := lg.g.bySeq[s]; ok {
			roots = append(roots, i)
		}
	}
	lg.unrelated = lg.g.unrelated(roots)
	lg.roots = len(rootSeqs)
	return lg, nil
}

// ReasonKeyOnly is the failure_reason of a snapshot job whose group cannot
// be nested: rows archived with a key-only replica identity lack the
// columns their foreign keys name, so which row is whose child is unknown.
// Nesting by guesswork would present a partial document as complete.
const ReasonKeyOnly = "key-only identity: foreign keys not captured"

// keyOnlyRefs reports whether a row of the group lacks (not NULL: absent
// from its image) a column one of its foreign keys names, or a row of a
// referenced table lacks a referenced column.
func keyOnlyRefs(rows []*archiveRow) bool {
	referenced := map[string][][]string{}
	for _, r := range rows {
		for _, f := range r.Refs {
			for _, c := range f.Columns {
				if !r.has(c) {
					return true
				}
			}
			t := f.Schema + "." + f.Table
			referenced[t] = append(referenced[t], f.RefColumns)
		}
	}
	for _, r := range rows {
		for _, cols := range referenced[r.qualified()] {
			for _, c := range cols {
				if !r.has(c) {
					return true
				}
			}
		}
	}
	return false
}

type outcome struct {
	status   string
	payload  []byte
	reason   string
	attempts int // retry_count to store
}

func (lg *loadedGroup) outcome(j job, cfg *Config) outcome {
	attempts := j.retryCount + 1
	if len(lg.g.rows) == 0 {
		return outcome{status: StatusFailed, attempts: attempts,
			reason: "no archive rows for the transaction (expired, erased, or never archived)"}
	}
	if lg.loadErr != "" {
		return outcome{status: StatusFailed, attempts: attempts, reason: lg.loadErr}
	}
	if short := missing(j.expected, lg.have); short != "" {
		if attempts >= cfg.MaxAttempts {
			return outcome{status: StatusFailed, attempts: attempts, reason: fmt.Sprintf(
				"incomplete transaction after %d attempts: %s (missing events may be in quarantine)", attempts, short)}
		}
		return outcome{status: StatusPending, attempts: attempts, reason: fmt.Sprintf(
			"incomplete transaction on attempt %d: %s", attempts, short)}
	}
	root, ok := lg.g.bySeq[j.rootSeq]
	if !ok {
		return outcome{status: StatusFailed, attempts: attempts, reason: fmt.Sprintf(
			"root row %s seq %d is no longer in the archive", sanitize(j.rootTable), j.rootSeq)}
	}
	payload, err := lg.g.document(root, lg.unrelated)
	if err != nil {
		return outcome{status: StatusFailed, attempts: attempts, reason: sanitize(err.Error())}
	}
	return outcome{status: StatusComplete, payload: payload, attempts: j.retryCount}
}
