package snapshot

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
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
	// BatchSize is how many due jobs (oldest first) a batch claims; with
	// each it takes the other due jobs of the same transaction, up to
	// 100 x BatchSize jobs (and at most 10,000) in all. Default 500.
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
		c.BatchSize = 500
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

// claimSQL claims up to $2 due jobs (oldest first), then every other due
// job of the same transactions up to $3 jobs in all, so a transaction's
// rows are read once for all of its documents; the transactions of the
// oldest jobs come first. Each transaction's jobs are read by index (a
// lateral lookup per transaction, by correlation_id: the unique index's
// prefix; joined as a set, the planner scanned the whole table per batch).
const claimSQL = `
WITH first AS MATERIALIZED (
SELECT id, correlation_id
  FROM %[1]s
 WHERE status = 'pending' AND (next_attempt_at IS NULL OR next_attempt_at <= $1)
 ORDER BY next_attempt_at NULLS FIRST, id
 LIMIT $2
   FOR UPDATE SKIP LOCKED
), txs AS MATERIALIZED (
SELECT correlation_id, min(id) AS first_id FROM first GROUP BY correlation_id
)
SELECT j.id, j.correlation_id, j.source, j.commit_lsn::text, j.root_table, j.root_seq, j.expected_tables, j.retry_count
  FROM txs t
 CROSS JOIN LATERAL (
       SELECT s.id, s.correlation_id, s.source, s.commit_lsn, s.root_table, s.root_seq, s.expected_tables, s.retry_count
         FROM %[1]s s
        WHERE s.correlation_id = t.correlation_id
          AND s.status = 'pending' AND (s.next_attempt_at IS NULL OR s.next_attempt_at <= $1)
        ORDER BY s.id
        LIMIT $3
          FOR UPDATE SKIP LOCKED) j
 ORDER BY t.first_id, j.id
 LIMIT $3`

// claimTxsSQL claims the due pending jobs of the transactions whose
// correlation ids are $2 (by the unique index's prefix), up to $3 jobs, in
// the order they were made.
const claimTxsSQL = `
SELECT j.id, j.correlation_id, j.source, j.commit_lsn::text, j.root_table, j.root_seq, j.expected_tables, j.retry_count
  FROM unnest($2::text[]) AS t(correlation_id)
 CROSS JOIN LATERAL (
       SELECT s.id, s.correlation_id, s.source, s.commit_lsn, s.root_table, s.root_seq, s.expected_tables, s.retry_count
         FROM %[1]s s
        WHERE s.correlation_id = t.correlation_id
          AND s.status = 'pending' AND (s.next_attempt_at IS NULL OR s.next_attempt_at <= $1)
        ORDER BY s.id
          FOR UPDATE SKIP LOCKED) j
 ORDER BY j.id
 LIMIT $3`

// groupRowsSQL reads the archive rows of many transactions at once.
const groupRowsSQL = `
SELECT r.source, r.commit_lsn::text, r.schema_name, r.table_name, r.identity, r.key, r.row, r.refs, r.seq,
       r.archived_at, r.commit_time
  FROM %s r
 WHERE (r.source, r.commit_lsn) IN (SELECT * FROM unnest($1::text[], $2::pg_lsn[])) AND r.verified
 ORDER BY r.source, r.commit_lsn, r.seq`

// groupRootsSQL reads the root rows (jobs of any status) of many
// transactions at once, for the unrelated count, by correlation id (the
// unique index's prefix).
const groupRootsSQL = `
SELECT source, commit_lsn::text, root_seq
  FROM %s
 WHERE correlation_id = ANY ($1::text[])`

