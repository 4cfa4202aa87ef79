package handler

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// DB is what the store functions need: a pool, a connection or a
// transaction.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Def is a handler (a row of epitaph.handlers).
type Def struct {
	ID           string        `json:"id"`
	Name         string        `json:"name,omitempty"`
	Schema       string        `json:"schema_name"`
	Table        string        `json:"table_name"`
	Kind         string        `json:"kind"`
	Target       string        `json:"target"`
	Priority     int           `json:"priority"`
	Phase        string        `json:"phase"`
	Columns      []string      `json:"columns"`
	MaxAttempts  int           `json:"max_attempts"`
	Backoff      time.Duration `json:"-"`
	ClaimTimeout time.Duration `json:"-"`
	SecretFile   string        `json:"secret_file,omitempty"`
	Revalidate   bool          `json:"revalidate"`
	// BatchSize > 1 (webhooks only): one POST of up to BatchSize
	// deliveries, {"deliveries": [...]}, acknowledged or failed as a
	// whole; a partial batch is sent once its first delivery has waited
	// BatchWait.
	BatchSize int           `json:"batch_size"`
	BatchWait time.Duration `json:"-"`
	// SourceURLFile: revalidation reads the source through the URL in this
	// file (empty: the projector's --source-url).
	SourceURLFile string     `json:"source_url_file,omitempty"`
	Enabled       bool       `json:"enabled"`
	RevokedAt     *time.Time `json:"revoked_at,omitempty"`
	CreatedAt     time.Time  `json:"created_at"`
	UpdatedAt     time.Time  `json:"updated_at"`
}

// QualifiedTable is "schema.table".
func (d Def) QualifiedTable() string { return d.Schema + "." + d.Table }

var uuidRE = regexp.MustCompile(`^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$`)

// ValidID reports whether s is a UUID.
func ValidID(s string) bool { return uuidRE.MatchString(s) }

// Validate checks a handler before it is added; errors are one line.
func (d *Def) Validate() error {
	if !ValidID(d.ID) {
		return errors.New("--id must be a UUID (the handler's stable identity)")
	}
	d.ID = strings.ToLower(d.ID)
	if d.Schema == "" || d.Table == "" {
		return errors.New("--table must be schema.table")
	}
	if err := validateTarget(d.Kind, d.Target); err != nil {
		return err
	}
	if d.Phase == "" {
		d.Phase = PhaseImmediate
	}
	if d.Phase != PhaseImmediate && d.Phase != PhaseAfterGroup {
		return fmt.Errorf("unknown --phase %q (immediate or after-group)", d.Phase)
	}
	if d.MaxAttempts <= 0 {
		return errors.New("--max-attempts must be at least 1")
	}
	// The target keeps these in whole milliseconds.
	if d.Backoff < time.Millisecond || d.ClaimTimeout < time.Millisecond {
		return errors.New("--backoff and --claim-timeout must be at least a millisecond")
	}
	if d.BatchSize == 0 {
		d.BatchSize = 1
	}
	if d.BatchSize < 1 || d.BatchSize > MaxBatchSize {
		return fmt.Errorf("--batch-size must be between 1 and %d", MaxBatchSize)
	}
	if d.BatchSize > 1 && d.Kind != KindWebhook {
		return errors.New("--batch-size: only webhooks send batches")
	}
	if d.BatchWait < 0 || (d.BatchSize > 1 && (d.BatchWait < time.Millisecond || d.BatchWait > d.ClaimTimeout/10)) {
		return errors.New("--batch-wait must be at least a millisecond and at most a tenth of --claim-timeout (its deliveries are claimed while they wait)")
	}
	if d.BatchSize == 1 {
		d.BatchWait = 0
	}
	if d.Columns == nil {
		d.Columns = []string{}
	}
	for _, c := range d.Columns {
		if c == "" {
			return errors.New("--columns: an empty column name")
		}
	}
	return nil
}

// RedactedTarget is the handler's target as every output shows it (see
// RedactTarget).
func (d Def) RedactedTarget() string { return RedactTarget(d.Kind, d.Target) }

// redacted replaces what output must not show.
const redacted = "xxxxx"

