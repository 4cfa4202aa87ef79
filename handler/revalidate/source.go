package revalidate

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
)

// keyExists reads the source: is there a row with the delivery's key in its
// table now? The key's values go as text parameters (their Postgres text
// form, as capture.ValueText gives it), so the server compares them as the column's own
// type and uses the key's index. A reason is returned when the source could
// not answer.
func (e *Evaluator) keyExists(ctx context.Context, url string, d delivery) (bool, string) {
	var key map[string]json.RawMessage
	if err := json.Unmarshal(d.key, &key); err != nil || len(key) == 0 {
		return false, ReasonSourceKeyInvalid
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
			return false, ReasonSourceKeyInvalid
		}
		if !notNull {
			where = append(where, pgx.Identifier{c}.Sanitize()+" IS NULL")
			continue
		}
		args = append(args, text)
		where = append(where, pgx.Identifier{c}.Sanitize()+" = $"+strconv.Itoa(len(args)))
	}
	q := `SELECT EXISTS (SELECT 1 FROM ` + pgx.Identifier{d.schemaName, d.table}.Sanitize() +
		` WHERE ` + strings.Join(where, " AND ") + `)`
	ctx, cancel := context.WithTimeout(ctx, e.cfg.SourceTimeout)
	defer cancel()
	p, err := e.pool(ctx, url)
	if err != nil {
		e.warnSource(d, err)
		return false, ReasonSourceDown
	}
	var exists bool
	if err := p.QueryRow(ctx, q, args...).Scan(&exists); err != nil {
		e.warnSource(d, err)
		return false, sourceReason(err)
	}
	return exists, ""
}

func (e *Evaluator) warnSource(d delivery, err error) {
	// err is a pgx/pgconn error: it names the host, never the password.
	e.cfg.Logger.Warn("revalidation deferred: source unreadable", "delivery", d.id, "handler", d.handlerID,
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
