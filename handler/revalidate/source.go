package revalidate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// keyExists reads the source: is there a row with the delivery's key in its
// table now (keyPredicate)? A reason is returned when the source could not
// answer.
func (e *Evaluator) keyExists(ctx context.Context, url string, d delivery) (bool, string) {
	where, args, err := keyPredicate(d.key, 0)
	if err != nil {
		return false, ReasonSourceKeyInvalid
	}
	q := `SELECT EXISTS (SELECT 1 FROM ` + pgx.Identifier{d.schemaName, d.table}.Sanitize() + ` WHERE ` + where + `)`
	exists, err := e.readSource(ctx, url, q, args, 1)
	switch {
	case errors.Is(err, errPool):
		e.warnSource(d, 1, err)
		return false, ReasonSourceDown
	case err != nil:
		e.warnSource(d, 1, err)
		return false, sourceReason(err)
	}
	return exists[0], ""
}

func (e *Evaluator) warnSource(d delivery, n int, err error) {
	// err is a pgx/pgconn error: it names the host, never the password.
	e.cfg.Logger.Warn("revalidation deferred: source unreadable", "delivery", d.id, "deliveries", n, "handler", d.handlerID,
		"table", d.schemaName+"."+d.table, "reason", sourceReason(err), "err", err)
}

// valueText is the Postgres text form of a key's JSON value (false for
// null): strings unquoted, numbers and booleans as written. The inverse of
// the capture's encoding, as capture.ValueText (not imported: the capture
// package's tests import the projector, which imports this package).
func valueText(v json.RawMessage) (string, bool, error) {
	switch {
	case len(v) == 0:
		return "", false, errors.New("empty value")
	case string(v) == "null":
		return "", false, nil
	case v[0] == '"':
		var out string
		err := json.Unmarshal(v, &out)
		return out, err == nil, err
	}
	return string(v), true, nil
}

// maxKeysPerRead bounds the keys of one source read (one EXISTS column and
// its parameters per key).
const maxKeysPerRead = 256

// sourceGroup is the open deliveries of a batch read from one source
// table.
type sourceGroup struct {
	url, schema, table string
	ps                 []*pending
}

// decideSources checks, for the open deliveries, that each key is still
// absent from its source table: one read per (source URL, table) of the
// batch, and returns those still open. Each delivery gets the reason it
// would alone: a source that cannot be read defers its deliveries; a key
// the source rejects (a value its column type cannot take) defers its own
// delivery only (the table's keys are then read one by one).
func (e *Evaluator) decideSources(ctx context.Context, open []*pending, results []Result) []*pending {
	var groups []*sourceGroup
	byTable := map[[3]string]*sourceGroup{}
	urls := map[string][2]string{} // by handler: the URL, or the reason there is none
	var still []*pending
	for _, p := range open {
		u, ok := urls[p.d.handlerID]
		if !ok {
			url, reason := e.sourceURL(p.d)
			u = [2]string{url, reason}
			urls[p.d.handlerID] = u
		}
		switch {
		case u[1] != "":
			settle(results, p, Result{Outcome: Defer, Reason: u[1]})
			continue
		case len(p.d.key) == 0 || string(p.d.key) == "null":
			// A row without a key (REPLICA IDENTITY NOTHING) cannot be
			// looked up; nothing says the deletion does not stand.
			still = append(still, p)
			continue
		}
		k := [3]string{u[0], p.d.schemaName, p.d.table}
		g := byTable[k]
		if g == nil {
			g = &sourceGroup{url: u[0], schema: p.d.schemaName, table: p.d.table}
			byTable[k] = g
			groups = append(groups, g)
		}
		g.ps = append(g.ps, p)
	}
	for _, g := range groups {
		for ps := range slices.Chunk(g.ps, maxKeysPerRead) {
			still = append(still, e.decideSourceTable(ctx, g.url, ps, results)...)
		}
	}
	return still
}

