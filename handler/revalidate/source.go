package revalidate

import (
	"context"
	"encoding/json"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/capture"
)

// keyExists reads the source: is there a row with the delivery's key in its
// table now? The key's values go as text parameters (their Postgres text
// form, capture.ValueText), so the server compares them as the column's own
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
		text, notNull, err := capture.ValueText(key[c])
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