// RedactTarget hides what a webhook URL may carry as a credential: its
// userinfo, each query value (an api_key=... some receivers take; the
// parameter's name stays, so an operator can tell which one it is), a
// query part without "=" (a bare token) and the fragment. Other kinds'
// targets are returned as they are. The target is still stored in clear in
// epitaph.handlers: a signed secret (--secret-file) is the way to
// authenticate.
func RedactTarget(kind, target string) string {
	if kind != KindWebhook {
		return target
	}
	u, err := url.Parse(target)
	if err != nil {
		return "(an unparsable URL)"
	}
	if u.User != nil {
		u.User = url.User(redacted)
	}
	if u.RawQuery != "" || u.ForceQuery {
		parts := strings.Split(u.RawQuery, "&")
		for i, p := range parts {
			name, _, ok := strings.Cut(p, "=")
			if ok && len(name) <= 64 {
				parts[i] = name + "=" + redacted
			} else {
				parts[i] = redacted
			}
		}
		u.RawQuery = strings.Join(parts, "&")
	}
	if u.Fragment != "" || u.RawFragment != "" {
		u.Fragment, u.RawFragment = redacted, ""
	}
	return u.String()
}

// validateTarget checks a handler's target for its kind.
func validateTarget(kind, target string) error {
	switch kind {
	case KindWebhook:
		u, err := url.Parse(target)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return errors.New("a webhook target is an http or https URL")
		}
		if u.User != nil {
			return errors.New("a webhook URL must not hold credentials (sign with --secret-file instead)")
		}
	case KindExec:
		if _, err := ParseCommand(target); err != nil {
			return err
		}
	case KindNATS:
		if target == "" || strings.ContainsAny(target, " \t*>") || strings.HasPrefix(target, "epitaph.") {
			return errors.New("a nats target is a literal subject outside epitaph.>")
		}
	case KindGo:
		if target == "" {
			return errors.New("a go handler's target is the name it is registered under")
		}
	default:
		return fmt.Errorf("unknown --kind %q (webhook, exec, nats or go)", kind)
	}
	return nil
}

const defColumns = `id::text, COALESCE(name, ''), schema_name, table_name, kind, target, priority, phase, columns,
	max_attempts, (extract(epoch FROM backoff) * 1000)::bigint, (extract(epoch FROM claim_timeout) * 1000)::bigint,
	COALESCE(secret_file, ''), revalidate, COALESCE(source_url_file, ''), enabled, revoked_at, created_at, updated_at,
	batch_size, (extract(epoch FROM batch_wait) * 1000)::bigint`

func scanDef(row pgx.Row) (Def, error) {
	var d Def
	var backoffMS, claimMS, batchWaitMS int64
	err := row.Scan(&d.ID, &d.Name, &d.Schema, &d.Table, &d.Kind, &d.Target, &d.Priority, &d.Phase, &d.Columns,
		&d.MaxAttempts, &backoffMS, &claimMS, &d.SecretFile, &d.Revalidate, &d.SourceURLFile, &d.Enabled,
		&d.RevokedAt, &d.CreatedAt, &d.UpdatedAt, &d.BatchSize, &batchWaitMS)
	d.Backoff, d.ClaimTimeout = time.Duration(backoffMS)*time.Millisecond, time.Duration(claimMS)*time.Millisecond
	d.BatchWait = time.Duration(batchWaitMS) * time.Millisecond
	return d, err
}

// ErrNotFound says no handler or delivery has the id.
var ErrNotFound = errors.New("not found")

// Add inserts a handler; a cursor handler's cursor is created in the
// same statement. An id in use is an error.
func Add(ctx context.Context, db DB, d Def) error {
	if err := d.Validate(); err != nil {
		return err
	}
	stmt := addSQL
	if d.UsesCursor() {
		stmt = `WITH h AS (` + addSQL + ` RETURNING id)` + cursorStartSQL
	}
	_, err := db.Exec(ctx, stmt,
		d.ID, d.Name, d.Schema, d.Table, d.Kind, d.Target, d.Priority, d.Phase, d.Columns, d.MaxAttempts,
		d.Backoff.Milliseconds(), d.ClaimTimeout.Milliseconds(), d.SecretFile, d.Revalidate, d.SourceURLFile,
		d.BatchSize, d.BatchWait.Milliseconds())
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "23505" {
		return fmt.Errorf("a handler with id %s exists already", d.ID)
	}
	if err != nil {
		return fmt.Errorf("add handler: %w", err)
	}
	return nil
}