func (e *Evaluator) decideSourceTable(ctx context.Context, url string, ps []*pending, results []Result) []*pending {
	if still, ok := e.decideSourceSet(ctx, url, ps, results); ok {
		return still
	}
	var exprs []string
	var args []any
	var asked []*pending
	for _, p := range ps {
		where, kargs, err := keyPredicate(p.d.key, len(args))
		if err != nil {
			settle(results, p, Result{Outcome: Defer, Reason: ReasonSourceKeyInvalid})
			continue
		}
		exprs = append(exprs, `EXISTS (SELECT 1 FROM `+pgx.Identifier{p.d.schemaName, p.d.table}.Sanitize()+` WHERE `+where+`)`)
		args = append(args, kargs...)
		asked = append(asked, p)
	}
	if len(asked) == 0 {
		return nil
	}
	exists, err := e.readSource(ctx, url, `SELECT `+strings.Join(exprs, ", "), args, len(asked))
	if err != nil && len(asked) > 1 && sourceReason(err) == ReasonSourceKeyInvalid {
		// One key the source rejects fails the statement: ask one by one,
		// so that only its delivery defers.
		var still []*pending
		for _, p := range asked {
			if settle(results, p, e.decideSourceOne(ctx, url, p.d)) {
				still = append(still, p)
			}
		}
		return still
	}
	if err != nil {
		reason := ReasonSourceDown
		if !errors.Is(err, errPool) {
			reason = sourceReason(err)
		}
		e.warnSource(asked[0].d, len(asked), err)
		for _, p := range asked {
			settle(results, p, Result{Outcome: Defer, Reason: reason})
		}
		return nil
	}
	var still []*pending
	for j, p := range asked {
		if exists[j] {
			settle(results, p, Result{Outcome: StopSuperseded, Reason: ReasonKeyInSource})
			continue
		}
		still = append(still, p)
	}
	return still
}

// decideSourceOne is the source check of one delivery.
func (e *Evaluator) decideSourceOne(ctx context.Context, url string, d delivery) Result {
	exists, reason := e.keyExists(ctx, url, d)
	switch {
	case reason != "":
		return Result{Outcome: Defer, Reason: reason}
	case exists:
		return Result{Outcome: StopSuperseded, Reason: ReasonKeyInSource}
	}
	return Result{}
}

// errPool marks a source pool that could not be opened.
var errPool = errors.New("source pool")

// readSource runs q (n boolean columns) on the source url, bounded by the
// source timeout.
func (e *Evaluator) readSource(ctx context.Context, url, q string, args []any, n int) ([]bool, error) {
	ctx, cancel := context.WithTimeout(ctx, e.cfg.SourceTimeout)
	defer cancel()
	p, err := e.pool(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errPool, err)
	}
	out := make([]bool, n)
	dst := make([]any, n)
	for j := range out {
		dst[j] = &out[j]
	}
	if err := p.QueryRow(ctx, q, args...).Scan(dst...); err != nil {
		return nil, fmt.Errorf("read %d keys: %w", n, err)
	}
	return out, nil
}

// keyPredicate is the WHERE of a key's lookup, its parameters numbered
// after the first `after`: the key's values as text parameters (their
// Postgres text form, as capture.ValueText gives it), so the server
// compares them as the column's own type and uses the key's index.
func keyPredicate(raw json.RawMessage, after int) (string, []any, error) {
	var key map[string]json.RawMessage
	if err := json.Unmarshal(raw, &key); err != nil || len(key) == 0 {
		return "", nil, errors.New("invalid key")
	}
	cols := make([]string, 0, len(key))
	for c := range key {
		cols = append(cols, c)
	}
	slices.Sort(cols)
	var where []string
	var args []any
	for _, c := range cols {
		text, notNull, err := valueText(key[c])
		if err != nil {
			return "", nil, err
		}
		if !notNull {
			where = append(where, pgx.Identifier{c}.Sanitize()+" IS NULL")
			continue
		}
		args = append(args, text)
		where = append(where, pgx.Identifier{c}.Sanitize()+" = $"+strconv.Itoa(after+len(args)))
	}
	return strings.Join(where, " AND "), args, nil
}