// writeSQL writes every claimed job's outcome in one statement: complete
// (payload, fingerprint, completed_at), failed (parked with its reason) or
// pending again (a later next_attempt_at).
const writeSQL = `
UPDATE %s s SET
       status          = u.status,
       payload         = CASE u.status WHEN 'complete' THEN u.payload::jsonb END,
       fingerprint     = CASE u.status WHEN 'pending' THEN s.fingerprint ELSE u.fingerprint END,
       completed_at    = CASE u.status WHEN 'complete' THEN $2::timestamptz ELSE s.completed_at END,
       retry_count     = u.retry_count,
       failure_reason  = u.reason,
       next_attempt_at = u.next_attempt_at,
       pending_since   = CASE u.status WHEN 'pending' THEN s.pending_since END,
       updated_at      = now()
  FROM unnest($1::bigint[], $3::text[], $4::text[], $5::text[], $6::int[], $7::text[], $8::timestamptz[])
       AS u(id, status, payload, fingerprint, retry_count, reason, next_attempt_at)
 WHERE s.id = u.id`

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
// transaction, and returns. With each claimed job it takes the other due
// jobs of the same transaction (see Config.BatchSize for the bound),
// so a transaction's rows are read once for all of its documents. It is
// set-based: one query claims, one reads the rows of every claimed
// transaction, one their roots, one writes every outcome, whatever the
// number of jobs. Any host may call it, on any schedule, from any
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
	return runInTx(ctx, db, cfg, func(ctx context.Context, tx pgx.Tx, cfg *Config, snapshots string, now time.Time) ([]job, error) {
		return claim(ctx, tx, snapshots, now, cfg.BatchSize, max(cfg.BatchSize, min(groupFactor*cfg.BatchSize, maxClaim)))
	})
}

// TxRef names a source transaction: its source, transaction id and commit
// LSN, the parts of its correlation id (event.CorrelationID), by which its
// jobs are found.
type TxRef struct {
	Source    string
	XID       int64
	CommitLSN event.LSN
}

// RunBatchFor is RunBatch for the due pending jobs of the given
// transactions only, up to 100 x BatchSize jobs (and at most 10,000): the
// projector runs it right after committing the commits of transactions
// whose jobs it left pending (a replayed commit's, or a group not complete
// yet, or beyond what one apply transaction assembles), so their documents do not
// wait for the batcher's turn behind older work. Claimed, loaded, assembled
// and written like RunBatch (the same statements but the claim, which
// reads the jobs by transaction); jobs locked by another batch are skipped
// and left to it.
func RunBatchFor(ctx context.Context, db Beginner, cfg Config, txs []TxRef) (Result, error) {
	var ids []string
	seen := make(map[TxRef]bool, len(txs))
	for _, t := range txs {
		if !seen[t] {
			seen[t] = true
			ids = append(ids, event.CorrelationID(t.Source, t.XID, t.CommitLSN))
		}
	}
	if len(ids) == 0 {
		return Result{}, nil
	}
	return runInTx(ctx, db, cfg, func(ctx context.Context, tx pgx.Tx, cfg *Config, snapshots string, now time.Time) ([]job, error) {
		limit := max(cfg.BatchSize, min(groupFactor*cfg.BatchSize, maxClaim))
		rows, err := tx.Query(ctx, fmt.Sprintf(claimTxsSQL, snapshots), now, ids, limit)
		if err != nil {
			return nil, fmt.Errorf("claim snapshot jobs of %d transactions: %w", len(ids), err)
		}
		jobs, err := pgx.CollectRows(rows, scanJob)
		if err != nil {
			return nil, fmt.Errorf("claim snapshot jobs of %d transactions: %w", len(ids), err)
		}
		return jobs, nil
	})
}

// claimFunc claims the jobs of one batch in tx.
type claimFunc func(ctx context.Context, tx pgx.Tx, cfg *Config, snapshots string, now time.Time) ([]job, error)