// addSQL inserts a handler.
const addSQL = `INSERT INTO epitaph.handlers (id, name, schema_name, table_name, kind, target, priority, phase,
	columns, max_attempts, backoff, claim_timeout, secret_file, revalidate, source_url_file, enabled, batch_size, batch_wait)
	VALUES ($1, NULLIF($2, ''), $3, $4, $5, $6, $7, $8, $9, $10, $11 * interval '1 millisecond', $12 * interval '1 millisecond',
	        NULLIF($13, ''), $14, NULLIF($15, ''), true, $16, $17 * interval '1 millisecond')`

// List returns every handler, by table, priority and id.
func List(ctx context.Context, db DB) ([]Def, error) {
	rows, err := db.Query(ctx, `SELECT `+defColumns+` FROM epitaph.handlers ORDER BY schema_name, table_name, priority, id`)
	if err != nil {
		return nil, fmt.Errorf("list handlers: %w", err)
	}
	defs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Def, error) { return scanDef(r) })
	if err != nil {
		return nil, fmt.Errorf("list handlers: %w", err)
	}
	return defs, nil
}

// Get returns one handler (ErrNotFound).
func Get(ctx context.Context, db DB, id string) (Def, error) {
	if !ValidID(id) {
		return Def{}, fmt.Errorf("handler id %q is not a UUID", id)
	}
	d, err := scanDef(db.QueryRow(ctx, `SELECT `+defColumns+` FROM epitaph.handlers WHERE id = $1`, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Def{}, fmt.Errorf("handler %s: %w", id, ErrNotFound)
	}
	if err != nil {
		return Def{}, fmt.Errorf("read handler %s: %w", id, err)
	}
	return d, nil
}

// SetEnabled enables or disables a handler: a disabled handler's
// deliveries are still queued, and wait (a cursor handler's rows wait
// after its cursor, which stays where it is); enabled again, it delivers
// them.
func SetEnabled(ctx context.Context, db DB, id string, enabled bool) error {
	if !ValidID(id) {
		return fmt.Errorf("handler id %q is not a UUID", id)
	}
	tag, err := db.Exec(ctx, `UPDATE epitaph.handlers SET enabled = $2, updated_at = now() WHERE id = $1`, id, enabled)
	if err != nil {
		return fmt.Errorf("update handler %s: %w", id, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("handler %s: %w", id, ErrNotFound)
	}
	return nil
}

// Revoke marks a handler revoked (no more deliveries are queued for it)
// and stops its open deliveries as stop_revoked; it returns how many. A
// cursor handler's pending rows (every archived row of its table after its
// cursor) are written as such stopped deliveries, and its cursor is
// deleted.
func Revoke(ctx context.Context, db interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}, id string) (int64, error) {
	return endHandler(ctx, db, id, `UPDATE epitaph.handlers SET revoked_at = COALESCE(revoked_at, now()), updated_at = now() WHERE id = $1`,
		string(StopRevoked))
}

// Remove deletes a handler; its open deliveries end stopped as
// stop_completed. It returns how many. A cursor handler's cursor is
// deleted with it, its pending rows written as such stopped deliveries.
func Remove(ctx context.Context, db interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}, id string) (int64, error) {
	return endHandler(ctx, db, id, `DELETE FROM epitaph.handlers WHERE id = $1`, string(StopCompleted))
}