// setKeys: when every key of ps is an object of the same columns whose
// values are JSON strings, numbers or booleans, those columns (sorted) and
// the keys as one JSON array; ok false otherwise (a null, an object or an
// array value: their lookups are keyPredicate's).
func setKeys(ps []*pending) (cols []string, keys []byte, ok bool) {
	keys = append(make([]byte, 0, 16*len(ps)), '[')
	for j, p := range ps {
		var key map[string]json.RawMessage
		if err := json.Unmarshal(p.d.key, &key); err != nil || len(key) == 0 {
			return nil, nil, false
		}
		if j == 0 {
			for c := range key {
				cols = append(cols, c)
			}
			slices.Sort(cols)
		}
		if len(key) != len(cols) {
			return nil, nil, false
		}
		for _, c := range cols {
			v, found := key[c]
			if !found || len(v) == 0 || v[0] == '{' || v[0] == '[' || string(v) == "null" {
				return nil, nil, false
			}
		}
		if j > 0 {
			keys = append(keys, ',')
		}
		keys = append(keys, p.d.key...)
	}
	return cols, append(keys, ']'), true
}

// sourceSetSQL asks which keys of a JSON array exist in table, in one
// statement whatever their number: jsonb_populate_recordset types each
// key's values as the table's columns (a JSON string, number or boolean
// is given to the column type's input as its text, as keyPredicate's text
// parameters are), and each is looked up by the key's columns (one index
// probe each). It returns the ordinals (from 1) of the keys found. Every
// key is typed, also when the table is empty (a FILTER, not a join whose
// plan may skip its outer side): a value the column rejects fails the
// statement, as it fails keyPredicate's.
func sourceSetSQL(schema, table string, cols []string) string {
	t := pgx.Identifier{schema, table}.Sanitize()
	where := make([]string, len(cols))
	for i, c := range cols {
		q := pgx.Identifier{c}.Sanitize()
		where[i] = "t." + q + " = k." + q
	}
	return `SELECT COALESCE(array_agg(k.ordinality::int) FILTER (WHERE EXISTS (
    SELECT 1 FROM ` + t + ` t WHERE ` + strings.Join(where, " AND ") + `)), '{}')
FROM jsonb_populate_recordset(NULL::` + t + `, $1::jsonb) WITH ORDINALITY k`
}

// decideSourceSet is the source check of ps (one table) in one statement
// of constant text (sourceSetSQL) instead of one EXISTS per key; ok false
// when its keys do not allow it, or the source answered it with an error
// (a key its column type rejects, a missing permission or table: the
// per-key statement then gives each delivery its reason). A source that
// does not answer (down, timed out) defers ps here, as the per-key
// statement would.
func (e *Evaluator) decideSourceSet(ctx context.Context, url string, ps []*pending, results []Result) ([]*pending, bool) {
	if len(ps) < 2 {
		return nil, false
	}
	cols, keys, ok := setKeys(ps)
	if !ok {
		return nil, false
	}
	found, err := e.readSourceSet(ctx, url, sourceSetSQL(ps[0].d.schemaName, ps[0].d.table, cols), keys)
	var pe *pgconn.PgError
	switch {
	case errors.As(err, &pe):
		return nil, false
	case err != nil:
		reason := ReasonSourceDown
		if !errors.Is(err, errPool) {
			reason = sourceReason(err)
		}
		e.warnSource(ps[0].d, len(ps), err)
		for _, p := range ps {
			settle(results, p, Result{Outcome: Defer, Reason: reason})
		}
		return nil, true
	}
	exists := make([]bool, len(ps))
	for _, j := range found {
		if j >= 1 && int(j) <= len(ps) {
			exists[j-1] = true
		}
	}
	var still []*pending
	for j, p := range ps {
		if exists[j] {
			settle(results, p, Result{Outcome: StopSuperseded, Reason: ReasonKeyInSource})
			continue
		}
		still = append(still, p)
	}
	return still, true
}

// readSourceSet runs q (sourceSetSQL) with keys on the source url, bounded
// by the source timeout.
func (e *Evaluator) readSourceSet(ctx context.Context, url, q string, keys []byte) ([]int32, error) {
	ctx, cancel := context.WithTimeout(ctx, e.cfg.SourceTimeout)
	defer cancel()
	p, err := e.pool(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errPool, err)
	}
	var found []int32
	if err := p.QueryRow(ctx, q, string(keys)).Scan(&found); err != nil {
		return nil, fmt.Errorf("read keys: %w", err)
	}
	return found, nil
}