// runInTx runs one batch whose jobs claim picks, in a transaction of its own.
func runInTx(ctx context.Context, db Beginner, cfg Config, claim claimFunc) (Result, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return Result{}, err
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return Result{}, fmt.Errorf("begin snapshot batch: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // after Commit it is a no-op

	res, err := runBatch(ctx, tx, &cfg, claim)
	if err != nil {
		return Result{}, err
	}
	if err := tx.Commit(ctx); err != nil {
		return Result{}, fmt.Errorf("commit snapshot batch: %w", err)
	}
	return res, nil
}

// txKey identifies a source transaction: (source, commit_lsn text).
type txKey [2]string

func runBatch(ctx context.Context, tx pgx.Tx, cfg *Config, claim claimFunc) (Result, error) {
	snapshots := table(cfg.Schema, "snapshots")
	now := cfg.Clock()
	jobs, err := claim(ctx, tx, cfg, snapshots, now)
	if err != nil || len(jobs) == 0 {
		return Result{}, err
	}
	groups, err := loadGroups(ctx, tx, cfg.Schema, jobs)
	if err != nil {
		return Result{}, err
	}
	res := Result{Claimed: len(jobs)}
	var w outcomes
	for _, j := range jobs {
		lg := groups[txKey{j.source, j.commitLSN}]
		out := lg.outcome(j, cfg)
		switch out.status {
		case StatusComplete:
			res.Completed++
		case StatusFailed:
			res.Failed++
		default:
			res.Retried++
			t := now.Add(cfg.delay(out.attempts))
			out.next = &t
		}
		w.add(j.id, out, lg.fp)
	}
	if _, err := tx.Exec(ctx, fmt.Sprintf(writeSQL, snapshots), w.ids, now, w.statuses, w.payloads, w.fps,
		w.attempts, w.reasons, w.next); err != nil {
		return Result{}, fmt.Errorf("write snapshot results: %w", err)
	}
	return res, nil
}

// outcomes are the columns of writeSQL's unnest.
type outcomes struct {
	ids      []int64
	statuses []string
	payloads []*string
	fps      []*string
	attempts []int32
	reasons  []*string
	next     []*time.Time
}

func (w *outcomes) add(id int64, out outcome, fp string) {
	w.ids = append(w.ids, id)
	w.statuses = append(w.statuses, out.status)
	var payload, reason *string
	if out.payload != nil {
		s := bytesString(out.payload)
		payload = &s
	}
	if out.reason != "" {
		reason = &out.reason
	}
	w.payloads = append(w.payloads, payload)
	w.fps = append(w.fps, &fp)
	w.attempts = append(w.attempts, int32(out.attempts))
	w.reasons = append(w.reasons, reason)
	w.next = append(w.next, out.next)
}

// groupFactor and maxClaim bound a batch that extends its claim with more
// jobs of the transactions it claimed: at most groupFactor * BatchSize
// jobs, and at most maxClaim (unless BatchSize is larger). A large
// transaction's rows are read once per batch, so the bound is generous.
const (
	groupFactor = 100
	maxClaim    = 10_000
)

func claim(ctx context.Context, tx pgx.Tx, snapshots string, now time.Time, first, limit int) ([]job, error) {
	rows, err := tx.Query(ctx, fmt.Sprintf(claimSQL, snapshots), now, first, limit)
	if err != nil {
		return nil, fmt.Errorf("claim snapshot jobs: %w", err)
	}
	jobs, err := pgx.CollectRows(rows, scanJob)
	if err != nil {
		return nil, fmt.Errorf("claim snapshot jobs: %w", err)
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
	// loadErr is a permanent problem with the stored rows (not a database
	// error): the jobs fail with it.
	loadErr string
}

// loadGroups reads the archive rows and the root rows of every transaction
// of jobs, two queries in all.
func loadGroups(ctx context.Context, tx pgx.Tx, schema string, jobs []job) (map[txKey]*loadedGroup, error) {
	corr := map[txKey]string{}
	var sources, lsns, ids []string
	for _, j := range jobs {
		k := txKey{j.source, j.commitLSN}
		if _, ok := corr[k]; !ok {
			corr[k] = j.correlationID
			sources, lsns, ids = append(sources, j.source), append(lsns, j.commitLSN), append(ids, j.correlationID)
		}
	}
	lists, loadErr, err := loadRows(ctx, tx, schema, sources, lsns)
	if err != nil {
		return nil, err
	}
	seqs, err := tx.Query(ctx, fmt.Sprintf(groupRootsSQL, table(schema, "snapshots")), ids)
	if err != nil {
		return nil, fmt.Errorf("read snapshot roots of %d transactions: %w", len(sources), err)
	}
	rootSeqs := map[txKey][]int{}
	for seqs.Next() {
		var k txKey
		var seq int
		if err := seqs.Scan(&k[0], &k[1], &seq); err != nil {
			seqs.Close()
			return nil, fmt.Errorf("read snapshot roots of %d transactions: %w", len(sources), err)
		}
		rootSeqs[k] = append(rootSeqs[k], seq)
	}
	if err := seqs.Err(); err != nil {
		return nil, fmt.Errorf("read snapshot roots of %d transactions: %w", len(sources), err)
	}
	out := make(map[txKey]*loadedGroup, len(corr))
	for k, id := range corr {
		lg := newLoadedGroup(newGroup(id, lists[k]), rootSeqs[k])
		if loadErr[k] != "" {
			lg.loadErr = loadErr[k]
		}
		out[k] = lg
	}
	return out, nil
}

// loadRows reads the verified archive rows of the transactions (sources[i],
// lsns[i]), one query for all, by transaction in seq order; loadErr names
// a transaction's permanent problem with its stored rows (not a database
// error).
func loadRows(ctx context.Context, tx pgx.Tx, schema string, sources, lsns []string) (map[txKey][]*archiveRow, map[txKey]string, error) {
	rows, err := tx.Query(ctx, fmt.Sprintf(groupRowsSQL, table(schema, "rows")), sources, lsns)
	if err != nil {
		return nil, nil, fmt.Errorf("read archive rows of %d transactions: %w", len(sources), err)
	}
	lists := map[txKey][]*archiveRow{}
	loadErr := map[txKey]string{}
	// The rows of a table carry the same refs: each distinct text is
	// decoded once per batch (decoding every row's was a visible share of
	// a batch), the rows sharing the result, which is only read.
	decoded := map[string][]event.Ref{}
	for rows.Next() {
		var (
			r        archiveRow
			k        txKey
			identity *string
			refs     []byte
			archived *time.Time
			commit   *time.Time
			key, row []byte
		)
		// key and row as bytes, not json.RawMessage: pgx scans jsonb into
		// a RawMessage through json.Unmarshal, a full decode of every
		// value (a quarter of a spanning batch's CPU); jsonb's text is
		// valid JSON, copied as it is.
		if err := rows.Scan(&k[0], &k[1], &r.Schema, &r.Table, &identity, &key, &row, &refs, &r.Seq, &archived, &commit); err != nil {
			rows.Close()
			return nil, nil, fmt.Errorf("read archive rows of %d transactions: %w", len(sources), err)
		}
		r.Key, r.Row = key, row
		if identity != nil {
			r.Identity = *identity
		}
		if archived != nil {
			r.ArchivedAt = *archived
		}
		if commit != nil {
			r.CommitTime = *commit
		}
		if r.CommitLSN, err = event.ParseLSN(k[1]); err != nil {
			rows.Close()
			return nil, nil, fmt.Errorf("read archive rows of %s at %s: %w", k[0], k[1], err)
		}
		if len(refs) > 0 && string(refs) != "null" {
			var ok bool
			if r.Refs, ok = decoded[string(refs)]; !ok {
				if err := json.Unmarshal(refs, &r.Refs); err != nil {
					if loadErr[k] == "" {
						loadErr[k] = fmt.Sprintf("archive row %s seq %d has unreadable refs", sanitize(r.qualified()), r.Seq)
					}
				} else {
					decoded[string(refs)] = r.Refs
				}
			}
		}
		lists[k] = append(lists[k], &r)
	}
	if err := rows.Err(); err != nil {
		return nil, nil, fmt.Errorf("read archive rows of %d transactions: %w", len(sources), err)
	}
	return lists, loadErr, nil
}

// newLoadedGroup computes what every job of the group shares: the
// fingerprint, the counts per table and the unrelated count over the
// group's root rows (by seq).
func newLoadedGroup(g *group, rootSeqs []int) *loadedGroup {
	lg := &loadedGroup{g: g, fp: g.fingerprint(), have: g.counts()}
	if keyOnlyRefs(g.rows) {
		lg.loadErr = ReasonKeyOnly
	}
	var roots []int
	for _, s := range rootSeqs {
		if i, ok := g.index(s); ok {
			roots = append(roots, i)
		}
	}
	lg.unrelated = g.unrelated(roots)
	return lg
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
	// The referenced column lists per table, each once (every child row
	// names its parent's: listed per row, the check was quadratic in a
	// transaction's rows).
	referenced := map[[2]string][][]string{}
	for _, r := range rows {
		for _, f := range r.Refs {
			for _, c := range f.Columns {
				if !r.has(c) {
					return true
				}
			}
			t := [2]string{f.Schema, f.Table}
			if !slices.ContainsFunc(referenced[t], func(c []string) bool { return slices.Equal(c, f.RefColumns) }) {
				referenced[t] = append(referenced[t], f.RefColumns)
			}
		}
	}
	for _, r := range rows {
		for _, cols := range referenced[[2]string{r.Schema, r.Table}] {
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
	attempts int        // retry_count to store
	next     *time.Time // next_attempt_at of a job left pending
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
	root, ok := lg.g.index(j.rootSeq)
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