func endHandler(ctx context.Context, db interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}, id, stmt, outcome string) (int64, error) {
	if !ValidID(id) {
		return 0, fmt.Errorf("handler id %q is not a UUID", id)
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	def, err := scanDef(tx.QueryRow(ctx, `SELECT `+defColumns+` FROM epitaph.handlers WHERE id = $1 FOR UPDATE`, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, fmt.Errorf("handler %s: %w", id, ErrNotFound)
	}
	if err != nil {
		return 0, fmt.Errorf("read handler %s: %w", id, err)
	}
	// The cursor's pending rows first, as stopped deliveries, so the
	// handler's row is still there to describe them.
	fromCursor, err := stopCursor(ctx, tx, def, outcome)
	if err != nil {
		return 0, err
	}
	if _, err := tx.Exec(ctx, stmt, id); err != nil {
		return 0, fmt.Errorf("update handler %s: %w", id, err)
	}
	tag, err := tx.Exec(ctx, `UPDATE epitaph.deliveries SET state = 'stopped', outcome = $2, claim_token = NULL,
		claim_expires_at = NULL, settled_at = now(), updated_at = now(), payload = NULL, payload_scrubbed_at = now()
		WHERE handler_id = $1 AND state IN ('pending', 'in_flight')`, id, outcome)
	if err != nil {
		return 0, fmt.Errorf("stop deliveries of handler %s: %w", id, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("commit: %w", err)
	}
	return tag.RowsAffected() + fromCursor, nil
}

// stopCursorPage bounds the rows stopCursor reads and writes at once.
const stopCursorPage = 5000

// stopCursorRowsSQL reads a page of a cursor handler's pending rows: the
// archived rows of its table after (commit_lsn, seq), whatever the
// horizon or their verification (the queued path had queued a delivery
// for each of them, released or not). %s is the live archive's rows
// table.
const stopCursorRowsSQL = `
SELECT a.source, a.commit_lsn::text, a.seq, a.key::text, a.correlation_id, a.commit_time, a.verified
FROM %s a
WHERE a.schema_name = $1 AND a.table_name = $2 AND (a.commit_lsn, a.seq) > ($3::pg_lsn, $4::int)
ORDER BY a.commit_lsn, a.seq LIMIT $5`

// stopCursorInsertSQL writes a page of a cursor handler's pending rows as
// stopped deliveries ($7: the outcome); a row queued for it already (a
// late row, a retried one) keeps its own delivery, which endHandler stops.
const stopCursorInsertSQL = `
INSERT INTO epitaph.deliveries (id, handler_id, source, commit_lsn, seq, schema_name, table_name, key, correlation_id,
    commit_time, version, phase, priority, released_at, verified, state, outcome, attempt, settled_at, payload_scrubbed_at)
SELECT u.id::uuid, $1::uuid, u.source, u.lsn::pg_lsn, u.seq, $2::text, $3::text, u.key::jsonb, u.corr, u.ct, $4::int,
       $5::text, $6::int, CASE WHEN u.verified THEN now() END, u.verified, 'stopped', $7::text, u.attempt, now(), now()
FROM unnest($8::text[], $9::text[], $10::text[], $11::int[], $12::text[], $13::text[], $14::timestamptz[], $15::boolean[], $16::int[])
     AS u(id, source, lsn, seq, key, corr, ct, verified, attempt)
ON CONFLICT DO NOTHING`

// stopCursor ends a cursor handler's pending work in tx, as endHandler
// ends a queued handler's open deliveries: every archived row of its table
// after its cursor (its batch in flight included, with the attempts spent
// on it) is written as a stopped delivery with outcome, and the cursor is
// deleted (a batch in flight settles nothing: its claim is gone). It
// returns how many deliveries it wrote; nothing for a handler without a
// cursor.
func stopCursor(ctx context.Context, tx pgx.Tx, def Def, outcome string) (int64, error) {
	var (
		lsn, toLSN *string
		seq, toSeq *int32
		attempt    int32
	)
	err := tx.QueryRow(ctx, `SELECT commit_lsn::text, seq, claimed_to_lsn::text, claimed_to_seq, attempt
		FROM epitaph.handler_cursors WHERE handler_id = $1 FOR UPDATE`, def.ID).Scan(&lsn, &seq, &toLSN, &toSeq, &attempt)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("read the cursor of handler %s: %w", def.ID, err)
	}
	if _, err := tx.Exec(ctx, `DELETE FROM epitaph.handler_cursors WHERE handler_id = $1`, def.ID); err != nil {
		return 0, fmt.Errorf("delete the cursor of handler %s: %w", def.ID, err)
	}
	var (
		schema  string
		version int
	)
	err = tx.QueryRow(ctx, `SELECT v.version, v.schema_name FROM epitaph.projection_versions v
		WHERE v.projection = $1 AND v.state = 'live' AND to_regclass(quote_ident(v.schema_name) || '.rows') IS NOT NULL`,
		archiveProjection).Scan(&version, &schema)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, nil // no archive: no pending row
	}
	if err != nil {
		return 0, fmt.Errorf("look up the live archive: %w", err)
	}
	read := fmt.Sprintf(stopCursorRowsSQL, pgx.Identifier{schema, "rows"}.Sanitize())
	atLSN, atSeq := *lsn, *seq
	var total int64
	for {
		rows, err := tx.Query(ctx, read, def.Schema, def.Table, atLSN, atSeq, stopCursorPage)
		if err != nil {
			return 0, fmt.Errorf("read the pending rows of handler %s: %w", def.ID, err)
		}
		var (
			ids, sources, lsns, corrs []string
			keys                      []*string
			seqs, attempts            []int32
			times                     []*time.Time
			verified                  []bool
		)
		var (
			src, l, corr string
			key          *string
			sq           int32
			ct           *time.Time
			ver          bool
		)
		_, err = pgx.ForEachRow(rows, []any{&src, &l, &sq, &key, &corr, &ct, &ver}, func() error {
			ids = append(ids, DeliveryID(def.ID, src, l, int(sq), 0))
			sources, lsns, seqs, keys, corrs = append(sources, src), append(lsns, l), append(seqs, sq), append(keys, key), append(corrs, corr)
			times, verified = append(times, ct), append(verified, ver)
			// The rows of the batch in flight carry its attempts.
			spent := int32(0)
			if toLSN != nil && !lsnAfter(l, sq, *toLSN, *toSeq) {
				spent = attempt
			}
			attempts = append(attempts, spent)
			return nil
		})
		if err != nil {
			return 0, fmt.Errorf("read the pending rows of handler %s: %w", def.ID, err)
		}
		if len(ids) == 0 {
			return total, nil
		}
		tag, err := tx.Exec(ctx, stopCursorInsertSQL, def.ID, def.Schema, def.Table, version, def.Phase, def.Priority, outcome,
			ids, sources, lsns, seqs, keys, corrs, times, verified, attempts)
		if err != nil {
			return 0, fmt.Errorf("stop the pending rows of handler %s: %w", def.ID, err)
		}
		total += tag.RowsAffected()
		atLSN, atSeq = lsns[len(lsns)-1], seqs[len(seqs)-1]
		if len(ids) < stopCursorPage {
			return total, nil
		}
	}
}

// lsnAfter reports whether (lsn, seq) is after (toLSN, toSeq).
func lsnAfter(lsn string, seq int32, toLSN string, toSeq int32) bool {
	if a, b := parseLSN(lsn), parseLSN(toLSN); a != b {
		return a > b
	}
	return seq > toSeq
}

// Info is a delivery as operators see it (never its payload in lists).
type Info struct {
	ID                string          `json:"id"`
	HandlerID         string          `json:"handler_id"`
	Schema            string          `json:"schema_name"`
	Table             string          `json:"table_name"`
	Key               json.RawMessage `json:"key"`
	CorrelationID     string          `json:"correlation_id"`
	State             string          `json:"state"`
	Attempt           int             `json:"attempt"`
	Outcome           *string         `json:"outcome"`
	LastError         *string         `json:"last_error"`
	Phase             string          `json:"phase"`
	Priority          int             `json:"priority"`
	Released          bool            `json:"released"`
	ReleasedUnsettled bool            `json:"released_unsettled"`
	Verified          bool            `json:"verified"`
	NextAttemptAt     time.Time       `json:"next_attempt_at"`
	ClaimExpiresAt    *time.Time      `json:"claim_expires_at"`
	Defers            int             `json:"defers"`
	PayloadScrubbed   bool            `json:"payload_scrubbed"`
	CreatedAt         time.Time       `json:"created_at"`
	UpdatedAt         time.Time       `json:"updated_at"`
	SettledAt         *time.Time      `json:"settled_at"`
	// Payload is set by Show only.
	Payload json.RawMessage `json:"payload,omitempty"`
	// FromArchive: a cursor handler's pending or in-flight delivery,
	// listed from the archived row after its cursor; it has no row in
	// epitaph.deliveries until its batch settles (ListCursorDeliveries).
	FromArchive bool `json:"from_archive,omitempty"`
}

const infoColumns = `id::text, handler_id::text, schema_name, table_name, key, correlation_id, state, attempt, outcome,
	last_error, phase, priority, released_at IS NOT NULL, released_unsettled, verified, next_attempt_at,
	claim_expires_at, defers, payload_scrubbed_at IS NOT NULL, created_at, updated_at, settled_at`

func scanInfo(r pgx.Row, extra ...any) (Info, error) {
	var i Info
	err := r.Scan(append([]any{&i.ID, &i.HandlerID, &i.Schema, &i.Table, &i.Key, &i.CorrelationID, &i.State, &i.Attempt,
		&i.Outcome, &i.LastError, &i.Phase, &i.Priority, &i.Released, &i.ReleasedUnsettled, &i.Verified, &i.NextAttemptAt,
		&i.ClaimExpiresAt, &i.Defers, &i.PayloadScrubbed, &i.CreatedAt, &i.UpdatedAt, &i.SettledAt}, extra...)...)
	return i, err
}

// Filter selects deliveries for ListDeliveries; zero fields match all.
type Filter struct {
	HandlerID, State, Schema, Table string
	Limit                           int
}

// States lists the delivery states.
var States = []string{StatePending, StateInFlight, StateDone, StateStopped, StateDead}

// ListDeliveries lists deliveries, newest first.
func ListDeliveries(ctx context.Context, db DB, f Filter) ([]Info, error) {
	if f.HandlerID != "" && !ValidID(f.HandlerID) {
		return nil, fmt.Errorf("handler id %q is not a UUID", f.HandlerID)
	}
	if f.Limit <= 0 {
		f.Limit = 1000
	}
	rows, err := db.Query(ctx, `SELECT `+infoColumns+` FROM epitaph.deliveries WHERE `+filterSQL+`
		ORDER BY created_at DESC, id LIMIT $5`, f.HandlerID, f.State, f.Schema, f.Table, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("list deliveries: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Info, error) { return scanInfo(r) })
	if err != nil {
		return nil, fmt.Errorf("list deliveries: %w", err)
	}
	return out, nil
}

// filterSQL is a Filter's condition ($1-$4) on epitaph.deliveries.
const filterSQL = `($1 = '' OR handler_id = NULLIF($1, '')::uuid) AND ($2 = '' OR state = $2)
		  AND ($3 = '' OR schema_name = $3) AND ($4 = '' OR table_name = $4)`

// CountDeliveries counts the deliveries ListDeliveries lists with the same
// filter (its limit included): what an action on "all matching" acts on.
func CountDeliveries(ctx context.Context, db DB, f Filter) (int, error) {
	if f.HandlerID != "" && !ValidID(f.HandlerID) {
		return 0, fmt.Errorf("handler id %q is not a UUID", f.HandlerID)
	}
	if f.Limit <= 0 {
		f.Limit = 1000
	}
	var n int
	err := db.QueryRow(ctx, `SELECT count(*) FROM (SELECT 1 FROM epitaph.deliveries WHERE `+filterSQL+` LIMIT $5) x`,
		f.HandlerID, f.State, f.Schema, f.Table, f.Limit).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("count deliveries: %w", err)
	}
	return n, nil
}

// ShowDelivery returns one delivery with its payload.
func ShowDelivery(ctx context.Context, db DB, id string) (Info, error) {
	if !ValidID(id) {
		return Info{}, fmt.Errorf("delivery id %q is not a UUID", id)
	}
	var payload []byte
	i, err := scanInfo(db.QueryRow(ctx, `SELECT `+infoColumns+`, payload FROM epitaph.deliveries WHERE id = $1`, id), &payload)
	if errors.Is(err, pgx.ErrNoRows) {
		return Info{}, fmt.Errorf("delivery %s: %w", id, ErrNotFound)
	}
	if err != nil {
		return Info{}, fmt.Errorf("read delivery %s: %w", id, err)
	}
	i.Payload = payload
	return i, nil
}

// Retry puts a dead or stopped delivery back to pending with a fresh
// attempt count. A payload scrubbed at its terminal state is rebuilt from
// the live archive's row; a row no longer archived cannot be retried.
func Retry(ctx context.Context, db DB, id string) error {
	if !ValidID(id) {
		return fmt.Errorf("delivery id %q is not a UUID", id)
	}
	var state string
	var hasPayload, archived, handlerExists, revoked bool
	err := db.QueryRow(ctx, `SELECT d.state, d.payload IS NOT NULL,
		  to_regclass('archive.rows') IS NOT NULL, h.id IS NOT NULL, h.revoked_at IS NOT NULL
		FROM epitaph.deliveries d LEFT JOIN epitaph.handlers h ON h.id = d.handler_id WHERE d.id = $1`, id).Scan(
		&state, &hasPayload, &archived, &handlerExists, &revoked)
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("delivery %s: %w", id, ErrNotFound)
	}
	if err != nil {
		return fmt.Errorf("read delivery %s: %w", id, err)
	}
	if state != StateDead && state != StateStopped {
		return fmt.Errorf("delivery %s is %s: only dead or stopped deliveries are retried", id, state)
	}
	// Never claimed again: it would stay pending for ever.
	if !handlerExists {
		return fmt.Errorf("delivery %s: its handler was removed: it cannot be retried", id)
	}
	if revoked {
		return fmt.Errorf("delivery %s: its handler is revoked: it cannot be retried", id)
	}
	payload, from := `d.payload`, ` WHERE`
	if !hasPayload {
		if !archived {
			return fmt.Errorf("delivery %s: its payload was scrubbed and no archive is live to rebuild it from", id)
		}
		payload = `jsonb_build_object('key', r.key, 'columns',
			COALESCE((SELECT jsonb_object_agg(c, r.row -> c) FROM unnest(h.columns) c), '{}'::jsonb))`
		from = ` FROM archive.rows r, epitaph.handlers h WHERE r.source = d.source AND r.commit_lsn = d.commit_lsn
			AND r.seq = d.seq AND h.id = d.handler_id AND`
	}
	tag, err := db.Exec(ctx, `UPDATE epitaph.deliveries d SET state = 'pending', attempt = 0, defers = 0, outcome = NULL,
		last_error = NULL, next_attempt_at = now(), settled_at = NULL, updated_at = now(), released_at = COALESCE(d.released_at, now()),
		payload = `+payload+`, payload_scrubbed_at = NULL`+from+` d.id = $1 AND d.state IN ('dead', 'stopped')`, id)
	if err != nil {
		return fmt.Errorf("retry delivery %s: %w", id, err)
	}
	if tag.RowsAffected() == 0 {
		// Another retry or discard may have changed it since it was read:
		// say what it is now rather than blame its row.
		err := db.QueryRow(ctx, `SELECT state FROM epitaph.deliveries WHERE id = $1`, id).Scan(&state)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			return fmt.Errorf("delivery %s: %w", id, ErrNotFound)
		case err != nil:
			return fmt.Errorf("read delivery %s: %w", id, err)
		case state != StateDead && state != StateStopped:
			return fmt.Errorf("delivery %s is %s: only dead or stopped deliveries are retried", id, state)
		}
		return fmt.Errorf("delivery %s: its payload was scrubbed and its row (or handler) is gone: it cannot be retried", id)
	}
	return nil
}

// Discard stops a pending or dead delivery (outcome discarded) and scrubs
// its payload. An in-flight one is refused: its attempt is under way and
// the receiver may get it whatever the record says; discard it once the
// attempt settles (pending again, or dead).
func Discard(ctx context.Context, db DB, id string) error {
	if !ValidID(id) {
		return fmt.Errorf("delivery id %q is not a UUID", id)
	}
	tag, err := db.Exec(ctx, `UPDATE epitaph.deliveries SET state = 'stopped', outcome = 'discarded', claim_token = NULL,
		claim_expires_at = NULL, settled_at = now(), updated_at = now(), payload = NULL, payload_scrubbed_at = now()
		WHERE id = $1 AND state IN ('pending', 'dead')`, id)
	if err != nil {
		return fmt.Errorf("discard delivery %s: %w", id, err)
	}
	if tag.RowsAffected() == 0 {
		d, err := ShowDelivery(ctx, db, id)
		if err != nil {
			return err
		}
		if d.State == StateInFlight {
			return fmt.Errorf("delivery %s is in_flight: its attempt is under way; discard it once it settles", id)
		}
		return fmt.Errorf("delivery %s is done or stopped already", id)
	}
	return nil
}
